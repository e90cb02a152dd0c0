#!/usr/bin/python3
# ctest-labels: unit
"""test_hostile_placement.py - hostile text files given to `inspect --ranks 2 --placement FILE`
(src/dist/dist.c) and to `run -f FILE` / `run --parallel 2 -f FILE` (tools/cmd_run.c), on the tiny
generated model. Each is refused fast, with a non-zero exit and a message naming the file and where:
/dev/zero and /dev/urandom (a NUL byte: once an endless loop of "blank" lines), a NUL inside a
placement line, a line longer than the reader takes (fgets used to cut it and read a comment's tail as
a placement), a directory (once "MoE layer 1 is not placed"), a file larger than a placement file can
be, and a prompt file holding a NUL byte (once cut there silently). Valid files (CRLF ends, no final
newline, a long comment within the bound) still give the map they spell and the prompts still run.
The placement cases SKIP on a moetax built without MPI. Every command runs under a timeout, so a hang
fails the test instead of hanging it. Registered like every tests/test_*.py: the ASan build's test runs
the ASan binary.

usage: test_hostile_placement.py MOETAX_BIN WORKDIR
"""
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ref"))
from checks import check, summary  # noqa: E402  (tests/ref/checks.py)

E = 8            # the tiny preset's experts (layers 1 and 2 MoE)
TIMEOUT = 20     # seconds: a hang fails the check instead of the whole run
FGETS_CHUNK = 65535  # what the old reader's fgets took of a line at a time


def run(args):
    """(returncode, stderr, stdout, seconds); a timeout is returncode None"""
    t0 = time.monotonic()
    try:
        r = subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=TIMEOUT)
        return r.returncode, r.stderr, r.stdout, time.monotonic() - t0
    except subprocess.TimeoutExpired:
        return None, f"timed out after {TIMEOUT} s", "", time.monotonic() - t0


def write(path, data):
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return path


def placement(moetax, tiny, path):
    """(rc, stderr, [rank of each expert] per MoE layer or None)"""
    rc, err, out, _ = run([moetax, "inspect", tiny, "--json", "--ranks", "2", "--placement", path])
    if rc != 0:
        return rc, err, None
    j = json.loads(out)
    maps = []
    for layer in j["placement"]:
        row = [None] * E
        for r, x in enumerate(layer["ranks"]):
            for e in x["experts"]:
                row[e] = r
        maps.append(row)
    return rc, err, maps


def refused(what, rc, err, *want):
    check(rc is not None, f"{what}: ends within {TIMEOUT} s")
    check(rc is not None and rc != 0 and "Sanitizer" not in err and all(w in err for w in want),
          f"{what}: exits non-zero naming {want}: rc {rc}, {err[-400:]!r}")


