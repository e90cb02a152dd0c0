#!/usr/bin/env python3
# ctest-labels: unit;model;threads
# ctest-cost: 20
"""test_server_slowloris.py - `moetax serve`'s request deadline, idle timeout and half-closed clients.

Usage: test_server_slowloris.py MOETAX WORKDIR. Standard library only; servers on 127.0.0.1, port 0.

  - --read-timeout: --max-conn connections that send part of a header and then a byte every 0.3 s
    hold every slot; they are closed at the deadline (not before), and a normal request that waited
    for a slot is answered soon after. A request that trickles in but is whole within the deadline,
    a stream and a non-streaming answer that take longer than the deadline, and a kept-alive
    connection's next request after them are not cut; a kept-alive connection left idle is closed
    at the deadline.
  - --timeout: an idle connection is closed; a stream that waited in the queue longer than the
    timeout is not (the time the server spends is not the client being idle).
  - A client that half-closes (shutdown(SHUT_WR), as `nc -N` does) after its request gets its whole
    stream; a stream's client that closes while its request waits in the queue leaves the queue at
    once; a half-closed client of a non-streaming request is taken as gone (on the wire its FIN is a
    close's, and nothing can be written before the answer to tell them apart).
  - bad --read-timeout / --timeout values are usage errors naming the option.
"""
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ref"))
from checks import SANITIZERS, check, long_skipped, summary  # noqa: E402  (tests/ref/checks.py)
from serve_proc import ServeProc, serve_built  # noqa: E402  (tests/ref/serve_proc.py)
from checks import SLOW as LONG_CHECKS  # noqa: E402

MOETAX = os.path.abspath(sys.argv[1])
WORK = os.path.abspath(sys.argv[2])
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(REPO, "models", "pycode-20m-q8_0.gguf")
SLOW = 4 if os.environ.get("MOETAX_SANITIZED") == "1" else 1  # margins (not deadlines) under the sanitizers


class Server(ServeProc):
    def __init__(self, *args, name, env=None):
        super().__init__(MOETAX, MODEL, WORK, f"slowloris-{name}", *args, env=env)

    def wait_metric(self, name, want, timeout):
        deadline = time.time() + timeout
        v = None
        while time.time() < deadline:
            v = self.metrics()[name]
            if v == want:
                return v
            time.sleep(0.02)
        return v


def raw_request(body, path="/v1/completions"):
    b = json.dumps(body).encode()
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(b), b))


def read_all(sk, limit):
    """Everything the server sends until it closes (or limit seconds): (bytes, how it ended)."""
    got, end = b"", "open"
    sk.settimeout(0.2)
    deadline = time.time() + limit
    while time.time() < deadline:
        try:
            d = sk.recv(65536)
        except socket.timeout:
            continue
        except OSError as e:
            end = f"error {e.__class__.__name__}"
            break
        if not d:
            end = "closed"
            break
        got += d
    return got, end


def closed_within(sk, limit):
    """Seconds until the server closed sk (None: still open after limit)."""
    t0 = time.time()
    _, end = read_all(sk, limit)
    return time.time() - t0 if end != "open" else None


def stream_events(resp):
    """The events of a streaming http.client response, parsed (and '[DONE]')."""
    buf, events = b"", []
    while True:
        chunk = resp.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            for line in ev.split(b"\n"):
                if line.startswith(b"data: "):
                    d = line[6:].decode()
                    events.append(d if d == "[DONE]" else json.loads(d))
    return events


def n_text_events(events):
    return sum(1 for e in events if e != "[DONE]" and e.get("choices") and e["choices"][0].get("text"))


READ_TIMEOUT = 2
MAX_CONN = 8
LONG = 230  # tokens: at 20 ms a step, twice the deadline (the model's context is 256 positions)


