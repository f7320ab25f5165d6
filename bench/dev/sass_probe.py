"""Static SASS of kernels for sm_90, without a GPU: the instruction mix of each hot loop.

    python bench/dev/sass_probe.py vq_gemv:vq_gemv_kernel [module:kernel ...] [--nvdisasm PATH] [--dump DIR]

Each kernel is compiled to PTX the way tests/kernels/compile_sm90.py does (its own launch bounds), assembled by
ptxas for sm_90 and disassembled by nvdisasm. The script then prints one JSON line per kernel: registers, spill
bytes, the instruction count, and for every loop that holds a load, a shared-memory load or an MMA its first and
last address, its length and its opcode counts, innermost first. A loop here is a backward branch and the
instructions it jumps over. `--dump DIR` keeps the PTX and the SASS.

Needs ptxas (the CUDA toolkit, as the sm_90 compile test does) and nvdisasm, which is not a dependency of the
project. nvdisasm is found from `--nvdisasm`, then $NVDISASM, then PATH. The NVIDIA wheel `nvidia-cuda-nvdisasm`
holds one: `pip download --no-deps nvidia-cuda-nvdisasm` and unzip it. Run it with NUMBA_ENABLE_CUDASIM unset.

What it is for: a CPU-side check that a kernel change does what it meant to do at the instruction level (fewer
instructions a block in the loop, no new spills in it) before its timing on the H200. It does not replace the timing.
"""
import argparse
import collections
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.kernels import compile_sm90  # noqa: E402

_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"(\.L_x_\d+)")
_HOT = ("HMMA", "IMMA", "LDS", "LDG", "LD", "LDSM")


def find_nvdisasm(given=None):
    for cand in (given, os.environ.get("NVDISASM"), shutil.which("nvdisasm")):
        if cand and Path(cand).exists():
            return str(cand)
    return None


def parse_sass(text):
    """[(address, instruction text)] and {label: address of the instruction after it} of nvdisasm's output."""
    insns, labels, pending = [], {}, []
    for line in text.splitlines():
        s = line.strip()
        m = _LABEL.match(s)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSN.match(s)
        if m:
            addr = int(m.group(1), 16)
            insns.append((addr, m.group(2)))
            for name in pending:
                labels[name] = addr
            pending = []
    return insns, labels


def opcode(insn):
    """The opcode without its modifiers and predicate: '@!P0 LDG.E.128 R4, ...' -> 'LDG'."""
    body = re.sub(r"^@!?U?P\w+\s+", "", insn)
    return body.split()[0].split(".")[0]


def loops(insns, labels):
    """The loops (backward branches) that hold a hot instruction, innermost (shortest) first."""
    out = []
    for addr, text in insns:
        if opcode(text) != "BRA":
            continue
        m = _TARGET.search(text)
        if not m or labels.get(m.group(1), addr + 1) > addr:
            continue
        start = labels[m.group(1)]
        body = [t for a, t in insns if start <= a <= addr]
        mix = collections.Counter(opcode(t) for t in body)
        if any(mix[h] for h in _HOT):
            out.append({"start": hex(start), "end": hex(addr), "instructions": len(body),
                        "mix": dict(mix.most_common())})
    return sorted(out, key=lambda r: r["instructions"])


def probe(target, nvdisasm, dump=None):
    cu = compile_sm90._compiler()
    mod_name, kname = target.split(":")
    mod = importlib.import_module(f"kernels.{mod_name}")
    ptx = compile_sm90._ptx_of(cu, getattr(mod, kname), mod.SIGNATURES[kname])
    res = compile_sm90.ptxas_resources(ptx)
    with tempfile.TemporaryDirectory() as tmp:
        src, obj = Path(tmp) / f"{kname}.ptx", Path(tmp) / f"{kname}.o"
        src.write_text(ptx)
        subprocess.run([compile_sm90.ptxas_path(), "-arch=sm_90", "-c", "-o", str(obj), str(src)], check=True,
                       capture_output=True, text=True, timeout=300)
        sass = subprocess.run([nvdisasm, "-c", str(obj)], check=True, capture_output=True, text=True,
                              timeout=300).stdout
    if dump:
        Path(dump).mkdir(parents=True, exist_ok=True)
        (Path(dump) / f"{kname}.ptx").write_text(ptx)
        (Path(dump) / f"{kname}.sass").write_text(sass)
    insns, labels = parse_sass(sass)
    return {"kernel": target, **res, "instructions": len(insns), "loops": loops(insns, labels)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("targets", nargs="+", help="module:kernel, as in kernels/<module>.py's SIGNATURES")
    ap.add_argument("--nvdisasm", help="path of nvdisasm (else $NVDISASM, else PATH)")
    ap.add_argument("--dump", help="folder to keep each kernel's PTX and SASS in")
    args = ap.parse_args(argv)
    if os.environ.get("NUMBA_ENABLE_CUDASIM"):
        sys.exit("sass_probe: unset NUMBA_ENABLE_CUDASIM (the simulator cannot compile PTX)")
    if compile_sm90.ptxas_path() is None:
        sys.exit("sass_probe: ptxas not found (PATH or /usr/local/cuda/bin)")
    nvd = find_nvdisasm(args.nvdisasm)
    if nvd is None:
        sys.exit("sass_probe: nvdisasm not found: pass --nvdisasm or set NVDISASM "
                 "(pip download --no-deps nvidia-cuda-nvdisasm, then unzip the wheel)")
    for t in args.targets:
        if t.count(":") != 1:
            sys.exit(f"sass_probe: {t!r} is not module:kernel")
        print(json.dumps(probe(t, nvd, args.dump)), flush=True)


if __name__ == "__main__":
    main()
