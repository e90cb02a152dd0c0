#!/usr/bin/python3
# ctest-labels: unit
# ctest-cost: 18
"""test_cli_safety.py - what the CLI promises about its outputs and inputs (issue 21,
the CLI side): output paths that are not regular files are refused and left alone
(a device node, a FIFO, a directory), a symbolic link is followed and kept, quantize
refuses its own input under another name, a shape larger than the free space is
refused before writing, SIGTERM leaves no temporary file, every output path and
option is checked before the work starts, a full disk leaves no truncated file,
--json is valid JSON on stdout alone (a quote in a name, NaN weights), non-finite
results are errors, and text inputs are capped (/dev/zero).

The full-disk cases need a small tmpfs (root); they are skipped without one.

usage: test_cli_safety.py MOETAX_BIN WORKDIR
"""
import glob
import hashlib
import json
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ref"))
from checks import check, summary  # noqa: E402  (tests/ref/checks.py)
from serve_proc import serve_built  # noqa: E402  (tests/ref/serve_proc.py)


def run(args, timeout=300, **kw):
    try:
        return subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=timeout, **kw)
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(args, -999, e.stdout or "", "timed out after %ss" % timeout)


def sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def tmp_left(d):
    return glob.glob(os.path.join(d, "*.tmp*"))


