"""The engine: loads the stack (① base GGUF, optional ② sidecar, optional ③ post-training file, the Engram
tables from the original checkpoint directory, given or found beside the base by content hash:
`find_engram_checkpoint`) and runs sessions on a backend.

Public API (the server and notebooks use nothing else): `Engine`, `Session`, `SamplingParams`,
`EngineError`. A session holds one request's state (window rings, compressed rows, index keys, Engram
history) that grows with the positions actually used, up to the context bound from the model metadata.
Prefill runs in blocks, decode one token at a time, both on the same forward; scoring uses the same
paths (`logits(..., split=P)`: P tokens by prefill, the rest one at a time).
With `prefix_cache_mb`, generation without an explicit session resumes from the longest cached prefix of its
prompt and stores its finished session back (prefix_cache.py; on the CUDA backend device copies of its states, and
host snapshots of them in the disk tier); logits are those of a cold prefill.
With `SamplingParams.json_format`, each step samples under the token mask of a JSON Schema or of a forced tool call's
grammar (constrain.py: JsonFormat, ToolCallFormat), on either backend's sampler; without it the unmasked path runs,
unchanged.
Several generations interleaved by one caller (the server's worker) share decode steps: with `batched=True`,
`generate` attaches to each token event that will be followed by a forward a `PendingDecode` ("decode"), and
`Engine.decode_batch` runs the pending decodes of several sessions as one step (on the CUDA backend one call over all
rows, `CudaBackend.decode_batch`; elsewhere one after another); a generation resumed with its decode not run makes
it itself. Each session's logits are bit for bit those of its own decode step.
Speculative decoding with the DSpark draft stages (speculative.py) is on by default (`dspark=True`) wherever the
backend supports it (the CPU and CUDA backends; speculative.supports) and the request is unconstrained; greedy output
is token-identical to plain greedy, sampled output has plain sampling's distribution. `spec_stats` sums its counts
over requests, `last_spec_stats` holds the last request's. Each request's scheduler starts from the previous one's
(`spec_priors`); where that one measured that no round could beat plain steps, requests decode plainly, all but
every RECHECK-th, which runs the scheduler again.

Shapes: T tokens, V vocab.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ds4lib.engine.backend import BackendContext, make_backend
from ds4lib.engine.constrain import Constrainer, GrammarError, JsonFormat, ToolCallFormat
from ds4lib.engine.prefix_cache import KvDiskStore, PrefixCache
from ds4lib.engine.speculative import Scheduler, SpecStats, generate_speculative, supports
from ds4lib.formats.checkpoint import CheckpointError, CheckpointReader
from ds4lib.formats.gguf import BaseFile, BaseFileError
from ds4lib.formats.names import KEY_SOURCE_DIR
from ds4lib.formats.sidecar import SidecarError, read_sidecar
from ds4lib.tokenmap import TokenMapError, load_token_map

__all__ = ["Engine", "Session", "SamplingParams", "EngineError", "Cancelled", "MemoryPlan", "find_engram_checkpoint",
           "JsonFormat", "GrammarError", "PendingDecode"]

EOS = 1
_MB = 1 << 20
SNAPSHOT_VERSION = 1          # bump when a state's meaning changes: older disk entries are then another stack's


class EngineError(RuntimeError):
    """The stack cannot be loaded or a request cannot be served as asked."""


class Cancelled(EngineError):
    """The caller asked to stop (e.g. the client went away) while a prefill was running."""


@dataclass(frozen=True)
class SamplingParams:
    """Defaults follow the model card: temperature 1.0, top_p 1.0, no top_k, no min_p. temperature 0 is greedy.
    `json_format`: the output must be JSON valid under that schema, or (a ToolCallFormat) exactly a DSML call block of
    those tools (constrained decoding, constrain.py).
    `draft_k`: drafted tokens verified per speculative round; None lets the scheduler choose from this request's
    measured costs, 0 decodes plainly. A seeded sampled request with draft_k None decodes plainly: its tokens would
    depend on k (their distribution does not), and a k chosen from wall-clock costs would make a seeded run
    irreproducible; give draft_k to draft a fixed number of tokens per round."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 256
    seed: int | None = None
    stop: tuple = ()
    json_format: JsonFormat | ToolCallFormat | None = None
    draft_k: int | None = None

    def __post_init__(self):
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < 1 << 64:
            raise ValueError(f"seed must be in [0, 2^64), got {self.seed}")
        if self.draft_k is not None and (isinstance(self.draft_k, bool) or not isinstance(self.draft_k, int)
                                         or self.draft_k < 0):
            raise ValueError(f"draft_k must be None or an integer >= 0, got {self.draft_k!r}")


