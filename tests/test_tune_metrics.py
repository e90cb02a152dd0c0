#!/usr/bin/python3
# ctest-labels: model
# ctest-cost: 75
"""test_tune_metrics.py - what moetax tune measures per configuration besides the speed ratio, and
the batch workload, on the committed trained model with a short --time:

- TTFT, per-sequence TPOT p50/p99 and the ledger's phases per token are in --json, the log, the
  table and --explain, and are sane: TTFT > 0, p99 >= p50 > 0, the phases add up to close to the
  measured wall time per token, the tax share is the tax phases' share of them;
- a log of an older tune (speed entries without those fields) still resumes: its quality is
  reused, its speeds are measured again and said so;
- --workload batch:4 sweeps batch sizes 4, 2, 1 and the capacity factor: with the factor off every
  batch size scores exactly the exact configuration's quality (KL 0, top-1 100%: the quantized
  kernels are batch-invariant), with it on, at a batch size where it must drop, KL > 0; the front
  is non-dominated; the recommendation keeps the quality bound and its configuration carries its
  capacity factor and batch size;
- the prefill form (--mla-prefill auto against absorbed on the recommendation, an MLA model's decode
  workload): nothing timed where auto is the absorbed form bit for bit (the trained model's short
  prompts), both forms timed and the quality measured where it decompresses (a generated model with
  wide compressed rows), the decision consistent with them, the configuration carrying it; a batch
  workload says why it is not tried.

usage: test_tune_metrics.py MOETAX_BIN WORKDIR
"""
import json
import math
import re
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ref"))
from checks import check, summary  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "models", "pycode-20m-q8_0.gguf")
PHASES = ["route", "dispatch", "load", "comm", "wait", "combine"]  # the tax phases (moetax/ledger.h)


def run(args):
    return subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=600)