def test_slowloris(s):
    """MAX_CONN trickling connections: closed at the deadline; a normal request gets through."""
    ended = [None] * MAX_CONN
    t_start = [0.0] * MAX_CONN
    stop = threading.Event()

    def trickle(i):
        sk = socket.create_connection(("127.0.0.1", s.port), timeout=10)
        t_start[i] = time.time()
        sk.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        sk.setblocking(False)
        while not stop.is_set():
            try:
                sk.send(b"a")
                if sk.recv(1) == b"":  # end of file: closed by the server
                    ended[i] = time.time() - t_start[i]
                    break
            except BlockingIOError:
                pass
            except OSError:  # reset: closed by the server
                ended[i] = time.time() - t_start[i]
                break
            stop.wait(0.3)
        sk.close()

    ts = [threading.Thread(target=trickle, args=(i,)) for i in range(MAX_CONN)]
    for t in ts:
        t.start()
    time.sleep(0.5)
    # a client that retries: at --max-conn, libmicrohttpd accepts and closes at once
    t0 = time.time()
    tries = 0
    while True:
        tries += 1
        try:
            c = s.conn(timeout=max(0.1, t0 + READ_TIMEOUT + 4 * SLOW - time.time()))
            c.request("POST", "/v1/completions", body=json.dumps({"prompt": "def f(", "max_tokens": 2}),
                      headers={"Content-Type": "application/json"})
            st = c.getresponse().status
            c.close()
            break
        except OSError as e:
            st = f"{e.__class__.__name__}: {e}"
            if time.time() > t0 + READ_TIMEOUT + 4 * SLOW:
                break
            time.sleep(0.05)
    took = time.time() - t0
    check(st == 200, f"a request behind {MAX_CONN} trickling connections (--max-conn {MAX_CONN}, --read-timeout "
                     f"{READ_TIMEOUT}): {st} after {took:.1f} s and {tries} tries")
    check(took > READ_TIMEOUT - 0.5 - 0.2, f"it was answered after {took:.2f} s: the trickling connections did not "
                                           f"hold every slot (the test does not test what it should)")
    until = t0 + READ_TIMEOUT + 4 * SLOW
    for t in ts:
        t.join(max(0, until - time.time()))
    stop.set()
    for t in ts:
        t.join(5)
    cut = [e for e in ended if e is not None]
    check(len(cut) == MAX_CONN, f"trickling connections closed: {len(cut)} of {MAX_CONN} ({ended})")
    check(all(READ_TIMEOUT - 0.05 <= e <= READ_TIMEOUT + 1.0 * SLOW for e in cut),
          f"closed at the deadline ({READ_TIMEOUT} s): after {[round(e, 2) for e in cut]} s")
    n = s.metrics()["moetax_http_read_timeouts_total"]
    check(n >= MAX_CONN, f"moetax_http_read_timeouts_total {n}, want >= {MAX_CONN}")
    print(f"  {MAX_CONN} trickling connections closed after {min(cut or [0]):.2f}-{max(cut or [0]):.2f} s; "
          f"the request behind them answered after {took:.2f} s ({tries} tries)")


def test_not_cut(s):
    """Slow requests that are whole in time, and answers longer than the deadline, are not cut."""
    res = {}

    def long_stream():
        c = s.conn()
        c.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                  body=json.dumps({"prompt": "import os\n", "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
                                   "stream": True}))
        t0 = time.time()
        r = c.getresponse()
        ev = stream_events(r) if r.status == 200 else []
        res["stream"] = (r.status, ev, time.time() - t0)
        # the same connection, kept alive past the deadline since its accept: its next request
        # has a deadline of its own
        c.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                  body=json.dumps({"prompt": "x", "max_tokens": 2}))
        r = c.getresponse()
        r.read()
        res["keepalive"] = r.status
        # left idle, the kept-alive connection is closed at the deadline
        res["idle_closed"] = closed_within(c.sock, READ_TIMEOUT + 2 * SLOW)
        c.close()

    def long_plain():
        c = s.conn()
        t0 = time.time()
        c.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                  body=json.dumps({"prompt": "def main(", "max_tokens": LONG, "temperature": 0, "ignore_eos": True}))
        r = c.getresponse()
        j = json.loads(r.read())
        res["plain"] = (r.status, j.get("usage", {}).get("completion_tokens"), time.time() - t0)
        c.close()

    def slow_in_time():
        """headers and body in 12 pieces over ~1.2 s: whole within the 2 s deadline"""
        req = raw_request({"prompt": "def g(", "max_tokens": 4, "temperature": 0})
        sk = socket.create_connection(("127.0.0.1", s.port), timeout=30)
        t0 = time.time()
        k = (len(req) + 11) // 12
        for i in range(0, len(req), k):
            sk.sendall(req[i:i + k])
            time.sleep(0.1)
        res["slow_sent"] = time.time() - t0
        got, end = read_all(sk, 30)
        res["slow"] = got[:15]
        sk.close()

    ts = [threading.Thread(target=f) for f in (long_stream, long_plain, slow_in_time)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60 * SLOW)
    st, ev, took = res.get("stream", (None, [], 0))
    check(st == 200 and ev and ev[-1] == "[DONE]" and n_text_events(ev) >= 1
          and ev[-2]["choices"][0]["finish_reason"] == "length",
          f"a stream of {LONG} tokens: {st}, {len(ev)} events, ends {ev[-2:] if ev else None}")
    check(took > READ_TIMEOUT, f"the stream took {took:.2f} s, not longer than the deadline: the test tests nothing")
    st, n, took2 = res.get("plain", (None, None, 0))
    check(st == 200 and n == LONG, f"a non-streaming answer of {LONG} tokens: {st}, {n} tokens")
    check(took2 > READ_TIMEOUT, f"the non-streaming answer took {took2:.2f} s, not longer than the deadline")
    check(res.get("keepalive") == 200, f"the kept-alive connection's next request: {res.get('keepalive')}")
    idle = res.get("idle_closed")
    check(idle is not None and READ_TIMEOUT - 0.1 <= idle <= READ_TIMEOUT + 1.0 * SLOW,
          f"an idle kept-alive connection closed after {idle} s, want about {READ_TIMEOUT}")
    check(res.get("slow", b"").startswith(b"HTTP/1.1 200"),
          f"a request sent in pieces over {res.get('slow_sent', 0):.2f} s (deadline {READ_TIMEOUT} s): {res.get('slow')!r}")
    print(f"  not cut: a stream of {took:.2f} s, a non-streaming answer of {took2:.2f} s, a request sent over "
          f"{res.get('slow_sent', 0):.2f} s; an idle kept-alive connection closed after {idle and round(idle, 2)} s")


