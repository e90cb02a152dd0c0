#!/usr/bin/env python3
# ctest-labels: unit;model
# ctest-cost: 3
"""test_server_hostile.py - `moetax serve` against requests built to hurt it, over raw sockets.

Usage: test_server_hostile.py MOETAX WORKDIR. Standard library only; servers on 127.0.0.1, port 0: one with
--chat-template chatml and --read-timeout 1 for most cases, one with --chat-template mistral-v7 (both with
MOETAX_SERVE_DEBUG=1, so that libmicrohttpd's own messages reach their logs).

  - a body of a million bytes made of empty objects (or of numbers) is refused with a 400 before it is
    parsed, and does not raise the server's peak memory (VmHWM) by the 80 bytes per body byte that
    Jansson's objects cost; brackets inside strings are not counted, and a request with a few thousand
    messages still passes.
  - two Content-Length headers (equal or not), Content-Length with Transfer-Encoding: chunked, and a
    transfer coding other than chunked are refused (400, 501) and the connection closed: a request
    pipelined after them is not answered.
  - a request with 16 KB of headers (the limit) gets its answer (once such requests ran and got none:
    headers that nearly filled libmicrohttpd's memory pool left no room for it); 20 KB of headers, or
    300 headers, are a 431 before anything runs (prompt tokens unchanged).
  - a chunked body that passes --max-body gets its 413 at once, and the connection closed, while the
    client goes on sending (it came only after the last chunk).
  - of three connections closed by --read-timeout (one silent, one kept alive after an answer, one with
    a request begun), moetax_http_read_timeouts_total counts the last and moetax_http_idle_closed_total
    the others; serve --help says that the deadline closes an idle kept-alive connection.
  - a chat message's role must be system, user, assistant or tool (400 naming messages[i].role), and
    tool only with a template that writes it (ChatML, not Mistral v7); content that spells a control
    token becomes that token, a completion's prompt stays plain text (as the README says).
  - libmicrohttpd says nothing while the server starts (with MOETAX_SERVE_DEBUG=1).
"""
import json
import os
import re
import random
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ref"))
from checks import SANITIZERS, check, summary  # noqa: E402  (tests/ref/checks.py)
from serve_proc import ServeProc, serve_built  # noqa: E402  (tests/ref/serve_proc.py)

MOETAX = os.path.abspath(sys.argv[1])
WORK = os.path.abspath(sys.argv[2])
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(REPO, "models", "pycode-20m-q8_0.gguf")
READ_TIMEOUT = 1
MAX_BODY = 1 << 20  # --max-body's default


class Server(ServeProc):
    def __init__(self, *args, name):
        super().__init__(MOETAX, MODEL, WORK, f"hostile-{name}", *args, env={"MOETAX_SERVE_DEBUG": "1"})

    def exchange(self, data, timeout=10):
        """Send data on a new connection; the responses that come back, and whether the server then
        closed the connection (see read_responses)."""
        sk = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        try:
            sk.sendall(data)
        except OSError:
            pass
        try:
            return read_responses(sk, timeout)
        finally:
            sk.close()

    def healthy(self):
        try:
            r, _ = self.exchange(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return bool(r) and r[0][0] == 200
        except OSError:
            return False


def read_responses(sk, timeout):
    """Parse HTTP responses off sk until the server closes it or sends nothing more for `timeout` s:
    ([(status, headers, body)], closed)."""
    buf, out, closed = b"", [], False
    sk.settimeout(timeout)

    def more():
        nonlocal buf, closed
        if closed:
            return False
        try:
            d = sk.recv(65536)
        except socket.timeout:
            return False
        except OSError:
            closed = True
            return False
        if not d:
            closed = True
            return False
        buf += d
        return True

    while True:
        while b"\r\n\r\n" not in buf:
            if not more():
                return out, closed
        head, buf = buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {}
        for l in lines[1:]:
            k, v = l.split(":", 1)
            headers[k.strip().lower()] = v.strip()
        body = b""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                while b"\r\n" not in buf:
                    if not more():
                        return out + [(status, headers, body)], closed
                size_line, buf = buf.split(b"\r\n", 1)
                n = int(size_line.split(b";")[0], 16)
                while len(buf) < n + 2:
                    if not more():
                        return out + [(status, headers, body + buf)], closed
                body, buf = body + buf[:n], buf[n + 2:]
                if n == 0:
                    break
        else:
            n = int(headers.get("content-length", "0"))
            while len(buf) < n:
                if not more():
                    break
            body, buf = buf[:n], buf[n:]
        out.append((status, headers, body))
        if not buf and not more():
            return out, closed


def post(path, body, extra=b"", keep_alive=False):
    """A POST request's bytes (Connection: close unless keep_alive); extra: more header lines."""
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
    if not keep_alive:
        extra += b"Connection: close\r\n"
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n%s"
            % (path.encode(), extra, len(body), body))


