# ctest-labels: unit
"""test_report_html.py - `moetax report` end to end: run a tiny model with
--ledger --trace --routing-stats, check the trace's structure, check that the
report of the trace agrees with the report of the ledger, then render the HTML
page in headless Chromium (DOM dump and screenshot) and check that it loads
without console errors and holds the charts.

argv[1] = moetax binary, argv[2] = scratch directory. Chromium (/usr/bin/chromium,
installed by scripts/deps.sh) is required: without it the test fails."""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from html.parser import HTMLParser

MOETAX = sys.argv[1] if len(sys.argv) > 1 else "moetax"
SCRATCH = sys.argv[2] if len(sys.argv) > 2 else tempfile.gettempdir()
CHROMIUM = "/usr/bin/chromium"
PHASES = ["route", "dispatch", "load", "comm", "wait", "combine", "expert", "shared", "attn", "dense", "norm",
          "head", "embd", "sample"]
CHART_TITLES = ["Time per token by layer", "Timeline of one step", "Expert heat map", "Per-worker wait"]

failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
        print("FAIL:", msg, file=sys.stderr)


def run(args, quiet=False):
    p = subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=300)
    if p.returncode != 0 and not quiet:
        print("command failed:", " ".join(args), "\n", p.stdout[-2000:], p.stderr[-4000:], file=sys.stderr)
    return p


def chromium(work, url, extra):
    profile = tempfile.mkdtemp(prefix="chromium-profile-", dir=work)
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--user-data-dir=" + profile, "--enable-logging=stderr", "--v=0"] + extra + [url]
    env = dict(os.environ, HOME=profile)
    p = subprocess.run(args, capture_output=True, text=True, errors="replace", timeout=180, env=env)
    shutil.rmtree(profile, ignore_errors=True)
    return p


def console_errors(stderr):
    bad = []
    for line in stderr.splitlines():
        if ("CONSOLE" in line and "ERROR" in line) or "Uncaught" in line:
            bad.append(line)
    return bad


def check_trace(path, threads):
    with open(path) as f:
        t = json.load(f)
    check(isinstance(t, dict) and isinstance(t.get("traceEvents"), list), "trace: traceEvents list")
    evs = t.get("traceEvents", [])
    names = {e.get("tid") for e in evs if e.get("ph") == "M" and e.get("name") == "thread_name"}
    check(names == set(range(threads)), "trace: thread_name metadata for workers 0..%d (got %s)" % (threads - 1, names))
    xs = [e for e in evs if e.get("ph") == "X"]
    check(len(xs) > 100, "trace: %d X events" % len(xs))
    bad = 0
    for e in xs:
        a = e.get("args", {})
        ok = (e.get("name") in PHASES and isinstance(e.get("ts"), (int, float)) and e["ts"] >= 0
              and isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0
              and isinstance(e.get("tid"), int) and not isinstance(e.get("tid"), bool) and 0 <= e["tid"] < threads
              and isinstance(a, dict) and isinstance(a.get("layer"), int) and isinstance(a.get("step"), int))
        if not ok:
            bad += 1
            if bad <= 3:
                print("bad trace event:", e, file=sys.stderr)
    check(bad == 0, "trace: %d malformed X events" % bad)


class Structure(HTMLParser):
    """Counts tags, checks nesting of the non-void elements, and looks for scripts and remote resources."""
    VOID = {"meta", "link", "br", "img", "input", "hr", "col", "area", "base", "wbr", "source", "track", "embed", "param"}

    def __init__(self):
        super().__init__()
        self.stack, self.errors, self.tags, self.remote = [], [], {}, []

    def handle_starttag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1
        for k, v in attrs:
            if k in ("src", "href") and v and re.match(r"^(https?:)?//", v):
                self.remote.append(v)
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append("</%s> closes <%s>" % (tag, self.stack[-1] if self.stack else "nothing"))
            if tag in self.stack:
                while self.stack and self.stack.pop() != tag:
                    pass
        else:
            self.stack.pop()