@dataclass
class MemoryPlan:
    weights: int
    state: int
    scratch: int
    prefix_cache: int = 0
    pool: int = 0                 # finished sessions' states a backend keeps for reuse (CudaBackend.release_state)

    @property
    def total(self) -> int:
        return self.weights + self.state + self.scratch + self.prefix_cache + self.pool

    def table(self) -> str:
        mb = 1 << 20
        cache = f" + prefix cache {self.prefix_cache / mb:,.1f} MB" if self.prefix_cache else ""
        pool = f" + state pool {self.pool / mb:,.1f} MB" if self.pool else ""
        return (f"weights {self.weights / mb:,.1f} MB + per-request state at full context {self.state / mb:,.1f} MB "
                f"+ scratch {self.scratch / mb:,.1f} MB{cache}{pool} = {self.total / mb:,.1f} MB")


@dataclass
class Session:
    """One request's state on the engine's backend."""
    engine: "Engine"
    state: object
    tokens: list = field(default_factory=list)
    features: list = field(default_factory=list)
    reused: int = 0               # leading tokens whose state came from the prefix cache

    @property
    def position(self) -> int:
        return len(self.tokens)


class PendingDecode:
    """A generation's next forward (one token on its session), left for the caller to run together with other
    sessions' (`Engine.decode_batch`); the generation reads `logits()` when resumed, decoding alone if nobody did."""

    def __init__(self, session: Session, token: int):
        self.session, self.token = session, int(token)
        self._logits, self._error = None, None

    @property
    def done(self) -> bool:
        return self._logits is not None or self._error is not None

    def fulfil(self, logits=None, error: BaseException | None = None):
        self._logits, self._error = logits, error

    def logits(self):
        if self._error is not None:
            raise self._error
        if self._logits is None:
            self._logits = self.session.engine.decode(self.session, self.token)
        return self._logits


def _content_hash(d: Path) -> str:
    reader = CheckpointReader.open(d, validate=False)
    try:
        return reader.content_hash()
    finally:
        reader.close()


def find_engram_checkpoint(base: BaseFile, engram_dir=None) -> Path:
    """The checkpoint folder that holds the base file's Engram tables (they are not copied into the base).

    With `engram_dir`: that folder, refused unless its content hash is the one the base file records.
    Without: the base file's own folder, then every folder beside the base file (sorted by name) that holds
    a config.json, the first whose content hash matches. A base file written before content-hash lookup
    (no hash recorded) falls back to the path it recorded."""
    want = base.source_hash
    if engram_dir:
        d = Path(engram_dir)
        if not d.is_dir():
            raise EngineError(f"Engram tables: directory {d} does not exist; pass --engram-dir with the original "
                              f"checkpoint")
        if want:
            try:
                got = _content_hash(d)
            except (CheckpointError, KeyError, OSError) as e:
                raise EngineError(f"Engram tables: {d} is not a readable checkpoint: {e}") from None
            if got != want:
                raise EngineError(f"Engram tables: {d} holds checkpoint {got[:16]}..., but {base.path} was built "
                                  f"from checkpoint {want[:16]}...; pass --engram-dir with that checkpoint")
        return d
    if not want:
        legacy = base.metadata.get(KEY_SOURCE_DIR, "")
        if legacy and Path(legacy).is_dir():
            return Path(legacy)
        raise EngineError(f"Engram tables: {base.path} records no source checkpoint; pass --engram-dir")
    here = Path(base.path).resolve().parent
    candidates = [here] + sorted(p for p in here.iterdir() if p.is_dir())
    tried = []
    for d in candidates:
        if not (d / "config.json").is_file():
            continue
        try:
            got = _content_hash(d)
        except (CheckpointError, KeyError, OSError):
            got = "unreadable"
        if got == want:
            return d
        tried.append(f"{d.name or d} ({got[:16]})")
    raise EngineError(f"Engram tables: no checkpoint with content hash {want[:16]}... (the one {Path(base.path).name} "
                      f"was built from) beside it in {here}" + (f"; checked {', '.join(tried)}" if tried else "")
                      + "; pass --engram-dir with the original checkpoint")


