"""Prometheus text exposition (format 0.0.4) of the server's counters, written by hand: no client library.

Owns: `Metrics`, a lock-guarded set of counters, gauges and two histograms, filled by the routes (requests by
endpoint and status) and by the worker (tokens, time to first token, decode speed, cancellations), and
`render()`, the body of GET /metrics. Counts are of emitted tokens only: EOS is not counted.
"""
from __future__ import annotations

import threading

__all__ = ["Metrics", "TTFT_BUCKETS", "TPS_BUCKETS"]

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPS_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 50.0, 100.0, 200.0)


class _Histogram:
    def __init__(self, buckets):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        self.n += 1
        self.sum += v
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1

    def lines(self, name: str) -> list:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.n}"]


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests = {}                       # (endpoint, status) -> count
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.generations = 0
        self.cancelled = 0
        self.decode_seconds = 0.0
        self.last_tokens_per_second = 0.0
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.tps = _Histogram(TPS_BUCKETS)
        self.decode_steps = 0                    # decode steps the worker ran (one batched step of several jobs)
        self.decode_rows = 0                     # job rows those steps carried

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            key = (endpoint, int(status))
            self.requests[key] = self.requests.get(key, 0) + 1

    def observe_generation(self, *, prompt_tokens: int, generated_tokens: int, ttft: float | None,
                           decode_seconds: float, cancelled: bool) -> None:
        """One finished (or cancelled) job. tokens/s is over the decode phase: tokens after the first, per second
        since the first."""
        with self._lock:
            self.generations += 1
            self.prompt_tokens += prompt_tokens
            self.generated_tokens += generated_tokens
            self.cancelled += int(cancelled)
            if ttft is not None:
                self.ttft.observe(ttft)
            if generated_tokens > 1 and decode_seconds > 0:
                self.decode_seconds += decode_seconds
                self.last_tokens_per_second = (generated_tokens - 1) / decode_seconds
                self.tps.observe(self.last_tokens_per_second)

    def observe_decode_step(self, rows: int) -> None:
        """One decode step of the worker carrying `rows` jobs' tokens (Engine.decode_batch)."""
        with self._lock:
            self.decode_steps += 1
            self.decode_rows += int(rows)

    def count_cancelled_in_queue(self) -> None:
        with self._lock:
            self.cancelled += 1

    def render(self, *, queue_depth: int, running: int, loaded: bool, prefix_cache=None, speculative=None) -> str:
        """`prefix_cache`: the engine's PrefixCache (or None), whose counters are read as they are; `speculative`:
        the engine's summed SpecStats (None when speculative decoding is off)."""
        with self._lock:
            lines = ["# HELP ds4_requests_total HTTP requests to the API endpoints, by endpoint and status.",
                     "# TYPE ds4_requests_total counter"]
            lines += [f'ds4_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                      for (e, s), n in sorted(self.requests.items())]
            scalars = [
                ("ds4_prompt_tokens_total", "counter", "Prompt tokens of generations run.", self.prompt_tokens),
                ("ds4_generated_tokens_total", "counter", "Tokens generated and emitted (EOS not counted).",
                 self.generated_tokens),
                ("ds4_generations_total", "counter", "Generations run by the worker.", self.generations),
                ("ds4_requests_cancelled_total", "counter", "Generations cancelled because the client went away.",
                 self.cancelled),
                ("ds4_decode_seconds_total", "counter", "Seconds spent decoding after each first token.",
                 round(self.decode_seconds, 6)),
                ("ds4_tokens_per_second", "gauge", "Decode speed of the last finished generation.",
                 round(self.last_tokens_per_second, 3)),
                ("ds4_decode_steps_total", "counter", "Decode steps run for interleaved generations (one step "
                 "carries a token of each job waiting for a forward).", self.decode_steps),
                ("ds4_decode_step_rows_total", "counter", "Generations' rows carried by those decode steps (rows / "
                 "steps = the mean batch).", self.decode_rows),
                ("ds4_queue_depth", "gauge", "Requests waiting for the worker.", queue_depth),
                ("ds4_requests_running", "gauge", "Generations admitted and interleaved now (at most --max-running).", running),
                ("ds4_engine_loaded", "gauge", "1 once the engine has loaded.", int(loaded)),
            ]
            if prefix_cache is not None:
                scalars += [
                    ("ds4_prefix_cache_hits_total", "counter", "Prompts resumed from a cached prefix.",
                     prefix_cache.hits),
                    ("ds4_prefix_cache_misses_total", "counter", "Prompts with no cached prefix.", prefix_cache.misses),
                    ("ds4_prefix_cache_tokens_reused_total", "counter", "Prompt tokens not prefilled again.",
                     prefix_cache.tokens_reused),
                    ("ds4_prefix_cache_bytes", "gauge", "Memory held by cached session states.", prefix_cache.bytes),
                ]
            if speculative is not None:
                st = speculative
                tpr = st.tokens_per_round if st.rounds else 0.0
                scalars += [
                    ("ds4_spec_rounds_total", "counter", "Speculative rounds (draft, verify 1 + k rows).", st.rounds),
                    ("ds4_spec_plain_steps_total", "counter", "Plain decode steps the scheduler chose instead.",
                     st.plain_steps),
                    ("ds4_spec_drafted_tokens_total", "counter", "Draft tokens verified.", st.drafted),
                    ("ds4_spec_accepted_tokens_total", "counter", "Draft tokens accepted.", st.accepted),
                    ("ds4_spec_tokens_per_round", "gauge", "Tokens per speculative round since start.", round(tpr, 4)),
                ]
            for name, kind, help_, value in scalars:
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
            if speculative is not None:
                lines += ["# HELP ds4_spec_acceptance Share of drafts accepted at each draft position since start.",
                          "# TYPE ds4_spec_acceptance gauge"]
                lines += [f'ds4_spec_acceptance{{position="{j + 1}"}} {a / d if d else 0.0:.4f}'
                          for j, (a, d) in enumerate(zip(speculative.accepted_at, speculative.drafted_at))]
            lines += ["# HELP ds4_time_to_first_token_seconds Seconds from request arrival to the first token.",
                      "# TYPE ds4_time_to_first_token_seconds histogram"]
            lines += self.ttft.lines("ds4_time_to_first_token_seconds")
            lines += ["# HELP ds4_generation_tokens_per_second Decode speed per generation.",
                      "# TYPE ds4_generation_tokens_per_second histogram"]
            lines += self.tps.lines("ds4_generation_tokens_per_second")
        return "\n".join(lines) + "\n"
