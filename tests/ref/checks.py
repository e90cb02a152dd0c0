"""checks.py - the tally every Python test keeps: check(cond, msg) counts a check and
prints "FAIL: msg" when it fails; summary() prints "N passed, M failed" and returns the
test's exit status (1 if anything failed). SLOW: MOETAX_SLOW=1 is set (scripts/test.sh passes it
on), so a test runs its long checks too; without it a test may leave out the long checks that
README's test section lists, saying so with long_skipped(). SANITIZERS: the sanitizers of the
build under test (MOETAX_SANITIZER, set by CTest), e.g. {"thread"}."""
import os
import sys

SLOW = os.environ.get("MOETAX_SLOW") == "1"
SANITIZERS = set(filter(None, os.environ.get("MOETAX_SANITIZER", "").split(",")))

passed = 0
failed = 0


def check(cond, msg):
    global passed, failed
    if cond:
        passed += 1
    else:
        failed += 1
        print("FAIL:", msg, flush=True)
    return cond


def summary():
    print("%d passed, %d failed" % (passed, failed))
    sys.stdout.flush()
    return 1 if failed else 0


def long_skipped(what):
    print("SKIP (a long check, run with MOETAX_SLOW=1): %s" % what, flush=True)
