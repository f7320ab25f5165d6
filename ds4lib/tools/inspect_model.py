"""`ds4 inspect PATH_OR_PRESET [--json]`: config, per-layer roles, tensor inventory and parameter counts.

PATH may be a checkpoint directory, a config.json, or a preset name (`v41-flash`, `tiny`).
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from ds4lib.config import ConfigError, ModelConfig
from ds4lib.engram_geometry import engram_geometry
from ds4lib.inventory import parameter_counts, tensor_inventory
from ds4lib.roles import layer_roles

__all__ = ["register", "inspect_model", "format_report"]


def _load(target: str) -> ModelConfig:
    p = Path(target)
    if p.exists():
        return ModelConfig.from_json(p)
    return ModelConfig.preset(target)


def inspect_model(cfg: ModelConfig) -> dict:
    roles = layer_roles(cfg)
    inv = tensor_inventory(cfg)
    geo = engram_geometry(cfg) if cfg.engram_layer_ids else None
    dtypes = Counter(s.dtype for s in inv.values())
    return {
        "config": cfg.to_flat_dict(),
        "ignored_config_keys": list(cfg.extra_keys),
        "roles": [{"layer": r.layer, "kind": r.kind, "ratio": r.ratio, "kv_src": r.kv_src, "idx_src": r.idx_src,
                   "engram": r.engram, "dspark_target": r.dspark_target, "experts": r.n_experts, "top_k": r.top_k,
                   "rope_base": r.rope_base, "yarn": r.yarn} for r in roles],
        "engram": None if geo is None else {
            "layer_ids": list(geo.layer_ids), "table_rows": list(geo.table_rows),
            "primes": [list(p) for p in geo.primes], "multipliers": [list(m) for m in geo.multipliers]},
        "tensors": {"count": len(inv), "by_dtype": dict(sorted(dtypes.items()))},
        "parameters": parameter_counts(cfg),
    }


def _fmt_n(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:,.3f} {unit}"
    return str(n)


def format_report(rep: dict) -> str:
    c = rep["config"]
    lines = ["DeepSeek V4.1 configuration",
             f"  vocab {c['vocab_size']}, dim {c['dim']}, layers {c['n_layers']} + {c['n_mtp_layers']} DSpark stages, "
             f"heads {c['n_heads']} x {c['head_dim']} (rope {c['rope_head_dim']}), q_lora {c['q_lora_rank']}, "
             f"o {c['o_groups']} x {c['o_lora_rank']}",
             f"  experts {c['n_routed_experts']} top-{c['n_activated_experts']} + {c['n_shared_experts']} shared, "
             f"width {c['moe_inter_dim']}; window {c['window_size']}; indexer {c['index_n_heads']} x "
             f"{c['index_head_dim']} top-{c['index_topk']}; candidates {c['candidate_topk_blocks']} x "
             f"{c['candidate_block_size']} from layer {c['candidate_source_layer']}",
             f"  mHC {c['hc_mult']} streams, {c['hc_sinkhorn_iters']} Sinkhorn iterations; norm eps {c['norm_eps']:g}; "
             f"context {c['max_position_embeddings']:,}",
             "", "Per-layer roles",
             f"  {'layer':>5} {'ratio':>5} {'kv':>4} {'idx':>4} {'engram':>6} {'experts':>9}  role"]
    for r in rep["roles"]:
        kv = r["kv_src"] if r["kv_src"] >= 0 else "-"
        ix = r["idx_src"] if r["idx_src"] >= 0 else "-"
        tgt = " (DSpark target)" if r["dspark_target"] else ""
        lines.append(f"  {r['layer']:>5} {r['ratio']:>5} {kv:>4} {ix:>4} {'yes' if r['engram'] else '-':>6} "
                     f"{r['experts']:>4}/{r['top_k']:<4}  {r['kind']}{tgt}")
    if rep["engram"]:
        e = rep["engram"]
        lines += ["", "Engram"]
        for lid, rows, mult in zip(e["layer_ids"], e["table_rows"], e["multipliers"]):
            lines.append(f"  layer {lid}: table rows {rows:,}; multipliers {mult}")
    t = rep["tensors"]
    lines += ["", f"Tensor inventory: {t['count']:,} tensors; " +
              ", ".join(f"{k} {v:,}" for k, v in t["by_dtype"].items())]
    pc = rep["parameters"]
    lines += ["", "Parameters (logical weights; block scales apart)",
              f"  total                 {_fmt_n(pc['total'])}",
              f"  Engram tables         {_fmt_n(pc['engram_tables'])}",
              f"  without Engram tables {_fmt_n(pc['total_without_engram_tables'])}",
              f"  DSpark stages         {_fmt_n(pc['dspark'])}",
              f"  active per token      {_fmt_n(pc['active_per_token'])}",
              f"  scale elements        {_fmt_n(pc['scale_elements'])}",
              f"  stored bytes          {pc['stored_bytes']:,}",
              "  by component:"]
    for k, v in pc["by_component"].items():
        lines.append(f"    {k:<26} {_fmt_n(v)}")
    if rep["ignored_config_keys"]:
        lines += ["", "Config keys not used by the text model: " + ", ".join(rep["ignored_config_keys"])]
    return "\n".join(lines)


def _run(args) -> int:
    try:
        cfg = _load(args.target)
    except ConfigError as e:
        print(f"ds4 inspect: {e}")
        return 2
    rep = inspect_model(cfg)
    print(json.dumps(rep, indent=2) if args.json else format_report(rep))
    return 0


def register(sub):
    p = sub.add_parser("inspect", help="print a model's config, layer roles, tensor inventory and parameter counts")
    p.add_argument("target", help="checkpoint directory, config.json, or preset (v41-flash, tiny)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_run)
