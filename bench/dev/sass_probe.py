"""Static SASS of kernels for sm_90, without a GPU: the instruction mix of each hot loop.

    python bench/dev/sass_probe.py vq_gemv:vq_gemv_kernel [module:kernel ...] [--nvdisasm PATH] [--dump DIR]
                                   [--contiguous]

Each kernel is compiled to PTX the way tests/kernels/compile_sm90.py does (its own launch bounds), assembled by
ptxas for sm_90 and disassembled by nvdisasm. The script then prints one JSON line per kernel: registers, spill
bytes, the instruction count, how many global loads are issued together before the first use of each (`loads`: a
batch of 1 waits a whole memory round trip alone), and for every loop that holds a load, a shared-memory load or an
MMA its first and last address, its length and its opcode counts, innermost first. A loop here is a backward branch
and the instructions it jumps over. `--dump DIR` keeps the PTX and the SASS.

Needs ptxas (the CUDA toolkit, as the sm_90 compile test does) and nvdisasm, which is not a dependency of the
project. nvdisasm is found from `--nvdisasm`, then $NVDISASM, then PATH. The NVIDIA wheel `nvidia-cuda-nvdisasm`
holds one: `pip download --no-deps nvidia-cuda-nvdisasm` and unzip it. Run it with NUMBA_ENABLE_CUDASIM unset.

`--contiguous` compiles every array argument as C-contiguous (`float32[:, ::1]` where SIGNATURES say
`float32[:, :]`). That is what runs: Numba's dispatcher types a contiguous device array with layout C, so the kernels
the engine launches are specialised for it, with the strides fixed at compile time. The SIGNATURES (layout A) are
what the sm_90 compile test builds and what the SASS tables of BENCHMARKS.md were read from up to the twenty-third
session; a kernel whose arguments include a strided view runs with layout A for that argument.

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


_REG = re.compile(r"\bR(\d+)\b")
_WIDTH = {"64": 2, "128": 4}


def _dest_regs(text):
    """The registers a load writes: its first operand and, for .64 / .128, the ones after it."""
    body = re.sub(r"^@!?U?P\w+\s+", "", text)
    op, _, rest = body.partition(" ")
    m = _REG.match(rest.strip())
    if not m:
        return set()
    width = next((w for suf, w in _WIDTH.items() if f".{suf}" in op), 1)
    return {int(m.group(1)) + i for i in range(width)}


def _src_regs(text):
    """The registers an instruction reads (every register operand after its first; a store's or a branch's all)."""
    body = re.sub(r"^@!?U?P\w+\s+", "", text)
    op, _, rest = body.partition(" ")
    ops = [o.strip() for o in rest.split(",")]
    reads = ops if op.split(".")[0] in ("ST", "STG", "STS", "RED", "ATOM", "ATOMG") else ops[1:]
    return {int(r) for o in reads for r in _REG.findall(o)}


def load_batches(insns):
    """Memory-level parallelism in straight-line order: for each global load (LDG, or LD: a generic one), the number
    of global loads issued from it up to the first instruction that reads what it loaded. A thread's independent
    loads issued one right before each use (batch 1) wait one memory round trip each (control flow is ignored)."""
    out = []
    for i, (_, text) in enumerate(insns):
        if opcode(text) not in ("LDG", "LD"):
            continue
        dest, n = _dest_regs(text), 1
        for _, later in insns[i + 1:]:
            if dest & _src_regs(later) or opcode(later) in ("BRA", "EXIT", "BAR", "RET"):
                break
            if opcode(later) in ("LDG", "LD"):
                n += 1
        out.append(n)
    return {"global_loads": len(out), "issued_alone": sum(1 for n in out if n == 1),
            "mean_batch": round(sum(out) / len(out), 2) if out else 0}


def contiguous_signature(sig):
    """The signature with every array argument C-contiguous: `float32[:, :]` -> `float32[:, ::1]`."""
    return re.sub(r"\[((?::, )*):\]", lambda m: "[" + m.group(1) + "::1]", sig)


def probe(target, nvdisasm, dump=None, contiguous=False):
    cu = compile_sm90._compiler()
    mod_name, kname = target.split(":")
    mod = importlib.import_module(mod_name if "." in mod_name else f"kernels.{mod_name}")
    sig = mod.SIGNATURES[kname]
    ptx = compile_sm90._ptx_of(cu, getattr(mod, kname), contiguous_signature(sig) if contiguous else sig)
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
    return {"kernel": target, "layout": "C" if contiguous else "as SIGNATURES", **res, "instructions": len(insns),
            "loads": load_batches(insns),
            "loops": loops(insns, labels)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("targets", nargs="+", help="module:kernel, as in kernels/<module>.py's SIGNATURES (a dotted "
                                               "module is imported as named: bench.dev.vq_lut:vq_lut_kernel)")
    ap.add_argument("--nvdisasm", help="path of nvdisasm (else $NVDISASM, else PATH)")
    ap.add_argument("--dump", help="folder to keep each kernel's PTX and SASS in")
    ap.add_argument("--contiguous", action="store_true",
                    help="array arguments C-contiguous, as the dispatcher specialises the engine's launches")
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
        print(json.dumps(probe(t, nvd, args.dump, args.contiguous)), flush=True)


if __name__ == "__main__":
    main()
