#!/usr/bin/python3
# ctest-labels: unit;model
"""test_predict_cli.py - the learned expert predictor from the command line, on the committed
default model: `profile --fit-predictor` writes P.pred beside P.json; `profile --predictor` scores
it against the router guess on other text; `run --expert-budget 25% --predictor` gives the very
text of the run without a store and prints both predictors' scores; a damaged predictor file is a
clear error naming the file (exit status 1, no crash); a predictor for another shape is refused.

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

    # a predictor of another shape (another width): refused naming both
    gen = os.path.join(work, "pcli_tiny.gguf")
    rc, out, err = run([moetax, "gen", "--preset", "tiny-v3", "-o", gen])
    check(rc == 0, "gen tiny-v3: %s" % err[-300:])
    rc, out, err = run([moetax, "run", "-m", gen, "-p", "a", "-n", "2", "--expert-budget", "50%", "--predictor", pred])
    check(rc == 1 and "pcli.pred" in err and "the model has" in err, "another model's predictor: rc %d, %s" % (rc, err[-300:]))

    print("test_predict_cli: %s" % ("FAIL (%d)" % len(FAILS) if FAILS else "ok"))
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
