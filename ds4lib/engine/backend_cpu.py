"""The CPU backend: the reference forward (ds4lib.ref) over the quantised stack's values, with the official
activation quantise-dequantise on. Sampling by ds4lib.ref.sampling (the device sampler's specification).
Speculative decoding (engine/speculative.py): the DSpark stages draft (`propose`), the reference State marks and
rolls back exactly (`mark`, `rollback`), and `append_context` keeps the stages' context rings."""
from __future__ import annotations

import numpy as np

from ds4lib.engine.weights import StackWeights
from ds4lib.ref import ReferenceModel
from ds4lib.ref.sampling import sample

__all__ = ["CpuBackend"]


class CpuBackend:
    name = "cpu"

    def __init__(self, engine, gains, bias):
        self.engine = engine
        self.weights = StackWeights(engine.base, engine.engram_reader, gains, bias)
        self.model = ReferenceModel(engine.cfg, self.weights, engine.token_map, quant_sim=True)

    def new_state(self):
        return self.model.new_state()

    def forward(self, state, tokens, last_only=False, observer=None):
        return self.model.forward(tokens, state, last_only=last_only, observer=observer)

    def decode_batch(self, states, tokens):
        """One token for each of several distinct sessions in one reference call (ReferenceModel.forward_rows): the
        weights are read once for all rows; each row's logits [B, V] are those of its own decode step."""
        return self.model.forward_rows(np.asarray(tokens, dtype=np.int64), list(states)).logits

    def propose(self, state, anchor, start_pos, pick=None):
        """The DSpark proposal after positions <= start_pos with `anchor` at start_pos + 1 (ref dspark_propose).
        `pick`: None (greedy), a speculative.DraftDraw (sampled drafts, drawn here on the host) or pick(row) ->
        token."""
        from ds4lib.engine.speculative import DraftDraw
        if isinstance(pick, DraftDraw):
            pick = pick.host_pick(start_pos)
        return self.model.dspark_propose(state, anchor, start_pos, pick)

    def mark(self, state):
        return state.mark()

    def rollback(self, state, mark, kept_tokens):
        self.model.rollback(state, mark, kept_tokens)

    def append_context(self, state, features, positions):
        """DSpark context rows for fed positions; only the last window's rows can reach the rings."""
        W = self.model.cfg.window_size
        self.model.dspark_append(state, features[-W:], np.asarray(positions)[-W:])

    def copy_state(self, state):
        """A deep copy (the prefix cache hands these out; the reference State holds only arrays and numbers)."""
        return state.copy()

    def to_host(self, logits):
        return logits

    def sample(self, logits, params, seed, step, mask=None) -> int:
        """`mask`: int32 token bitmask [ceil(V / 32)] of a constrained step (ds4lib.ref.sampling), or None."""
        return int(sample(logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                          min_p=params.min_p, seed=seed, step=step, mask=mask))

    def memory_plan(self):
        from ds4lib.engine.engine import MemoryPlan
        cfg = self.engine.cfg
        ctx = self.engine.context_length
        f32 = 4
        state = 0
        for r in self.model.roles:
            state += cfg.window_size * cfg.head_dim * f32
            if r.owns_compressor:
                rows = -(-ctx // r.ratio)
                state += rows * cfg.head_dim * f32 * 2            # doubling growth: up to 2x the rows in use
                if r.indexer_owns_k:
                    state += rows * cfg.index_head_dim * f32 * 2
        B = self.engine.prefill_block
        scratch = f32 * B * (8 * cfg.hc_mult * cfg.dim + 3 * cfg.n_heads * (cfg.window_size + B + cfg.index_topk)
                             + 2 * cfg.vocab_size + 4 * cfg.moe_inter_dim * cfg.n_activated_experts)
        return MemoryPlan(weights=self.weights.dequantized_bytes(), state=state, scratch=scratch)