def main():
    check(os.path.exists(CHROMIUM), "chromium is missing at %s (scripts/deps.sh installs the Debian package)" % CHROMIUM)
    os.makedirs(SCRATCH, exist_ok=True)
    work = tempfile.mkdtemp(prefix="report_html_", dir=SCRATCH)
    model, ledger, trace = (os.path.join(work, n) for n in ("m.gguf", "ledger.json", "trace.json"))
    page, png = os.path.join(work, "report.html"), os.path.join(work, "report.png")
    print("scratch:", work, "(kept on failure or with MOETAX_KEEP=1)")
    threads = 2

    p = run([MOETAX, "gen", "--preset", "tiny-v3", "-o", model])
    check(p.returncode == 0, "moetax gen")
    p = run([MOETAX, "run", "-m", model, "-p", "hello world", "-n", "24", "--temp", "0", "--ignore-eos",
             "-t", str(threads), "--ledger", ledger, "--trace", trace, "--routing-stats"])
    check(p.returncode == 0, "moetax run")
    if failures:
        return

    check_trace(trace, threads)

    # the report of the trace agrees with the report of the ledger
    pl = run([MOETAX, "report", ledger, "--json"])
    pt = run([MOETAX, "report", trace, "--json"])
    check(pl.returncode == 0 and pt.returncode == 0, "moetax report --json")
    if pl.returncode == 0 and pt.returncode == 0:
        rl, rt = json.loads(pl.stdout), json.loads(pt.stdout)
        for key in ("tax_share", "efficiency", "phase_s", "per_token_us", "layers", "workers", "steps", "routing"):
            check(key in rl, "report --json has %s" % key)
        check(set(rl["phase_s"]) == set(PHASES), "phase_s has every phase")
        check(len(rl["layers"]) == rl["n_layer"], "one entry per layer")
        check(len(rl["workers"]) == threads, "one entry per worker")
        check(rl["steps"]["all"]["steps"] == rl["steps"]["prefill"]["steps"] + rl["steps"]["decode"]["steps"],
              "steps add up")
        check(rl["routing"] is not None and len(rl["routing"]["layers"]) > 0, "routing stats present")
        check(rt["routing"] is None, "no routing from a trace")
        a, b = rl["tax_share"], rt["tax_share"]
        check(abs(a - b) <= 0.05 * max(a, b) + 1e-3, "tax share: ledger %.4f vs trace %.4f (within 5%%)" % (a, b))
        check(abs(rl["efficiency"] - 100 * (1 - a)) < 1e-6, "efficiency = 100 (1 - tax share)")
        check(rl["steps"]["all"]["tokens"] == rt["steps"]["all"]["tokens"], "tokens agree")
        print("tax share: ledger %.4f, trace %.4f" % (a, b))

    # text report
    p = run([MOETAX, "report", ledger])
    check(p.returncode == 0 and "tax share" in p.stdout and "routing (" in p.stdout, "text report")

    # errors: clear message, exit 1
    bad = os.path.join(work, "bad.json")
    with open(bad, "w") as f:
        f.write('{"moetax_ledger": 1, "threads": ')
    p = run([MOETAX, "report", bad], quiet=True)
    check(p.returncode == 1 and bad in p.stderr and "not valid JSON" in p.stderr, "truncated file: error naming it")

    # the page
    p = run([MOETAX, "report", ledger, "--html", page])
    check(p.returncode == 0 and os.path.getsize(page) > 2000, "report --html")
    with open(page, encoding="utf-8") as f:
        html = f.read()
    check(html.startswith("<!DOCTYPE html>"), "HTML5 doctype")
    s = Structure()
    s.feed(html)
    s.close()
    check(not s.errors, "HTML nesting: %s" % s.errors[:5])
    check(not s.stack, "unclosed elements: %s" % s.stack)
    check("script" not in s.tags, "no scripts")
    check(not s.remote, "no remote resources: %s" % s.remote[:3])
    check(s.tags.get("svg", 0) == 4, "4 svg charts (got %d)" % s.tags.get("svg", 0))

    url = "file://" + os.path.abspath(page)
    d = chromium(work, url, ["--dump-dom"])
    check(d.returncode == 0, "chromium --dump-dom exit %d: %s" % (d.returncode, d.stderr[-1500:]))
    errs = console_errors(d.stderr)
    check(not errs, "console errors: %s" % errs[:5])
    dom = d.stdout
    check(dom.count("<svg") == 4, "DOM holds 4 <svg> (got %d)" % dom.count("<svg"))
    for t in CHART_TITLES:
        check(t in dom, "DOM has chart title %r" % t)
    check("tax share" in dom.lower() and "efficiency" in dom.lower(), "DOM has the headline")

    sc = chromium(work, url, ["--screenshot=" + png, "--window-size=1400,2000", "--hide-scrollbars"])
    check(sc.returncode == 0, "chromium --screenshot exit %d: %s" % (sc.returncode, sc.stderr[-1500:]))
    check(not console_errors(sc.stderr), "console errors (screenshot): %s" % console_errors(sc.stderr)[:5])
    size = os.path.getsize(png) if os.path.exists(png) else 0
    check(size > 30000, "screenshot %s is %d bytes" % (png, size))
    with open(png, "rb") as f:
        check(f.read(8) == b"\x89PNG\r\n\x1a\n", "screenshot is a PNG")
    print("page %s, screenshot %s (%d bytes)" % (page, png, size))

    # the page from the trace (real spans per worker lane)
    tpage = os.path.join(work, "report_trace.html")
    p = run([MOETAX, "report", trace, "--html", tpage])
    check(p.returncode == 0, "report --html from the trace")
    d = chromium(work, "file://" + os.path.abspath(tpage), ["--dump-dom"])
    check(d.returncode == 0 and not console_errors(d.stderr), "trace page loads without errors")
    check("spans per worker" in d.stdout, "trace page draws spans per worker")
    if not failures and not os.environ.get("MOETAX_KEEP"):
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
    if failures:
        print("test_report_html: %d failed" % len(failures))
        sys.exit(1)
    print("test_report_html: ok")
