// server_openai_sdk.mjs - `moetax serve` driven by the official OpenAI Node SDK (npm `openai`).
//
// Not run by CI (no npm registry there). By hand:
//   mkdir -p /tmp/oai && cd /tmp/oai && npm init -y && npm install openai
//   build/moetax serve --port 8080 &        # the default model (no chat template)
//   MOETAX_OPENAI_SDK_DIR=/tmp/oai node tests/server_openai_sdk.mjs http://127.0.0.1:8080/v1
// tests/test_server.py runs it against its own server when the package is found
// (MOETAX_OPENAI_SDK_DIR, or an `openai` that node resolves from here or the current folder).
// `--probe`: exit 0 if the package can be loaded, 1 otherwise.
import { createRequire } from "node:module";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

async function loadOpenAI() {
  const bases = [];
  if (process.env.MOETAX_OPENAI_SDK_DIR) bases.push(join(process.env.MOETAX_OPENAI_SDK_DIR, "package.json"));
  bases.push(import.meta.url, join(process.cwd(), "package.json"));
  for (const b of bases) {
    try {
      const path = createRequire(b).resolve("openai");
      const mod = await import(pathToFileURL(path).href);
      return mod.default ?? mod.OpenAI;
    } catch (e) {
      /* try the next */
    }
  }
  return null;
}

const OpenAI = await loadOpenAI();
if (process.argv[2] === "--probe") process.exit(OpenAI ? 0 : 1);
if (!OpenAI) {
  console.log("SKIP: npm package 'openai' not found");
  process.exit(0);
}
const baseURL = process.argv[2] ?? "http://127.0.0.1:8080/v1";
const client = new OpenAI({ baseURL, apiKey: process.env.MOETAX_API_KEY ?? "none", maxRetries: 0, timeout: 60000 });
let checks = 0, fails = 0;
function check(cond, msg) {
  checks++;
  if (!cond) {
    fails++;
    console.log("FAIL:", msg);
  }
}

const models = await client.models.list();
const model = models.data[0]?.id;
check(typeof model === "string" && model.length > 0, `models.list: ${JSON.stringify(models.data)}`);

const prompt = "def __init__(self";
const c = await client.completions.create({ model, prompt, max_tokens: 16, temperature: 0 });
check(c.object === "text_completion" && typeof c.choices[0].text === "string" && c.choices[0].text.length > 0,
      `completions.create: ${JSON.stringify(c)}`);
check(c.usage.completion_tokens >= 1 && c.usage.total_tokens === c.usage.prompt_tokens + c.usage.completion_tokens,
      `usage: ${JSON.stringify(c.usage)}`);

// streaming: the same greedy text, chunk by chunk
const stream = await client.completions.create({ model, prompt, max_tokens: 16, temperature: 0, stream: true,
                                                 stream_options: { include_usage: true } });
let text = "", chunks = 0, finish = null, usage = null;
for await (const ch of stream) {
  if (ch.usage) usage = ch.usage;
  if (!ch.choices?.length) continue;
  text += ch.choices[0].text ?? "";
  if (ch.choices[0].finish_reason) finish = ch.choices[0].finish_reason;
  chunks++;
}
check(text === c.choices[0].text, `stream text ${JSON.stringify(text)} != ${JSON.stringify(c.choices[0].text)}`);
check(chunks > 1 && finish === c.choices[0].finish_reason, `stream: ${chunks} chunks, finish ${finish}`);
check(usage && usage.completion_tokens === c.usage.completion_tokens, `stream usage ${JSON.stringify(usage)}`);

// stop strings
const half = c.choices[0].text.slice(4, 7);
const s = await client.completions.create({ model, prompt, max_tokens: 16, temperature: 0, stop: [half] });
check(s.choices[0].text === c.choices[0].text.slice(0, c.choices[0].text.indexOf(half)) &&
      s.choices[0].finish_reason === "stop", `stop ${JSON.stringify(half)}: ${JSON.stringify(s.choices[0])}`);

// errors come back as the SDK's typed errors with the status
async function expectError(what, status, f, re) {
  try {
    await f();
    check(false, `${what}: no error`);
  } catch (e) {
    check(e instanceof OpenAI.APIError && e.status === status && (!re || re.test(e.message)),
          `${what}: ${e?.constructor?.name} ${e?.status} ${e?.message}`);
  }
}
await expectError("n = 2", 400, () => client.completions.create({ model, prompt, n: 2 }));
await expectError("max_tokens beyond the cache", 400, () => client.completions.create({ model, prompt, max_tokens: 1 << 20 }));
await expectError("a wrong type", 400, () => client.completions.create({ model, prompt, temperature: "hot" }));
const info = await client.models.list();
const chatOn = info.data[0]?.meta?.chat_template && info.data[0].meta.chat_template !== "unknown";
if (chatOn) {
  const r = await client.chat.completions.create({ model, messages: [{ role: "user", content: "def f(" }], max_tokens: 8 });
  check(r.choices[0].message.role === "assistant", `chat: ${JSON.stringify(r)}`);
  const st = await client.chat.completions.create({ model, messages: [{ role: "user", content: "def f(" }], max_tokens: 8,
                                                    stream: true });
  let n = 0;
  for await (const ch of st) n += ch.choices?.length ? 1 : 0;
  check(n >= 1, "chat stream");
} else {
  await expectError("chat without a template", 400,
                    () => client.chat.completions.create({ model, messages: [{ role: "user", content: "hi" }] }),
                    /\/v1\/completions/);
}
const bad = new OpenAI({ baseURL, apiKey: "wrong-key", maxRetries: 0 });
if (process.env.MOETAX_API_KEY) await expectError("a wrong key", 401, () => bad.models.list());

console.log(`server_openai_sdk: ${checks} checks, ${fails} failed (the openai package)`);
process.exit(fails ? 1 : 0);
