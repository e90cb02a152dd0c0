"""serve_proc.py - a `moetax serve` under test: started with the given options on 127.0.0.1 and a free
port (--port 0; the port is read from its "listening on" line), `threads` threads (-t; default 1), its stdout and stderr in WORKDIR/serve-NAME.log; its /metrics as a dict, its peak memory,
and stop() (SIGTERM, then SIGKILL after 20 s) with its exit status. A server that does not start within
60 s ends the test with its output."""
import http.client
import os
import re
import subprocess
import sys
import time


class ServeProc:
    def __init__(self, moetax, model, workdir, name, *args, env=None, threads=1):
        self.log_path = os.path.join(workdir, f"serve-{name}.log")
        self.log = open(self.log_path, "w+b")
        self.p = subprocess.Popen([moetax, "serve", "-m", model, "--host", "127.0.0.1", "--port", "0", "-t", str(threads),
                                   *args], stdout=self.log, stderr=self.log, env=dict(os.environ, **(env or {})))
        deadline = time.time() + 60
        self.port = None
        while time.time() < deadline and self.port is None and self.p.poll() is None:
            m = re.search(rb"listening on http://127\.0\.0\.1:(\d+)", self.output())
            if m:
                self.port = int(m.group(1))
            else:
                time.sleep(0.05)
        if self.port is None:
            sys.exit(f"moetax serve did not start: {self.output().decode(errors='replace')}")
        self.startup = self.output()  # what it printed until it listened

    def output(self):
        with open(self.log_path, "rb") as f:
            return f.read()

    def conn(self, timeout=60):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def metrics(self):
        c = self.conn()
        c.request("GET", "/metrics")
        data = c.getresponse().read().decode()
        c.close()
        return {k: float(v) for k, v in (l.rsplit(" ", 1) for l in data.splitlines() if l and not l.startswith("#"))}

    def hwm_kib(self):
        """The server's peak resident memory so far (VmHWM), KiB."""
        with open(f"/proc/{self.p.pid}/status") as f:
            return int(re.search(r"VmHWM:\s*(\d+) kB", f.read()).group(1))

    def stop(self):
        if self.p.poll() is None:
            self.p.terminate()
        try:
            rc = self.p.wait(20)
        except subprocess.TimeoutExpired:
            self.p.kill()
            rc = self.p.wait()
        self.log.close()
        return rc


def serve_built(moetax, what="this test"):
    """Whether this moetax has `serve` (libmicrohttpd); prints a SKIP line naming what is skipped when not."""
    probe = subprocess.run([moetax, "serve", "--port", "-1"], capture_output=True, text=True, timeout=60)
    if "built without libmicrohttpd" in probe.stderr:
        print(f"SKIP ({what}): this moetax was built without libmicrohttpd")
        return False
    return True
