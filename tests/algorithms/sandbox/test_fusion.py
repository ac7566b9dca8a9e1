"""The SandboxFusion client against a tiny in-test server that mimics ``/run_code``."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from relay.algorithms.sandbox.api import Limits
from relay.algorithms.sandbox.config import SandboxFusionConfig
from relay.algorithms.sandbox.fusion import FusionSandbox


class FakeFusion:
    """A ``/run_code`` server: answers from ``reply(request) -> (http_status, body)``, records
    every request and the most requests it ever held at once."""

    def __init__(self, reply) -> None:
        self.reply = reply
        self.requests: list[dict] = []
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.requests.append(body)
                    fake.in_flight += 1
                    fake.most_in_flight = max(fake.most_in_flight, fake.in_flight)
                try:
                    status, answer = fake.reply(body) if self.path == "/run_code" else (404, {})
                finally:
                    with fake.lock:
                        fake.in_flight -= 1
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/run_code"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def finished(stdout: str = "", stderr: str = "", code: int = 0, status: str = "Finished"):
    overall = "Success" if code == 0 and status == "Finished" else "Failed"
    return 200, {"status": overall, "message": "", "run_result": {
        "status": status, "return_code": code, "stdout": stdout, "stderr": stderr,
        "execution_time": 0.01}}


@pytest.fixture
def serve():
    servers: list[FakeFusion] = []

    def start(reply) -> FakeFusion:
        servers.append(FakeFusion(reply))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def client(url: str, **config) -> FusionSandbox:
    return FusionSandbox(SandboxFusionConfig(url=url, backoff_s=0.0, **config))


def test_a_request_carries_the_api_fields_and_the_answer_maps_to_an_execution(serve):
    server = serve(lambda body: finished(stdout=body["stdin"].upper()))
    box = client(server.url, memory_limit_mb=512)
    result = box.run("print(input().upper())", stdin="hi", files={"a/b.txt": "é"},
                     limits=Limits(wall_s=3, memory_mb=256))
    assert (result.status, result.stdout, result.exit_code) == ("ok", "HI", 0)
    sent = server.requests[0]
    assert sent["language"] == "python" and sent["run_timeout"] == 3
    assert sent["memory_limit_MB"] == 256 and sent["stdin"] == "hi"
    assert base64.b64decode(sent["files"]["a/b.txt"]).decode() == "é"
    box.run("pass")
    assert server.requests[1]["memory_limit_MB"] == 512  # no Limits: verl's memory_limit_mb
    box.close()


@pytest.mark.parametrize(("answer", "status", "reason"), [
    (finished(stderr="Traceback...\nZeroDivisionError: division by zero", code=1), "error",
     "exited with code 1: ZeroDivisionError: division by zero"),
    (finished(stderr="MemoryError", code=1), "memory", "memory limit of 1024 MB exceeded"),
    (finished(status="TimeLimitExceeded", code=None), "timeout", "run_timeout of 10 s"),
    ((200, {"status": "SandboxError", "message": "no runner"}), "sandbox_error", "no runner"),
    ((400, {"detail": "bad language"}), "sandbox_error", "HTTP 400"),
])
def test_failures_map_to_statuses_with_reasons(serve, answer, status, reason):
    server = serve(lambda body: answer)
    box = client(server.url)
    result = box.run("x")
    assert result.status == status and reason in result.reason, result
    assert len(server.requests) == 1  # none of these is retried
    box.close()


def test_5xx_is_retried_then_succeeds(serve):
    answers = iter([(503, {}), (502, {}), finished(stdout="1\n")])
    server = serve(lambda body: next(answers))
    box = client(server.url, retries=2)
    assert box.run("print(1)").stdout == "1\n"
    assert len(server.requests) == 3
    box.close()


def test_a_server_that_is_gone_gives_up_with_a_reason():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    box = client(f"http://127.0.0.1:{port}/run_code", retries=2)
    result = box.run("print(1)")
    assert result.status == "sandbox_error"
    assert "failed 3 times" in result.reason and "refused" in result.reason.lower()
    box.close()


def test_output_is_cut_at_the_limit(serve):
    server = serve(lambda body: finished(stdout="x" * 500))
    box = client(server.url)
    result = box.run("x", limits=Limits(output_bytes=100))
    assert result.stdout == "x" * 100 and "stdout cut at 100 bytes" in result.reason
    box.close()


def test_max_concurrent_holds_across_threads_and_the_event_loop(serve):
    def slow(body):
        time.sleep(0.2)
        return finished(stdout="ok")

    server = serve(slow)
    box = client(server.url, max_concurrent=2)
    threads = [threading.Thread(target=box.run, args=("x",)) for _ in range(4)]
    for thread in threads:
        thread.start()

    async def from_the_loop() -> int:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick = asyncio.create_task(ticker())
        results = await asyncio.gather(*(box.arun("x") for _ in range(4)))
        tick.cancel()
        assert [r.stdout for r in results] == ["ok"] * 4
        return ticks

    ticks = asyncio.run(from_the_loop())
    for thread in threads:
        thread.join()
    assert len(server.requests) == 8 and server.most_in_flight == 2
    assert ticks >= 20  # 8 requests, 2 at a time, 0.2 s each: the loop ticked throughout
    box.close()


def test_a_url_without_http_is_refused():
    with pytest.raises(ValueError, match="sandbox_fusion.url, the http"):
        FusionSandbox(SandboxFusionConfig(url="localhost:8080/run_code"))