def error_message(resp):
    """The message of a {"error": {"message", "type", "code"}} body ('' when it is not one)."""
    try:
        e = json.loads(resp[2])["error"]
        return e["message"] if {"message", "type", "code"} <= set(e) else ""
    except (ValueError, KeyError, TypeError, IndexError):
        return ""


def test_json_containers(s):
    """A megabyte of empty objects (or numbers) is a 400 before Jansson parses it."""
    junk = b"[" + b"{}," * 340000 + b"{}]"
    body = b'{"prompt": "x", "max_tokens": 1, "junk": %s}' % junk
    r, _ = s.exchange(post("/v1/completions", body))
    msg = error_message(r[0]) if r else ""
    check(r and r[0][0] == 400 and "objects and arrays" in msg,
          f"a {len(body) >> 10} KiB body of empty objects: {r[0][0] if r else None} {msg!r}")
    body = b'{"prompt": "x", "max_tokens": 1, "junk": [%s0]}' % (b"0," * 500000)
    r, _ = s.exchange(post("/v1/completions", body))
    msg = error_message(r[0]) if r else ""
    check(r and r[0][0] == 400 and "values" in msg, f"a body of 500000 numbers: {r[0][0] if r else None} {msg!r}")
    # the peak memory of 4 such requests at once
    before = s.hwm_kib()
    res = []
    ts = [threading.Thread(target=lambda: res.append(s.exchange(post("/v1/completions", junk)))) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    grew = (s.hwm_kib() - before) >> 10
    check(len(res) == 4 and all(r and r[0][0] == 400 for r, _ in res), f"4 bodies of empty objects at once: {res}")
    if not SANITIZERS:  # the sanitizers' allocator keeps freed memory in quarantine
        check(grew < 40, f"4 bodies of 1 MB of empty objects at once raised the server's peak memory by {grew} MiB")
    print(f"  4 x 1 MB of empty objects at once: VmHWM +{grew} MiB")
    # brackets, commas and escaped quotes inside strings are not counted
    r, _ = s.exchange(post("/v1/completions", {"prompt": '{[,\\"' * 20000, "max_tokens": 1}))
    check(r and r[0][0] in (200, 400) and "JSON" not in error_message(r[0]),
          f"a prompt of 100000 brackets, commas and quotes: {r[0][0] if r else None} {error_message(r[0]) if r else ''}")
    # what a real request needs still passes: 2048 messages, each with a content part
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": [{"type": "text", "text": "a"}]}
            for i in range(2048)]
    r, _ = s.exchange(post("/v1/chat/completions", {"messages": msgs, "max_tokens": 1}))
    check(r and r[0][0] in (200, 400) and "refused unparsed" not in error_message(r[0]),
          f"2048 messages with content parts: {r[0][0] if r else None} {error_message(r[0]) if r else ''}")
    # the most messages a request may have, each with two content parts
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            for _ in range(4096)]
    r, _ = s.exchange(post("/v1/chat/completions", {"messages": msgs, "max_tokens": 1}))
    check(r and r[0][0] in (200, 400) and "refused unparsed" not in error_message(r[0]),
          f"4096 messages with two content parts: {r[0][0] if r else None} {error_message(r[0]) if r else ''}")
    # an agent's tools (ignored by the server) with large schemas: 128 tools of 20 enum properties
    tools = [{"type": "function", "function": {"name": f"f{t}", "description": "d", "parameters": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "enum": [f"v{k}" for k in range(25)]}
                                         for i in range(20)}}}} for t in range(128)]
    r, _ = s.exchange(post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                                    "max_tokens": 1}))
    check(r and r[0][0] == 200, f"128 tools with large schemas: {r[0][0] if r else None} "
                                f"{error_message(r[0]) if r else ''}")


