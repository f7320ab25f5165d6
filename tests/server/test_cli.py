"""`ds4-server` flags and failure exits, and the fast paths of scripts/main.sh (argument and domain checks, which
run before anything is installed or built)."""
from __future__ import annotations

import signal
import subprocess
import sys

from server.cli import build_parser
from tests.server.conftest import ROOT, start_server, stop_server


def test_seed_flags_and_defaults():
    args = build_parser().parse_args(["-m", "base.gguf"])
    assert (args.host, args.port, args.cuda, args.zchain, args.posttrain, args.engram_dir, args.mem_budget_mb) == \
        ("127.0.0.1", 8000, False, None, None, None, None)
    args = build_parser().parse_args(["-m", "b", "--zchain", "z", "--posttrain", "p", "--engram-dir", "e",
                                      "--mem-budget-mb", "110000", "--host", "0.0.0.0", "--port", "9", "--cuda"])
    assert (args.model, args.zchain, args.posttrain, args.engram_dir, args.mem_budget_mb, args.host, args.port,
            args.cuda) == ("b", "z", "p", "e", 110000.0, "0.0.0.0", 9, True)


def _run(args, timeout=120, **kw):
    return subprocess.run([sys.executable, "-m", "server.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, **kw)


def test_prefix_cache_is_on_by_default_on_both_backends(monkeypatch):
    import ds4lib.engine
    from ds4lib.tools.engine_args import open_engine
    seen = {}
    monkeypatch.setattr(ds4lib.engine, "Engine", lambda *a, **kw: seen.update(kw))
    for flags, mb in (([], 1024.0), (["--cuda"], 1024.0), (["--cuda", "--prefix-cache-mb", "5"], 5.0),
                      (["--prefix-cache-mb", "0"], 0.0)):
        open_engine(build_parser().parse_args(["-m", "b", *flags]), warm_up=False)
        assert seen["prefix_cache_mb"] == mb, flags


def test_tools_warm_up_the_cuda_backend_only(monkeypatch):
    """`ds4 -p/score/eval --cuda` compile or load every kernel before their first request (open_engine); the CPU
    backend has nothing to compile; ds4-server warms up on its worker instead (warm_up=False here)."""
    import ds4lib.engine
    from ds4lib.tools.engine_args import open_engine
    warmed = []

    class Fake:
        def __init__(self, *a, backend, **kw):
            self.backend = backend

        def warm_up(self):
            warmed.append(self.backend)

    monkeypatch.setattr(ds4lib.engine, "Engine", Fake)
    for flags in ([], ["--cuda"]):
        open_engine(build_parser().parse_args(["-m", "b", *flags]))
    open_engine(build_parser().parse_args(["-m", "b", "--cuda"]), warm_up=False)
    assert warmed == ["cuda"]


def test_bad_flag_values_are_usage_errors():
    for args, flag in ((["--max-queue", "-1"], "--max-queue"), (["--port", "x"], "--port"),
                       (["--sse-keepalive-s", "nan"], "--sse-keepalive-s"), (["--mem-budget-mb", "0"], "--mem-budget")):
        r = _run(["-m", "b.gguf", *args])
        assert r.returncode == 2 and f"argument {flag}" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_missing_base_file_exits_2():
    r = _run(["-m", "/nonexistent/base.gguf"])
    assert r.returncode == 2 and "no such base file" in r.stderr


def test_failed_load_exits_1_with_the_reason(tiny_stack, tmp_path):
    base, ck = tiny_stack
    r = _run(["-m", str(base), "--engram-dir", str(ck), "--mem-budget-mb", "1", "--port", "0"])
    assert r.returncode == 1, r.stderr
    assert "the engine failed to load" in r.stderr and "does not fit --mem-budget-mb" in r.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    r = _run(["-m", str(bad), "--port", "0"])
    assert r.returncode == 1 and "the engine failed to load" in r.stderr


def test_failed_load_exits_when_started_with_sigint_ignored(tiny_stack):
    """A server started in the background by a non-interactive shell (scripts/main.sh, CI) inherits SIGINT as
    ignored; a failed load must still end the process instead of leaving it hanging."""
    base, ck = tiny_stack
    r = _run(["-m", str(base), "--engram-dir", str(ck), "--mem-budget-mb", "1", "--port", "0"], timeout=60,
             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert r.returncode == 1 and "does not fit --mem-budget-mb" in r.stderr, r.stderr[-2000:]


def test_sigterm_stops_cleanly(tiny_stack, tmp_path):
    base, ck = tiny_stack
    server = start_server(["-m", str(base), "--engram-dir", str(ck)], tmp_path / "log")
    assert server.get("/health").json()["model"] == "ds4-test"
    assert "cpu warm-up:" in server.log.read_text()          # warmed up before /health said ok
    assert stop_server(server) == 0
    assert "stopped" in server.log.read_text()


def _main_sh(*args, env=None):
    import os
    return subprocess.run(["bash", str(ROOT / "scripts" / "main.sh"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


def test_main_sh_refuses_a_domain_without_sidecar(tmp_path):
    (tmp_path / "law").mkdir()                 # a directory without a manifest is not a sidecar either
    for domain in ("finance", "code", "law", "medicine", "science"):
        r = _main_sh("--domain", domain, env={"DS4_SIDECARS_DIR": str(tmp_path)})
        assert r.returncode != 0
        assert f"no ② sidecar for '{domain}'" in r.stderr and f"{tmp_path}/{domain}/manifest.json" in r.stderr
        assert f"ds4 sidecar --base models/ds4-tiny-base.gguf --domain {domain} --fit {domain}/fit" in r.stderr
        assert "[1/4]" not in r.stdout, "the domain check must come before installing or building anything"


def test_main_sh_arguments():
    r = _main_sh("--help")
    assert r.returncode == 0 and "bash scripts/main.sh stop" in r.stdout
    assert _main_sh("--domain", "astrology").returncode == 2
    assert _main_sh("--frobnicate").returncode == 2
