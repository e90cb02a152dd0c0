#!/usr/bin/python3
# ctest-labels: unit;model
"""test_tune.py - moetax tune on the default model: the results' shape, the Pareto front
non-dominated, the recommendation within the quality bound (or the default), its
configuration read back by run/bench/perplexity/serve's --config, and malformed
configurations refused with the key named.

usage: test_tune.py MOETAX_BIN WORKDIR
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ref"))
from checks import check, summary  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "pycode-20m-q8_0.gguf")


def run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=600, **kw)


def main():
    mt, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    calib = os.path.join(work, "tune_calib.py")
    with open(calib, "w") as f:
        f.write("".join("def f%d(a, b=None):\n    if b is None:\n        return a\n    return [a, b, %d]\n\n" % (i, i)
                        for i in range(120)))
    cfg, page = os.path.join(work, "tune.json"), os.path.join(work, "tune.html")
    r = run([mt, "tune", "-m", MODEL, "--calib", calib, "--time", "30s", "--json", "-o", cfg, "--html", page])
    check(r.returncode == 0, f"tune: rc {r.returncode}: {r.stderr[-500:]}")
    rows = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    check(len(rows) >= 4, f"tune --json: {len(rows)} rows")
    final = [o for o in rows if o["stage"] == 3]
    check(len(final) >= 2, f"{len(final)} configurations reached stage 3")
    exact = [o for o in rows if o["experts_used"] == 4 and o["capacity_factor"] == 0]
    check(exact and all(o["kl"] == 0 and o["ppl_change"] == 0 and o["top1"] == 1 for o in exact),
          "the file's k: KL 0, perplexity unchanged, top-1 100% (threads and paging change no bit)")
    fewer = [o for o in rows if o["experts_used"] < 4]
    check(fewer and all(o["kl"] > 0 for o in fewer), "fewer experts per token: KL > 0")
    for a in final:  # the front: no stage-3 point is both faster and closer
        dom = [b for b in final if b is not a and b["speed_ratio"] >= a["speed_ratio"] and b["kl"] <= a["kl"]
               and (b["speed_ratio"] > a["speed_ratio"] or b["kl"] < a["kl"])]
        check(a["pareto"] == (not dom), f"{a['config']}: pareto {a['pareto']}, dominated by {[b['config'] for b in dom]}")
    check(os.path.exists(cfg) and os.path.getsize(page) > 1000, "tune -o and --html written")
    c = json.load(open(cfg))
    check(c["moetax_config"] == 1 and c["measured"]["ppl_change"] <= 0.01, f"the recommendation keeps the bound: {c}")
    # --config: read back by the tools (options still win)
    base = [mt, "run", "-m", MODEL, "-p", "def f(", "-n", "8", "--temp", "0"]
    a, b = run(base), run(base + ["--config", cfg])
    check(a.returncode == 0 and b.returncode == 0, f"run --config: {b.stderr[-300:]}")
    if c["experts_used"] == 4:
        check(a.stdout == b.stdout, "run --config with the file's k: the same greedy text")
    k2 = os.path.join(work, "tune_k2.json")
    with open(k2, "w") as f:
        json.dump({"moetax_config": 1, "experts_used": 2, "threads": 1}, f)
    r2 = run(base + ["--config", k2])
    r2b = run(base + ["--experts-used", "2", "-t", "1"])
    check(r2.returncode == 0 and r2.stdout == r2b.stdout and "1 threads" in r2.stderr,
          f"--config experts_used 2, threads 1 = --experts-used 2 -t 1: {r2.stderr[-200:]}")
    r3 = run(base + ["--config", k2, "--experts-used", "4"])
    check(r3.returncode == 0 and r3.stdout == a.stdout, "an option after --config wins")
    for tool in (["perplexity", "-m", MODEL, "-f", calib, "-c", "64"], ["bench", "-m", MODEL, "-p", "0", "-n", "4", "-r", "1", "--no-mem"]):
        r = run([mt] + tool + ["--config", k2])
        check(r.returncode == 0, f"{tool[0]} --config: {r.stderr[-300:]}")
    bad = os.path.join(work, "tune_bad.json")
    for text, key in (('{"moetax_config": 1, "threads": "two"}', "threads"), ('{"moetax_config": 2}', "moetax_config"),
                      ('{"moetax_config": 1, "overflow": "sideways"}', "overflow"), ('{"moetax_config": 1,', "JSON")):
        with open(bad, "w") as f:
            f.write(text)
        r = run(base + ["--config", bad])
        check(r.returncode == 2 and key in r.stderr, f"config {text!r}: rc {r.returncode} {r.stderr.strip()}")
    r = run([mt, "tune", "-m", MODEL, "--max-quality-loss", "-1"])
    check(r.returncode == 2 and "--max-quality-loss" in r.stderr, "a negative quality bound is refused")
    return summary()


if __name__ == "__main__":
    sys.exit(main())