class Engine:
    RECHECK = 16                  # every 16th request that drafting cannot help still runs the scheduler

    def __init__(self, base_path, *, zchain=None, posttrain=None, engram_dir=None, backend: str = "cpu",
                 mem_budget_mb: float | None = None, prefill_block: int = 512, tokenizer_path=None,
                 prefix_cache_mb: float = 0.0, kv_disk_dir=None, kv_disk_mb: float = 4096.0, dspark: bool = True):
        try:
            self.base = BaseFile.open(base_path)
        except BaseFileError as e:
            raise EngineError(str(e)) from None
        self.cfg = cfg = self.base.config
        self.context_length = cfg.max_position_embeddings
        self.prefill_block = prefill_block
        self.sidecar = self.posttrain = None
        try:
            if zchain:
                self.sidecar = read_sidecar(zchain, cfg, expect_kind="sidecar")
            if posttrain:
                self.posttrain = read_sidecar(posttrain, cfg, expect_kind="posttrain")
                if self.sidecar is None:
                    raise EngineError(f"{posttrain}: a post-training file stacks on a sidecar; pass --zchain too")
                if self.posttrain.base_fnv != self.sidecar.fingerprint:
                    raise EngineError(f"{posttrain}: solved against sidecar {self.posttrain.base_fnv}, but the "
                                      f"loaded sidecar is {self.sidecar.fingerprint}; refusing the mismatched pair")
        except SidecarError as e:
            raise EngineError(str(e)) from None
        gains, bias = {}, {}
        for sc in filter(None, (self.sidecar, self.posttrain)):
            for l, g in sc.gains.items():
                gains[l] = gains[l] * g if l in gains else g
            for l, b in sc.bias.items():
                bias[l] = bias[l] + b if l in bias else b
        self.engram_dir = find_engram_checkpoint(self.base, engram_dir) if cfg.engram_layer_ids else \
            Path(engram_dir or "")
        self.engram_reader, self.token_map = self._open_engram(cfg)
        self.tokenizer = self._open_tokenizer(tokenizer_path)
        self.constrainer = Constrainer(self.tokenizer.to_str(), n_vocab=cfg.vocab_size, eos=EOS)
        ctx = BackendContext(cfg, self.base, self.token_map, self.engram_reader, self.prefill_block,
                             self.context_length, dspark=bool(dspark))
        self.backend = make_backend(backend, ctx, gains, bias)
        self.speculative = bool(dspark) and supports(self.backend, cfg)
        self.spec_stats = SpecStats(cfg.dspark_block_size) if self.speculative else None
        self.spec_priors = {}        # greedy (True) / sampled (False) -> the last such request's Scheduler
        self._hopeless_runs = 0       # requests decoded plainly because drafting could not pay (_drafting_hopeless)
        self.last_spec_stats = None
        self.memory = self.backend.memory_plan()
        self.memory.prefix_cache = int(prefix_cache_mb * _MB)
        self.prefix_cache = self._open_prefix_cache(prefix_cache_mb, kv_disk_dir, kv_disk_mb)
        if mem_budget_mb is not None and self.memory.total > mem_budget_mb * (1 << 20):
            raise EngineError(f"the stack does not fit --mem-budget-mb {mem_budget_mb:,.0f}: {self.memory.table()}")

    # ------------------------------------------------------------------ loading
    def _open_engram(self, cfg):
        if not cfg.engram_layer_ids:
            return None, None
        d = self.engram_dir
        try:
            reader = CheckpointReader.open(d, validate=False)
            for l in cfg.engram_layer_ids:
                for suffix in ("weight", "scale"):
                    name = f"layers.{l}.engram.embed.{suffix}"
                    if not reader.has(name):
                        raise EngineError(f"Engram table {name} is missing from {d}")
                    want = reader.inventory[name].shape
                    if tuple(reader.raw(name).shape) != want:
                        raise EngineError(f"Engram table {name} in {d} has shape {list(reader.raw(name).shape)}, "
                                          f"expected {list(want)}")
            if reader.cfg.to_flat_dict() != cfg.to_flat_dict():
                raise EngineError(f"{d} holds a different model than the base file (configs differ)")
            tmap = load_token_map(d, cfg)
        except (CheckpointError, TokenMapError) as e:
            raise EngineError(f"Engram tables: {e}") from None
        return reader, tmap

    def _open_tokenizer(self, path):
        from tokenizers import Tokenizer
        candidates = [Path(path)] if path else [self.engram_dir / "tokenizer.json",
                                               Path(self.base.path).with_name("tokenizer.json")]
        for p in candidates:
            if p.is_file():
                return Tokenizer.from_file(str(p))
        raise EngineError(f"no tokenizer.json (looked in {', '.join(map(str, candidates))})")

    def _open_prefix_cache(self, mb, disk_dir, disk_mb):
        if not mb and not disk_dir:
            return None
        if not hasattr(self.backend, "copy_state"):
            raise EngineError(f"the prefix cache needs state snapshots, which the {self.backend.name} backend does "
                              f"not have yet; run without --prefix-cache-mb / --kv-disk-dir")
        if mb < 0 or disk_mb <= 0:
            raise EngineError("prefix cache sizes must be >= 0 MB (memory) and > 0 MB (disk)")
        disk = None
        nbytes = getattr(self.backend, "state_nbytes", None)
        if disk_dir:
            try:
                disk = KvDiskStore(disk_dir, fingerprint=self.fingerprint(), max_bytes=int(disk_mb * _MB),
                                   to_arrays=getattr(self.backend, "state_to_arrays", None))
            except OSError as e:
                raise EngineError(f"--kv-disk-dir {disk_dir}: {e}") from None
        return PrefixCache(max_bytes=int(mb * _MB), new_state=self.backend.new_state,
                           copy_state=self.backend.copy_state, disk=disk, state_nbytes=nbytes,
                           from_arrays=getattr(self.backend, "state_from_arrays", None))

    def fingerprint(self) -> str:
        """What a cached state depends on: the stack's files, the backend, the snapshot layout version."""
        st = Path(self.base.path).stat()
        parts = [str(Path(self.base.path).resolve()), str(st.st_size), str(st.st_mtime_ns),
                 self.sidecar.fingerprint if self.sidecar else "-", self.posttrain.fingerprint if self.posttrain else "-",
                 str(self.engram_dir.resolve()) if self.engram_reader is not None else "-", self.backend.name,
                 f"snapshot {SNAPSHOT_VERSION}"]
        if hasattr(self.backend, "draft"):       # a CUDA state holds DSpark rings only with the stages on the device
            parts.append("dspark" if self.backend.draft is not None else "no-dspark")
        return "|".join(parts)

    # ------------------------------------------------------------------ sessions and forward
    def new_session(self) -> Session:
        return Session(self, self.backend.new_state())

    def resume(self, prompt_ids) -> Session:
        """A session for `prompt_ids`: a copy of the longest cached proper prefix (its length in `reused` and
        `position`; feed it prompt_ids[position:]), or a new one."""
        if self.prefix_cache is None:
            return self.new_session()
        state, features, n = self.prefix_cache.lookup(prompt_ids)
        if state is None:
            return self.new_session()
        return Session(self, state, [int(t) for t in prompt_ids[:n]], features, reused=n)

    def _check_tokens(self, toks):
        bad = [t for t in toks if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise EngineError(f"token id {bad[0]} is outside the model's vocabulary [0, {self.cfg.vocab_size})")

    def _check_room(self, session, n):
        if session.position + n > self.context_length:
            raise EngineError(f"request needs {session.position + n} positions; the model's context is "
                              f"{self.context_length}")

    def prefill(self, session: Session, tokens, *, all_logits: bool = False, observer=None, should_stop=None,
                draft_context: bool = False):
        """Feed tokens in blocks of `prefill_block`; returns the last position's logits [V] (or all [T, V]).
        With all_logits the result is a host array; otherwise it stays where the backend keeps it (the CUDA
        backend samples on the device and reads back only the token). `draft_context`: also append the DSpark
        context rows of the fed positions (speculative decoding drafts from them)."""
        toks = [int(t) for t in tokens]
        if not toks:
            raise EngineError("prefill needs at least one token")
        self._check_tokens(toks)
        self._check_room(session, len(toks))
        outs = []
        for i in range(0, len(toks), self.prefill_block):
            if should_stop is not None and i and should_stop():
                raise Cancelled("cancelled during prefill")
            chunk = toks[i:i + self.prefill_block]
            out = self.backend.forward(session.state, chunk, last_only=not all_logits, observer=observer)
            if draft_context:
                self.backend.append_context(session.state, out.features,
                                            np.arange(session.position, session.position + len(chunk)))
            session.tokens.extend(chunk)
            if out.features is not None and self.backend.name == "cpu":
                session.features.append(out.features)
            outs.append(self.backend.to_host(out.logits) if all_logits else out.logits)
        return np.concatenate(outs) if all_logits else outs[-1][-1]

    def decode(self, session: Session, token: int, observer=None) -> np.ndarray:
        """One token at the session's position; returns its logits [V]."""
        self._check_tokens([int(token)])
        self._check_room(session, 1)
        out = self.backend.forward(session.state, [int(token)], last_only=True, observer=observer)
        session.tokens.append(int(token))
        return out.logits[-1]

    def decode_batch(self, pending) -> None:
        """Run the PendingDecodes of distinct sessions as one step where the backend can (`decode_batch`), else one
        by one; each is fulfilled with its logits [V], or with the error its decode raised (the generation that
        reads it raises it; a failed batched step fails every one of its rows)."""
        todo = []
        for p in pending:
            if p.done:
                continue
            try:
                self._check_tokens([p.token])
                self._check_room(p.session, 1)
            except EngineError as e:
                p.fulfil(error=e)
                continue
            todo.append(p)
        if len(todo) > 1 and hasattr(self.backend, "decode_batch"):
            try:
                rows = self.backend.decode_batch([p.session.state for p in todo], [p.token for p in todo])
            except Exception as e:  # noqa: BLE001 - delivered to every generation of the step
                for p in todo:
                    p.fulfil(error=e)
                return
            for b, p in enumerate(todo):
                p.session.tokens.append(p.token)
                p.fulfil(rows[b])
            return
        for p in todo:
            try:
                p.fulfil(self.decode(p.session, p.token))
            except Exception as e:  # noqa: BLE001
                p.fulfil(error=e)

    def logits(self, tokens, split: int | None = None, observer=None) -> np.ndarray:
        """Teacher-forced logits [T, V] of a fresh sequence: all by prefill, or with `split`=P the first P
        tokens by prefill and the rest one at a time through the decode path."""
        toks = [int(t) for t in tokens]
        s = self.new_session()
        if split is None or split >= len(toks):
            return self.prefill(s, toks, all_logits=True, observer=observer)
        parts = [self.prefill(s, toks[:split], all_logits=True, observer=observer)] if split > 0 else []
        for t in toks[max(split, 0):]:
            parts.append(self.backend.to_host(self.decode(s, t, observer=observer))[None])
        return np.concatenate(parts)

    def score(self, tokens, split: int | None = None) -> np.ndarray:
        """log p(token[i] | tokens[:i]) for i >= 1, float64 [T-1]."""
        lg = self.logits(tokens, split).astype(np.float64)
        lse = np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1)) + lg.max(-1)
        t = np.asarray(tokens[1:], dtype=np.int64)
        return lg[np.arange(len(t)), t] - lse[:-1]

    def warm_up(self, *, quiet: bool = False):
        """Compile (first run) or load from numba-cuda's disk cache every kernel a request uses, by a short prefill,
        decode steps and samples on a throwaway session (warmup.py); one line on stderr unless `quiet`. Returns the
        WarmUp report."""
        from ds4lib.engine.warmup import warm_up
        return warm_up(self, quiet=quiet)

    # ------------------------------------------------------------------ generation
    def generate_ids(self, prompt_ids, params: SamplingParams, session: Session | None = None, should_stop=None):
        """Yield generated token ids (EOS included, then stop) up to params.max_tokens. `should_stop()` is polled
        between prefill blocks (raising Cancelled); between tokens the caller simply stops iterating (close()).
        Without `session`, the prompt resumes from the prefix cache and the finished session is stored back."""
        s, rest = self._session_for(prompt_ids, session)
        return self._generate_ids(s, rest, params, should_stop, store=session is None)

    def _session_for(self, prompt_ids, session):
        if not prompt_ids:
            raise EngineError("the prompt is empty")
        if session is not None:
            return session, list(prompt_ids)
        s = self.resume(prompt_ids)
        return s, list(prompt_ids)[s.position:]

    def _generate_ids(self, s: Session, prompt_ids, params, should_stop, store: bool, progress: bool = False,
                      batched: bool = False, draft: bool = True):
        """With `progress`, also yields None after each prefill block but the last (a caller interleaving several
        generations steps each one block at a time). With `batched`, a plain-path token that a forward will follow
        is yielded as a PendingDecode of it (module docstring). `draft=False`: no speculative decoding for this
        request (the server's worker admitting it beside others: their batched rows share the weights as a verify
        call's rows would, and a drafting request's rounds would hold the others up)."""
        self._check_room(s, len(prompt_ids) + params.max_tokens if params.max_tokens else len(prompt_ids))
        clean = False                 # the state is consistent (no forward failed midway): it may be cached
        seeded_sampled = params.temperature > 0 and params.seed is not None and params.draft_k is None
        spec = self.speculative and draft and params.json_format is None and params.draft_k != 0 \
            and params.max_tokens > 1 and not seeded_sampled and not self._drafting_hopeless(params)
        self.last_spec_stats = None   # this request's counts: set by _generate_speculative, None on the plain path
        try:
            if progress:
                B = self.prefill_block
                for i in range(0, len(prompt_ids), B):
                    if i:
                        yield None
                        if should_stop is not None and should_stop():
                            raise Cancelled("cancelled during prefill")
                    logits = self.prefill(s, prompt_ids[i:i + B], draft_context=spec)
            else:
                logits = self.prefill(s, prompt_ids, should_stop=should_stop, draft_context=spec)
            seed = params.seed if params.seed is not None else int(np.random.SeedSequence().entropy % (1 << 63))
            if spec:
                yield from self._generate_speculative(s, logits, params, seed)
                clean = True
                return
            constraint = self._constraint(params)
            for step in range(params.max_tokens):
                if constraint is None:
                    tok = self.backend.sample(logits, params, seed, step)
                else:
                    tok = self.backend.sample(logits, params, seed, step, mask=constraint.mask())
                    constraint.advance(tok)
                follows = tok != EOS and not (constraint is not None and constraint.finished) \
                    and step < params.max_tokens - 1
                pending = PendingDecode(s, tok) if batched and follows else None
                yield tok if pending is None else pending
                if tok == EOS:
                    break
                if constraint is not None and constraint.finished:
                    yield EOS                     # the only token the grammar allows: no forward needed
                    break
                if not follows:
                    break
                logits = self.decode(s, tok) if pending is None else pending.logits()
            clean = True
        except (GeneratorExit, Cancelled):
            clean = True
            raise
        finally:
            if store and clean:
                self._retire(s)

    def _retire(self, s: Session):
        """A finished generation's session (consistent, and the engine's own): into the prefix cache if there is one,
        and its state back to the backend's pool where it keeps one (the cache then holds a copy,
        `detach_state`)."""
        be = self.backend
        if self.prefix_cache is not None:
            if hasattr(be, "detach_state"):
                state = be.detach_state(s.state)
            else:
                if hasattr(be, "park_state"):
                    be.park_state(s.state)
                state = s.state
            self.prefix_cache.store(s.tokens, state, s.features)
        elif hasattr(be, "release_state"):
            be.release_state(s.state)

    def _drafting_hopeless(self, params) -> bool:
        """The previous request of this kind measured that no round could beat plain steps (Scheduler.hopeless): this
        one decodes plainly, without the draft context rows and the per-step scheduling a speculative request would
        pay for nothing. Every RECHECK-th such request still runs the scheduler, so the verdict follows the costs."""
        prior = self.spec_priors.get(params.temperature == 0)
        if params.draft_k is not None or prior is None or not prior.hopeless():
            return False
        self._hopeless_runs += 1
        return self._hopeless_runs % self.RECHECK != 0

    def _generate_speculative(self, s, logits, params, seed):
        B = self.cfg.dspark_block_size
        fixed = params.draft_k
        stats = SpecStats(B)
        self.last_spec_stats = stats
        kind = params.temperature == 0                   # greedy and sampled requests accept differently
        sched = Scheduler(B, fixed, prior=self.spec_priors.get(kind))
        try:
            yield from generate_speculative(self, s, logits, params, seed, sched, stats)
        finally:
            self.spec_stats.add(stats)
            if fixed is None and sched.draft_s:
                self.spec_priors[kind] = sched           # the next request of this kind starts from its costs

    def _constraint(self, params: SamplingParams):
        if params.json_format is None:
            return None
        try:
            return self.constrainer.start(params.json_format)
        except GrammarError as e:
            raise EngineError(str(e)) from None

    def generate(self, prompt_ids, params: SamplingParams, session: Session | None = None, should_stop=None,
                 progress: bool = False, batched: bool = False, draft: bool = True):
        """Yield one {"type": "token", "id", "text"} event per generated token (EOS excepted), `text` being the new
        text, possibly empty (held back while it may be an incomplete UTF-8 character or the start of a stop
        string); at the end, held-back text that turned out not to start a stop string comes as one more event with
        id None; then {"type": "done", "finish_reason": "stop" | "length", "stop": the matched stop string or None,
        "completion_tokens", "text", "cached_tokens": prompt tokens taken from the prefix cache}. A stop string ends
        generation and is not emitted; EOS is not counted. With `progress`, {"type": "prefill", "position"} comes
        after each prefill block but the last, so that a caller can interleave generations block by block. With
        `batched`, a token event that a forward will follow also carries it as "decode" (a PendingDecode: module
        docstring); a stop string that ends the generation leaves it off. `draft=False`: no speculative decoding
        (`_generate_ids`)."""
        stops = tuple(s for s in params.stop if s)
        sess, rest = self._session_for(prompt_ids, session)
        gen = self._generate_ids(sess, rest, params, should_stop, store=session is None, progress=progress,
                                 batched=batched, draft=draft)
        try:                          # closing this generator closes the token stream at once (and caches it)
            yield from self._events(gen, stops, sess)
        finally:
            gen.close()

    def _events(self, gen, stops, sess):
        ids, emitted, finish, matched = [], "", "length", None
        decode = self.tokenizer.decode
        for tok in gen:
            if tok is None:
                yield {"type": "prefill", "position": sess.position}
                continue
            pending = None
            if isinstance(tok, PendingDecode):
                pending, tok = tok, tok.token
            if tok == EOS:
                finish = "stop"
                break
            ids.append(tok)
            text = decode(ids, skip_special_tokens=False)
            hits = sorted((text.find(s), s) for s in stops if s in text)
            if hits:
                finish, matched = "stop", hits[0][1]
                target = text[:hits[0][0]]
            else:
                target = text.rstrip("\ufffd")
                for s in stops:                   # hold back a tail that may grow into a stop string
                    for k in range(min(len(s) - 1, len(target)), 0, -1):
                        if target.endswith(s[:k]):
                            target = target[:-k]
                            break
            delta = ""
            if len(target) > len(emitted) and target.startswith(emitted):
                delta, emitted = target[len(emitted):], target
            ev = {"type": "token", "id": tok, "text": delta}
            if pending is not None and matched is None:
                ev["decode"] = pending
            yield ev
            if matched is not None:
                break
        if matched is None:
            text = decode(ids, skip_special_tokens=False)
            if len(text) > len(emitted) and text.startswith(emitted):
                yield {"type": "token", "id": None, "text": text[len(emitted):]}
                emitted = text
        yield {"type": "done", "finish_reason": finish, "stop": matched, "completion_tokens": len(ids),
               "text": emitted, "cached_tokens": sess.reused}

    def encode(self, text: str) -> list:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    @property
    def domain(self) -> str:
        """The domain the stack serves: the ② sidecar's recorded domain (its directory name when it records none),
        or "none" for the bare base."""
        if self.sidecar is None:
            return "none"
        return str(self.sidecar.manifest.get("notes", {}).get("domain") or self.sidecar.root.name)

    def describe(self) -> dict:
        return {"base": str(self.base.path), "backend": self.backend.name, "domain": self.domain,
                "sidecar": self.sidecar.fingerprint if self.sidecar else None,
                "posttrain": self.posttrain.fingerprint if self.posttrain else None,
                "context_length": self.context_length, "memory": self.memory.table(),
                "config": json.loads(json.dumps(self.cfg.to_flat_dict()))}