def test_framing(s):
    """Bodies whose length two readers could take differently (request smuggling): a 400 (501 for an
    unknown transfer coding) and the connection closed, so the bytes after it are never a request."""
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    cases = (
        ("two equal Content-Lengths", b"Content-Length: %d\r\nContent-Length: %d\r\n\r\n%s" % (len(body), len(body), body),
         400, "Content-Length"),
        ("two different Content-Lengths", b"Content-Length: %d\r\ncontent-length: 5\r\n\r\n%s" % (len(body), body),
         400, "Content-Length"),
        ("Content-Length and chunked", b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n%s" % (len(body), chunked),
         400, "Transfer-Encoding"),
        ("chunked and Content-Length", b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n%s" % chunked,
         400, "Transfer-Encoding"),
        ("a transfer coding other than chunked", b"Transfer-Encoding: gzip\r\n\r\n%s" % body, 501, "chunked"),
        # libmicrohttpd keeps the space in the name, so it read no length at all and took the body
        # for the next request (before: a 400 for the empty body, then /health answered from it)
        ("Content-Length with a space before its colon", b"Content-Length : %d\r\n\r\n%s" % (len(health), health),
         400, "space or tab"),
        ("Transfer-Encoding with a space before its colon",
         b"Transfer-Encoding : chunked\r\nContent-Length: 4\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(health), health),
         400, "space or tab"),
        # a client's error, not the server's (these were a 501 server_error)
        ("chunked with a trailing space", b"Transfer-Encoding: chunked \r\n\r\n%s" % chunked, 400, "white space"),
        ("an empty Transfer-Encoding", b"Transfer-Encoding: \r\n\r\n%s" % chunked, 400, "empty"),
        ("a coding list with a space after its comma", b"Transfer-Encoding: gzip, chunked\r\n\r\n%s" % chunked, 501,
         "chunked"),
        # a compressed body was parsed as JSON
        ("a gzip Content-Encoding", b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
         415, "uncompressed"),
    )
    for name, rest, want, word in cases:
        t0 = time.time()
        r, closed = s.exchange(head + rest + health, timeout=5)
        took = time.time() - t0
        check(len(r) == 1 and r[0][0] == want and word in error_message(r[0]) and r[0][1].get("connection") == "close"
              and closed and took < READ_TIMEOUT,
              f"{name}: want one {want} naming {word} and the connection closed at once, got "
              f"{[(x[0], error_message(x)) for x in r]}, {'closed' if closed else 'open'} after {took:.2f} s")
    # one Content-Length, or chunked alone, is still fine on a kept-alive connection
    health = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    r, _ = s.exchange(head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body) + health, timeout=5)
    check([x[0] for x in r] == [200, 200], f"a request and /health on one connection: {[x[0] for x in r]}")
    r, _ = s.exchange(head + b"Transfer-Encoding: chunked\r\n\r\n%s" % chunked + health, timeout=5)
    check([x[0] for x in r] == [200, 200], f"a chunked request and /health on one connection: {[x[0] for x in r]}")
    # a target in absolute form (RFC 9112 3.2.2: a server must accept it) is routed by its path (it was a 404)
    r, _ = s.exchange(b"GET http://127.0.0.1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", timeout=5)
    check([x[0] for x in r] == [200], f"GET http://host/health: {[x[0] for x in r]}")


