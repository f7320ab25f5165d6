"""Fixtures of the server tests: one small random stack per session (tests/server/stack.py, ~10 s on 2 cores)
and one live `ds4-server` on a free port. The live server runs in a subprocess exactly as a user starts it
(`python -m server.cli`, waitress), so the SDK tests exercise the real HTTP stack, SSE framing included.
"""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server.stack import TOKENIZER, build_tiny_stack

__all__ = ["ROOT", "TOKENIZER", "LiveServer", "start_server", "stop_server"]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_stack(tmp_path_factory):
    """(base GGUF, checkpoint dir holding the Engram tables and tokenizer.json)."""
    return build_tiny_stack(tmp_path_factory.mktemp("stack"))


@pytest.fixture(scope="session")
def engine(tiny_stack):
    from ds4lib.engine import Engine
    base, ck = tiny_stack
    return Engine(base, engram_dir=ck)


class LiveServer:
    def __init__(self, url: str, proc: subprocess.Popen, log: Path):
        self.url, self.proc, self.log = url, proc, log

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return httpx.post(self.url + path, timeout=kw.pop("timeout", 60), **kw)

    def metric(self, name: str) -> float:
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)


def start_server(args: list, log: Path, timeout: float = 120.0) -> LiveServer:
    out = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", *args, "--port", "0"], cwd=ROOT,
                            stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    url = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ds4-server exited with {proc.returncode}:\n{log.read_text()}")
        m = re.search(r"listening on (http://[\d.]+:\d+)", log.read_text())
        if m and url is None:
            url = m.group(1)
        if url:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return LiveServer(url, proc, log)
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"ds4-server did not become healthy in {timeout} s:\n{log.read_text()}")


def stop_server(server: LiveServer) -> int:
    server.proc.send_signal(signal.SIGTERM)
    try:
        return server.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        return server.proc.wait()


@pytest.fixture(scope="session")
def live_server(tiny_stack, tmp_path_factory):
    base, ck = tiny_stack
    log = tmp_path_factory.mktemp("server") / "server.log"
    server = start_server(["-m", str(base), "--engram-dir", str(ck), "--alias", "ds4-test", "--model-alias",
                           "ds4-alias"], log)
    yield server
    rc = stop_server(server)
    assert rc == 0, f"ds4-server exited with {rc} on SIGTERM:\n{log.read_text()}"


@pytest.fixture(scope="module")
def shipped_app():
    """The shipped ds4-tiny ① base served in-process (server.create_app, model name "ds4"), once healthy; its worker
    stops after the module."""
    from ds4lib.engine import Engine
    from server import create_app
    engine = Engine(ROOT / "models" / "ds4-tiny-base.gguf", engram_dir=ROOT / "models" / "ds4-tiny")
    app = create_app(engine, model_name="ds4")
    c = app.test_client()
    deadline = time.monotonic() + 30
    while c.get("/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    yield app
    app.extensions["ds4"].worker.stop(timeout=5)


@pytest.fixture(scope="session")
def openai_client(live_server):
    import openai
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def anthropic_client(live_server):
    import anthropic
    return anthropic.Anthropic(base_url=live_server.url, api_key="unused", max_retries=0, timeout=120)
