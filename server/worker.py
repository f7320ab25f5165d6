"""The one thread that owns the engine, fed by a bounded FIFO queue of jobs, interleaving the admitted ones.

Owns: `Worker` (loads the engine on its own thread, so /health answers 503 while it loads and, with `warm_up`, while
`Engine.warm_up` compiles or loads its kernels (status "warming_up"); then runs up to `max_running` jobs at once,
round-robin: one step of each in turn, a step being one generated token or one prefill block, so a long prompt
delays the others by one block at a time and no admitted job starves; the forwards that the round's tokens ask for
then run as one batched decode step, Engine.decode_batch, one row a job; a job admitted while others run or
wait decodes without drafting: its rows share the weights with theirs, as a verify call's rows would, and a drafting
job's rounds would hold the others up) and `Job` (one request's prompt ids, sampling
parameters, a per-request event queue the worker fills, and a cancel flag). The engine is not thread-safe: nothing
but the worker thread calls it; each job has its own session state. A request that finds `max_queue` jobs already
waiting gets a 429 with Retry-After (the expected wait, from recent job durations); while the model loads or warms
up, a 503 with Retry-After. Request threads wait on their job's queue; a client that goes away sets the cancel flag,
and the worker drops the job before it starts or stops it at its next step, so the slot frees at once.

Events a job carries are the engine's ({"type": "token", "id", "text"}, then {"type": "done", ...}) with the
done event completed by the worker: `stop_sequence` (which stop string ended it, or None) and
`reasoning_tokens`. An engine failure arrives as {"type": "error"} and is raised to the consumer as JobError. A
failure the engine names mid-generation (the output constraint rejecting a token, or logits holding NaN/inf) is a
500 with its own code and one log line; anything else is a 500 "generation_failed" with the traceback in the log.

Does not own: request parsing (schemas.py), prompt building (prompts.py), response shapes.
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from ds4lib.chat import END_THINK, THINK
from ds4lib.engine import Cancelled, EngineError, GrammarError, NonFiniteLogits, SamplingParams
from ds4lib.tokenizer import TextEncoder

from server.metrics import Metrics
from server.schemas import RequestError

__all__ = ["Worker", "Job", "JobError"]

log = logging.getLogger("ds4.server")
_POLL_S = 0.2


class JobError(RuntimeError):
    def __init__(self, message: str, status: int = 500, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.code = message, status, code


# Failures the engine names during generation: a server fault (500), but a known one, so no traceback is logged.
_NAMED_FAILURES = ((GrammarError, "output_constraint_failed"), (NonFiniteLogits, "non_finite_logits"))


def _never() -> bool:
    return False


@dataclass
class Job:
    prompt_ids: list
    params: SamplingParams
    thinking_open: bool
    t_arrival: float = field(default_factory=time.perf_counter)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    keepalive_s: float | None = None            # a quiet stream gets a keep-alive event this often
    events: queue.Queue = field(default_factory=queue.Queue)
    _cancel: threading.Event = field(default_factory=threading.Event)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        self._cancel.set()

    def events_iter(self, disconnected=_never):
        """The job's events up to and including "done". Returns early (after cancelling) when `disconnected()`
        turns true while waiting; raises JobError on an engine failure. With `keepalive_s`, a wait longer than that
        (in the queue, or a long prefill) yields {"type": "keepalive"} so proxies and clients keep the stream open."""
        next_check = time.monotonic() + _POLL_S
        last = time.monotonic()
        poll = min(_POLL_S, self.keepalive_s) if self.keepalive_s else _POLL_S
        while True:
            try:
                ev = self.events.get(timeout=poll)
            except queue.Empty:
                ev = None
            now = time.monotonic()
            if now >= next_check:                  # by the clock: tokens may arrive faster than the poll period
                next_check = now + _POLL_S
                if disconnected():
                    self.cancel()
                    return
            if ev is None:
                if self.keepalive_s and now - last >= self.keepalive_s:
                    last = now
                    yield {"type": "keepalive"}
                continue
            last = now
            if ev["type"] == "error":
                raise JobError(ev["message"], ev["status"], ev.get("code"))
            yield ev
            if ev["type"] == "done":
                return

    def result(self, disconnected=_never) -> dict | None:
        """Wait for the done event (None if the client went away first)."""
        done = None
        for ev in self.events_iter(disconnected):
            if ev["type"] == "done":
                done = ev
        return done


class Worker:
    """`load` is called on the worker thread and returns the Engine; with `warm_up`, `Engine.warm_up()` runs next on
    the same thread (the one that serves, so the CUDA context is the same) before the state turns "ready";
    `on_fatal(exc)` runs if either fails."""

    def __init__(self, load, *, metrics: Metrics, max_queue: int = 32, max_running: int = 4, on_fatal=None,
                 keepalive_s: float | None = None, warm_up: bool = False):
        if max_running < 1 or max_queue < 0:
            raise ValueError("max_running must be >= 1 and max_queue >= 0")
        self._load, self._on_fatal, self.keepalive_s, self._warm_up = load, on_fatal, keepalive_s, warm_up
        self.metrics, self.max_queue, self.max_running = metrics, max_queue, max_running
        self.engine = self.encoder = None
        self.state, self.error = "loading", None
        self._active: list = []                         # the admitted jobs' runs (worker thread only mutates)
        self._job_seconds = 5.0                         # moving average of a job's wall time, for Retry-After
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="ds4-engine", daemon=True)

    def start(self) -> "Worker":
        self._thread.start()
        return self

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    @property
    def running(self) -> int:
        return len(self._active)

    def require_ready(self):
        """The engine, for read-only use of its tokenizer and context length; a 503 while it is not ready."""
        if not self.ready:
            starting = {"loading": "the model is still loading",
                        "warming_up": "the model is warming up (compiling or loading its kernels)"}
            raise RequestError(starting.get(self.state, f"the model failed to load: {self.error}"), status=503,
                               kind="overloaded_error", code="model_not_ready",
                               headers={"Retry-After": "5"} if self.state in starting else None)
        return self.engine

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: the waiting jobs' expected wall time over the running slots."""
        waits = self._job_seconds * (self._queue.qsize() + 1) / self.max_running
        return int(min(600, max(1, math.ceil(waits))))

    def submit(self, prompt_ids, params: SamplingParams, *, thinking_open: bool) -> Job:
        self.require_ready()
        if self._queue.qsize() >= self.max_queue:
            raise RequestError(f"{self._queue.qsize()} requests are already waiting and {self.running} running; "
                               f"try again later", status=429, kind="rate_limit_error", code="queue_full",
                               headers={"Retry-After": str(self.retry_after())})
        job = Job(list(prompt_ids), params, thinking_open, keepalive_s=self.keepalive_s)
        self._queue.put(job)
        return job

    def stop(self, timeout: float | None = None) -> None:
        """Stop the running jobs at their next step, fail the waiting ones, end the thread."""
        for run in list(self._active):
            run.job.events.put({"type": "error", "message": "the server is shutting down", "status": 503})
            run.job.cancel()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.events.put({"type": "error", "message": "the server is shutting down", "status": 503})
        self._queue.put(None)
        if self._thread.is_alive() and timeout is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the worker thread
    def _run(self) -> None:
        try:
            self.engine = self._load()
            tok = self.engine.tokenizer
            self.encoder = TextEncoder(tok)
            self._think_id, self._end_think_id = tok.token_to_id(THINK), tok.token_to_id(END_THINK)
            if self._warm_up:
                self.state = "warming_up"
                log.info("warming up the %s backend (compiling or loading its kernels) ...", self.engine.backend.name)
                log.info("%s", self.engine.warm_up(quiet=True).message)
        except Exception as e:                        # any load or warm-up failure: report it, never hang
            self.state, self.error = "failed", str(e)
            log.error("the engine failed to load: %s", e)
            if self._on_fatal is not None:
                self._on_fatal(e)
            return
        self.state = "ready"
        try:
            while self._admit():
                for run in list(self._active):      # round-robin: one step of each admitted job
                    if not self._step(run):
                        self._active.remove(run)
                self._decode_pending()
        finally:
            for run in self._active:
                self._finish(run)
            self._active.clear()

    def _admit(self) -> bool:
        """Move waiting jobs into free slots (blocking only when nothing runs); False once stopped."""
        while len(self._active) < self.max_running:
            try:
                job = self._queue.get(block=not self._active)
            except queue.Empty:
                return True
            if job is None:
                return False
            if job.cancelled:
                log.info("job %s: cancelled while queued (client went away)", job.id)
                self.metrics.count_cancelled_in_queue()
                continue
            alone = not self._active and self._queue.qsize() == 0      # drafting pays only for a job alone
            self._active.append(_Run(job, self.engine.generate(job.prompt_ids, job.params, progress=True,
                                                              batched=True, draft=alone,
                                                              should_stop=lambda j=job: j.cancelled)))
        return True

    def _step(self, run: "_Run") -> bool:
        """Advance one job by one step; False when it has finished (done, failed or cancelled)."""
        job = run.job
        if job.cancelled:
            self._finish(run)
            return False
        try:
            ev = next(run.gen)
        except StopIteration:
            self._finish(run)
            return False
        except Cancelled:
            log.info("job %s: cancelled during prefill (client went away)", job.id)
            self._finish(run)
            return False
        except EngineError as e:
            job.events.put({"type": "error", "message": str(e), "status": 400})
            self._finish(run)
            return False
        except Exception as e:                        # the worker must outlive any one request
            code = next((c for kind, c in _NAMED_FAILURES if isinstance(e, kind)), None)
            if code is None:
                log.exception("job %s: generation failed", job.id)
            else:
                log.error("job %s: generation failed after %d tokens: %s", job.id, len(run.ids), e)
            job.events.put({"type": "error", "message": f"generation failed: {e}", "status": 500,
                            "code": code or "generation_failed"})
            self._finish(run)
            return False
        if ev["type"] == "token":
            run.pending = ev.pop("decode", None)
            if ev["id"] is not None:
                run.ids.append(ev["id"])
                run.t_first = run.t_first or time.perf_counter()
            job.events.put(ev)
        elif ev["type"] == "done":
            run.done = self._complete(ev, run.ids, job)
            job.events.put(run.done)
            self._finish(run)
            return False
        return True                                   # a token, or a prefill block ("prefill")

    def _decode_pending(self) -> None:
        """The forwards the jobs' last tokens asked for, as one batched step (Engine.decode_batch); a failure reaches
        each job when its generation resumes."""
        pending = [run.pending for run in self._active if run.pending is not None and not run.job.cancelled]
        for run in self._active:
            run.pending = None
        if not pending:
            return
        try:
            self.engine.decode_batch(pending)
        except Exception as e:                        # decode_batch delivers its failures; this is a last resort
            log.exception("a batched decode step failed")
            for p in pending:
                if not p.done:
                    p.fulfil(error=e)
        self.metrics.observe_decode_step(len(pending))

    def _finish(self, run: "_Run") -> None:
        job, done = run.job, run.done
        run.gen.close()                               # the engine caches the session if it is consistent
        now = time.perf_counter()
        self._job_seconds = 0.8 * self._job_seconds + 0.2 * (now - run.t_start)
        n = done["completion_tokens"] if done else len(run.ids)
        cancelled = done is None and job.cancelled
        self.metrics.observe_generation(
            prompt_tokens=job.prompt_tokens, generated_tokens=n,
            ttft=None if run.t_first is None else run.t_first - job.t_arrival,
            decode_seconds=0.0 if run.t_first is None else now - run.t_first, cancelled=cancelled)
        log.info("job %s: %d prompt (%d cached) + %d generated tokens in %.2f s (%s)", job.id, job.prompt_tokens,
                 done.get("cached_tokens", 0) if done else 0, n, now - job.t_arrival,
                 "cancelled" if cancelled else done["finish_reason"] if done else "failed")

    def _complete(self, ev: dict, ids: list, job: Job) -> dict:
        """Name the stop string that ended the generation (the engine reports it) and count reasoning tokens."""
        stop_sequence = ev.get("stop")
        n = ev["completion_tokens"]
        if job.thinking_open or (ids and ids[0] == self._think_id):
            reasoning = ids.index(self._end_think_id) + 1 if self._end_think_id in ids else n
        else:
            reasoning = 0
        return dict(ev, stop_sequence=stop_sequence, reasoning_tokens=min(reasoning, n))


@dataclass
class _Run:
    """An admitted job on the worker thread: its engine event generator and what it has produced so far."""
    job: Job
    gen: object
    ids: list = field(default_factory=list)
    t_first: float | None = None
    t_start: float = field(default_factory=time.perf_counter)
    done: dict | None = None
    pending: object = None                        # the forward its last token asked for (Engine.PendingDecode)
