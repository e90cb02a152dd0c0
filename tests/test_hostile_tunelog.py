#!/usr/bin/python3
# ctest-labels: unit
# ctest-cost: 40
"""test_hostile_tunelog.py - `moetax tune --log FILE` given a file that is not its log, or a log
whose entries are damaged, on the tiny generated model:

- a file tune did not write (a text file, the indented configuration `tune -o` writes, a one-line
  JSON object), a directory, /dev/zero, a FIFO, a line longer than the bound, a NUL byte: refused,
  exit status non-zero, the file (or folder) left byte for byte as it was, the message naming the
  path (and the line and the bound where there is one), before anything is measured and without
  hanging (every run has a timeout);
- entries with a reused field missing, a string, NaN, negative or absurd: refused, the message
  naming the line and the field, the log unchanged, before anything is measured;
- a log tune wrote is still reused, and one whose last line an interruption cut still resumes (the
  cut line dropped, every line of the result JSON).

usage: test_hostile_tunelog.py MOETAX_BIN WORKDIR
"""
import json
import os
import shutil
import stat
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ref"))
from checks import check, summary  # noqa: E402  (tests/ref/checks.py)

MEASURING = "configurations, calibration"  # tune's line once the exact distributions are computed
SAN = ("AddressSanitizer", "UndefinedBehaviorSanitizer", "runtime error:", "LeakSanitizer")


def run(args, timeout):
    """(returncode, stderr, seconds); a run past the timeout is killed and reads as returncode None"""
    t0 = time.monotonic()
    try:
        r = subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=timeout)
        return r.returncode, r.stderr, time.monotonic() - t0
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return None, err + f" [killed after {timeout} s]", time.monotonic() - t0


def snapshot(path):
    """the bytes of a file, or a folder's names and their files' bytes"""
    if os.path.isdir(path):
        return {n: snapshot(os.path.join(path, n)) for n in sorted(os.listdir(path))}
    with open(path, "rb") as f:
        return f.read()