def rows_of(r):
    return [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{") and '"config"' in x]


def metric_checks(rows, what):
    measured = [o for o in rows if o["stage"] >= 2]
    check(len(measured) >= 2, f"{what}: {len(measured)} configurations with a speed measurement")
    for o in measured:
        ph = o.get("phase_us_per_token") or {}
        total = sum(ph.values())
        tax = sum(v for k, v in ph.items() if k in PHASES)
        step = o.get("step_us_per_token", 0)
        ok = (o.get("ttft_ms", 0) > 0 and o.get("tpot_p99_ms", 0) >= o.get("tpot_p50_ms", 0) > 0 and step > 0
              and 0.5 * step <= total <= 1.05 * step and abs(tax / max(total, 1e-9) - o["tax_share"]) < 1e-6
              and ph.get("expert", 0) > 0 and ph.get("attn", 0) > 0)
        check(ok, f"{what} {o['config']}: TTFT {o.get('ttft_ms')} ms, TPOT p50 {o.get('tpot_p50_ms')} p99 "
              f"{o.get('tpot_p99_ms')} ms, phases {total:.1f} of {step:.1f} us/token, tax {o['tax_share']:.4f} "
              f"vs {tax / max(total, 1e-9):.4f}")
    unmeasured = [o for o in rows if o["stage"] < 2]
    check(all("ttft_ms" not in o for o in unmeasured), f"{what}: no timing shown for what was not timed")


def front_check(rows, what):
    final = [o for o in rows if o["stage"] == 3 and o["fits"]]
    check(len(final) >= 2, f"{what}: {len(final)} configurations at stage 3")
    for a in final:
        dom = [b for b in final if b is not a and b["speed_ratio"] >= a["speed_ratio"] and b["kl"] <= a["kl"]
               and (b["speed_ratio"] > a["speed_ratio"] or b["kl"] < a["kl"])]
        check(a["pareto"] == (not dom), f"{what} {a['config']}: pareto {a['pareto']}, dominated by "
              f"{[b['config'] for b in dom]}")


def prefill_lines(r):
    return [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{") and '"prefill_form"' in x]


def prefill_checks(mt, work, calib, rows):
    """The prefill form (an MLA model's decode workload, after the recommendation). On the trained model at a
    32-token prompt the cost model keeps the absorbed form, so auto's prompt logits are the absorbed form's bit
    for bit and nothing is timed; on a model whose compressed rows are wide (kv_lora 256 against heads of 16 + 16
    values) a 256-token prompt is decompressed: both forms timed alternately, the quality with every micro-batch
    decompressed measured (another summation order: KL > 0), and the decision follows from those figures within
    the bounds; the configuration written carries it and run reads it back."""
    pf = prefill_lines(rows)
    check(len(pf) == 1 and pf[0]["identical"] and not pf[0]["taken"] and pf[0]["prefill_form"] == "absorbed"
          and "bit for bit" in pf[0]["why"] and "ttft_ms_auto" not in pf[0],
          f"trained model, a 32-token prompt: auto is the absorbed form here, said so, nothing timed: {pf}")
    wide = os.path.join(work, "tune_mla_wide.gguf")
    g = run([mt, "gen", "--preset", "tiny", "--type", "q8_0", "--kv-lora", "256", "--nope", "16", "--rope-dim", "16",
             "--v-head", "16", "--ctx", "512", "-o", wide])
    check(g.returncode == 0, f"gen: {g.stderr[-300:]}")
    cfg = os.path.join(work, "tune_mla_wide.json")
    wlog = os.path.join(work, "tune_mla_wide.log")
    if os.path.exists(wlog):
        os.remove(wlog)
    base = [mt, "tune", "-m", wide, "--calib", calib, "--time", "10s", "--prompt", "256", "--json", "--log", wlog]
    r = run(base + ["-o", cfg])
    check(r.returncode == 0, f"tune on the wide MLA model: rc {r.returncode}: {r.stderr[-500:]}")
    pf = prefill_lines(r)
    check(len(pf) == 1, f"one prefill-form line: {pf}")
    if len(pf) != 1:
        return
    p = pf[0]
    print(f"prefill form on the wide MLA model, 256-token prompt: TTFT {p.get('ttft_ms_absorbed')} -> "
          f"{p.get('ttft_ms_auto')} ms ({p.get('ttft_ratio')}x), taken {p['taken']}")
    check(p["kind"] == "prefill_form" and not p["identical"] and p["pairs"] >= 3 and p["prompt"] == 256
          and p["ttft_ms_absorbed"] > 0
          and p["ttft_ms_auto"] > 0 and 0 < p["ttft_ratio"] < 10, f"both forms timed: {p}")
    check(p["kl"] > 0 and 0 < p["top1"] <= 1, f"the decompressed form's quality measured: KL {p['kl']}")
    taken = p["ttft_ratio"] <= 0.95 and p["ppl_change"] <= 0.01
    check(p["taken"] == taken and p["prefill_form"] == ("auto" if taken else "absorbed") and (taken or p.get("why")),
          f"the decision follows from the figures and the 1% bound: {p}")
    c = json.load(open(cfg)) if os.path.exists(cfg) else {}
    w = c.get("measured", {}).get("prefill") or {}
    same = set(w) == set(p) and all(math.isclose(w[k], v, rel_tol=1e-5) if isinstance(v, float) else w[k] == v
                                    for k, v in p.items())
    check(c.get("mla_prefill") == p["prefill_form"] and same, f"the configuration carries it: {c}")
    a = run([mt, "run", "-m", wide, "--config", cfg, "-p", "a b c", "-n", "4", "--temp", "0"])
    check(a.returncode == 0, f"run --config reads it: {a.stderr[-300:]}")
    # --max-kl 0 (the log reused): only exact configurations, and the decompressed form is not one: its quality
    # is measured first, and a form outside the bounds is not timed
    r0 = run(base + ["--max-kl", "0"])
    p0 = prefill_lines(r0)
    check(r0.returncode == 0 and len(p0) == 1 and not p0[0]["taken"] and p0[0]["prefill_form"] == "absorbed"
          and "--max-kl" in p0[0].get("why", "") and p0[0]["pairs"] == 0 and "ttft_ms_auto" not in p0[0]
          and p0[0]["kl"] > 0, f"--max-kl 0: the prefill form stays absorbed, untimed, said why: {p0}")


def main():
    mt, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    calib = os.path.join(work, "tune_metrics_calib.py")
    with open(calib, "w") as f:
        f.write("".join("def g%d(x, y=None):\n    if y is None:\n        return x\n    return {x: y, %d: x}\n\n" % (i, i)
                        for i in range(24)))
    # decode: the new fields in --json and in the log
    log = os.path.join(work, "tune_metrics.log")
    if os.path.exists(log):
        os.remove(log)
    base = [mt, "tune", "-m", MODEL, "--calib", calib, "--time", "10s", "--prompt", "32"]
    r = run(base + ["--json", "--log", log])
    check(r.returncode == 0, f"tune: rc {r.returncode}: {r.stderr[-500:]}")
    rows = rows_of(r)
    metric_checks(rows, "decode")
    prefill_checks(mt, work, calib, r)
    entries = [json.loads(x) for x in open(log)] if os.path.exists(log) else []
    speed = [e for e in entries if e.get("kind") == "speed"]
    check(speed and all(e["ttft_ms"] > 0 and e["p99_ms"] >= e["tpot_p50_ms"] > 0 and e["step_us"] > 0 for e in speed)
          and all(e["prompt"] == 32 and e.get("ubatch") == 512 and len(e["phase_us"]) >= 14 for e in speed),
          f"the log's speed entries carry TTFT, TPOT, the phases and the prompt: {speed[:1]}")
    # the table and --explain (the log reused: nothing measured again)
    r2 = run(base + ["--explain", "--log", log])
    check(r2.returncode == 0 and "reused from" in r2.stderr and "measured again" not in r2.stderr,
          f"a rerun reuses the log: {r2.stderr[-300:]}")
    check("TTFT ms" in r2.stdout and "p99 ms" in r2.stdout and "TPOT p50" in r2.stdout, "the table shows TTFT and TPOT")
    check("explain (ledger" in r2.stdout and "TTFT (32-token prompt)" in r2.stdout and "wall per token" in r2.stdout,
          f"--explain shows TTFT, TPOT and the phases against the wall: {r2.stdout[-800:]}")
    m = re.search(r"routed experts' own phases .*? are ([0-9.]+)% of the default's: through them\s+the expert levers "
                  r"\(top-k, expert type, store\) give at most ([0-9.]+)x", r2.stdout)
    check(m is not None and 0 < float(m.group(1)) < 100 and
          abs(float(m.group(2)) - 1 / (1 - float(m.group(1)) / 100)) < 0.02,
          f"--explain bounds what the expert levers can give by their phases' share: {r2.stdout[-800:]}")
    # --max-kl bounds the recommendation too (the log reused): 0 leaves exact configurations only
    rk = run(base + ["--json", "--log", log, "--max-kl", "0"])
    krows = rows_of(rk)
    krec = [x for x in krows if x.get("recommended")]
    check(rk.returncode == 0 and len(krec) == 1 and krec[0]["kl"] == 0,
          f"--max-kl 0 recommends an exact configuration: rc {rk.returncode} {krec} {rk.stderr[-300:]}")
    check(any(x.get("kl", 0) > 0 for x in krows),
          "the front has lossy configurations for --max-kl to exclude (else that check could not fail)")
    rb = run(base + ["--max-kl", "-1"])
    check(rb.returncode == 2 and "--max-kl" in rb.stderr, f"--max-kl -1: a usage error: {rb.returncode} {rb.stderr[-200:]}")
    # an older tune's log: its speed entries without the new fields; quality reused, speeds measured again
    old = os.path.join(work, "tune_metrics_old.log")
    with open(old, "w") as f:
        for e in entries:
            for k in ("ttft_ms", "tpot_p50_ms", "step_us", "prompt"):
                e.pop(k, None)
            f.write(json.dumps(e) + "\n")
    r3 = run(base + ["--json", "--log", old])
    check(r3.returncode == 0 and "reused from" in r3.stderr and "measured again" in r3.stderr,
          f"an older log resumes (quality reused, speeds measured again): rc {r3.returncode} {r3.stderr[-400:]}")
    metric_checks(rows_of(r3), "older log")
    after = [json.loads(x) for x in open(old)]
    check(len(after) > len(entries) and all("ttft_ms" in e for e in after[len(entries):] if e.get("kind") == "speed"),
          "the older log is appended to with complete speed entries")

    # batch:4: batch size and capacity factor as levers
    blog, bcfg = os.path.join(work, "tune_metrics_batch.log"), os.path.join(work, "tune_metrics_batch.json")
    if os.path.exists(blog):
        os.remove(blog)
    r = run([mt, "tune", "-m", MODEL, "--calib", calib, "--time", "12s", "--workload", "batch:4", "--json",
             "--log", blog, "-o", bcfg])
    check(r.returncode == 0, f"tune --workload batch:4: rc {r.returncode}: {r.stderr[-500:]}")
    rows = rows_of(r)
    metric_checks(rows, "batch:4")
    pf = prefill_lines(r)
    check(len(pf) == 1 and pf[0]["prefill_form"] is None and "one sequence" in pf[0]["why"],
          f"batch:4: the prefill form is not tried, and the line says why: {pf}")
    front_check(rows, "batch:4")
    qual = [o for o in rows if o["stage"] >= 1]
    check({o["batch"] for o in qual} == {1, 2, 4}, f"batch sizes swept: {sorted({o['batch'] for o in qual})}")
    off = [o for o in qual if o["capacity_factor"] == 0 and o["experts_used"] == 4 and not o["expert_type"]
           and o["cache_type"] == "f32"]
    check({o["batch"] for o in off} == {1, 2, 4} and all(o["kl"] == 0 and o["top1"] == 1 and o["ppl_change"] == 0
                                                           for o in off),
          f"capacity factor off: the exact quality at every batch size: {[(o['config'], o['kl']) for o in off][:6]}")
    # a lossy configuration whose logits do not depend on the batch size scores the same to the last bit
    # at every size (the log keeps 17 digits; --json's 10 would hide a difference in summation order)
    same = {}
    for e in [json.loads(x) for x in open(blog)] if os.path.exists(blog) else []:
        if e.get("kind") == "quality" and " cf 0 " in e["config"] + " ":
            same.setdefault((e["stage"], re.sub(r" b[0-9]+$", "", e["config"])), []).append(e)
    groups = [g for g in same.values() if len(g) > 1 and any(e["kl"] > 0 for e in g)]
    check(groups and all(len({(e["kl"], e["ppl"], e["top1"]) for e in g}) == 1 for g in groups),
          f"quality without a capacity factor is batch-invariant, lossy configurations too: "
          f"{[[(e['config'], e['kl']) for e in g] for g in groups if len({e['kl'] for e in g}) > 1][:3]}")
    cf = [o for o in qual if o["capacity_factor"] > 0]
    check(cf and all(o["batch"] > 1 for o in cf), f"capacity factors swept at batch sizes > 1: {len(cf)}")
    # 4 sequences x 4 experts of 32, capacity ceil(C 16 / 32) = 1 per expert: tokens sharing an expert are dropped
    cf4 = [o for o in cf if o["batch"] == 4 and o["experts_used"] == 4 and not o["expert_type"]]
    check(cf4 and all(o["kl"] > 0 and o["top1"] < 1 for o in cf4),
          f"a capacity factor that drops changes the outputs (KL > 0): {[(o['config'], o['kl']) for o in cf4]}")
    one = sorted((o["overflow"], o["capacity_factor"]) for o in cf4 if o["threads"] == os.cpu_count() and not o["no_mmap"])
    check(one == [("drop", 1.25), ("reroute", 1.25)],
          f"C = 1.25 and 1.0 give one capacity at batch 4: measured once per overflow (drop, reroute): {one}")
    for o in qual:
        if o["stage"] >= 2:
            check(o["tokens_per_s"] > 0 and o["tpot_p50_ms"] > 0, f"{o['config']}: aggregate tokens/s and TPOT")
    rec = [o for o in rows if o["recommended"]]
    check(len(rec) == 1 and rec[0]["ppl_change"] <= 0.01 and rec[0]["stage"] == 3,
          f"the recommendation keeps the 1% bound: {[(o['config'], o['ppl_change']) for o in rec]}")
    c = json.load(open(bcfg)) if os.path.exists(bcfg) else {}
    if rec and c:
        check(abs(c.get("capacity_factor", 0) - rec[0]["capacity_factor"]) < 1e-6
              and c["measured"]["batch"] == rec[0]["batch"] and c["measured"]["tpot_p99_ms"] > 0
              and math.isfinite(c["measured"]["ttft_ms"]), f"the configuration written: {c}")
    # a p99 TPOT bound no configuration meets: a clear message, not a pick
    r = run([mt, "tune", "-m", MODEL, "--calib", calib, "--time", "10s", "--workload", "batch:4", "--log", blog,
             "--max-tpot", "0.000001"])
    check(r.returncode != 0 and "--max-tpot" in r.stderr and "no configuration" in r.stderr,
          f"--max-tpot below every measurement: refused with the reason: {r.stderr[-300:]}")
    return summary()


if __name__ == "__main__":
    sys.exit(main())
