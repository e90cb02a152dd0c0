#!/usr/bin/python3
# ctest-labels: unit;model
# ctest-cost: 31
"""test_predict_cli.py - the learned expert predictor from the command line, on the committed
default model: `profile --fit-predictor` writes P.pred beside P.json; `profile --predictor` scores
it against the router guess on other text; `run --expert-budget 25% --predictor` gives the very
text of the run without a store and prints both predictors' scores; a damaged predictor file is a
clear error naming the file (exit status 1, no crash); a predictor for another shape is refused.
`profile --dump-features` writes rows that tools/train/fit_predictor.py (PyTorch; skipped without
it) fits a hidden-layer predictor from; the engine's score of that file on other text is the
script's own, to the token, with and without a margin (extra experts: precision below recall);
it drives a run's prefetch with the run's very text.

usage: test_predict_cli.py MOETAX_BIN WORKDIR
"""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FAILS = []


def check(cond, msg):
    if not cond:
        FAILS.append(msg)
        print("FAIL:", msg)


def run(args):
    p = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    return p.returncode, p.stdout, p.stderr


def main():
    moetax, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    fit_text = os.path.join(ROOT, "tools", "train", "train.py")
    other_text = os.path.join(ROOT, "tools", "train", "bpe.py")
    prof = os.path.join(work, "pcli.json")
    pred = os.path.join(work, "pcli.pred")
    for f in (prof, pred):
        if os.path.exists(f):
            os.remove(f)
    rc, out, err = run([moetax, "profile", "-f", fit_text, "-o", prof, "--fit-predictor", "--max-tokens", "1500",
                        "-t", "2"])
    check(rc == 0, "profile --fit-predictor: rc %d: %s" % (rc, err[-400:]))
    check(os.path.exists(pred) and "predictor fitted on" in err, "P.pred beside P.json: %s" % err[-400:])
    check(os.path.exists(prof), "the profile is written too")

    rc, out, err = run([moetax, "profile", "-f", other_text, "-o", os.path.join(work, "pcli2.json"),
                        "--predictor", pred, "--max-tokens", "800", "-t", "2"])
    check(rc == 0 and "router guess P" in err and "learned P" in err and "layer 1 -> 2" in err,
          "profile --predictor scores both: rc %d: %s" % (rc, err[-600:]))

    prompt = ["-p", "def main(args):\n    ", "-n", "24", "--temp", "0", "-t", "2"]
    rc0, out0, err0 = run([moetax, "run"] + prompt)
    rc1, out1, err1 = run([moetax, "run"] + prompt + ["--expert-budget", "25%", "--predictor", pred])
    check(rc0 == 0 and rc1 == 0, "run rc %d / %d: %s" % (rc0, rc1, err1[-400:]))
    check(out0 == out1, "the text with a store and the learned predictor is the run's without: %r vs %r" % (out0, out1))
    check("predictors, 1 layer ahead" in err1 and "learned P" in err1, "run prints the scores: %s" % err1[-600:])

    with open(pred, "rb") as f:
        data = f.read()
    bad = os.path.join(work, "pcli_bad.pred")
    for what, blob, field in (("truncated", data[:-9], "size"), ("one byte flipped", data[:200] + bytes([data[200] ^ 1]) +
                              data[201:], "checksum"), ("empty", b"", "shorter"), ("not a predictor", b"x" * 300, "magic")):
        with open(bad, "wb") as f:
            f.write(blob)
        rc, out, err = run([moetax, "run"] + prompt + ["--expert-budget", "25%", "--predictor", bad])
        check(rc == 1 and "pcli_bad.pred" in err and field in err, "%s predictor: rc %d, %s" % (what, rc, err[-300:]))
    rc, out, err = run([moetax, "bench", "-m", os.path.join(ROOT, "models", "pycode-20m-q8_0.gguf"), "-p", "0", "-n", "4",
                        "-r", "1", "--no-mem", "--expert-budget", "25%", "--predictor", os.path.join(work, "nope.pred")])
    check(rc != 0 and rc < 128 and "nope.pred" in err, "a missing predictor: rc %d, %s" % (rc, err[-300:]))
    # a missing file, a directory or a device as --predictor or --warm: the reader's own words, by name
    nope, short = os.path.join(work, "nope.json"), ["-p", "a", "-n", "2", "--expert-budget", "25%"]
    fifo = os.path.join(work, "pcli.fifo")  # no writer: opening it would block
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    for opt, path, want in (("--predictor", work, "is a directory, not a predictor file"),
                            ("--predictor", fifo, "not a regular file (a FIFO)"),
                            ("--predictor", "/dev/null", "not a regular file"),
                            ("--predictor", nope, "No such file or directory"),
                            ("--warm", nope, "cannot open it: No such file or directory"),
                            ("--warm", work, "is a directory"), ("--warm", "/dev/zero", "a NUL byte at byte offset 0")):
        rc, out, err = run([moetax, "run"] + short + [opt, path])
        check(rc == 1 and path + ":" in err and want in err and "JSON" not in err and "16 GiB" not in err,
              "%s %s: rc %d, %s" % (opt, path, rc, err[-300:]))

    # a predictor of another shape (another width): refused naming both
    gen = os.path.join(work, "pcli_tiny.gguf")
    rc, out, err = run([moetax, "gen", "--preset", "tiny-v3", "-o", gen])
    check(rc == 0, "gen tiny-v3: %s" % err[-300:])
    rc, out, err = run([moetax, "run", "-m", gen, "-p", "a", "-n", "2", "--expert-budget", "50%", "--predictor", pred])
    check(rc == 1 and "pcli.pred" in err and "the model has" in err, "another model's predictor: rc %d, %s" % (rc, err[-300:]))

    # feature rows, the PyTorch fit of a hidden layer, and the engine scoring the same file
    feat, hfeat = os.path.join(work, "pcli.feat"), os.path.join(work, "pcli_h.feat")
    rc, out, err = run([moetax, "profile", "-f", fit_text, "-o", os.path.join(work, "pcli3.json"), "--dump-features", feat,
                        "--max-tokens", "1500", "-t", "2"])
    check(rc == 0 and "feature rows (1500 tokens x 5 MoE layers)" in err and os.path.getsize(feat) > 1500 * 5 * 1184,
          "profile --dump-features: rc %d: %s" % (rc, err[-400:]))
    rc, out, err = run([moetax, "profile", "-f", other_text, "-o", os.path.join(work, "pcli4.json"), "--dump-features",
                        hfeat, "--max-tokens", "600", "-t", "2"])
    check(rc == 0, "profile --dump-features (held-out): rc %d: %s" % (rc, err[-400:]))
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
        print("test_predict_cli: no PyTorch: the fit_predictor.py case is skipped")
    if have_torch and rc == 0:
        hpred = os.path.join(work, "pcli_h.pred")
        p = subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "tools", "train", "fit_predictor.py"), feat, "-o", hpred,
                            "--heldout", hfeat, "--hidden", "32", "--epochs", "2", "--margins", "0.01", "--threads", "2"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
        check(p.returncode == 0 and os.path.exists(hpred), "fit_predictor.py: rc %d: %s" % (p.returncode, p.stderr[-600:]))
        import re
        got = {}
        for m in re.finditer(r"margin ([0-9.]+): precision ([0-9.]+)%, recall ([0-9.]+)%", p.stdout):
            got[float(m.group(1))] = (float(m.group(2)), float(m.group(3)))
        check(0.0 in got and 0.01 in got, "fit_predictor.py reports held-out precision/recall: %s" % p.stdout[-600:])
        for mg in (0.0, 0.01):
            rc, out, err = run([moetax, "profile", "-f", other_text, "-o", os.path.join(work, "pcli5.json"),
                                "--predictor", hpred, "--predictor-margin", str(mg), "--max-tokens", "600", "-t", "2"])
            m = re.search(r"1 layer ahead.*learned P ([0-9.]+)% R ([0-9.]+)%", err)
            check(rc == 0 and m, "profile --predictor (hidden layer, margin %g): rc %d: %s" % (mg, rc, err[-600:]))
            if m and mg in got:
                P, R = float(m.group(1)), float(m.group(2))
                check(abs(P - got[mg][0]) <= 0.15 and abs(R - got[mg][1]) <= 0.15,
                      "margin %g: the engine's P %.1f R %.1f, the script's P %.1f R %.1f" % (mg, P, R, *got[mg]))
                check((P < R) == (mg > 0) or P == R == 100, "margin %g: precision %.1f, recall %.1f" % (mg, P, R))
        rc2, out2, err2 = run([moetax, "run"] + prompt + ["--expert-budget", "25%", "--predictor", hpred])
        check(rc2 == 0 and out2 == out0, "the text with the hidden-layer predictor is the run's without: %r vs %r" % (
            out0, out2))

    print("test_predict_cli: %s" % ("FAIL (%d)" % len(FAILS) if FAILS else "ok"))
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