def test_big_headers(s):
    """Headers that nearly fill libmicrohttpd's memory pool left no room for the answer: the request ran
    its whole generation and then got nothing. Now headers under the limit get their answer, headers
    over it a 431 before anything runs, and the server stays healthy."""
    def one(name, hdrs, stream=False, path="/v1/completions", raw=None):
        # prompt tokens are counted when the prompt is prefilled, before the answer (a finished request
        # is counted after it, so moetax_requests_total can lag the client), at least 1 for a cached prompt
        before = s.metrics()["llamacpp:prompt_tokens_total"]
        req = raw or post(path, {"prompt": "def f(", "max_tokens": 4, "stream": stream}, extra=hdrs)
        r, closed = s.exchange(req, timeout=10)
        ran = s.metrics()["llamacpp:prompt_tokens_total"] - before
        return r, closed, ran

    for stream in (False, True):
        # 16384 bytes in all with the request's own headers (post's: Host, Content-Type, Content-Length)
        r, _, _ = one("16 KB", b"X-Pad: " + b"a" * 16200 + b"\r\n", stream)
        check(len(r) == 1 and r[0][0] == 200 and (b"[DONE]" in r[0][2] if stream else json.loads(r[0][2])["choices"]),
              f"a request with 16 KB of headers (stream {stream}): {[(x[0], x[2][:80]) for x in r]}")
    for name, hdrs, ours in (("20 KB of headers", b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * 990) for i in range(20)), True),
                             ("300 headers", b"".join(b"X-P%d: a\r\n" % i for i in range(300)), True),
                             ("200 KB of headers", b"X-Pad: " + b"a" * 200000 + b"\r\n", False)):
        r, closed, ran = one(name, hdrs)
        # past the memory pool libmicrohttpd answers its own 431 (HTML)
        check(len(r) == 1 and r[0][0] == 431 and (not ours or "headers" in error_message(r[0])) and closed
              and ran == 0, f"a request with {name}: {[(x[0], x[2][:80]) for x in r]}, "
                            f"{'closed' if closed else 'open'}, prompt tokens +{ran}")
    # libmicrohttpd keeps every cookie, query argument and trailer in the pool too: before, ~2000 query
    # arguments, ~1700 cookies or ~1800 trailers ran the request and left no room for its answer
    # (our 431 while they are past the limits but fit the pool; past the pool libmicrohttpd answers its own
    # 431 or closes: either way the request never runs)
    body = json.dumps({"prompt": "def f(", "max_tokens": 4}).encode()

    def trailed(n):
        return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n"
                b"\r\n%x\r\n%s\r\n0\r\n%s\r\n" % (len(body), body, b"".join(b"t%d: v\r\n" % i for i in range(n))))
    for n_args, n_cookies, n_trailers, ours in ((400, 400, 300, True), (2000, 1700, 1800, False)):
        for name, kw in ((f"{n_args} query arguments", {"path": "/v1/completions?" + "&".join(["a"] * n_args)}),
                         (f"{n_cookies} cookies",
                          {"hdrs": b"Cookie: " + b"; ".join(b"a=%d" % i for i in range(n_cookies)) + b"\r\n"}),
                         (f"{n_trailers} trailers", {"raw": trailed(n_trailers)})):
            r, closed, ran = one(name, kw.get("hdrs", b""), path=kw.get("path", "/v1/completions"), raw=kw.get("raw"))
            check(closed and ran == 0 and (not ours or (len(r) == 1 and r[0][0] == 431
                                                        and "headers" in error_message(r[0]))),
                  f"a request with {name}: {[(x[0], x[2][:80]) for x in r]}, {'closed' if closed else 'open'}, "
                  f"prompt tokens +{ran} (want {'our 431 and ' if ours else ''}nothing run)")
    r, _, ran = one("a few query arguments and cookies", b"Cookie: a=1; b=2\r\n", path="/v1/completions?x=1&y=2")
    check(len(r) == 1 and r[0][0] == 200 and ran >= 1, f"a request with a few query arguments and cookies: "
                                                      f"{[(x[0], x[2][:80]) for x in r]}, prompt tokens +{ran}")
    check(s.healthy(), "after requests with big headers: /health")


