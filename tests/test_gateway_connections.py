"""Ordinary clients against the gateway's connection bounds (``guarded_protocol``: max_connections,
header_timeout_s, max_header_bytes): pipelining, keep-alive reuse, split heads, HTTP/1.0,
``Expect: 100-continue``, chunked bodies, long streams and slow upstreams, early answers before the
body is read, and the connection counter after every kind of close. Real sockets, httpx, aiohttp and
the ``openai`` client against the real gateway (uvicorn + httptools) in front of the scripted
upstream, real Redis and a real Kafka-protocol broker (fixtures of tests/test_gateway_bounds.py)."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from typing import Any

import orjson
import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests import helpers  # noqa: E402
from tests import test_gateway_bounds as bounds  # noqa: E402
from tests.scripted_upstream import Upstream  # noqa: E402
from tests.test_gateway_bounds import BODY, MESSAGES, MODEL, _answer, _closed, _request, client, metric  # noqa: E402
from watchdog.gateway.server import GatewayServer  # noqa: E402

pytestmark = [pytest.mark.services]
#: the fixtures of tests/test_gateway_bounds.py (a scripted upstream; a gateway parametrized by its settings)
upstream, gateway = bounds.upstream, bounds.gateway


def _statuses(data: bytes) -> list[int]:
    return [int(line.split(b" ")[1]) for line in data.split(b"\r\n") if line.startswith(b"HTTP/1.")]


def _read_responses(sock: socket.socket, n: int, timeout: float = 10.0) -> bytes:
    """Read until ``n`` whole responses (content-length framed) are in, or the socket closes."""
    sock.settimeout(timeout)
    data = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, rest = 0, data
        while True:
            head, sep, tail = rest.partition(b"\r\n\r\n")
            if not sep:
                break
            length, lower = 0, head.lower()
            for line in lower.split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            if b"transfer-encoding: chunked" in lower:
                end = tail.find(b"\r\n0\r\n\r\n") if not tail.startswith(b"0\r\n\r\n") else -2
                if end == -1:
                    break
                length = end + 7
            if len(tail) < length:
                break
            rest = tail[length:]
            if not head.startswith(b"HTTP/1.1 100"):
                done += 1
        if done >= n:
            return data
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, OSError):
            return data
        if not chunk:
            return data
        data += chunk
    return data


def _settled(srv: GatewayServer, baseline: int = 0) -> None:
    assert helpers.wait_until(lambda: srv.app.connections == baseline, 5), \
        f"app.connections {srv.app.connections}, baseline {baseline}"


@pytest.mark.parametrize("gateway", [{"header_timeout_s": 1.0}], indirect=True)
def test_pipelined_keep_alive_split_heads_http10_expect_and_chunked_are_served(gateway: GatewayServer) -> None:
    port = gateway.port
    # ten requests in one write (HTTP/1.1 pipelining)
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(_request(port) * 10)
    assert _statuses(_read_responses(s, 10)) == [200] * 10
    s.close()
    # a 300 KB body in the same segment as its head
    raw = orjson.dumps({**BODY, "user": "u" * 300_000})
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n" % len(raw) + raw)
    assert _statuses(_read_responses(s, 1)) == [200]
    s.sendall(_request(port))
    assert _statuses(_read_responses(s, 1)) == [200]
    s.close()
    # a head in 1-byte segments, all within the timeout
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    req = _request(port)
    head_len = req.index(b"\r\n\r\n") + 4
    for i in range(head_len):
        s.sendall(req[i:i + 1])
        time.sleep(0.004)
    s.sendall(req[head_len:])
    assert _statuses(_read_responses(s, 1)) == [200]
    s.close()
    # HTTP/1.0
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(_request(port).replace(b"HTTP/1.1", b"HTTP/1.0", 1))
    got = _answer(s)
    assert _statuses(got) == [200] and _closed(s)
    s.close()
    # Expect: 100-continue, the body sent after the 100
    s = socket.create_connection(("127.0.0.1", port))
    raw = orjson.dumps(BODY)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n" % len(raw))
    s.settimeout(5)
    assert s.recv(100).startswith(b"HTTP/1.1 100")
    s.sendall(raw)
    assert _statuses(_read_responses(s, 1)) == [200]
    s.close()
    # a chunked body in 3 pieces, 0.3 s apart
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"transfer-encoding: chunked\r\n\r\n")
    for i in range(0, len(raw), len(raw) // 3 + 1):
        part = raw[i:i + len(raw) // 3 + 1]
        s.sendall(b"%x\r\n" % len(part) + part + b"\r\n")
        time.sleep(0.3)
    s.sendall(b"0\r\n\r\n")
    assert _statuses(_read_responses(s, 1)) == [200]
    s.close()
    # 150 requests on one kept-alive httpx connection
    with httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", timeout=10) as c:
        codes = [c.post("/chat/completions", json=BODY).status_code for _ in range(150)]
        assert codes == [200] * 150 and gateway.app.connections == 1
    _settled(gateway)
    assert metric(gateway, 'llmwd_gateway_connections_closed_total{reason="header_timeout"}') == 0


@pytest.mark.parametrize("gateway", [{"header_timeout_s": 1.0}], indirect=True)
def test_a_stream_and_a_slow_answer_outlast_the_header_timeout(gateway: GatewayServer, upstream: Upstream) -> None:
    upstream.mode = "slow"  # 200 chunks 50 ms apart
    t0 = time.monotonic()
    n = 0
    with client(gateway) as c:
        for _chunk in c.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True):
            n += 1
            if n == 60:
                break
    assert n == 60 and time.monotonic() - t0 > 2.5
    upstream.mode, upstream.hold_s = "hold", 3.0
    t0 = time.monotonic()
    with client(gateway) as c:
        out = c.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert out.choices and time.monotonic() - t0 >= 3.0
    assert metric(gateway, 'llmwd_gateway_connections_closed_total{reason="header_timeout"}') == 0
    _settled(gateway, 0)


@pytest.mark.parametrize("gateway", [{"max_in_flight": 1}], indirect=True)
def test_an_answer_before_the_body_is_read_leaves_the_connection_usable(
        gateway: GatewayServer, upstream: Upstream) -> None:
    """The gateway answers some requests before reading their body (a path it does not proxy,
    ``max_in_flight`` full, a declared length past the body budget): the rest of the body is then read
    and dropped by uvicorn, and the connection stays usable for the next request."""
    port = gateway.port
    raw = orjson.dumps({"model": MODEL, "input": "x" * 1_000_000})
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n" % len(raw) + raw)
    first = _read_responses(s, 1)
    s.sendall(_request(port))
    got = first + _read_responses(s, 1)
    s.close()
    assert _statuses(got) == [404, 200], got[:400]
    # max_in_flight full: a 503 before the 1 MB body is read, then the next request once the slot is back
    upstream.mode, upstream.hold_s = "hold", 2.0
    holder = threading.Thread(target=lambda: httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                                        json=BODY, timeout=10))
    holder.start()
    assert helpers.wait_until(lambda: gateway.app.in_flight == 1 and upstream.peak >= 1, 5)
    raw = orjson.dumps({**BODY, "user": "u" * 1_000_000})
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n" % len(raw) + raw)
    first = _read_responses(s, 1)
    holder.join()
    upstream.mode = "ok"
    s.sendall(_request(port))
    got = first + _read_responses(s, 1)
    s.close()
    assert _statuses(got) == [503, 200], got[:400]
    assert metric(gateway, 'llmwd_gateway_connections_closed_total{reason="headers_too_large"}') == 0
    _settled(gateway, 0)


@pytest.mark.parametrize("gateway", [{"max_connections": 10}], indirect=True)
def test_websocket_upgrade_attempts_do_not_leak_the_connection_count(gateway: GatewayServer) -> None:
    """A client that asks for a WebSocket (a probe, a misconfigured SDK) is handed to uvicorn's
    WebSocket protocol, whose end is the one reported: the gateway's count of open connections
    (``max_connections`` is judged on it) must still come back, or ``max_connections`` such attempts
    get every later client refused 503."""
    port = gateway.port
    for _ in range(12):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET /v1/chat/completions HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
                  b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n")
        _answer(s, 2)
        s.close()
    time.sleep(0.5)
    left = gateway.app.connections
    code = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=BODY, timeout=5).status_code
    print(f"after 12 WebSocket attempts: app.connections {left}, then a chat request: {code}")
    assert left == 0 and code == 200
    _settled(gateway, 0)


@pytest.mark.parametrize("gateway", [{"max_connections": 10, "header_timeout_s": 1.0}], indirect=True)
def test_the_connection_count_returns_to_its_baseline_after_every_kind_of_close(gateway: GatewayServer) -> None:
    port = gateway.port
    raw = _request(port)
    for i in range(300):
        s = socket.create_connection(("127.0.0.1", port))
        kind = i % 6
        if kind == 0:  # reset mid-request
            s.sendall(raw[:40])
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif kind == 1:  # half-close after a whole request
            s.sendall(raw)
            s.shutdown(socket.SHUT_WR)
            _answer(s, 5)
        elif kind == 2:  # a whole request, then close
            s.sendall(raw)
            _read_responses(s, 1)
        elif kind == 3:  # reset after the head, body missing
            s.sendall(raw[:raw.index(b"\r\n\r\n") + 4])
            time.sleep(0.01)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif kind == 4:  # connect and close
            pass
        else:  # a bad request
            s.sendall(b"GARBAGE\r\n\r\n")
            _answer(s, 2)
        s.close()
    # timeouts and refusals: 12 idle sockets (2 past the limit), left to time out
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(12)]
    time.sleep(0.2)
    refused = idle[10:]
    for r in refused:  # a refused client that keeps sending still reads its 503
        with contextlib.suppress(OSError):
            r.sendall(raw * 50)
        assert _statuses(_answer(r)) == [503]
    time.sleep(1.5)
    for s in idle:
        s.close()
    _settled(gateway, 0)
    assert [c for c in (httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=BODY, timeout=5).status_code,)] \
        == [200]
    _settled(gateway, 0)


@pytest.mark.parametrize("gateway", [{"header_timeout_s": 1.0}], indirect=True)
def test_a_head_behind_a_long_answer_is_not_timed_while_the_gateway_is_not_reading(
        gateway: GatewayServer, upstream: Upstream) -> None:
    """Pipelined behind an answer that takes longer than ``header_timeout_s``: uvicorn stops reading
    once a second request is queued, so the rest of a third head waits in the socket for the server.
    It must not be timed then (the whole connection was reset 1 s in, the first answer cut); a head
    that still does not end once the gateway reads again is closed as before."""
    upstream.mode, upstream.hold_s = "hold", 2.5
    port = gateway.port
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t0 = time.monotonic()
    s.sendall(_request(port))
    assert helpers.wait_until(lambda: upstream.peak >= 1, 5)
    upstream.mode = "ok"
    nxt = _request(port)
    s.sendall(nxt + nxt[:30])  # a second request, and the start of a third
    time.sleep(0.1)
    s.sendall(nxt[30:])  # the rest of the third, 0.1 s later
    try:
        got = _read_responses(s, 3)
    except ConnectionResetError:
        got = b""
    took = time.monotonic() - t0
    print(f"3 pipelined requests behind a 2.5 s answer, header_timeout_s 1: {_statuses(got)} in {took:.1f} s")
    assert _statuses(got) == [200] * 3 and took >= 2.5
    assert metric(gateway, 'llmwd_gateway_connections_closed_total{reason="header_timeout"}') == 0
    s.sendall(nxt[:30])  # a head begun and never ended, the gateway reading: closed after the timeout
    t0 = time.monotonic()
    assert _answer(s, 3) == b"" and 0.9 < time.monotonic() - t0 < 2
    s.close()
    assert metric(gateway, 'llmwd_gateway_connections_closed_total{reason="header_timeout"}') == 1
    _settled(gateway, 0)


@pytest.mark.parametrize("gateway", [{"header_timeout_s": 1.0, "max_connections": 300}], indirect=True)
def test_clients_that_leave_mid_stream_or_mid_answer_give_back_connection_and_slot(
        gateway: GatewayServer, upstream: Upstream) -> None:
    """100 aiohttp clients that drop a stream after its first line and 100 that give up on a held
    answer after 0.3 s: the connection count and the in-flight count come back, and 200 requests on
    20 kept-alive connections are served."""
    aiohttp = pytest.importorskip("aiohttp")
    import asyncio

    url = f"http://127.0.0.1:{gateway.port}/v1/chat/completions"

    async def drop_stream(session: Any) -> None:
        async with session.post(url, json={**BODY, "stream": True}) as r:
            await r.content.readline()

    async def give_up(session: Any) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            async with session.post(url, json=BODY, timeout=aiohttp.ClientTimeout(total=0.3)) as r:
                await r.read()

    async def run() -> list[int]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as s:
            upstream.mode = "slow"
            await asyncio.gather(*(drop_stream(s) for _ in range(100)))
            upstream.mode, upstream.hold_s = "hold", 2.0
            await asyncio.gather(*(give_up(s) for _ in range(100)))
        upstream.mode = "ok"
        codes: list[int] = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=20)) as s:
            for _ in range(10):
                answers = await asyncio.gather(*(s.post(url, json=BODY) for _ in range(20)))
                codes += [a.status for a in answers]
                for a in answers:
                    a.release()
        return codes

    assert asyncio.run(run()) == [200] * 200
    assert helpers.wait_until(lambda: gateway.app.connections == 0 and gateway.app.in_flight == 0, 5)
    assert metric(gateway, "llmwd_gateway_connections") == 1  # the scrape itself


def test_a_head_too_large_behind_an_answer_in_flight_is_refused_after_that_answer(
        gateway: GatewayServer, upstream: Upstream) -> None:
    """A request in flight, and behind it (pipelined) a head that grows past ``max_header_bytes``:
    the 431 was written at once, so the client read it as the first request's answer (and that
    answer was cut). The first request is answered, then the 431, then the connection closed."""
    upstream.mode, upstream.hold_s = "hold", 1.0
    port = gateway.port
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(_request(port))
    assert helpers.wait_until(lambda: upstream.peak >= 1, 5)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")
    for _ in range(12):  # 96 KB of head, never ended
        s.sendall(b"x-filler: " + b"a" * 8000 + b"\r\n")
        time.sleep(0.01)
    got = _answer(s, 4)
    print(f"a 96 KB head pipelined behind a 1 s answer: {_statuses(got)}")
    assert _statuses(got) == [200, 431] and _closed(s)
    s.close()
    assert metric(gateway, 'llmwd_gateway_connections_closed_total{reason="headers_too_large"}') == 1
    _settled(gateway, 0)