def main():
    mt, work = sys.argv[1], os.path.join(sys.argv[2], "hostile_tunelog")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    model, calib = os.path.join(work, "tiny.gguf"), os.path.join(work, "calib.py")
    r = subprocess.run([mt, "gen", "--preset", "tiny", "-o", model], capture_output=True, text=True)
    check(r.returncode == 0, f"gen tiny: {r.stderr}")
    with open(calib, "w") as f:
        # a short calibration text: the tuner's quality stage then takes ~1 s (release) instead of filling
        # --time under the sanitizers; this test is about the log, not the tuning
        f.write("".join("def f%d(a, b=None):\n    return [a, b, %d]\n\n" % (i, i) for i in range(10)))
    tune = [mt, "tune", "-m", model, "--calib", calib, "--time", "10s", "--prompt", "16"]

    def refused(name, path, want, timeout=60):
        """tune --log path: refused before measuring, the message naming what `want` lists, path unchanged"""
        mode = os.stat(path).st_mode if os.path.exists(path) else 0
        before = snapshot(path) if stat.S_ISREG(mode) or stat.S_ISDIR(mode) else None  # not a device's or FIFO's
        rc, err, dt = run(tune + ["--log", path], timeout)
        msg = err.strip().splitlines()[-1] if err.strip() else ""
        check(not any(x in err for x in SAN), f"{name}: no sanitizer report: {err[-600:]}")
        check(rc is not None and rc != 0 and all(w in err for w in want) and MEASURING not in err,
              f"{name}: refused before measuring, naming {want}: rc {rc}, {dt:.1f} s: {err[-600:]}")
        check(dt < 20, f"{name}: refused at once, not after {dt:.1f} s")
        if before is not None:
            check(snapshot(path) == before, f"{name}: {path} left byte for byte as it was")
        print(f"  {name} ({dt:.2f} s): {msg}")
        return err

    # ---- files tune did not write (bug 3): refused, left untouched -----------------------------------
    text = os.path.join(work, "notes.txt")
    with open(text, "w") as f:
        f.write("threads = 2\n# my settings, not a tune log\n\nexperts_used = 3")  # no newline at the end
    refused("a text file", text, ["--log " + text, "line 1", "not a log tune wrote", "untouched"])
    cfg = os.path.join(work, "tuned.json")  # as tune -o writes it: indented, so no line is a JSON object
    with open(cfg, "w") as f:
        json.dump({"moetax_config": 1, "threads": 2, "experts_used": 2, "measured": {"kl": 0.01}}, f, indent=1)
        f.write("\n")
    refused("a configuration file (-o's)", cfg, ["--log " + cfg, "line 1", "not a log tune wrote"])
    one = os.path.join(work, "one.json")
    with open(one, "w") as f:
        f.write('{"moetax_config": 1, "threads": 2}\n')
    refused("a one-line JSON object", one, ["--log " + one, "line 1", "moetax_tune_log"])
    folder = os.path.join(work, "logs")
    os.makedirs(folder)
    with open(os.path.join(folder, "keep.txt"), "w") as f:
        f.write("keep\n")
    refused("a directory", folder, ["--log " + folder, "is a directory"])
    refused("/dev/zero", "/dev/zero", ["--log /dev/zero", "not a regular file"], timeout=30)
    fifo = os.path.join(work, "fifo")
    os.mkfifo(fifo)
    refused("a FIFO (no writer)", fifo, ["--log " + fifo, "not a regular file"], timeout=30)

    # ---- a log tune wrote: reused (the existing behaviour) ---------------------------------------------
    log = os.path.join(work, "tune.log")
    rc, err, dt = run(tune + ["--log", log], 300)
    check(rc == 0 and os.path.exists(log) and not any(x in err for x in SAN), f"tune --log: rc {rc}: {err[-500:]}")
    lines = open(log).read().splitlines() if os.path.exists(log) else []
    entries = [json.loads(x) for x in lines[1:]]
    check(lines and "moetax_tune_log" in json.loads(lines[0]) and entries, f"the log: a header and entries: {lines[:2]}")
    print(f"  tune --log ({dt:.1f} s): {len(entries)} entries")
    qi = next((i for i, e in enumerate(entries, 1) if e.get("kind") == "quality"), None)
    si = next((i for i, e in enumerate(entries, 1) if e.get("kind") == "speed" and "ttft_ms" in e), None)
    check(qi is not None and si is not None, "the log holds quality and speed entries")
    if qi is None or si is None:
        return summary()
    again = os.path.join(work, "again.log")
    shutil.copy(log, again)
    rc, err, dt = run(tune + ["--log", again], 300)
    check(rc == 0 and "reused from " + again in err and not any(x in err for x in SAN), f"a log tune wrote is reused: rc {rc}: {err[-400:]}")
    check(open(again).read().startswith(open(log).read()), "the reused log is appended to, its lines kept")
    print(f"  rerun with the log ({dt:.1f} s)")

    # a last line cut by an interruption: dropped, the rest reused
    cut = os.path.join(work, "cut.log")
    with open(cut, "w") as f:
        f.write("\n".join(lines) + "\n" + '{"kind":"speed","stage":2,"config":"t1 k')
    rc, err, dt = run(tune + ["--log", cut], 300)
    check(rc == 0 and "cut by an interrupted run" in err and "reused from" in err and not any(x in err for x in SAN),
          f"a cut last line: dropped, the log reused: rc {rc}: {err[-400:]}")
    try:
        ok = all(json.loads(x) for x in open(cut))
    except ValueError:
        ok = False
    check(ok, "after the cut line was dropped every line of the log is JSON")

    # an older tune appended its next entry to the line an interruption had cut (no newline first): that
    # entry is read, the cut part skipped
    resumed = os.path.join(work, "resumed.log")
    with open(resumed, "w") as f:
        f.write("\n".join(lines[:si] + ['{"kind":"speed","stage":2,"con' + lines[si]] + lines[si + 1:]) + "\n")
    rc, err, dt = run(tune + ["--log", resumed], 300)
    check(rc == 0 and f"line {si + 1} begins with a line an interrupted run cut" in err and "reused from" in err and
          not any(x in err for x in SAN), f"an older tune's cut-and-resumed line: rc {rc}: {err[-400:]}")

    # ---- over-long lines and NUL bytes (bug 3) ---------------------------------------------------------
    def variant(name, body, mode="w"):
        p = os.path.join(work, name)
        with open(p, mode) as f:
            f.write(body)
        return p

    head = lines[0] + "\n"
    refused("an over-long line", variant("long.log", head + '{"kind": "' + "x" * 100000 + '"}\n'),
            ["line 2", "longer than 65536 bytes"])
    refused("an endless line", variant("endless.log", "{" + "x" * 300000), ["line 1", "longer than 65536 bytes"])
    refused("a NUL byte", variant("nul.log", (head + lines[1] + "\n" + lines[2][:20] + "\0" + lines[2][20:] + "\n")
                                   .encode(), "wb"), ["line 3", "NUL byte"])

    # ---- damaged entries (bug 4): each refused naming its line and field -------------------------------
    def damaged(name, idx, edit, field, raw=None):
        ls = list(lines)
        e = json.loads(ls[idx])
        edit(e)
        ls[idx] = raw(e) if raw else json.dumps(e)
        p = variant("".join(c if c.isalnum() else "_" for c in name) + ".log", "\n".join(ls) + "\n")
        refused(name, p, ["--log " + p, f"line {idx + 1}", f'"{field}"'])

    def setk(k, v):
        return lambda e: e.__setitem__(k, v)

    def pop(k):
        return lambda e: e.pop(k)

    damaged("quality: kl missing", qi, pop("kl"), "kl")
    damaged("quality: kl a string", qi, setk("kl", "0.01"), "kl")
    damaged("quality: kl NaN", qi, setk("kl", float("nan")), "kl")
    damaged("quality: kl negative", qi, setk("kl", -0.5), "kl")
    damaged("quality: top1 above 1", qi, setk("top1", 7.0), "top1")
    damaged("quality: ppl_change null", qi, setk("ppl_change", None), "ppl_change")
    damaged("speed: speed_ratio missing", si, pop("speed_ratio"), "speed_ratio")
    damaged("speed: tokens_per_s a string", si, setk("tokens_per_s", "fast"), "tokens_per_s")
    damaged("speed: speed_ratio absurd", si, setk("speed_ratio", 1e300), "speed_ratio")
    damaged("speed: speed_ratio Infinity", si, setk("speed_ratio", float("inf")), "speed_ratio")
    damaged("speed: ttft_ms negative", si, setk("ttft_ms", -1.0), "ttft_ms")
    damaged("speed: step_us missing (the other new fields there)", si, pop("step_us"), "step_us")
    damaged("speed: prompt a string", si, setk("prompt", "16"), "prompt")
    damaged("speed: a phase NaN", si, lambda e: e["phase_us"].__setitem__(2, float("nan")), "phase_us")
    damaged("speed: a phase negative", si, lambda e: e["phase_us"].__setitem__(2, -3.0), "phase_us[2]")
    damaged("speed: phases cut short", si, lambda e: e["phase_us"].pop(), "phase_us")
    damaged("speed: stage a string", si, setk("stage", "2"), "stage")
    damaged("an entry of no known kind", si, setk("kind", "speedy"), "kind")
    damaged("config not a string", si, setk("config", 4), "config")
    damaged("a line cut in the middle", si, lambda e: None, "kind", raw=lambda e: '{"kind": "spe')
    return summary()


if __name__ == "__main__":
    sys.exit(main())