def placements(moetax, tiny, work):
    inter = [e % 2 for e in range(E)]
    ok = write(os.path.join(work, "ok.txt"), "# interleaved\n*: " + " ".join(map(str, inter)) + "\n")
    rc, err, maps = placement(moetax, tiny, ok)
    if rc != 0 and "without MPI" in err:
        print("SKIP: moetax was built without MPI (--placement)")
        return
    check(rc == 0 and maps == [inter, inter], f"a valid placement file gives its map: rc {rc} {maps} {err[-300:]}")
    crlf = write(os.path.join(work, "crlf.txt"), "# c\r\n1: 0 1 0 1 0 1 0 1\r\n2: 1 1 1 1 0 0 0 0 # x\r\n")
    rc, err, maps = placement(moetax, tiny, crlf)
    check(rc == 0 and maps == [inter, [1, 1, 1, 1, 0, 0, 0, 0]], f"CRLF line ends: rc {rc} {maps} {err[-300:]}")
    nonl = write(os.path.join(work, "nonl.txt"), "*: " + " ".join(map(str, inter)))
    rc, err, maps = placement(moetax, tiny, nonl)
    check(rc == 0 and maps == [inter, inter], f"no newline at the end: rc {rc} {maps} {err[-300:]}")
    # a comment longer than the old 64 KiB buffer but within the bound: read whole, still a comment
    longc = write(os.path.join(work, "long-comment.txt"),
                  "#" + "c" * (FGETS_CHUNK + 40) + "\n*: " + " ".join(map(str, inter)) + "\n")
    rc, err, maps = placement(moetax, tiny, longc)
    check(rc == 0 and maps == [inter, inter], f"a comment past 64 KiB within the bound: rc {rc} {maps} {err[-300:]}")

    # /dev/zero: once an endless loop (each fgets line of NULs looked blank)
    rc, err, _, secs = run([moetax, "inspect", tiny, "--ranks", "2", "--placement", "/dev/zero"])
    refused("--placement /dev/zero", rc, err, "/dev/zero:1:", "NUL byte", "byte offset 0")
    check(secs < 5, f"--placement /dev/zero fails fast ({secs:.1f} s)")
    rc, err, _, secs = run([moetax, "inspect", tiny, "--ranks", "2", "--placement", "/dev/urandom"])
    refused("--placement /dev/urandom", rc, err, "--placement /dev/urandom")
    check(secs < 5, f"--placement /dev/urandom fails fast ({secs:.1f} s)")

    # a NUL in a line: once the line ended there ("0 1 0 1": 4 ranks of 8, or silently taken)
    nul = write(os.path.join(work, "nul.txt"), b"# two rows\n*: 0 1 0 1\x000 1 0 1\n")
    rc, err, _ = placement(moetax, tiny, nul)
    refused("a NUL in a placement line", rc, err, "nul.txt:2:", "NUL byte", "byte offset 21")
    nul_tail = write(os.path.join(work, "nul-tail.txt"), b"*: " + " ".join(map(str, inter)).encode() + b"\n\x00\x00\n")
    rc, err, _ = placement(moetax, tiny, nul_tail)
    refused("NUL bytes after a valid map", rc, err, "nul-tail.txt:2:", "byte offset 19")

    # a line past the bound: fgets used to cut it, and the comment's tail became a placement
    long_line = write(os.path.join(work, "long-line.txt"),
                      "#" + " " * (2 * FGETS_CHUNK - 1) + "*: " + " ".join("1" for _ in range(E)) + "\n")
    rc, err, maps = placement(moetax, tiny, long_line)
    refused("a placement line past the bound", rc, err, "long-line.txt:1:", "too long")

    # binary junk after the ranks: named, but printable (an escape sequence stays off the terminal)
    junk = write(os.path.join(work, "junk.txt"), b"*: 0 1 0 1 0 1 0 1 \x1b[2J\x07x\n")
    rc, err, _ = placement(moetax, tiny, junk)
    refused("control bytes in a placement line", rc, err, "junk.txt:1:", "'?[2J?x' is not a rank")
    check("\x1b" not in err and "\x07" not in err, f"the message carries no control bytes: {err[-200:]!r}")

    # a layer given twice: its number named (the message said "layer given"); the dense layer 0: said so (the
    # message named the range 0..2, which holds it)
    twice = write(os.path.join(work, "twice.txt"), "1: 0 0 0 0 0 0 0 0\n1: 1 1 1 1 1 1 1 1\n2: 0 0 0 0 0 0 0 0\n")
    rc, err, _ = placement(moetax, tiny, twice)
    refused("a layer placed twice", rc, err, "twice.txt:2: layer 1 placed twice")
    dense = write(os.path.join(work, "dense.txt"), "0: 0 0 0 0 0 0 0 0\n")
    rc, err, _ = placement(moetax, tiny, dense)
    refused("the dense layer placed", rc, err, "dense.txt:1: layer 0 is a dense layer")

    # a directory: once read as an empty map ("MoE layer 1 is not placed")
    rc, err, _ = placement(moetax, tiny, work)
    refused("a directory as --placement", rc, err, work, "directory")

    # a file larger than any placement: refused before it is parsed
    big = os.path.join(work, "big.txt")
    with open(big, "w") as f:
        f.write("# a comment line\n" * (17 << 16) + "*: " + " ".join(map(str, inter)) + "\n")
    rc, err, _ = placement(moetax, tiny, big)
    refused("a 17 MiB placement file", rc, err, "big.txt", "more than")
    os.unlink(big)


def prompts(moetax, tiny, work):
    base = [moetax, "run", "-m", tiny, "-n", "2", "-t", "1", "--temp", "0", "--ignore-eos"]
    ok = write(os.path.join(work, "prompt.txt"), "def f(x):\n    return x\n")
    rc, err, out, _ = run(base + ["-f", ok])
    check(rc == 0 and "def f(x):\n    return x\n" in out, f"run -f a valid prompt file: rc {rc} {err[-300:]}")
    many = write(os.path.join(work, "prompts.txt"), "a = 1\nb = 2\nc = 3\n")
    rc, err, out, _ = run(base + ["--parallel", "2", "-f", many])
    check(rc == 0, f"run --parallel 2 -f a valid prompts file: rc {rc} {err[-300:]}")

    # a NUL byte: once the prompt (or that prompt line) silently ended there
    nul = write(os.path.join(work, "prompt-nul.txt"), b"def f(x):\n    return\x00 x + 1\n")
    rc, err, _, _ = run(base + ["-f", nul])
    refused("run -f a prompt with a NUL", rc, err, "prompt-nul.txt", "NUL byte", "byte offset 20", "line 2")
    nul_many = write(os.path.join(work, "prompts-nul.txt"), b"a = 1\nb = \x00 2\nc = 3\n")
    rc, err, _, _ = run(base + ["--parallel", "2", "-f", nul_many])
    refused("run --parallel -f prompts with a NUL", rc, err, "prompts-nul.txt", "NUL byte", "byte offset 10",
            "line 2")


def main():
    moetax, work = os.path.abspath(sys.argv[1]), os.path.join(os.path.abspath(sys.argv[2]), "hostile-placement")
    os.makedirs(work, exist_ok=True)
    tiny = os.path.join(work, "tiny.gguf")
    r = subprocess.run([moetax, "gen", "--preset", "tiny", "-o", tiny], capture_output=True, text=True,
                       errors="replace", timeout=120)
    if not check(r.returncode == 0, f"gen --preset tiny: {r.stderr[-300:]}"):
        return summary()
    placements(moetax, tiny, work)
    prompts(moetax, tiny, work)
    return summary()


if __name__ == "__main__":
    sys.exit(main())