def test_chunked_over(s):
    """A chunked body past --max-body: a 413 as soon as it passes, and the connection closed, while the
    client is still sending (and goes on sending, as a naive one does)."""
    sk = socket.create_connection(("127.0.0.1", s.port), timeout=10)
    sk.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n")
    piece = b"a" * (64 << 10)
    try:
        for _ in range(MAX_BODY // len(piece) + 1):
            sk.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        t0 = time.time()
        for _ in range(4):  # the client does not look yet: 256 KiB more, and no last chunk
            sk.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        r, closed = read_responses(sk, 5)
        took = time.time() - t0
        # the server now reads and drops what this client still sends until it closes (at most a
        # second): meanwhile the one HTTP thread serves everyone else
        t1 = time.time()
        ok = s.healthy()
        check(ok and time.time() - t1 < 0.5, f"/health beside a refused client that has not closed: {ok} after "
                                             f"{time.time() - t1:.2f} s (want at once)")
    except OSError as e:
        r, closed, took = [], f"{e.__class__.__name__}", 0
    sk.close()
    check(len(r) == 1 and r[0][0] == 413 and "--max-body" in error_message(r[0])
          and r[0][1].get("connection") == "close" and closed is True and took < READ_TIMEOUT,
          f"a chunked body past --max-body: {[(x[0], error_message(x)) for x in r]}, closed {closed} after "
          f"{took:.2f} s (want a 413 and a close at once)")
    check(s.healthy(), "after a chunked body past --max-body: /health")


def test_big_prompts(s):
    """Prompts near --max-body are parsed and tokenized off the HTTP loop (by its prep thread): /health
    answers at once while three of them are, not after them."""
    rng = random.Random(7)
    text = " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
                    for _ in range(110000))
    body = json.dumps({"prompt": text, "max_tokens": 1}).encode()
    check(64 << 10 < len(body) < MAX_BODY, f"the test's body is {len(body)} bytes")
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
           b"Connection: close\r\n\r\n" % len(body)) + body
    done = []

    def big():
        t = time.time()
        r, _ = s.exchange(req, timeout=120)
        done.append((time.time() - t, r))

    ths = [threading.Thread(target=big) for _ in range(3)]
    for t in ths:
        t.start()
    lat = []
    while any(t.is_alive() for t in ths):
        t = time.time()
        ok = s.healthy()
        lat.append(time.time() - t)
        check(ok, "/health while large prompts are prepared")
        time.sleep(0.002)
    for t in ths:
        t.join()
    statuses = [r[0][0] if r else None for _, r in done]
    check(statuses == [400] * 3 and all("positions" in error_message(r[0]) for _, r in done),
          f"the large prompts (longer than the context): {statuses}")
    longest = max(t for t, _ in done)
    print(f"  big prompts: /health max {1e3 * max(lat):.1f} ms over {len(lat)}, prompts {1e3 * longest:.0f} ms")
    check(len(lat) >= 3 and max(lat) < longest / 4, f"/health took up to {1e3 * max(lat):.1f} ms ({len(lat)} requests) "
          f"while the large prompts took {1e3 * longest:.0f} ms (want a small part of it)")


def test_read_timeout_counts(s):
    """--read-timeout closes a connection that sent nothing, one that is kept alive and idle after an
    answer, and one whose request began but did not finish: only the last is a read timeout in
    /metrics; the other two are idle connections closed."""
    m0 = s.metrics()
    socks = [socket.create_connection(("127.0.0.1", s.port), timeout=10) for _ in range(3)]
    nothing, kept, begun = socks
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    begun.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n")
    res = [read_responses(sk, READ_TIMEOUT + 3) for sk in socks]
    for sk in socks:
        sk.close()
    check(all(closed for _, closed in res) and [len(r) for r, _ in res] == [0, 1, 0],
          f"three connections closed by the deadline: {[([x[0] for x in r], closed) for r, closed in res]}")
    m = s.metrics()
    cut = m["moetax_http_read_timeouts_total"] - m0["moetax_http_read_timeouts_total"]
    idle = m.get("moetax_http_idle_closed_total", 0) - m0.get("moetax_http_idle_closed_total", 0)
    check(cut == 1 and idle == 2, f"read timeouts +{cut} (want 1: the request begun), idle connections closed "
                                  f"+{idle} (want 2)")
    h = subprocess.run([MOETAX, "serve", "--help"], capture_output=True, text=True, timeout=60).stdout
    check(re.search(r"--read-timeout S[^-]*kept-alive", h) is not None,
          "serve --help does not say that --read-timeout closes an idle kept-alive connection")


def chat(s, msgs, **kw):
    r, _ = s.exchange(post("/v1/chat/completions", dict({"messages": msgs, "max_tokens": 1, "temperature": 0}, **kw)))
    return (r[0][0], error_message(r[0]), json.loads(r[0][2]) if r[0][0] == 200 else None) if r else (None, "", None)


