#!/usr/bin/python3
# ctest-labels: unit
"""test_hostile_files.py - damaged or crafted side files (predictors, routing profiles, ledgers)
through the commands that read them: each is refused quickly with a message naming the file and
the field, with no signal and no sanitizer report, and the valid files still work.

- a predictor whose header asks for the largest shape (4096 layers x 65536 experts) with no
  pairs, or one pair: refused before anything of that size is allocated; a predictor of another
  model; a pair whose target is not the next MoE layer.
- a routing profile with a layer that is not an integer, a dense layer (--warm), counts that add
  up past 64 bits (report), and `report -` reading a profile from stdin.
- a ledger with 65536 experts and 64 routed layers (the report's ranking was quadratic in the
  experts), a layer listed twice, an expert listed twice in one token's set, decode steps whose
  batch sizes come in descending order.
Registered like every tests/test_*.py: the ASan build's test runs the ASan binary.

usage: test_hostile_files.py MOETAX_BIN WORKDIR
"""
import json
import os
import struct
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ref"))
from checks import check, summary  # noqa: E402  (tests/ref/checks.py)

BIN, WORK = os.path.abspath(sys.argv[1]), sys.argv[2]
os.makedirs(WORK, exist_ok=True)
os.chdir(WORK)
SANITIZER = ("runtime error", "AddressSanitizer", "LeakSanitizer", "UndefinedBehaviorSanitizer")


