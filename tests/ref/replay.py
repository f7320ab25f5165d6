"""Teacher-forced replay of the official test vectors through the reference, layer by layer.

Each layer gets the official input (the previous block's output and pre-mix), so a layer's result
is compared with the official one without the chaotic amplification of a random-weight network
(one BF16 ulp on 1% of the embedding moves its logits by ~9%)."""
import numpy as np


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-30))


def forced_call(model, ids, state, block_out, block_pre, on_layer):
    """Run one call with layer l's input forced to (block_out[l-1], block_pre[l-1]).
    `on_layer(l, h_out, pre_out, obs)` receives each layer's own result and its observations."""
    call = model.begin(ids, state)
    for l in range(model.cfg.n_layers):
        if l > 0:
            call.h, call.pre = block_out[l - 1].copy(), block_pre[l - 1].copy()
        obs = {}
        model.run_layer(call, l, lambda layer, name, v: obs.__setitem__(name, np.array(v)))
        on_layer(l, call.h, call.pre, obs)
    call.h, call.pre = block_out[-1].copy(), block_pre[-1].copy()
    return model.finish(call)

