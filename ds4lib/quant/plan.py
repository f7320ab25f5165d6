"""The base quantizer's plan: per-layer VQ widths (the bit plan) and the size table of a base file.

Owns: `BitPlan`, `default_n13`, `parse_bits_plan`, `size_table`, `format_size_table`. The tensor layout
itself (which official tensor becomes what) is ds4lib.formats.gguf.base_file_layout.

Bit plan. The shallowest backbone layers get 13-bit codebooks (8,192 codewords), the rest 12 bits (4,096);
DSpark stages are always 12-bit. The seed spends the 3.09 GB saved by shared codebooks on 14 of 40 layers;
a model with L backbone layers gets the same share, n13 = floor(L * 14/40 + 1/2) (8 layers -> 3, 40 -> 14),
which keeps the fraction of 13-bit layers, hence the extra bits per weight, the same at any depth.

Size table. Rows as in the seed's "What the 113.56 GB is made of"; the byte counts add up exactly to the
file size (the last row holds the GGUF header, metadata, the statistics tensor and alignment padding).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ds4lib.formats.gguf import ALIGNMENT
from ds4lib.formats.q4k import LINEAR_TYPES
from ds4lib.inventory import parameter_counts

__all__ = ["BitPlan", "default_n13", "parse_bits_plan", "size_table", "format_size_table", "SEED_SIZE_TABLE_GB",
           "N13_REAL", "N_LAYERS_REAL"]

N13_REAL = 14
N_LAYERS_REAL = 40
# The seed's table (GB = 1e9 bytes), for comparison columns.
SEED_SIZE_TABLE_GB = {"indices": 104.90, "gains": 0.30, "codebooks": 0.003, "q4k": 4.96, "draft": 2.56,
                      "stored": 0.85, "total": 113.56}


def default_n13(n_layers: int) -> int:
    """Number of shallowest backbone layers at 13 bits: the seed's 14 of 40, scaled (module docstring)."""
    return int(math.floor(n_layers * N13_REAL / N_LAYERS_REAL + 0.5))


@dataclass(frozen=True)
class BitPlan:
    bits: tuple          # one width per layer: backbone layers, then DSpark stages (always 12)
    spec: str            # the plan as given

    @property
    def n13(self) -> int:
        return sum(1 for b in self.bits if b == 13)


def parse_bits_plan(spec, cfg) -> BitPlan:
    """`auto` (default_n13 shallowest layers at 13 bits), an integer N (N shallowest at 13), or a comma list
    of 12/13 for every backbone layer (optionally followed by 12 for each DSpark stage)."""
    text = str(spec).strip().lower()
    L, S = cfg.n_layers, cfg.n_mtp_layers
    if text in ("auto", "default", ""):
        n13 = default_n13(L)
        return BitPlan(tuple([13] * n13 + [12] * (L - n13) + [12] * S), "auto")
    if "," not in text:
        try:
            n13 = int(text)
        except ValueError:
            raise ValueError(f"bits plan {spec!r}: expected 'auto', a count of 13-bit layers, or a comma list") \
                from None
        if not 0 <= n13 <= L:
            raise ValueError(f"bits plan {spec!r}: the count of 13-bit layers must be in 0..{L}")
        return BitPlan(tuple([13] * n13 + [12] * (L - n13) + [12] * S), str(n13))
    try:
        vals = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"bits plan {spec!r}: list entries must be 12 or 13") from None
    if len(vals) == L:
        vals += [12] * S
    if len(vals) != L + S or any(v not in (12, 13) for v in vals):
        raise ValueError(f"bits plan {spec!r}: need {L} (or {L + S}) entries of 12 or 13")
    if any(v != 12 for v in vals[L:]):
        raise ValueError(f"bits plan {spec!r}: DSpark stages are always 12-bit")
    return BitPlan(tuple(vals), ",".join(str(v) for v in vals))