def run(args, stdin=None, timeout=60):
    try:
        p = subprocess.run([BIN] + args, input=stdin, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")


def refused(what, args, wants, stdin=None, timeout=60):
    """a non-zero exit without a signal or sanitizer report, the message naming every string in wants"""
    r = run(args, stdin, timeout)
    if r is None:
        check(False, "%s: still running after %d s" % (what, timeout))
        return
    rc, _, err = r
    bad = [s for s in SANITIZER if s in err]
    check(rc > 0 and not bad and all(w in err for w in wants),
          "%s: exit %d, wanted a refusal naming %s; stderr: %s" % (what, rc, wants, err.strip()[-400:]))


def works(what, args, stdin=None):
    r = run(args, stdin)
    ok = r is not None and r[0] == 0 and not any(s in r[2] for s in SANITIZER)
    check(ok, "%s: %s" % (what, "timed out" if r is None else "exit %d: %s" % (r[0], r[2].strip()[-400:])))
    return r[1] if ok else ""


def write(name, data):
    with open(name, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    return name


def fnv1a(b):
    h = 0xcbf29ce484222325
    for c in b:
        h = ((h ^ c) * 0x100000001b3) & 0xffffffffffffffff
    return h


def resum(b):
    """the predictor's trailing FNV-1a 64 of everything before it, as the writer does"""
    return b[:-8] + struct.pack("<Q", fnv1a(b[:-8]))


# ---- the files: the tiny model (layer 0 dense, MoE layers 1 and 2), its profile and predictor ----
works("gen", ["gen", "--preset", "tiny", "-o", "tiny.gguf"])
write("text.txt", "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n" * 3)
works("profile", ["profile", "-m", "tiny.gguf", "-f", "text.txt", "-o", "prof.json", "--fit-predictor"])
RUN = ["run", "-m", "tiny.gguf", "-p", "hello", "-n", "2", "--expert-budget", "160K"]
works("run --predictor (valid)", RUN + ["--predictor", "prof.pred"])
works("run --warm (valid)", RUN + ["--warm", "prof.json"])

# ---- predictors ----------------------------------------------------------------------------------
good = open("prof.pred", "rb").read()
head = bytearray(good[:128] + b"\0" * 8)
struct.pack_into("<IIIIIIIII", head, 8, 2, 4096, 65536, 65536, 1, 2, 1, 65537, 0)  # version .. n_pairs
struct.pack_into("<I", head, 44, 0)  # no hidden layer
refused("a 136-byte predictor asking for 4096 layers x 65536 experts, no pairs",
        RUN + ["--predictor", write("huge0.pred", resum(bytes(head)))], ["huge0.pred", "the model has 3"], timeout=30)
struct.pack_into("<I", head, 40, 1)
refused("the same with one pair", RUN + ["--predictor", write("huge1.pred", resum(bytes(head)))],
        ["huge1.pred", "4096 layers", "the model has 3"], timeout=30)
works("gen another model", ["gen", "--preset", "tiny", "--embd", "96", "-o", "wide.gguf"])
refused("a predictor of another model", ["run", "-m", "wide.gguf", "-p", "hi", "-n", "1", "--expert-budget", "300K",
                                         "--predictor", "prof.pred"], ["prof.pred", "the model has"])
# the first pair is (layer 1, 1 ahead) -> layer 2; make it predict layer 1 ahead -> 3 (no such MoE layer)
n_pairs = struct.unpack_from("<I", good, 40)[0]
check(n_pairs >= 1 and struct.unpack_from("<III", good, 128) == (1, 1, 2),
      "the fitted predictor's first pair: %s" % (struct.unpack_from("<III", good, 128),))
bad = bytearray(good)
struct.pack_into("<I", bad, 128 + 8, 1)
refused("a pair predicting an earlier layer", RUN + ["--predictor", write("back.pred", resum(bytes(bad)))],
        ["back.pred", "offset 136", "pair target"])
struct.pack_into("<II", bad, 128, 0, 1)
struct.pack_into("<I", bad, 128 + 8, 1)
refused("a pair of the dense layer 0", RUN + ["--predictor", write("dense.pred", resum(bytes(bad)))],
        ["dense.pred", "offset 128", "pair layer", "not a MoE layer"])

# a model with one MoE layer: its fitted predictor has no pairs, and still loads (it predicts nothing)
works("gen one MoE layer", ["gen", "--preset", "tiny", "--layers", "2", "--dense-lead", "1", "-o", "one.gguf"])
works("its profile", ["profile", "-m", "one.gguf", "-f", "text.txt", "-o", "one.json", "--fit-predictor"])
check(struct.unpack_from("<I", open("one.pred", "rb").read(), 40)[0] == 0, "the one-layer predictor has no pairs")
works("run --predictor with no pairs", ["run", "-m", "one.gguf", "-p", "hi", "-n", "2", "--expert-budget", "160K",
                                        "--predictor", "one.pred"])

# ---- profiles ------------------------------------------------------------------------------------
prof = json.load(open("prof.json"))
check([l["layer"] for l in prof["layers"]] == [1, 2], "the profile's layers: %s" % [l["layer"] for l in prof["layers"]])


def variant(name, edit):
    d = json.loads(json.dumps(prof))
    edit(d)
    return write(name, json.dumps(d))


p = variant("layer_real.json", lambda d: d["layers"][1].update(layer=2.0))
refused("--warm: a layer written 2.0", RUN + ["--warm", p], ["layer_real.json", "layers[1].layer"])
refused("report: a layer written 2.0", ["report", p], ["layer_real.json", "layers[1].layer"])
p = variant("layer_str.json", lambda d: d["layers"][0].update(layer="1"))
refused("report: a layer written \"1\"", ["report", p], ["layers[0].layer"])
p = variant("dense.json", lambda d: d["layers"][0].update(layer=0))
refused("--warm: a profile of the dense layer 0", RUN + ["--warm", p], ["dense.json", "layer 0", "not a MoE layer"])
p = variant("overflow.json", lambda d: d["layers"][0].update(freq=[2 ** 62] * len(d["layers"][0]["freq"])))
refused("report: counts past 64 bits", ["report", p], ["overflow.json", "layers[0].freq", "add up"])
p = variant("no_tokens.json", lambda d: d.pop("tokens"))
refused("report: no token count", ["report", p], ["no_tokens.json", "tokens"])
p = variant("model_num.json", lambda d: d.update(model=7))
refused("report: a model name that is a number", ["report", p], ["model_num.json", "model"])
p = variant("model_html.json", lambda d: d.update(model="<script>alert(1)</script>\x1b[2J"))
out = works("report: a model name with markup and an escape", ["report", p, "--html", "model_html.html"])
page = open("model_html.html").read() if os.path.exists("model_html.html") else ""
check("<script>" not in page and "&lt;script&gt;" in page, "the page escapes the model's name")
check("\x1b" not in out and "<script>alert(1)</script>?[2J" in out, "the text report prints the name without the escape")
by_path = works("report PROFILE", ["report", "prof.json"])
by_stdin = works("report - < PROFILE", ["report", "-"], stdin=open("prof.json", "rb").read())
check(by_stdin and by_stdin.replace("moetax report: -", "moetax report: prof.json") == by_path,
      "report - differs from report prof.json:\n%s\n%s" % (by_stdin[:300], by_path[:300]))
refused("report --max-input-bytes of a profile", ["report", "--max-input-bytes", "100", "prof.json"], ["prof.json"])

# ---- ledgers -------------------------------------------------------------------------------------
works("a ledger", ["run", "-m", "tiny.gguf", "-p", "hello world", "-n", "8", "-t", "2", "--ledger", "led.json",
                   "--routing-stats"])
led = json.load(open("led.json"))


def lvariant(name, edit):
    d = json.loads(json.dumps(led))
    edit(d)
    return write(name, json.dumps(d))


def pad(o, n):  # every per-layer table of a ledger to n rows
    if isinstance(o, dict):
        for key, v in o.items():
            if key == "layer_phase_s" and isinstance(v, list):
                o[key] = v + [v[-1]] * (n - len(v))
            else:
                pad(v, n)
    elif isinstance(o, list):
        for v in o:
            pad(v, n)


def many_experts(d):
    d["n_expert"] = 65536
    d["n_layer"] = 64
    layer = d["routing"]["layers"][0]
    d["routing"]["layers"] = [dict(layer, layer=i) for i in range(64)]
    pad(d, 64)


p = lvariant("many.json", many_experts)
rep = run(["report", "--json", p], timeout=30)  # the quadratic ranking took minutes
ok = rep is not None and rep[0] == 0 and not any(s in rep[2] for s in SANITIZER)
check(ok, "report of 64 layers x 65536 experts: %s" % ("still running after 30 s" if rep is None else rep[2][-400:]))
if ok:
    r = json.loads(rep[1])["routing"]
    check(len(r["layers"]) == 64 and r["layers"][0]["hottest"] == r["layers"][63]["hottest"],
          "the 64 copies of a layer differ: %s" % [(x["layer"], x["hottest"]) for x in r["layers"][:2]])
def step_tokens(d):
    for st in d["steps"]:
        st["tokens"] = 6 * 10 ** 18


p = lvariant("tokens.json", step_tokens)
refused("steps of 6e18 tokens (their sum overflowed)", ["report", p], ["tokens.json", "tokens"])
p = lvariant("bigk.json", lambda d: d.update(n_expert=32768, n_expert_used=32768))
refused("32768 experts used per token", ["report", p], ["bigk.json", "n_expert_used"])


def empty_layers(d):  # 300 routed layers of 65536 experts and no tokens: 300 x 65536 counts
    d.update(n_expert=65536, n_layer=300)
    pad(d, 300)
    d["routing"] = {"tokens": 0, "first_token": 0, "layers": [{"layer": i, "step": [], "experts": []} for i in range(300)]}


p = lvariant("empty_layers.json", empty_layers)
refused("300 empty routing layers of 65536 experts", ["report", p], ["empty_layers.json", "routing.layers", "counts"],
        timeout=30)
p = lvariant("million.json", lambda d: d.update(n_expert=1000000))
refused("a ledger of a million experts", ["report", p], ["million.json", "n_expert"])
p = lvariant("twice.json", lambda d: d["routing"]["layers"].append(d["routing"]["layers"][0]))
refused("a routing layer listed twice", ["report", p], ["twice.json", "routing.layers[2].layer", "twice"])


def same_expert(d):
    d["routing"]["layers"][0]["experts"][3] = [5, 5]


p = lvariant("same.json", same_expert)
refused("an expert twice in a token's set", ["report", p], ["same.json", "routing.layers[0].experts[3][1]", "twice"])


def batches(d):
    dec = [s for s in d["steps"] if s["kind"] == "decode"]
    for i, s in enumerate(dec):
        s["batch"] = [7, 5, 3, 7, 2, 1, 5][i % 7]


rep = works("report of steps whose batch sizes descend", ["report", "--json", lvariant("batches.json", batches)])
if rep:
    got = [b["batch"] for b in json.loads(rep)["batches"]]
    check(got == [1, 2, 3, 5, 7], "batch rows: %s (wanted 1 2 3 5 7)" % got)

# ---- numbers past what a run records, in ledgers and traces; command-line counts -------------------


def huge_times(d):
    for st in d["steps"]:
        st["wall_s"] = 1.7e308


refused("a ledger's step of 1.7e308 s (report --html looped on an infinite axis, filling the disk)",
        ["report", lvariant("huge_times.json", huge_times), "--html", "huge_times.html"],
        ["huge_times.json", "steps[0].wall_s", "beyond"], timeout=30)
check(not [f for f in os.listdir(".") if f.startswith("huge_times.html")], "no page (or temporary page) is left")
write("huge_dur.json", json.dumps({"traceEvents": [{"ph": "X", "name": "attn", "ts": 0, "dur": 1.7976e308, "pid": 0,
                                                     "tid": 0, "args": {"layer": 0, "step": 0}}]}))
refused("a trace span of 1.7976e308 us", ["report", "huge_dur.json", "--html", "huge_dur.html"],
        ["huge_dur.json", "dur", "beyond"], timeout=30)
# one store read across every step and many short ones before them: each step's window once scanned
# every read before it; the busy and in-flight time are the steps' whole time (the long read covers it)
N = 50000
ev = [{"ph": "X", "cat": "io", "name": "demand read", "pid": 1, "tid": 0, "ts": 0, "dur": 1e12}]
ev += [{"ph": "X", "cat": "io", "name": "demand read", "pid": 1, "tid": 0, "ts": i + 1, "dur": 0.5} for i in range(N)]
ev += [{"ph": "X", "name": "attn", "pid": 0, "tid": 0, "ts": N + 10 + 2 * i, "dur": 1, "args": {"layer": 0, "step": i}}
       for i in range(N)]
write("reads.json", json.dumps({"traceEvents": ev}))
rep = run(["report", "--json", "reads.json"], timeout=120)
ok = rep is not None and rep[0] == 0 and not any(x in rep[2] for x in SANITIZER)
check(ok, "report of %d reads and %d steps: %s" % (N + 1, N, "still running" if rep is None else rep[2][-300:]))
if ok:
    io = json.loads(rep[1])["io"]
    check(abs(io["busy_share"] - 1) < 1e-9 and abs(io["mean_in_flight"] - 1) < 1e-9,
          "one read across every step: busy share and mean in flight 1: %s" % io)
refused("bench -p 2^62 (its token buffer's size wrapped: a heap overflow)",
        ["bench", "-m", "tiny.gguf", "-p", "4611686018427387904", "-r", "1"], ["-p values"])
refused("bench -n 2^63-1", ["bench", "-m", "tiny.gguf", "-n", "9223372036854775807", "-r", "1"], ["-n values"])
refused("bench --batch 2 -p 2^62 (B x tokens overflowed, cast to int32)",
        ["bench", "-m", "tiny.gguf", "--batch", "2", "-p", "4611686018427387904", "-n", "4", "-r", "1"], ["-p values"])
works("--capacity-factor 1e-40 (a float above 0: each expert takes one assignment)",
      ["perplexity", "-m", "tiny.gguf", "-f", "text.txt", "--capacity-factor", "1e-40"])
refused("--config - (a configuration from standard input)", ["run", "-m", "tiny.gguf", "-p", "hi", "-n", "1",
                                                             "--config", "-"], ["--config", "'-'"])
refused("--capacity-factor 1e-300 (its float was 0: off)",
        ["perplexity", "-m", "tiny.gguf", "-f", "text.txt", "--capacity-factor", "1e-300"], ["--capacity-factor"])
write("tiny_cf.json", json.dumps({"moetax_config": 1, "capacity_factor": 1e-300}))
refused("a configuration's capacity factor 1e-300", ["perplexity", "-m", "tiny.gguf", "-f", "text.txt", "--config",
                                                     "tiny_cf.json"], ["tiny_cf.json", "capacity_factor"])
write("dup_key.json", '{"moetax_config": 1, "threads": 2, "threads": 1}')
refused("a configuration with a key twice", ["perplexity", "-m", "tiny.gguf", "-f", "text.txt", "--config",
                                             "dup_key.json"], ["dup_key.json", "duplicate"])
refused("--config /dev/zero", ["perplexity", "-m", "tiny.gguf", "-f", "text.txt", "--config", "/dev/zero"],
        ["/dev/zero", "not a configuration"], timeout=30)
refused("--config DIR", ["perplexity", "-m", "tiny.gguf", "-f", "text.txt", "--config", "."], ["directory"])
refused("tune --workload batch:12abc", ["tune", "-m", "tiny.gguf", "--workload", "batch:12abc"], ["--workload"])
refused("tune --workload batch:4294967297", ["tune", "-m", "tiny.gguf", "--workload", "batch:4294967297"],
        ["--workload"])
works("gen 8 layers of 256 experts", ["gen", "--arch", "mixtral", "--preset", "tiny", "--layers", "8", "--experts", "256",
                                      "--embd", "16", "--expert-ff", "8", "--heads", "2", "--heads-kv", "1", "--head-dim",
                                      "8", "--vocab", "300", "-o", "w8.gguf"])
refused("inspect --ranks 65536 of 8 x 256 experts (tables of layers x experts x ranks)",
        ["inspect", "w8.gguf", "--ranks", "65536"], ["--ranks 65536", "2^26"], timeout=30)

# ---- positions past the model's trained context (tiny: 512): run, but with a warning saying so ----------
def warned(what, args, wants):
    r = run(args, timeout=120)
    ok = r is not None and r[0] == 0 and not any(x in r[2] for x in SANITIZER) and all(w in r[2] for w in wants)
    check(ok, "%s: %s" % (what, "timed out" if r is None else "exit %d, wanted a warning naming %s; stderr: %s"
                          % (r[0], wants, r[2].strip()[-400:])))


past = ["warning", "past the 512 positions the model was trained on"]
warned("eval --decode 600", ["eval", "-m", "tiny.gguf", "--tokens", "1,2,3", "--decode", "600", "-t", "1"], past)
warned("run -c 640 -n 600", ["run", "-m", "tiny.gguf", "-p", "hi", "-n", "600", "-c", "640", "--ignore-eos", "-t", "1"],
       past)
write("long.txt", "x " * 700)
warned("run --parallel 2 of a 700-token prompt", ["run", "-m", "tiny.gguf", "-f", "long.txt", "--parallel", "2", "-n", "2",
                                                  "-t", "1"], past)
r = run(["bench", "-m", "tiny.gguf", "-p", "8", "-n", "4", "-r", "1", "-t", "1", "--no-mem", "--expert-budget", "50%,1"])
check(r is not None and r[0] > 0 and "--expert-budget 1: expert budget of" in r[2] and "give at least" in r[2]
      and "tg4" not in r[1], "bench --expert-budget 50%%,1: refused before the first test: %s"
      % ((r[1][-300:] + r[2][-300:]) if r else "timed out"))
refused("tune --calib MISSING: the option named", ["tune", "-m", "tiny.gguf", "--calib", "nothere.txt"],
        ["--calib", "nothere.txt"])
r = run(["inspect", "tiny.gguf", "--ranks", "2", "--ep-replicas", "1", "--ep-load", "nothere.json"])
check(r is not None and (r[0] > 0 and "--ep-load" in r[2] and "nothere.json" in r[2] or "without MPI" in r[2]),
      "inspect --ep-load MISSING: the option named: %s" % (r[2][-300:] if r else "timed out"))
write("empty.txt", "")
refused("profile of an empty text (a BOS-only profile was written)", ["profile", "-m", "tiny.gguf", "-f", "empty.txt",
                                                                     "-o", "empty.json"], ["empty.txt", "no text"])
check(not os.path.exists("empty.json"), "no profile is written for an empty text")
works("profile --max-tokens 1 of a real text (the empty-text check refused it)",
      ["profile", "-m", "tiny.gguf", "-f", "text.txt", "-o", "one_tok.json", "--max-tokens", "1"])
# bench's per-budget outputs (FILE.budget-25pct.json) against the inputs too (a --warm profile was overwritten)
import shutil  # noqa: E402
shutil.copy("prof.json", "x.budget-25pct.json")
warm_before = open("x.budget-25pct.json", "rb").read()
refused("bench --ledger x.json --warm x.budget-25pct.json", ["bench", "-m", "tiny.gguf", "-p", "0", "-n", "4", "-r", "1",
                                                             "--no-mem", "--expert-budget", "25%", "--ledger", "x.json",
                                                             "--warm", "x.budget-25pct.json"], ["is the input"])
check(open("x.budget-25pct.json", "rb").read() == warm_before, "the warm-start profile is left as it was")
works("a prefill-only ledger", ["run", "-m", "tiny.gguf", "-p", "hello world", "-n", "0", "--ledger", "nodec.json"])
refused("report --decode-only of a prefill-only ledger (its breakdowns were zeros)",
        ["report", "nodec.json", "--decode-only"], ["nodec.json", "no decode steps"])
for c in (["perplexity", "-f", "text.txt"], ["bench", "-n", "2", "-r", "1"], ["serve"]):
    refused(c[0] + " --overflow without --capacity-factor (ignored)", c + ["-m", "tiny.gguf", "--overflow", "reroute"],
            ["--overflow goes with --capacity-factor"], timeout=30)
refused("eval --tokens 1,2, (a trailing comma was taken)", ["eval", "-m", "tiny.gguf", "--tokens", "1,2,"], ["--tokens"])
refused("bench -t 1, (a trailing comma was taken)", ["bench", "-m", "tiny.gguf", "-t", "1,"], ["thread list"])
refused("run --parallel 128 -n 2^24 (its cells wrapped in int32: the model's 512, then no prompt fit)",
        ["run", "-m", "tiny.gguf", "-f", "long.txt", "--parallel", "128", "-n", "16777216"], ["KV cells", "lower -n"])
# a row longer than gen's 2^20-value chunk (its buffers held a chunk: a heap overflow under ASan, a corrupt heap
# in the release build)
works("gen a row of 1.1 M values", ["gen", "--preset", "tiny", "--layers", "1", "--embd", "1", "--ff", "1100000",
                                     "--dense-lead", "1", "--experts", "2", "--experts-used", "1", "-o", "longrow.gguf"])
works("inspect it", ["inspect", "longrow.gguf", "--checksums"])
# the store's per-token figures count the tokens that ran (the last sampled token is not run: they counted it)
works("run with a store and a ledger", ["run", "-m", "tiny.gguf", "-p", "hi", "-n", "16", "--ignore-eos", "-t", "1",
                                        "--expert-budget", "50%", "--ledger", "store_led.json"])
if os.path.exists("store_led.json"):
    led = json.load(open("store_led.json"))
    check(led.get("store", {}).get("tokens") == led.get("totals", {}).get("tokens"),
          "the ledger's store tokens %s = its tokens %s" % (led.get("store", {}).get("tokens"),
                                                            led.get("totals", {}).get("tokens")))
# inspect shows a file's text without its control bytes: a value with ESC sequences and a newline forged a line
# and moved the terminal's cursor
def gguf_str(b):
    return struct.pack("<Q", len(b)) + b
evil = b"line1\n  general.file_type    uint32   7\x1b]0;pwned\x07\x00hidden"
raw = b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + gguf_str(b"general.architecture") + struct.pack("<I", 8) + \
    gguf_str(b"llama") + gguf_str(b"test.\x1b[2Jkey") + struct.pack("<I", 8) + gguf_str(evil)
open("ctrl.gguf", "wb").write(raw + b"\0" * (-len(raw) % 32))
r = run(["inspect", "ctrl.gguf"])
check(r is not None and r[0] == 0 and "\x1b" not in r[1] and "\x07" not in r[1] and "line1?" in r[1] and "hidden" in r[1],
      "inspect prints no control bytes: %r" % (r[1][-400:] if r else "timed out"))
# quantize: a tensor name longer than it writes is refused (it was cut to 255 bytes: renamed, or two names
# clashing as "declared twice"); an already quantized file converted again is said
tname = b"t" * 300
raw = b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + gguf_str(b"general.architecture") + struct.pack("<I", 8) + \
    gguf_str(b"llama") + gguf_str(tname) + struct.pack("<IQIQ", 1, 32, 0, 0)
raw += b"\0" * (-len(raw) % 32) + struct.pack("<32f", *range(32))
open("longname.gguf", "wb").write(raw)
if os.path.exists("longname_q8.gguf"):
    os.unlink("longname_q8.gguf")  # an earlier run's
refused("quantize a 300-byte tensor name", ["quantize", "longname.gguf", "longname_q8.gguf", "q8_0"],
        ["tensor name of 300 bytes"])
check(not os.path.exists("longname_q8.gguf"), "no output for a name it cannot write")
works("gen q4_0", ["gen", "--preset", "tiny", "--type", "q4_0", "-o", "tq4.gguf"])
r = run(["quantize", "tq4.gguf", "tq4_q8.gguf", "q8_0"])
check(r is not None and r[0] == 0 and "is already q4_0" in r[2], "quantize q4_0 -> q8_0 says the file was quantized: %s"
      % (r[2][-300:] if r else "timed out"))
# an output name of 250 bytes (legal): written (its temporary name, 11 bytes longer, was refused as too long)
works("gen -o a 254-byte name", ["gen", "--preset", "tiny", "-o", "a" * 249 + ".gguf"])
check(os.path.exists("a" * 249 + ".gguf") and not [f for f in os.listdir(".") if f.startswith((".moetax.tmp.", "a" * 249 + ".gguf.tmp"))],
      "the long-named output is there and no temporary file of it is left")
refused("run --parallel 2 -n 0 (it generated a token per prompt)", ["run", "-m", "tiny.gguf", "-f", "long.txt",
                                                                     "--parallel", "2", "-n", "0"], ["-n 0"])
# a model path that is not UTF-8 (a file named in another encoding): the ledger stays JSON that report and Python
# read (its bytes went into the file as they were: report refused it, and so did Python's json)
latin = b"mod\xe9l.gguf"
if os.path.lexists(latin):
    os.unlink(latin)
os.symlink(os.path.abspath("tiny.gguf").encode(), latin)
r = subprocess.run([BIN, "run", "-m", latin, "-p", "hi", "-n", "2", "-t", "1", "--ledger", "latin_led.json"],
                   capture_output=True, timeout=60)
check(r.returncode == 0, "run of a model named in Latin-1: %s" % r.stderr.decode(errors="replace")[-300:])
try:
    led = json.load(open("latin_led.json", encoding="utf-8"))
    check(led.get("model", "").startswith("mod\ufffdl"), "the ledger names the model with U+FFFD: %r" % led.get("model"))
except (OSError, ValueError) as e:
    check(False, "the ledger of a Latin-1 model path is JSON: %s" % e)
works("report it", ["report", "latin_led.json"])
refused("run -p X -f FILE (the file's text was used)", ["run", "-m", "tiny.gguf", "-p", "hi", "-f", "long.txt", "-n", "1"],
        ["-p and -f"])
r = run(["run", "-m", "tiny.gguf", "-p", "hi", "-n", "20", "-t", "1", "--ignore-eos"])
check(r is not None and r[0] == 0 and "warning" not in r[2], "no warning within the trained context: %s"
      % (r[2][-300:] if r else "timed out"))

# ---- an output in place of an input: refused, the input left as it was --------------------------------
import shutil  # noqa: E402
shutil.copy("tiny.gguf", "victim.gguf")
before = open("victim.gguf", "rb").read()
for what, args in [
        ("eval --out MODEL", ["eval", "-m", "victim.gguf", "--tokens", "1,2", "--out", "victim.gguf"]),
        ("run --ledger MODEL", ["run", "-m", "victim.gguf", "-p", "hi", "-n", "1", "--ledger", "victim.gguf"]),
        ("run --trace ./MODEL", ["run", "-m", "victim.gguf", "-p", "hi", "-n", "1", "--trace", "./victim.gguf"]),
        ("bench --ledger MODEL", ["bench", "-m", "victim.gguf", "-n", "2", "-r", "1", "--ledger", "victim.gguf"]),
        ("profile -o MODEL", ["profile", "-m", "victim.gguf", "-f", "text.txt", "-o", "victim.gguf"]),
        ("gen --dense-twin-of MODEL -o MODEL", ["gen", "--dense-twin-of", "victim.gguf", "-o", "victim.gguf"])]:
    refused(what, args, ["victim.gguf", "is the input"])
check(open("victim.gguf", "rb").read() == before, "the model is left as it was")
# the side files a command reads (a text, a predictor, a warm-start profile, a configuration): the refusal names the
# option (each of these was replaced, exit 0, before the inputs were taken from the whole command line)
write("side.txt", "def f(x):\n    return x\n" * 40)
cfg = json.dumps({"moetax_config": 1, "threads": 1})
write("cfg.json", cfg)
side = open("side.txt", "rb").read()
for what, args, opt in [
        ("bench -f TEXT --trace TEXT", ["bench", "-m", "tiny.gguf", "-n", "2", "-r", "1", "--no-mem", "-f", "side.txt",
                                         "--trace", "side.txt"], "-f"),
        ("run --predictor P --trace P", ["run", "-m", "tiny.gguf", "-p", "hi", "-n", "1", "--expert-budget", "50%",
                                          "--predictor", "side.txt", "--trace", "side.txt"], "--predictor"),
        ("run --warm=W --ledger ./W", ["run", "-m", "tiny.gguf", "-p", "hi", "-n", "1", "--expert-budget", "50%",
                                        "--warm=side.txt", "--ledger", "./side.txt"], "--warm"),
        ("run --config C --ledger C", ["run", "-m", "tiny.gguf", "-p", "hi", "-n", "1", "--config", "cfg.json",
                                        "--ledger", "cfg.json"], "--config"),
        ("profile --predictor P -o P", ["profile", "-m", "tiny.gguf", "-f", "text.txt", "--predictor", "side.txt",
                                         "-o", "side.txt"], "--predictor"),
        ("profile --predictor P --dump-features P", ["profile", "-m", "tiny.gguf", "-f", "text.txt", "-o", "pf.json",
                                                      "--predictor", "side.txt", "--dump-features", "side.txt"],
         "--predictor"),
        ("tune --calib T --html T", ["tune", "-m", "tiny.gguf", "--calib", "side.txt", "--html", "side.txt"], "")]:
    victim = "cfg.json" if "cfg.json" in args else "side.txt"
    refused(what, args, [victim, "is the input", opt])
check(open("side.txt", "rb").read() == side, "the side file is left as it was")
check(open("cfg.json").read() == cfg, "the configuration is left as it was")
refused("report LEDGER --html LEDGER", ["report", "led.json", "--html", "led.json"], ["led.json", "is the input"])
refused("run --ledger A --trace ./A", ["run", "-m", "tiny.gguf", "-p", "hi", "-n", "1", "--ledger", "same.json",
                                      "--trace", "./same.json"], ["same.json", "the same file"])
refused("profile -o P --predictor-out P", ["profile", "-m", "tiny.gguf", "-f", "text.txt", "-o", "pp.out",
                                           "--fit-predictor", "--predictor-out", "pp.out"], ["pp.out", "the same file"])
refused("eval --tokens 4294967297 (read as token 1)", ["eval", "-m", "tiny.gguf", "--tokens", "4294967297,1"],
        ["4294967297"])
refused("serve --api-key '' (authentication silently off)", ["serve", "-m", "tiny.gguf", "--api-key", ""], ["--api-key"],
        timeout=30)
refused("gen with 2^30 heads of 2^30 dims (its size overflowed: UBSan)",
        ["gen", "--preset", "tiny", "--heads", "1073741824", "--nope", "1073741824", "-o", "huge.gguf"], ["parameters"])
check(not os.path.exists("huge.gguf"), "no file is written for a shape too large")

# quantize to q4_k of 36-column rows: the message names the type each tensor gets (it said q8_0 and wrote f16)
works("gen 36 columns", ["gen", "--preset", "tiny", "--embd", "36", "--heads", "4", "-o", "odd36.gguf"])
q = run(["quantize", "odd36.gguf", "odd36q.gguf", "q4_k"])
ins = run(["inspect", "odd36q.gguf"])
said = {}  # tensor -> the type its message names
for line in (q[2] if q else "").splitlines():
    if line.startswith("moetax quantize: ") and line.endswith(" instead"):
        said[line.split(": ")[1]] = line.split()[-2]
written = {f[0]: f[1] for f in (x.split() for x in (ins[1] if ins else "").splitlines()) if len(f) > 1 and f[0] in said}
check(q is not None and q[0] == 0 and said.get("token_embd.weight") == "f16" and written == said,
      "quantize names the type each fallback is written as: said %s, written %s" % (said, written))

# a weight that is NaN or infinite (a damaged F32 file): quantize and --expert-type refuse it, naming the tensor
# (or layer and expert) and the row, and write nothing (the quantizers' float-to-integer conversions of such
# values were undefined behaviour; UBSan's float-cast-overflow in the sanitizer build)
from gguf_np import GGUFReader  # noqa: E402  (tests/ref/gguf_np.py)
works("gen f32", ["gen", "--preset", "tiny", "--type", "f32", "-o", "nan.gguf"])
info = GGUFReader("nan.gguf").tensors["blk.1.ffn_up_exps.weight"]
with open("nan.gguf", "r+b") as f:  # expert 2, row 5: values 7 (NaN) and 8 (infinity)
    f.seek(info.abs_offset + 4 * (info.ne[0] * (2 * info.ne[1] + 5) + 7))
    f.write(struct.pack("<2f", float("nan"), float("inf")))
for t in ("q4_0", "q4_1", "q5_1", "q8_0", "q4_k"):
    if os.path.exists("nanq.gguf"):
        os.remove("nanq.gguf")
    refused("quantize a NaN weight to " + t, ["quantize", "nan.gguf", "nanq.gguf", t],
            ["blk.1.ffn_up_exps.weight", "row %d, column 7" % (2 * info.ne[1] + 5), "NaN or an infinity"])
    check(not os.path.exists("nanq.gguf"), "quantize %s: nothing written for a NaN weight" % t)
works("quantize a NaN weight to f16 (it holds one)", ["quantize", "nan.gguf", "nanq.gguf", "f16"])
refused("--expert-type q4_0 of a NaN weight", ["run", "-m", "nan.gguf", "--expert-type", "q4_0", "-p", "a", "-n", "1"],
        ["layer 1, expert 2's up, row 5", "NaN or an infinity"])

# a file whose layers are all dense (block_count cut to its dense lead) while its expert keys hold anything: no
# expert tensor is bound, so nothing checked those keys, and the context sized buffers by them (expert_shared_count
# 469762049 x 32: 135 GB, found by fuzz_model; an out-of-memory error in this build, an abort under ASan). It is a
# dense model: it runs, in a small footprint.
works("gen a 2-layer model", ["gen", "--preset", "tiny", "--layers", "2", "--dense-lead", "1", "-o", "dense_keys.gguf"])
blob = bytearray(open("dense_keys.gguf", "rb").read())
for key, val in ((b"deepseek2.block_count", 1), (b"deepseek2.expert_shared_count", 469762049),
                 (b"deepseek2.expert_count", 2**31 - 1), (b"deepseek2.expert_feed_forward_length", 2**31 - 1),
                 (b"deepseek2.expert_used_count", 2**31 - 1)):
    at = blob.index(key) + len(key)
    check(struct.unpack_from("<I", blob, at)[0] == 4, "%s is a uint32 key" % key.decode())  # GGUF type 4
    struct.pack_into("<I", blob, at + 4, val)
write("dense_keys.gguf", bytes(blob))
r = run(["run", "-m", "dense_keys.gguf", "-p", "def", "-n", "4", "--temp", "0", "--routing-stats", "--ledger",
         "dense_keys.json"])
check(r is not None and r[0] == 0 and not any(x in r[2] for x in SANITIZER),
      "an all-dense file with huge expert keys runs as a dense model: %s" % (r[2].strip()[-300:] if r else "timed out"))
check(r is not None and "per token): wait" in r[2] and "per token): ," not in r[2],
      "the ledger's summary of a dense model starts with its first phase: %s" % (r[2].strip()[-300:] if r else ""))
# its ledger (an empty routing section: nothing was routed) is one report reads
works("report of a dense model's ledger with --routing-stats", ["report", "dense_keys.json"])

sys.exit(summary())
