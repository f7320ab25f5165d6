"""The CI-sized soak (bench/bench_soak.py on the small random stack): a few streaming clients for a few seconds
against a live `ds4-server` (OpenAI and Anthropic streams, follow-up turns) with 0 errors and RSS within the
budget, then the server killed with SIGKILL mid-stream and restarted on the same --kv-disk-dir: no corrupt entry,
and the restarted server serves and resumes a conversation from the disk tier."""
from __future__ import annotations

import pytest

from bench.bench_soak import kill_mid_stream_and_restart, soak, start_server, stop_server


@pytest.mark.slow
def test_a_few_clients_for_seconds_then_a_kill_mid_stream_and_a_restart(tiny_stack, tmp_path):
    base, ck = tiny_stack
    kv = tmp_path / "kv"
    extra = ["--max-running", "2", "--max-queue", "4", "--prefix-cache-mb", "64", "--kv-disk-dir", str(kv),
             "--kv-disk-mb", "64"]
    servers = [start_server(base, ck, tmp_path / "soak.log", extra)]

    def restart():
        servers.append(start_server(base, ck, tmp_path / "restart.log", extra))
        return servers[-1]

    try:
        r = soak(servers[0], clients=3, seconds=4.0, max_tokens=4, max_running=2, runtime_mb=512.0,
                 request_timeout=120.0)
        assert r["errors"] == 0, r["error_samples"]
        assert r["completed"] >= 3 and r["ttft_p50_s"] is not None and r["aggregate_tokens_per_s"] > 0, r
        assert r["within_budget"], r
        assert r["turns_with_cached_tokens"] > 0, "follow-up turns should resume from the prefix cache"
        assert list(kv.rglob("*.ds4kv")), "finished sessions are written to the disk tier"
        check = kill_mid_stream_and_restart(servers[0], restart, kv, timeout=120.0)
        assert check["killed_mid_stream"] and check["stream_error_seen_by_client"], check
        assert check["corrupt_entries"] == [] and check["partial_files_after_restart"] == [], check
        assert check["restart_serves"] and check["restart_resumed_from_disk"] and check["ok"], check
    finally:
        for s in servers:
            if s.proc.poll() is None:
                stop_server(s)
    assert servers[0].proc.returncode == -9 and servers[-1].proc.returncode == 0, servers[-1].log.read_text()[-2000:]