def test_half_close(s):
    """shutdown(SHUT_WR) after the request: a stream still gets everything."""
    sk = socket.create_connection(("127.0.0.1", s.port), timeout=30)
    sk.sendall(raw_request({"prompt": "class A:", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                            "stream": True}))
    sk.shutdown(socket.SHUT_WR)
    got, end = read_all(sk, 30)
    sk.close()
    check(got.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in got and got.count(b'"text"') >= 2,
          f"a half-closed client's stream: {end}, {len(got)} bytes, ends {got[-60:]!r}")
    # a half-closed non-streaming client cannot be told from one that left: its request is cancelled
    before = s.metrics()["moetax_requests_cancelled_total"]
    sk = socket.create_connection(("127.0.0.1", s.port), timeout=30)
    sk.sendall(raw_request({"prompt": "class B:", "max_tokens": LONG, "temperature": 0, "ignore_eos": True}))
    sk.shutdown(socket.SHUT_WR)
    got, end = read_all(sk, 30)
    sk.close()
    n = s.wait_metric("moetax_requests_cancelled_total", before + 1, 5)
    check(got == b"" and n == before + 1, f"a half-closed non-streaming client is taken as gone: got {got[:40]!r}, "
                                          f"{n - before} requests cancelled")


def test_gone_from_queue(s):
    """Both slots busy; a queued stream's client reads the response's headers and closes (a FIN, as a
    half-close's): the comment written to it draws a reset, and the request leaves the queue at once."""
    def bg(prompt):
        c = s.conn()
        c.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                  body=json.dumps({"prompt": prompt, "max_tokens": 100, "ignore_eos": True, "stream": True}))
        stream_events(c.getresponse())
        c.close()

    ts = [threading.Thread(target=bg, args=(p,)) for p in ("a = 1\n", "b = 2\n")]
    for t in ts:
        t.start()
    check(s.wait_metric("llamacpp:requests_processing", 2, 10) == 2, "two requests run")
    sk = socket.create_connection(("127.0.0.1", s.port), timeout=30)
    sk.sendall(raw_request({"prompt": "c = 3\n", "max_tokens": 8, "stream": True}))
    got = b""
    while b"\r\n\r\n" not in got:
        got += sk.recv(4096)
    check(s.wait_metric("llamacpp:requests_deferred", 1, 5) == 1, "the third waits in the queue")
    t0 = time.time()
    sk.close()
    left = s.wait_metric("llamacpp:requests_deferred", 0, 2 * SLOW)
    took = time.time() - t0
    check(left == 0 and any(t.is_alive() for t in ts),
          f"the queued stream whose client closed left the queue while the others ran: deferred {left} "
          f"after {took:.2f} s")
    for t in ts:
        t.join(60 * SLOW)


