"""checks.py - the tally every Python test keeps: check(cond, msg) counts a check and
prints "FAIL: msg" when it fails; summary() prints "N passed, M failed" and returns the
test's exit status (1 if anything failed)."""
import sys

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