def test_roles(s, mistral):
    """A message role the template cannot render is a 400 naming the field; tool only where a template
    writes the role's name (ChatML here; not Mistral, which took it for the assistant)."""
    for role in ("robot", "function", "User", ""):
        st, msg, _ = chat(s, [{"role": "user", "content": "hi"}, {"role": role, "content": "x"}])
        check(st == 400 and "messages[1].role" in msg, f"role {role!r}: {st} {msg!r}")
    for role in ("system", "user", "assistant", "tool", "developer"):
        st, msg, _ = chat(s, [{"role": role, "content": "x"}, {"role": "user", "content": "hi"}])
        check(st == 200, f"role {role!r} with ChatML: {st} {msg!r}")
    # developer (OpenAI's newer name) is rendered as system: the same prompt, token for token, so the
    # system request right after it reuses all of its cells but the last token's (prefix reuse), and
    # a user request after that, whose turn differs from the role's name on, does not
    u = [chat(s, [{"role": role, "content": "be brief"}, {"role": "user", "content": "hi"}])[2]["usage"]
         for role in ("developer", "system", "user")]
    n = [(x["prompt_tokens"], x["prompt_tokens_details"]["cached_tokens"]) for x in u]
    check(n[1][1] == n[1][0] - 1 and n[2][1] < n[2][0] - 8,
          f"(prompt tokens, cached) with developer, then system, then user first: {n}")
    st, msg, _ = chat(mistral, [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}])
    check(st == 400 and "messages[1].role" in msg and "mistral-v7" in msg, f"role 'tool' with mistral-v7: {st} {msg!r}")
    st, msg, _ = chat(mistral, [{"role": "user", "content": "hi"}])
    check(st == 200, f"a user message with mistral-v7: {st} {msg!r}")
    # what the README says: message content that spells a control token becomes that token, as in
    # llama-server (this model has one: <|endoftext|>); a completion's prompt is plain text
    n = [chat(s, [{"role": "user", "content": c}])[2]["usage"]["prompt_tokens"] for c in ("<|endoftext|>", "<|endoftexx|>")]
    check(n[0] < n[1] - 3, f"a message spelling <|endoftext|>: {n[0]} prompt tokens, one that does not: {n[1]}")
    r, _ = s.exchange(post("/v1/completions", {"prompt": "<|endoftext|>", "max_tokens": 1}))
    check(r and r[0][0] == 200 and json.loads(r[0][2])["usage"]["prompt_tokens"] > 3,
          f"a completion's prompt <|endoftext|> is plain text: {r[0][2][:200] if r else None}")


def main():
    os.makedirs(WORK, exist_ok=True)
    if not serve_built(MOETAX):
        return 0
    t0 = time.time()
    s = Server("--chat-template", "chatml", "--read-timeout", str(READ_TIMEOUT), "--parallel", "2", name="main")
    mistral = Server("--chat-template", "mistral-v7", "--parallel", "1", name="mistral")
    # libmicrohttpd said nothing while it started (its logger was not the first option: a warning)
    noise = [l for l in s.startup.decode(errors="replace").splitlines() if not l.startswith("moetax serve: ")]
    check(not noise, f"the server's start-up output, besides its own lines: {noise}")
    try:
        for name, fn in (("json containers", test_json_containers), ("framing", test_framing),
                         ("roles", lambda s: test_roles(s, mistral)),
                         ("big headers", test_big_headers), ("chunked body over the limit", test_chunked_over),
                         ("big prompts", test_big_prompts),
                         ("read timeout counts", test_read_timeout_counts)):
            t = time.time()
            fn(s)
            print(f"  {name}: {time.time() - t:.2f} s", flush=True)
        check(s.healthy(), "the server does not answer /health after the hostile requests")
    finally:
        check(s.stop() == 0, "the server did not exit 0")
        check(mistral.stop() == 0, "the mistral-v7 server did not exit 0")
    print(f"test_server_hostile: {time.time() - t0:.1f} s")
    return summary()


if __name__ == "__main__":
    sys.exit(main())