def test_idle_timeout():
    """--timeout 1 (and no request deadline): an idle connection is closed; a stream that waits in the
    queue longer than that, and the one before it, are not."""
    s = Server("--timeout", "1", "--read-timeout", "0", "--parallel", "1", name="idle",
               env={"MOETAX_TEST_STEP_DELAY_US": "10000"})
    try:
        idle = socket.create_connection(("127.0.0.1", s.port), timeout=10)
        res = {}

        def stream(key, prompt):
            c = s.conn()
            t0 = time.time()
            c.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                      body=json.dumps({"prompt": prompt, "max_tokens": 150, "ignore_eos": True, "stream": True}))
            try:
                r = c.getresponse()
                ev = stream_events(r)
            except (OSError, http.client.HTTPException) as e:
                ev = [f"{e.__class__.__name__}"]
            res[key] = (ev, time.time() - t0)
            c.close()

        t1 = threading.Thread(target=stream, args=("first", "x = 1\n"))
        t1.start()
        s.wait_metric("llamacpp:requests_processing", 1, 10)
        t2 = threading.Thread(target=stream, args=("queued", "y = 2\n"))
        t2.start()
        gone = closed_within(idle, 1 + 2.5 * SLOW)
        idle.close()
        check(gone is not None, "--timeout 1: an idle connection was not closed")
        t1.join(60 * SLOW)
        t2.join(60 * SLOW)
        for key in ("first", "queued"):
            ev, took = res.get(key, ([], 0))
            check(ev and ev[-1] == "[DONE]" and n_text_events(ev) >= 1,
                  f"--timeout 1: the {key} stream ({took:.2f} s) was cut: {len(ev)} events, ends {ev[-2:]}")
        check(res.get("queued", ([], 0))[1] > 2, "the queued stream did not wait longer than the timeout: the test "
                                                 "tests nothing")
        print(f"  --timeout 1: an idle connection closed after {gone and round(gone, 2)} s; a stream that waited "
              f"{res.get('queued', ([], 0))[1]:.2f} s in all got its whole answer")
    finally:
        check(s.stop() == 0, "the idle-timeout server did not exit 0")


def test_option_errors():
    for args, name in ((["--read-timeout", "-1"], "--read-timeout"), (["--read-timeout", "1.5"], "--read-timeout"),
                       (["--read-timeout", "86401"], "--read-timeout"), (["--read-timeout"], "--read-timeout"),
                       (["--timeout", "x"], "--timeout"), (["-to", "-5"], "--timeout"), (["--timeout="], "--timeout")):
        r = subprocess.run([MOETAX, "serve", "-m", MODEL, *args], capture_output=True, text=True, timeout=60)
        check(r.returncode == 2 and name in r.stderr and "seconds" in r.stderr,
              f"serve {' '.join(args)}: rc {r.returncode}, {r.stderr.strip()!r}")


def main():
    os.makedirs(WORK, exist_ok=True)
    if not serve_built(MOETAX):
        return 0
    t0 = time.time()
    test_option_errors()
    s = Server("--max-conn", str(MAX_CONN), "--read-timeout", str(READ_TIMEOUT), "--timeout", "60", "--parallel", "2",
               name="deadline", env={"MOETAX_TEST_STEP_DELAY_US": "20000"})
    # under ThreadSanitizer the cases that wait out deadlines and streams (about 30 s there) are long
    # checks: the sweeper's threads run in the others, and the release and ASan runs time them all
    tsan_quick = "thread" in SANITIZERS and not LONG_CHECKS
    try:
        for name, fn in (("slowloris", lambda: test_slowloris(s)), ("not cut", lambda: test_not_cut(s)),
                         ("half-close", lambda: test_half_close(s)), ("gone from the queue", lambda: test_gone_from_queue(s))):
            if tsan_quick and name == "not cut":
                long_skipped(f"{name} under ThreadSanitizer")
                continue
            t = time.time()
            fn()
            print(f"  {name}: {time.time() - t:.2f} s", flush=True)
    finally:
        check(s.stop() == 0, "the deadline server did not exit 0")
    t = time.time()
    if tsan_quick:
        long_skipped("idle timeout under ThreadSanitizer")
    else:
        test_idle_timeout()
        print(f"  idle timeout: {time.time() - t:.2f} s", flush=True)
    print(f"test_server_slowloris: {time.time() - t0:.1f} s")
    return summary()


if __name__ == "__main__":
    sys.exit(main())