def _pad(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def size_table(cfg, layout, header_len: int, bits) -> dict:
    """Bytes of the base file by part (see module docstring); `total_bytes` equals the file size."""
    parts = {k: 0 for k in ("indices", "gains", "codebooks", "q4k", "draft", "stored", "overhead")}
    fallback = {k: 0 for k in LINEAR_TYPES}
    for t in layout:
        pad = _pad(t.nbytes) - t.nbytes
        parts["overhead"] += pad
        if t.kind.startswith("vq_"):
            if t.layer >= cfg.n_layers:
                key = "draft"
            else:
                key = {"vq_index": "indices", "vq_plane": "indices", "vq_gain": "gains",
                       "vq_codebook": "codebooks"}[t.kind]
        elif t.kind in LINEAR_TYPES:
            key = "q4k"
            fallback[t.kind] += 1
        elif t.kind == "stats":
            key = "overhead"
        else:
            key = "stored"
        parts[key] += t.nbytes
    parts["overhead"] += header_len
    n12 = sum(1 for b in bits[:cfg.n_layers] if b == 12)
    n13 = sum(1 for b in bits[:cfg.n_layers] if b == 13)
    fb = ", ".join(f"{n} tensors {k}" for k, n in fallback.items() if k != "q4_K" and n)
    formats = {
        "indices": f"VQ-8, {n12} layers x 12 bit + {n13} layers x 13 bit",
        "gains": "f16",
        "codebooks": f"{cfg.n_layers} x E4M3",
        "q4k": "q4_K" + (f" (not a multiple of 256: {fb})" if fb else " (+ DSpark/Engram/Markov linears)"),
        "draft": f"VQ-8, 12 bit ({cfg.n_mtp_layers} stages: indices, gains, codebooks)",
        "stored": "as shipped (BF16 / F32 / FP8)",
        "overhead": "GGUF header, metadata, stats tensor, 128-byte alignment",
    }
    labels = {
        "indices": "Routed-expert indices", "gains": "Row gains", "codebooks": "Codebooks",
        "q4k": "Attention, shared experts, embedding, output head",
        "draft": "Speculative draft towers (DSpark routed experts)", "stored": "Everything else",
        "overhead": "File overhead",
    }
    total = sum(parts.values())
    counts = parameter_counts(cfg)
    weights = counts["total_without_engram_tables"]
    routed = counts["by_component"].get("routed_experts", 0)
    rows = [{"key": k, "part": labels[k], "format": formats[k], "bytes": int(v), "gb": v / 1e9}
            for k, v in parts.items()]
    return {"rows": rows, "total_bytes": int(total), "total_gb": total / 1e9, "weights": int(weights),
            "bits_per_weight": 8.0 * total / weights,
            "routed_bits_per_weight": 8.0 * (parts["indices"] + parts["gains"] + parts["codebooks"]) / routed
            if routed else 0.0,
            "q4k_fallback_tensors": {k: n for k, n in fallback.items() if k != "q4_K"}}


def format_size_table(table: dict, seed: bool = False) -> str:
    """The size table as text (GB = 1e9 bytes); `seed` adds the seed's column for comparison."""
    head = f"{'Part':<52} {'Format':<58} {'GB':>9}" + (f" {'seed GB':>8}" if seed else "")
    lines = [head, "-" * len(head)]
    for r in table["rows"]:
        extra = f" {SEED_SIZE_TABLE_GB.get(r['key'], float('nan')):>8.3f}" if seed else ""
        lines.append(f"{r['part']:<52} {r['format']:<58} {r['gb']:>9.4f}{extra}")
    extra = f" {SEED_SIZE_TABLE_GB['total']:>8.2f}" if seed else ""
    total = f"Total ({table['total_bytes']:,} bytes)"
    bpw = f"{table['bits_per_weight']:.3f} bits/weight overall, {table['routed_bits_per_weight']:.3f} routed"
    lines.append(f"{total:<52} {bpw:<58} {table['total_gb']:>9.4f}{extra}")
    return "\n".join(lines)
