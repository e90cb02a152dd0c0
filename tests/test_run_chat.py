#!/usr/bin/python3
# ctest-labels: unit
"""test_run_chat.py - `moetax run --chat`: the prompt as one user message (with -sys, a
system message first) rendered with a chat template; a model without
tokenizer.chat_template (what `moetax gen` writes) is a clear error naming
--chat-template; --chat-template chatml renders as ChatML and generates exactly what
`run -p` of the rendered text does (greedy; the text has no control tokens in this
vocabulary, so the server's control-token split leaves it as plain text); --chat-template
(run and serve) takes exactly one of the template names, anything else is a usage error listing them.

usage: test_run_chat.py MOETAX_BIN WORKDIR
"""
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ref"))
from checks import check, summary  # noqa: E402  (tests/ref/checks.py)
from serve_proc import serve_built  # noqa: E402  (tests/ref/serve_proc.py)


def run(args):
    return subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=600)


def main():
    mt, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    model = os.path.join(work, "chat-tiny.gguf")
    r = run([mt, "gen", "--preset", "tiny", "-o", model])
    check(r.returncode == 0, "gen: " + r.stderr[-300:])
    base = [mt, "run", "-m", model, "-n", "6", "--temp", "0", "-t", "1"]
    r = run(base + ["--chat", "-p", "hi"])
    check(r.returncode != 0 and "no tokenizer.chat_template" in r.stderr and "--chat-template" in r.stderr,
          "no template: clear error: " + r.stderr[-300:])
    r = run(base + ["--chat-template", "nonesuch", "--chat", "-p", "hi"])
    check(r.returncode != 0 and "nonesuch" in r.stderr, "unknown --chat-template named: " + r.stderr[-200:])
    # --chat-template takes a name, matched exactly: a near miss or a fragment of a template's source
    # (which the model's template detection would have recognised) is a usage error listing every name
    every = ["chatml", "llama2", "llama2-sys", "llama2-sys-bos", "llama2-sys-strip", "mistral-v1", "mistral-v3",
             "mistral-v3-tekken", "mistral-v7", "phi3", "llama3", "deepseek2", "deepseek3"]
    for bad in ("mistral-v8", "mistral", "x<|im_start|>"):
        r = run(base + ["--chat", "--chat-template", bad, "-p", "hi"])
        listed = r.stderr.split("the names are ")[-1].split("\n")[0].split(", ")
        check(r.returncode == 2 and "not a template" in r.stderr and sorted(listed) == sorted(every),
              f"--chat-template {bad!r}: {r.stderr[-400:]}")
    for name in every:
        r = run(base + ["--chat", "--chat-template", name, "-p", "hi", "-n", "1"])
        check(r.returncode == 0, f"--chat-template {name}: {r.stderr[-300:]}")
    try:
        if serve_built(mt, "serve --chat-template mistral-v9"):
            r = subprocess.run([mt, "serve", "-m", model, "--port", "0", "--chat-template", "mistral-v9"],
                               capture_output=True, text=True, errors="replace", timeout=20)
            check(r.returncode == 2 and "mistral-v9" in r.stderr and "mistral-v3-tekken" in r.stderr,
                  f"serve: {r.stderr[-300:]}")
    except subprocess.TimeoutExpired:
        check(False, "serve --chat-template mistral-v9 started")
    r = run(base + ["-sys", "x", "-p", "hi"])
    check(r.returncode != 0 and "--chat" in r.stderr, "-sys without --chat: " + r.stderr[-200:])
    rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    a = run(base + ["--chat", "--chat-template", "chatml", "-sys", "Be brief.", "-p", "hi"])
    check(a.returncode == 0 and a.stdout.startswith(rendered), "chatml rendering echoed: " + repr(a.stdout[:200]))
    b = run(base + ["-p", rendered])
    check(b.returncode == 0 and a.stdout == b.stdout, "same text as run -p of the rendering: %r vs %r" % (a.stdout, b.stdout))
    c = run(base + ["--chat", "--chat-template", "llama3", "-p", "hi"])
    check(c.returncode == 0 and c.stdout.startswith("<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"),
          "llama3 rendering: " + repr(c.stdout[:200]))
    return summary()


if __name__ == "__main__":
    sys.exit(main())
