"""The ② sidecar and ③ post-training directories: per-expert down-projection gains and router selection biases.

Layout of a directory (one format for both kinds):

    manifest.json     {"format": "ds4-sidecar", "version": 1, "kind": "sidecar" | "posttrain",
                       "config_sha256": sha256 of the model config, "layers": {"3": {"gains": true,
                       "bias": true, ...free per-layer notes...}}, "notes": {...}}
    gr_L03.bin        gains of layer 3: for each expert e (ascending), D/32 blocks of 17 bytes =
                      one UE8M0 scale byte + 16 bytes of E2M1 nibbles (low nibble = even channel).
                      The stored value is the delta: s_e[d] = 1 + e2m1(code) * scale.
    rb_L03.bin        router selection bias of layer 3: float32 little-endian [E], added to the
                      selection score only (never to the routing weights).
    base.fnv          (post-training only) FNV-1a 64-bit fingerprint, 16 hex digits, of the sidecar it was
                      solved against; the engine refuses any other pairing.

The fingerprint of a directory covers manifest.json and then exactly the files its manifest lists, in
manifest order (per layer: gr_ then rb_); each file contributes its name, a zero byte and its bytes. Other
files in the directory (notes, plots, a stray copy) do not change it. docs/formats.md describes all of this.
A UE8M0 scale byte of 255 is NaN in that format and is refused at load.

The engine applies g_eff = g_base * s_sidecar * s_posttrain to the down projection's output channels
(w2 rows) and adds both biases to the router's selection bias. A gain of exactly 1 (delta code 0) and a
bias of 0 leave the model bit-identical.
Shapes: E experts of the layer, D hidden (output channels of w2).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ds4lib.formats.fp4 import e2m1_decode, e2m1_encode, pack_nibbles, unpack_nibbles
from ds4lib.formats.fp8 import pow2_ceil_exponent, ue8m0_decode

__all__ = ["SidecarError", "Sidecar", "FORMAT", "VERSIONS", "fnv1a64", "config_fingerprint", "quantize_gains",
           "dequantize_gains", "write_sidecar", "read_sidecar", "directory_fingerprint", "listed_files",
           "write_layer_files", "write_manifest", "BLOCK_BYTES", "GROUP"]

FORMAT = "ds4-sidecar"
VERSIONS = (1,)
GROUP = 32
BLOCK_BYTES = 1 + GROUP // 2          # 17


class SidecarError(ValueError):
    """A sidecar or post-training directory that cannot be used with this model or this stack."""


FNV_OFFSET, FNV_PRIME = 0xCBF29CE484222325, 0x100000001B3


def _fnv1a64_py(data: bytes, h: int) -> int:
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h


_FNV_JIT = []


def _fnv_kernel():
    """The compiled byte loop (Numba on the CPU: uint64 arithmetic wraps modulo 2^64 as FNV needs), built once
    per process; FNV-1a is a strict byte-serial recurrence, so there is nothing to vectorise in NumPy."""
    if not _FNV_JIT:
        from numba import njit, uint64

        @njit(cache=True)
        def fnv(data, h):
            p = uint64(FNV_PRIME)
            for i in range(data.shape[0]):
                h = (h ^ uint64(data[i])) * p
            return h
        _FNV_JIT.append(fnv)
    return _FNV_JIT[0]


def fnv1a64(data: bytes, h: int = FNV_OFFSET) -> int:
    """FNV-1a 64-bit of `data`, continuing from `h`. Short inputs take the Python loop; long ones the
    compiled loop (a 40 MB sidecar in well under a second). Both give the same value."""
    if len(data) < 4096:
        return _fnv1a64_py(data, h)
    import numpy as _np
    return int(_fnv_kernel()(_np.frombuffer(data, dtype=_np.uint8), _np.uint64(h)))


def config_fingerprint(cfg) -> str:
    return hashlib.sha256(json.dumps(cfg.to_flat_dict(), sort_keys=True).encode()).hexdigest()


def quantize_gains(delta) -> np.ndarray:
    """delta [E, D] (s - 1) -> uint8 [E, D/32, 17] blocks on the FP4 lattice (scale 2^ceil(log2(amax/6)))."""
    delta = np.asarray(delta, dtype=np.float32)
    E, D = delta.shape
    if D % GROUP:
        raise SidecarError(f"gain vectors of length {D} are not a multiple of {GROUP}")
    g = delta.reshape(E, D // GROUP, GROUP)
    amax = np.abs(g).max(-1)
    exp = np.where(amax > 0, pow2_ceil_exponent(np.maximum(amax, 1e-30) / np.float32(6.0)), -127)
    exp = np.clip(exp, -127, 127)
    scale = np.ldexp(np.float32(1.0), exp).astype(np.float32)
    codes = e2m1_encode(g / scale[..., None])
    out = np.empty((E, D // GROUP, BLOCK_BYTES), dtype=np.uint8)
    out[..., 0] = (exp + 127).astype(np.uint8)
    out[..., 1:] = pack_nibbles(codes)
    return out


def dequantize_gains(blocks) -> np.ndarray:
    """uint8 [E, D/32, 17] -> gains s [E, D] (float32, 1 + delta)."""
    blocks = np.asarray(blocks, dtype=np.uint8)
    scale = ue8m0_decode(blocks[..., 0])
    vals = e2m1_decode(unpack_nibbles(blocks[..., 1:])) * scale[..., None]
    return (np.float32(1.0) + vals.reshape(blocks.shape[0], -1)).astype(np.float32)


@dataclass
class Sidecar:
    kind: str
    gains: dict = field(default_factory=dict)      # layer -> float32 [E, D]
    bias: dict = field(default_factory=dict)       # layer -> float32 [E]
    fingerprint: str = ""                           # FNV-1a of this directory's contents
    base_fnv: str | None = None                     # post-training: fingerprint of the sidecar it stacks on
    manifest: dict = field(default_factory=dict)
    root: Path = Path(".")                          # the directory it was read from


def listed_files(manifest: dict) -> list:
    """The data files a manifest lists, in manifest order (per layer: gains, then bias)."""
    out = []
    for key, info in manifest.get("layers", {}).items():
        l = int(key)
        if info.get("gains"):
            out.append(f"gr_L{l:02d}.bin")
        if info.get("bias"):
            out.append(f"rb_L{l:02d}.bin")
    return out


def directory_fingerprint(root) -> str:
    """FNV-1a 64 over manifest.json and the files it lists, in manifest order (nothing else in the directory)."""
    root = Path(root)
    man_bytes = (root / "manifest.json").read_bytes()
    try:
        man = json.loads(man_bytes)
    except json.JSONDecodeError as e:
        raise SidecarError(f"{root / 'manifest.json'}: not JSON ({e})") from None
    h = FNV_OFFSET
    for name in ["manifest.json"] + listed_files(man):
        f = root / name
        data = man_bytes if name == "manifest.json" else (f.read_bytes() if f.exists() else b"")
        h = fnv1a64(name.encode() + b"\0", h)
        h = fnv1a64(data, h)
    return f"{h:016x}"


def write_sidecar(root, cfg, *, kind: str, gain_deltas: dict | None = None, bias: dict | None = None,
                  base: "Sidecar | None" = None, layer_notes: dict | None = None, notes: dict | None = None) -> Path:
    """Write a directory. gain_deltas {layer: [E, D] s - 1}, bias {layer: [E]}; for kind='posttrain' pass
    the sidecar it was solved against as `base`. Writes into a temporary folder and renames it into place."""
    if kind not in ("sidecar", "posttrain"):
        raise SidecarError(f"unknown kind {kind!r}")
    root = Path(root)
    tmp = root.with_name(root.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    layers = {}
    for l, d in sorted((gain_deltas or {}).items()):
        E, _ = cfg.moe_shape(l)
        d = np.asarray(d, dtype=np.float32)
        if d.shape != (E, cfg.dim):
            raise SidecarError(f"layer {l}: gains {list(d.shape)}, expected [{E}, {cfg.dim}]")
        (tmp / f"gr_L{l:02d}.bin").write_bytes(quantize_gains(d).tobytes())
        layers.setdefault(str(l), {})["gains"] = True
    for l, b in sorted((bias or {}).items()):
        E, _ = cfg.moe_shape(l)
        b = np.asarray(b, dtype="<f4")
        if b.shape != (E,):
            raise SidecarError(f"layer {l}: bias {list(b.shape)}, expected [{E}]")
        (tmp / f"rb_L{l:02d}.bin").write_bytes(b.tobytes())
        layers.setdefault(str(l), {})["bias"] = True
    for l, note in (layer_notes or {}).items():
        layers.setdefault(str(l), {}).update(note)
    man = {"format": FORMAT, "version": VERSIONS[-1], "kind": kind, "config_sha256": config_fingerprint(cfg),
           "layers": layers, "notes": notes or {}}
    (tmp / "manifest.json").write_text(json.dumps(man, indent=1, sort_keys=True) + "\n")
    if kind == "posttrain":
        if base is None:
            raise SidecarError("a post-training file must name the sidecar it was solved against")
        (tmp / "base.fnv").write_text(base.fingerprint + "\n")
    _swap_into_place(tmp, root)
    return root


def _swap_into_place(tmp: Path, root: Path) -> None:
    """Move the finished `tmp` directory to `root`, keeping the previous `root` as NAME.old. The copy older than
    that is deleted only once the new directory is in place, so at every instant each version that existed
    before the call is still on disk (an interruption anywhere loses nothing but the older backup)."""
    old = root.with_name(root.name + ".old")
    stale = root.with_name(root.name + ".old.del")
    if root.exists():
        if old.exists():
            if stale.exists():
                shutil.rmtree(stale)
            os.replace(old, stale)
        os.replace(root, old)
    os.replace(tmp, root)
    if stale.exists():
        shutil.rmtree(stale)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_layer_files(root, cfg, layer: int, *, gain_blocks=None, bias=None) -> list:
    """Write one layer's files into an existing directory, each to a temporary name and renamed (used by the
    solver, which writes a directory layer by layer). gain_blocks: uint8 [E, D/32, 17] as `quantize_gains`
    returns; bias: [E]. The manifest is not touched: a file counts only once `write_manifest` lists it."""
    root = Path(root)
    E, _ = cfg.moe_shape(layer)
    names = []
    if gain_blocks is not None:
        g = np.asarray(gain_blocks, dtype=np.uint8)
        if g.shape != (E, cfg.dim // GROUP, BLOCK_BYTES):
            raise SidecarError(f"layer {layer}: gain blocks {list(g.shape)}, expected "
                               f"[{E}, {cfg.dim // GROUP}, {BLOCK_BYTES}]")
        _write_atomic(root / f"gr_L{layer:02d}.bin", g.tobytes())
        names.append(f"gr_L{layer:02d}.bin")
    if bias is not None:
        b = np.asarray(bias, dtype="<f4")
        if b.shape != (E,) or not np.isfinite(b).all():
            raise SidecarError(f"layer {layer}: bias must be {E} finite values")
        _write_atomic(root / f"rb_L{layer:02d}.bin", b.tobytes())
        names.append(f"rb_L{layer:02d}.bin")
    return names


def write_manifest(root, cfg, *, kind: str, layers: dict, notes: dict | None = None) -> Path:
    """Write manifest.json (temporary name, then rename). `layers` {layer: {"gains": bool, "bias": bool, ...}}."""
    if kind not in ("sidecar", "posttrain"):
        raise SidecarError(f"unknown kind {kind!r}")
    man = {"format": FORMAT, "version": VERSIONS[-1], "kind": kind, "config_sha256": config_fingerprint(cfg),
           "layers": {str(l): v for l, v in layers.items()}, "notes": notes or {}}
    path = Path(root) / "manifest.json"
    _write_atomic(path, (json.dumps(man, indent=1, sort_keys=True) + "\n").encode())
    return path


def read_sidecar(root, cfg, *, expect_kind: str | None = None) -> Sidecar:
    root = Path(root)
    man_path = root / "manifest.json"
    if not man_path.exists():
        raise SidecarError(f"{root}: no manifest.json (not a sidecar directory)")
    try:
        man = json.loads(man_path.read_text())
    except json.JSONDecodeError as e:
        raise SidecarError(f"{man_path}: not JSON ({e})") from None
    if man.get("format") != FORMAT:
        raise SidecarError(f"{root}: format {man.get('format')!r} is not {FORMAT!r}")
    if man.get("version") not in VERSIONS:
        raise SidecarError(f"{root}: format version {man.get('version')!r} is not one this engine knows "
                           f"({', '.join(map(str, VERSIONS))})")
    kind = man.get("kind")
    if expect_kind and kind != expect_kind:
        raise SidecarError(f"{root}: is a {kind!r} directory, expected {expect_kind!r}")
    if man.get("config_sha256") != config_fingerprint(cfg):
        raise SidecarError(f"{root}: solved for another model (config fingerprint differs)")
    sc = Sidecar(kind=kind, manifest=man, fingerprint=directory_fingerprint(root), root=root)
    for key, info in man.get("layers", {}).items():
        l = int(key)
        if not 0 <= l < cfg.n_all_layers:
            raise SidecarError(f"{root}: layer {l} does not exist in this model")
        E, _ = cfg.moe_shape(l)
        if info.get("gains"):
            f = root / f"gr_L{l:02d}.bin"
            raw = np.fromfile(f, dtype=np.uint8) if f.exists() else np.zeros(0, np.uint8)
            want = E * (cfg.dim // GROUP) * BLOCK_BYTES
            if raw.size != want:
                raise SidecarError(f"{f}: {raw.size} bytes, expected {want} (truncated or for another shape)")
            blocks = raw.reshape(E, cfg.dim // GROUP, BLOCK_BYTES)
            if (blocks[..., 0] == 255).any():
                e, b = np.argwhere(blocks[..., 0] == 255)[0]
                raise SidecarError(f"{f}: expert {e}, block {b}: scale byte 255 is NaN in UE8M0")
            sc.gains[l] = dequantize_gains(blocks)
        if info.get("bias"):
            f = root / f"rb_L{l:02d}.bin"
            raw = np.fromfile(f, dtype="<f4") if f.exists() else np.zeros(0, np.float32)
            if raw.size != E:
                raise SidecarError(f"{f}: {raw.size} values, expected {E}")
            if not np.isfinite(raw).all():
                raise SidecarError(f"{f}: non-finite router bias")
            sc.bias[l] = raw.astype(np.float32)
    if kind == "posttrain":
        f = root / "base.fnv"
        if not f.exists():
            raise SidecarError(f"{root}: a post-training directory needs base.fnv")
        sc.base_fnv = f.read_text().strip()
    return sc