def mount_tmpfs(d, size):
    os.makedirs(d, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%s" % size, "tmpfs", d], capture_output=True)
    return r.returncode == 0


def umount(d):
    subprocess.run(["umount", d], capture_output=True)


def is_json(text):
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def main():
    mt, work = sys.argv[1], os.path.join(sys.argv[2], "cli_safety")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    model = os.path.join(work, "tiny.gguf")
    r = run([mt, "gen", "--preset", "tiny", "-o", model])
    check(r.returncode == 0, f"gen tiny: {r.stderr}")
    root = os.geteuid() == 0

    # ---- item 2: output paths that are not regular files ------------------------------
    fifo = os.path.join(work, "fifo")
    os.mkfifo(fifo)
    r = run([mt, "gen", "--preset", "tiny", "-o", fifo], timeout=60)
    check(r.returncode == 1 and "FIFO" in r.stderr and stat.S_ISFIFO(os.lstat(fifo).st_mode),
          f"gen -o FIFO refused, the FIFO left: {r.stderr}")
    r = run([mt, "gen", "--preset", "tiny", "-o", work], timeout=60)
    check(r.returncode == 1 and "directory" in r.stderr and os.path.isdir(work), f"gen -o DIR refused: {r.stderr}")
    if root:  # a device node of our own (the old writer renamed over /dev/null as root)
        dev = os.path.join(work, "null")
        os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        for args in (["gen", "--preset", "tiny", "-o", dev], ["quantize", model, dev, "q8_0"]):
            r = run([mt] + args, timeout=60)
            check(r.returncode != 0 and "character device" in r.stderr and stat.S_ISCHR(os.lstat(dev).st_mode),
                  f"{args[0]} onto a character device refused, the device left: {r.stderr}")
    else:
        print("SKIP: device node cases (not root)")
    # a symbolic link: the file it names is written, the link stays
    target = os.path.join(work, "target.gguf")
    link = os.path.join(work, "link.gguf")
    with open(target, "w") as f:
        f.write("old")
    os.symlink("target.gguf", link)
    r = run([mt, "gen", "--preset", "tiny", "-o", link])
    check(r.returncode == 0 and os.path.islink(link) and sha(target) == sha(model),
          f"gen -o LINK writes the link's target and keeps the link: {r.stderr}")
    # quantize IN ./../dir/IN: the same file under another name
    f32 = os.path.join(work, "in.gguf")
    shutil.copy(model, f32)
    before = sha(f32)
    other = os.path.join(work, ".", "..", os.path.basename(work), "in.gguf")
    r = run([mt, "quantize", f32, other, "q8_0"])
    check(r.returncode == 2 and "same file" in r.stderr and sha(f32) == before, f"quantize IN ./../dir/IN: {r.stderr}")
    os.symlink("in.gguf", os.path.join(work, "in_link.gguf"))
    r = run([mt, "quantize", f32, os.path.join(work, "in_link.gguf"), "q8_0"])
    check(r.returncode == 2 and "same file" in r.stderr and sha(f32) == before, f"quantize IN LINK-TO-IN: {r.stderr}")
    check(not tmp_left(work), f"no temporary files left: {tmp_left(work)}")

    # ---- item 7: a shape beyond the free space; SIGTERM removes the temporary file -----------
    small = os.path.join(work, "small_fs")
    have_tmpfs = root and mount_tmpfs(small, "512k")
    big_dir = small if have_tmpfs else work  # the old writer filled the disk: give it a small one
    t0 = time.time()
    # 2^24 heads: 180 G parameters, 688 GiB of f32 (2^30 heads are now refused by the parameter cap first)
    r = run([mt, "gen", "--preset", "tiny", "--heads", "16777216", "-o", os.path.join(big_dir, "huge.gguf")], timeout=120)
    check(r.returncode == 1 and "free" in r.stderr and time.time() - t0 < 60 and not tmp_left(big_dir),
          f"gen --heads 16777216 refused before writing: {r.stderr}")
    if have_tmpfs:
        keep = os.path.join(small, "keep.gguf")
        with open(keep, "w") as f:
            f.write("keep")
        r = run([mt, "gen", "--preset", "tiny", "-o", keep])  # 1 MiB of weights on a 512 KiB tmpfs
        check(r.returncode == 1 and "free" in r.stderr and open(keep).read() == "keep" and not tmp_left(small),
              f"gen onto a file system too small: refused, the old file kept: {r.stderr}")
    # SIGTERM, and the other signals that end a process (SIGHUP: a closed terminal; it left the
    # temporary file before)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        p = subprocess.Popen([mt, "gen", "--preset", "small", "--type", "q4_0", "-o", os.path.join(work, "killed.gguf")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for _ in range(200):  # until the temporary file exists
            if tmp_left(work) or p.poll() is not None:
                break
            time.sleep(0.05)
        seen = bool(tmp_left(work))
        p.send_signal(sig)
        p.wait(timeout=60)
        p.stderr.close()
        check(seen and p.returncode == -sig and not tmp_left(work) and not os.path.exists(os.path.join(work, "killed.gguf")),
              f"{sig.name} during gen: rc {p.returncode}, temporary files {tmp_left(work)}")

    # ---- item 8: outputs and options checked before the work starts ---------------------------
    missing = os.path.join(work, "missing", "dir", "x.json")
    r = run([mt, "run", "-m", model, "-p", "def f(", "-n", "8", "--ledger", missing])
    check(r.returncode == 2 and "missing/dir" in r.stderr and r.stdout == "", f"run --ledger /missing/dir: {r.stderr}")
    r = run([mt, "run", "-m", model, "-p", "def f(", "-n", "8", "--trace", work])
    check(r.returncode == 2 and "directory" in r.stderr and r.stdout == "", f"run --trace DIR: {r.stderr}")
    for extra, want in ((["--ledger", missing], "missing/dir"), (["--trace", missing], "missing/dir"),
                        (["--twin", os.path.join(work, "no_twin.gguf")], "--twin"),
                        (["--expert-budget", "50%,10000%"], "10000%"),
                        (["--expert-budget", "50%,abc"], "abc")):
        r = run([mt, "bench", "-m", model, "-p", "8", "-n", "4", "-r", "1", "--no-mem"] + extra)
        check(r.returncode == 1 and want in r.stderr and "| tiny.gguf" not in r.stdout,
              f"bench {extra} refused before its tests: {r.stderr} {r.stdout[:200]}")
    r = run([mt, "run", "-m", model, "-p", "x", "-n", "2", "--expert-budget", "10000%"])
    check(r.returncode == 2 and "out of range" in r.stderr, f"run --expert-budget 10000%: {r.stderr}")
    # the store's options do nothing without a store: refused, naming the option and the budget it needs
    nowhere = os.path.join(work, "nonexist")
    for opt in (["--warm", nowhere], ["--predictor", nowhere], ["--read-ahead", "1"], ["--io-engine", "pread"],
                ["--policy=lru"], ["--no-prefetch"], ["--buffered-io"], ["--io-threads", "2"], ["--read-ahead-min", "0.5"]):
        name = opt[0].split("=")[0]
        r = run([mt, "run", "-m", model, "-p", "x", "-n", "2"] + opt)
        check(r.returncode == 2 and f"{name} needs --expert-budget" in r.stderr, f"run {opt} without a budget: {r.stderr}")
    if serve_built(mt, "serve --warm without a budget"):
        r = run([mt, "serve", "-m", model, "--port", "0", "--warm", nowhere], timeout=20)  # it used to start
        check(r.returncode == 2 and "--warm needs --expert-budget" in r.stderr, f"serve --warm without a budget: {r.stderr}")
    r = run([mt, "eval", "-m", model, "--tokens", "1,2", "--out", missing])
    check(r.returncode == 2 and "missing/dir" in r.stderr and "greedy" not in r.stdout, f"eval --out /missing: {r.stderr}")
    r = run([mt, "report", os.path.join(work, "none.json"), "--html", missing])
    check(r.returncode == 2 and "missing/dir" in r.stderr, f"report --html /missing: {r.stderr}")
    # a full disk: an error, and no truncated file (nor a temporary one)
    full = os.path.join(work, "full_fs")
    if root and mount_tmpfs(full, "64k"):
        logits = os.path.join(full, "logits.f32")
        toks = ",".join(str(i) for i in range(1, 41))  # 40 rows of 512 floats: 80 KiB
        r = run([mt, "eval", "-m", model, "--tokens", toks, "--out", logits])
        check(r.returncode == 1 and "No space" in r.stderr and not os.path.exists(logits) and not tmp_left(full),
              f"eval --out on a full disk: {r.stderr}")
        led, trace = os.path.join(full, "run.json"), os.path.join(full, "run.trace.json")
        r = run([mt, "run", "-m", model, "-p", "def f(x):", "-n", "40", "--ignore-eos", "--routing-stats",
                 "--ledger", led, "--trace", trace])
        # the ledger may fit, the trace does not: no file is truncated
        check(r.returncode == 1 and "No space" in r.stderr and not os.path.exists(trace) and not tmp_left(full)
              and (not os.path.exists(led) or is_json(open(led).read())), f"run --trace on a full disk: {r.stderr[-300:]}")
        # report --html on a full disk names the page and the reason (it said "writing the HTML page failed")
        led2, page = os.path.join(work, "run2.json"), os.path.join(full, "page.html")
        r = run([mt, "run", "-m", model, "-p", "def f(x):", "-n", "40", "--ignore-eos", "--ledger", led2])
        filler = os.path.join(full, "filler")
        with open(filler, "wb") as f:  # leave a few KiB: less than the page
            try:
                f.write(b"\0" * (56 << 10))
            except OSError:
                pass
        r = run([mt, "report", led2, "--html", page])
        check(r.returncode == 1 and page in r.stderr and "No space" in r.stderr and not os.path.exists(page)
              and not tmp_left(full), f"report --html on a full disk: {r.stderr[-300:]}")
        # a routing profile's page names the page, not the profile; --dump-features says the reason
        text, prof = os.path.join(work, "prof_text.txt"), os.path.join(work, "prof.json")
        with open(text, "w") as f:
            f.write("def f(x):\n    return x + 1\n" * 20)
        r = run([mt, "profile", "-m", model, "-f", text, "-o", prof])
        page2, feat = os.path.join(full, "prof.html"), os.path.join(full, "feat.bin")
        r = run([mt, "report", prof, "--html", page2])
        check(r.returncode == 1 and page2 in r.stderr and "No space" in r.stderr and not tmp_left(full),
              f"report PROFILE --html on a full disk: {r.stderr[-300:]}")
        r = run([mt, "profile", "-m", model, "-f", text, "-o", os.path.join(work, "prof2.json"), "--dump-features", feat])
        check(r.returncode == 1 and feat in r.stderr and "No space" in r.stderr and not tmp_left(full),
              f"profile --dump-features on a full disk: {r.stderr[-300:]}")
        umount(full)
    else:
        print("SKIP: full-disk cases (no tmpfs)")
    if have_tmpfs:
        umount(small)

    # ---- item 3 and 9: --json is JSON alone on stdout; non-finite results are errors -------
    r = run([mt, "run", "-m", model, "-p", "def f(", "-n", "4", "--ignore-eos", "--json"])
    check(r.returncode == 0 and is_json(r.stdout) and r.stderr.startswith("def f("),
          f"run --json: stdout is one JSON object, the text on stderr: {r.stdout!r}")
    quoted = os.path.join(work, 'we"ird\\name.gguf')
    shutil.copy(model, quoted)
    for args in (["inspect", quoted, "--json", "--checksums"],
                 ["bench", "-m", quoted, "-p", "8", "-n", "4", "-r", "1", "--no-mem", "--json"],
                 ["bench", "-m", quoted, "-p", "0", "-n", "4", "-r", "1", "--no-mem", "--json", "--expert-budget", "50%",
                  "--buffered-io"]):
        r = run([mt] + args)
        lines = [x for x in r.stdout.splitlines() if x.strip()] if args[0] == "bench" else [r.stdout]
        check(r.returncode == 0 and lines and all(is_json(x) for x in lines), f"{args[0]} --json with a quote in the "
              f"model's name: {r.stderr[-300:]} {r.stdout[:300]!r}")
    # a model whose output matrix is NaN: every logit is NaN (the loader checks the norms itself)
    nan = os.path.join(work, "nan.gguf")
    shutil.copy(model, nan)
    d = json.loads(run([mt, "inspect", nan, "--json"]).stdout)
    t = [x for x in d["tensors"] if x["name"] == "output.weight"][0]
    with open(nan, "r+b") as f:
        f.seek(d["data_offset"] + t["offset"])
        f.write(struct.pack("<f", float("nan")) * (t["nbytes"] // 4))
    r = run([mt, "inspect", nan, "--json", "--checksums"])
    dj = json.loads(r.stdout) if r.returncode == 0 and is_json(r.stdout) else {}
    tn = [x for x in dj.get("tensors", []) if x["name"] == "output.weight"]
    check(tn and tn[0]["sum"] is None and "nan" not in r.stdout.lower().replace("nan.gguf", ""),
          f"inspect --json --checksums of NaN weights: null, not nan: {r.stdout[-200:]!r}")
    r = run([mt, "run", "-m", nan, "-p", "def f(", "-n", "4", "--temp", "0"])
    check(r.returncode == 1 and ("not finite" in r.stderr or "NUMERIC" in r.stderr), f"run on NaN weights: {r.stderr}")
    r = run([mt, "eval", "-m", nan, "--tokens", "1,2,3", "--decode", "2"])
    check(r.returncode == 1 and ("not finite" in r.stderr or "NUMERIC" in r.stderr), f"eval on NaN weights: {r.stderr}")
    text = os.path.join(work, "doc.py")
    with open(text, "w") as f:
        f.write("def f(x):\n    return x + 1\n" * 8)
    r = run([mt, "perplexity", "-m", nan, "-f", text, "--json"])
    check(r.returncode == 1 and "nan" not in r.stdout and ("not finite" in r.stderr or "NaN" in r.stderr),
          f"perplexity on NaN weights is an error: {r.stdout!r} {r.stderr}")
    # --parallel: --check-finite names the layer (a NaN attention output in layer 0), --adapt-threads runs;
    # the chat options, which it does not render yet, are refused by name
    nan0 = os.path.join(work, "nan_layer0.gguf")
    shutil.copy(model, nan0)
    t = [x for x in d["tensors"] if x["name"] == "blk.0.attn_output.weight"][0]
    with open(nan0, "r+b") as f:
        f.seek(d["data_offset"] + t["offset"])
        f.write(struct.pack("<f", float("nan")) * (t["nbytes"] // 4))
    par = ["run", "--parallel", "2", "-f", text, "-n", "2"]
    r = run([mt] + par + ["-m", nan0, "--check-finite"])
    check(r.returncode == 1 and "layer 0: the hidden state" in r.stderr, f"run --parallel --check-finite: {r.stderr}")
    r = run([mt] + par + ["-m", model, "--adapt-threads", "-t", "2"])
    check(r.returncode == 0, f"run --parallel --adapt-threads: {r.stderr}")
    for opt, name in ((["--chat"], "--chat"), (["-sys", "be brief"], "-sys"), (["--chat-template", "chatml"], "--chat-template"),
                      (["--chat-template", "no-such-template"], "--chat-template")):
        r = run([mt] + par + ["-m", model] + opt)
        check(r.returncode == 2 and f"--parallel does not combine with {name}" in r.stderr, f"run --parallel {opt}: {r.stderr}")
    r = run([mt, "perplexity", "-m", quoted, "-f", text, "--json"])
    check(r.returncode == 0 and is_json(r.stdout) and json.loads(r.stdout)["ppl"] > 0, f"perplexity --json: {r.stdout!r}")

    # ---- item 7 and 9: capped text inputs, clear messages ---------------------------------
    for args in (["perplexity", "-m", model, "-f", "/dev/zero"], ["report", "/dev/zero"],
                 ["tokenize", "-m", model, "-f", "/dev/zero"], ["run", "-m", model, "-f", "/dev/zero"]):
        r = run([mt] + args, timeout=120)
        check(r.returncode in (1, 2) and "--max-input-bytes" in r.stderr, f"{args[0]} /dev/zero: {r.stderr}")
    r = run([mt, "tokenize", "-m", model, "-f", text, "--max-input-bytes", "16"])
    check(r.returncode == 1 and "more than" in r.stderr, f"--max-input-bytes 16: {r.stderr}")
    r = run([mt, "tokenize", "-m", model, "-f", text, "--max-input-bytes", "1M"])
    check(r.returncode == 0, f"--max-input-bytes 1M: {r.stderr}")
    r = run([mt, "run", "-m", model, "-f", work])
    check(r.returncode == 2 and "is a directory" in r.stderr, f"run -f DIR: {r.stderr}")
    r = run([mt, "gen", "--preset", "tiny", "--embd", "2000000000", "-o", os.path.join(work, "e.gguf")])
    check(r.returncode == 2 and "out of range" in r.stderr, f"gen --embd 2000000000: {r.stderr}")
    r = run([mt, "bench", "-m", model, "-p", "600", "-n", "0", "-r", "1", "--no-mem"])
    check(r.returncode == 0 and "longer than the 512" in r.stderr, f"bench -p 600 on a 512-token model warns: {r.stderr}")
    check(not tmp_left(work), f"no temporary files left at the end: {tmp_left(work)}")
    # ---- results on standard output that cannot be written (a full disk): an error, not exit 0 ------
    if os.path.exists("/dev/full"):
        for args in ([mt, "run", "-m", model, "-p", "def f(", "-n", "8", "-t", "1"], [mt, "inspect", model], [mt, "--help"],
                     [mt, "tokenize", "-m", model, "-p", "def f(x):"]):
            with open("/dev/full", "w") as full:
                r = subprocess.run(args, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
            check(r.returncode != 0 and "cannot write" in r.stderr and "No space left" in r.stderr,
                  f"{' '.join(args[1:2])} > /dev/full: rc {r.returncode}, {r.stderr[-300:]!r}")
    return summary()


if __name__ == "__main__":
    sys.exit(main())
