"""Export the training model to the official checkpoint format, and load an official checkpoint back into it.

FP8 linears and FP4 experts are quantised exactly as QAT simulated them (ds4lib.synth.store_float), so the
exported FP4/FP8 model is the one the training forward computed with. Only the training run imports this.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ds4lib.formats.checkpoint import CheckpointReader, CheckpointWriter
from ds4lib.inventory import tensor_inventory
from ds4lib.synth import store_float

def official_state(model) -> dict:
    """{official name: float32 numpy} for every inventory tensor (scales excluded)."""
    sd = model.state_dict()
    out = {}
    for spec in tensor_inventory(model.cfg).values():
        if spec.is_scale:
            continue
        if spec.name not in sd:
            raise KeyError(f"training model has no parameter {spec.name}")
        out[spec.name] = sd[spec.name].detach().float().cpu().numpy()
    return out


def export_checkpoint(model, out_dir, extra_files=None, shard_bytes=15 << 20, metadata=None):
    return export_values(model.cfg, official_state(model), out_dir, extra_files, shard_bytes, metadata)


def export_values(cfg, values, out_dir, extra_files=None, shard_bytes=15 << 20, metadata=None):
    """`official_state` values (host arrays) -> an official checkpoint directory (no torch work: a
    background thread may run it while training goes on)."""
    writer = CheckpointWriter(out_dir, cfg, shard_bytes=shard_bytes, metadata=metadata)
    pending = {}
    for spec in tensor_inventory(cfg).values():
        if spec.is_scale:
            writer.add(spec.name, pending.pop(spec.name))
            continue
        arrays = store_float(spec, values[spec.name], cfg)
        writer.add(spec.name, arrays.pop(spec.name))
        pending.update(arrays)
    return writer.close(extra_files or {})


@torch.no_grad()
def load_official(model, ckpt_dir):
    """Set every parameter from a checkpoint (dequantised float32 values)."""
    r = CheckpointReader.open(ckpt_dir)
    sd = model.state_dict()
    for spec in tensor_inventory(model.cfg).values():
        if spec.is_scale:
            continue
        sd[spec.name].copy_(torch.from_numpy(np.ascontiguousarray(r.weight(spec.name))))
    return model


def load_model(ckpt_dir, token_map, cfg=None):
    """The training model (QAT on, eval mode) holding an official checkpoint's values; `cfg` defaults to the
    checkpoint's own config.json."""
    from ds4lib.config import ModelConfig
    from training.model import Model
    cfg = cfg or ModelConfig.from_json(Path(ckpt_dir) / "config.json")
    model = Model(cfg, qat=True, max_pos=4096)
    model.set_token_map(token_map)
    return load_official(model, ckpt_dir).eval()


def write_json(path, obj):
    path.write_text(json.dumps(obj, indent=2) + "\n")
