#!/usr/bin/python3
# ctest-labels: model
# ctest-cost: 49
"""test_tune.py - moetax tune on the default model: the results' shape, the Pareto front
non-dominated, the recommendation within the quality bound (or the default), its
configuration read back by run/bench/perplexity/serve's --config, and malformed
configurations refused with the key named. The precision lever: --expert-type q4_0 computes
the logits of the file `quantize --experts-only` writes, bit for bit, and the tuner lists it
with its measured KL; under --memory only configurations that fit are on the front.

usage: test_tune.py MOETAX_BIN WORKDIR
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ref"))
from checks import SLOW, check, long_skipped, summary  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "pycode-20m-q8_0.gguf")


def run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=600, **kw)


def bench_tps(mt, cfgfile):
    """bench's decode tokens/s (64 tokens, 2 repetitions), with --config cfgfile if given; with an expert budget
    the store run's figure"""
    args = [mt, "bench", "-m", MODEL, "-p", "0", "-n", "64", "-r", "2", "--no-mem", "--json"]
    r = run(args + (["--config", cfgfile] if cfgfile else []))
    rows = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{") and '"tokens_per_s"' in x]
    check(r.returncode == 0 and rows, f"bench --config {cfgfile}: {r.stderr[-300:]}")
    return rows[-1]["tokens_per_s"] if rows else 0


def paired(mt, cfgfile, pairs=5):
    """median and spread (max - min) of bench's ratio cfgfile / default, run alternately"""
    rs = sorted(bench_tps(mt, cfgfile) / max(bench_tps(mt, None), 1e-9) for _ in range(pairs))
    return rs[len(rs) // 2], rs[-1] - rs[0]


def bench_check(mt, work, rows, c):
    """the recommendation re-measured by bench alternately against the default, printed beside its claimed ratio
    (not asserted: timings inside a parallel test run are not a measurement; the claim is checked by hand with
    bench on a quiet machine); a default recommendation: the front configurations benched likewise"""
    rec = [o for o in rows if o.get("recommended")]
    check(len(rec) == 1, f"one recommended row: {len(rec)}")
    if not SLOW:
        long_skipped("the recommendation re-measured by bench (printed, not asserted)")
        return
    ncpu = os.cpu_count()
    is_default = (c["experts_used"] == 4 and c["threads"] == ncpu and not c["no_mmap"] and not c.get("expert_budget")
                  and not c.get("expert_type"))
    if not is_default:
        ratio, spread = paired(mt, os.path.join(work, "tune.json"))
        band = max(0.15, spread)
        print(f"bench re-measured the recommendation at {ratio:.3f}x (claimed {c['measured']['speed_ratio']:.3f}x, "
              f"spread {band:.3f}){'' if abs(ratio - c['measured']['speed_ratio']) <= band else ' - outside the band: noise?'}")
        return
    front = [o for o in rows if o["pareto"] and not (o["experts_used"] == 4 and o["threads"] == ncpu and not o["no_mmap"]
                                                     and not o["expert_budget_mib"] and not o["expert_type"])][:2]
    for o in front:
        f = os.path.join(work, "tune_front.json")
        with open(f, "w") as fh:
            json.dump({"moetax_config": 1, "threads": o["threads"], "experts_used": o["experts_used"],
                       "no_mmap": o["no_mmap"], "expert_type": o["expert_type"]}, fh)
        ratio, spread = paired(mt, f, 3)
        band = max(0.15, spread)
        print(f"default recommended: front {o['config']} in bench {ratio:.3f}x (spread {band:.3f})")


def store_checks(mt, work, calib):
    """--memory below the full footprint: expert-store configurations, exact, written into the config and read
    back by bench; a rerun reuses the log; another workload's log refused; --memory 1M named as impossible"""
    scfg, slog = os.path.join(work, "tune_store.json"), os.path.join(work, "tune_store.log")
    if os.path.exists(slog):
        os.remove(slog)
    args = [mt, "tune", "-m", MODEL, "--calib", calib, "--time", "10s", "--memory", "80M", "--json", "-o", scfg,
            "--log", slog]
    r = run(args)
    check(r.returncode == 0 and "does not fit" in r.stdout + r.stderr, f"tune --memory 80M: {r.stderr[-400:]}")
    rows = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{") and '"config"' in x]
    st = [o for o in rows if o["expert_budget_mib"] > 0 and o["experts_used"] == 4]
    check(len(st) >= 4 and all(o["kl"] == 0 and o["ppl_change"] == 0 for o in st),
          f"expert-store configurations, exact: {len(st)}")
    # store + smaller k (a combination among the survivors): that k's quality, the store adding none
    for o in (o for o in rows if o["expert_budget_mib"] > 0 and o["experts_used"] < 4):
        same = [x for x in rows if x["experts_used"] == o["experts_used"] and not x["expert_budget_mib"]
                and not x["expert_type"] and x["stage"] >= 1]
        check(o["kl"] > 0 and all(x["kl"] == o["kl"] for x in same), f"{o['config']}: the quality of its k")
    nofit = [o for o in rows if not o["fits"]]
    check(nofit and all(not o["pareto"] and not o["recommended"] for o in nofit)
          and all(o["footprint_mib"] > 80 for o in nofit) and all(o["footprint_mib"] <= 80 for o in rows if o["fits"]),
          f"--memory 80M: what does not fit is neither on the front nor recommended: {[o['config'] for o in nofit]}")
    check(any(o["pareto"] for o in rows), "--memory 80M: a front of configurations that fit")
    c = json.load(open(scfg)) if os.path.exists(scfg) else {}
    check(bool(c.get("expert_budget")) and c.get("policy") in ("next-use", "lfu"), f"the store's keys written: {c}")
    # round trip: bench --config reads the same budget, policy and prefetch
    b = run([mt, "bench", "-m", MODEL, "-p", "0", "-n", "8", "-r", "1", "--no-mem", "--json", "--config", scfg])
    brow = [json.loads(x) for x in b.stdout.splitlines() if '"expert_budget_mib"' in x]
    check(brow and abs(brow[0]["expert_budget_mib"] * 1024 - int(c["expert_budget"][:-1])) < 1
          and brow[0]["policy"] == c["policy"] and brow[0]["prefetch"] == (not c["no_prefetch"]),
          f"config round trip through bench: {brow[:1]} vs {c}")
    r2 = run(args)
    check(r2.returncode == 0 and "reused from" in r2.stderr, f"a rerun reuses the log: {r2.stderr[-300:]}")
    # what the log held is reused, not measured again: every configuration both runs report at the
    # same stage carries the same numbers (the rerun may go further within its --time, so its
    # recommendation may legitimately differ; a timing comparison here would only measure the machine)
    rows2 = {(o["config"], o["stage"]): o for o in (json.loads(x) for x in r2.stdout.splitlines()
                                                     if x.startswith("{") and '"config"' in x)}
    same = [(o, rows2[(o["config"], o["stage"])]) for o in rows if (o["config"], o["stage"]) in rows2]
    check(len(same) >= 2 and all(a["speed_ratio"] == b["speed_ratio"] and a["kl"] == b["kl"] for a, b in same),
          f"the rerun reuses the logged measurements ({len(same)} configurations at the same stage)")
    r3 = run(args[:-2] + ["--log", slog, "--workload", "batch:2"])
    check(r3.returncode != 0 and "another tuning" in r3.stderr, f"another workload's log refused: {r3.stderr[-300:]}")
    r4 = run([mt, "tune", "-m", MODEL, "--calib", calib, "--time", "10s", "--memory", "1M", "--log",
              os.path.join(work, "tune_1m.log")])
    check(r4.returncode != 0 and "no configuration fits" in r4.stderr and "at least" in r4.stderr,
          f"--memory 1M: a clear message naming the minimum: {r4.stderr[-300:]}")


def precision_checks(mt, work):
    """--expert-type q4_0: the logits of a file whose routed experts `quantize --experts-only` converted (the same
    quantizer: moetax_to_float then moetax_from_float per row), bit for bit; run and --config alike; refused beside
    an expert store; a bad type named"""
    q4 = os.path.join(work, "tune_experts_q4_0.gguf")
    r = run([mt, "quantize", "--experts-only", MODEL, q4, "q4_0"])
    check(r.returncode == 0 and os.path.getsize(q4) < os.path.getsize(MODEL), f"quantize --experts-only: {r.stderr[-300:]}")
    toks = ",".join(str(7 * i % 1000 + 1) for i in range(40))
    outs = {}
    for name, args in (("file", ["-m", q4]), ("load", ["-m", MODEL, "--expert-type", "q4_0"]),
                       ("load1", ["-m", MODEL, "--expert-type", "q4_0", "-t", "1", "--no-mmap"]),
                       ("stored", ["-m", MODEL])):
        f = os.path.join(work, f"tune_logits_{name}.f32")
        r = run([mt, "eval", "--tokens", toks, "--decode", "8", "--out", f] + args)
        check(r.returncode == 0, f"eval {name}: {r.stderr[-300:]}")
        outs[name] = open(f, "rb").read() if os.path.exists(f) else b""
    check(outs["file"] and outs["file"] == outs["load"] == outs["load1"],
          "--expert-type q4_0: logits bit-identical to the file quantize --experts-only wrote (2 and 1 threads, --no-mmap)")
    check(outs["stored"] != outs["load"], "--expert-type q4_0 changes the logits of a Q8_0 file")
    base = [mt, "run", "-p", "def f(", "-n", "12", "--temp", "0"]
    a, b = run(base + ["-m", q4]), run(base + ["-m", MODEL, "--expert-type", "q4_0"])
    cfg = os.path.join(work, "tune_q4.json")
    with open(cfg, "w") as f:
        json.dump({"moetax_config": 1, "expert_type": "q4_0"}, f)
    c = run(base + ["-m", MODEL, "--config", cfg])
    check(a.returncode == 0 and a.stdout == b.stdout == c.stdout, "run --expert-type q4_0 / --config expert_type: "
          "the --experts-only file's greedy text")
    r = run([mt, "bench", "-m", MODEL, "-p", "0", "-n", "4", "-r", "1", "--no-mem", "--expert-type", "q4_0",
             "--expert-budget", "50%"])
    check(r.returncode != 0 and "--expert-type" in r.stderr and "--expert-budget" in r.stderr,
          f"--expert-type with an expert store: refused, both named: {r.stderr[-300:]}")
    r = run(base + ["-m", MODEL, "--expert-type", "q3_x"])
    check(r.returncode == 2 and "--expert-type" in r.stderr, f"--expert-type q3_x refused: {r.stderr[-200:]}")
    with open(cfg, "w") as f:
        json.dump({"moetax_config": 1, "expert_type": "q9"}, f)
    r = run(base + ["-m", MODEL, "--config", cfg])
    check(r.returncode == 2 and "expert_type" in r.stderr, f"config expert_type q9 refused: {r.stderr[-200:]}")
    os.remove(q4)


def main():
    mt, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    calib = os.path.join(work, "tune_calib.py")
    with open(calib, "w") as f:
        f.write("".join("def f%d(a, b=None):\n    if b is None:\n        return a\n    return [a, b, %d]\n\n" % (i, i)
                        for i in range(120)))
    cfg, page = os.path.join(work, "tune.json"), os.path.join(work, "tune.html")
    log = os.path.join(work, "tune.log")
    if os.path.exists(log):
        os.remove(log)
    r = run([mt, "tune", "-m", MODEL, "--calib", calib, "--time", "20s", "--json", "-o", cfg, "--html", page])
    check(os.path.exists(log), "the log is written beside -o by default")
    check(r.returncode == 0, f"tune: rc {r.returncode}: {r.stderr[-500:]}")
    rows = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{") and '"config"' in x]
    check(len(rows) >= 4, f"tune --json: {len(rows)} rows")
    final = [o for o in rows if o["stage"] == 3]
    check(len(final) >= 2, f"{len(final)} configurations reached stage 3")
    exact = [o for o in rows if o["experts_used"] == 4 and o["capacity_factor"] == 0 and not o["expert_type"]
             and o["cache_type"] == "f32"]
    check(exact and all(o["kl"] == 0 and o["ppl_change"] == 0 and o["top1"] == 1 for o in exact),
          "the file's k: KL 0, perplexity unchanged, top-1 100% (threads and paging change no bit)")
    fewer = [o for o in rows if o["experts_used"] < 4]
    check(fewer and all(o["kl"] > 0 for o in fewer), "fewer experts per token: KL > 0")
    q4 = [o for o in rows if o["expert_type"] == "q4_0"]
    check(q4 and all(o["kl"] > 0 for o in q4), f"the precision lever listed, experts q4_0, with its KL: "
          f"{[(o['config'], o['kl']) for o in q4[:2]]}")
    # the KV cells lever: F16 and Q8_0 cells on the default, each with its measured quality (rounded cached rows:
    # KL > 0) and a smaller footprint than the default's F32 cells (Q8_0 the smallest)
    kv = {o["cache_type"]: o for o in rows if o["cache_type"] != "f32"}
    d0 = [o for o in exact if o["threads"] == os.cpu_count() and not o["no_mmap"]]
    check(set(kv) == {"f16", "q8_0"} and all(o["kl"] > 0 and o["experts_used"] == 4 and not o["expert_type"]
                                              for o in kv.values())
          and d0 and d0[0]["footprint_mib"] > kv["f16"]["footprint_mib"] > kv["q8_0"]["footprint_mib"],
          f"the KV cells lever listed with its KL and footprint: {[(o['config'], o['kl'], o['footprint_mib']) for o in kv.values()]}")
    final = [o for o in final if o["fits"]]
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
    if c["experts_used"] == 4 and not c.get("expert_type"):
        check(a.stdout == b.stdout, "run --config with the file's k and experts: the same greedy text")
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
    precision_checks(mt, work)
    bench_check(mt, work, rows, c)
    store_checks(mt, work, calib)
    r = run([mt, "tune", "-m", MODEL, "--max-quality-loss", "-1"])
    check(r.returncode == 2 and "--max-quality-loss" in r.stderr, "a negative quality bound is refused")
    return summary()


if __name__ == "__main__":
    sys.exit(main())
