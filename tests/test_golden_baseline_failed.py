"""The FP16 baseline engine of a golden job hangs (accepts connections, never answers).

Every scheduled replay then measures no item: an ``error`` verdict, which pages ops and decides nothing.
Found by an outside review (2026-12-07): the shipped ``golden-rougeL`` rule counted those errors toward its
``errors_trip_after`` (3) and, at the third replay, rolled the route back to the engine that was hanging.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.daemon_harness import make_config, running_daemon
from tests.helpers import write_golden_set

ROOT = Path(__file__).resolve().parent.parent
ITEMS = {f"What is item {i}?": f"Item {i} is the answer number {i}." for i in range(8)}


class _Healthy(BaseHTTPRequestHandler):
    """OpenAI-compatible /v1/completions answering each golden prompt with its reference."""

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = ITEMS.get(body.get("prompt", ""), "")
        out = json.dumps({"id": "x", "object": "text_completion", "model": "m",
                          "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *a: object) -> None:
        pass


class _Hanging:
    """Accepts every connection and never answers (a wedged inference server)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)

    def close(self) -> None:
        self._stop = True
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.mark.services
def test_a_hanging_fp16_baseline_never_rolls_a_route_back_to_fp16(kafka_service, redis_service, redis_client, topic,
                                                                  tmp_path: Path) -> None:
    set_dir = write_golden_set(tmp_path / "mini", ITEMS.items(), name="mini", languages="en")
    healthy = ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=healthy.serve_forever, daemon=True).start()
    hang = _Hanging()
    opts = {"kind": "openai", "model": "m", "timeout_s": 0.5, "connect_timeout_s": 0.5, "retries": 0}
    cfg = make_config(kafka_service.address, redis_service.port, topic, ROOT / "policies" / "default.yaml", None,
                      golden={"jobs": [{"name": "mini", "set": str(set_dir), "model": "llama-3-8b", "routes": ["qa"],
                                        "every_s": None,
                                        "candidate": {**opts, "precision": "fp8",
                                                      "base_url": f"http://127.0.0.1:{healthy.server_port}"},
                                        "baseline": {**opts, "precision": "fp16",
                                                     "base_url": f"http://127.0.0.1:{hang.port}"}}]})
    try:
        with running_daemon(cfg) as (daemon, _server):
            scheduler = daemon.golden
            took = []
            for _ in range(4):  # four scheduled replays while the FP16 server is wedged
                t0 = time.monotonic()
                assert scheduler.run_job("mini") is True
                took.append(time.monotonic() - t0)
                time.sleep(1.5)  # the daemon's loop judges the replay
            status = scheduler.status()[0]
            flag = daemon.flags.precision_for("llama-3-8b", "qa")
            audit = redis_client.xrange("llmwd:audit")
            verdicts = json.dumps(daemon.status()["verdicts"])
    finally:
        healthy.shutdown()
        hang.close()
    print("replay seconds:", [round(t, 1) for t in took], "flag:", flag, "audit:", audit, status)
    assert all(t < 30 for t in took)  # each replay is bounded by the engine's timeouts
    assert "no golden item measured" in verdicts
    # the FP16 engine is the broken one: the route must stay on FP8 (and nothing be flipped)
    assert flag == "fp8", f"route rolled back to the hanging FP16 engine: {audit}"
    assert audit == []
