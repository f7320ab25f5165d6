"""The suite split into shards that run side by side (scripts/test.sh starts one pytest process a shard).

A shard is a set of whole test files: with DS4_TEST_SHARD=i/n, tests/conftest.py keeps the tests of the files this
module assigns to shard i and deselects the rest. Every process computes the same assignment from the same collected
files: longest first (the seconds in tests/shard_weights.tsv, a file the table lacks counting DEFAULT_SECONDS),
each onto the shard with the least so far, ties to the lower shard.

Files that read sm_90 PTX (tests/kernels/compile_sm90's ptx_counts / ptx_texts) share a shard with PTX_SOURCE, the
compile test, whose PTX stays in its process for them: in another process they compile their kernels again (the
fused mixes' ticket test took 149 s there against 7 s beside it). They run after it because they sort after it in
tests/kernels; the group is placed as one file of their summed seconds.

    python -m tests.shards DURLOG > tests/shard_weights.tsv   # the table from a per-test log (bench/pytest_durlog.py)
"""
import math
import sys
from pathlib import Path

WEIGHTS = Path(__file__).with_name("shard_weights.tsv")
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SECONDS = 2.0
PTX_SOURCE = "tests/kernels/test_compile_sm90.py"      # compiles every kernel; its PTX stays in its process
PTX_READERS = ("ptx_counts(", "ptx_texts(")             # what a file calls to read that PTX


def parse_shard(text: str) -> tuple[int, int]:
    """"i/n" -> (i, n) with 0 <= i < n; anything else raises ValueError naming DS4_TEST_SHARD."""
    try:
        i, n = (int(p) for p in text.split("/"))
    except ValueError:
        raise ValueError(f"DS4_TEST_SHARD={text!r}: expected i/n, e.g. 0/2") from None
    if not 0 <= i < n:
        raise ValueError(f"DS4_TEST_SHARD={text!r}: need 0 <= i < n")
    return i, n


def read_weights(path: Path = WEIGHTS) -> dict[str, float]:
    """{test file relative to the repository root: seconds} from a table of "seconds<TAB>file" lines."""
    weights = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                seconds, name = line.split("\t")
                weights[name] = float(seconds)
    return weights


def ptx_groups(files, root: Path = ROOT) -> dict[str, str]:
    """{file: PTX_SOURCE} for each collected test file (other than PTX_SOURCE) whose text calls a PTX reader, when
    PTX_SOURCE is collected too; {} otherwise."""
    files = set(files)
    if PTX_SOURCE not in files:
        return {}
    out = {}
    for f in sorted(files - {PTX_SOURCE}):
        path = root / f
        if path.is_file() and any(r in path.read_text(errors="replace") for r in PTX_READERS):
            out[f] = PTX_SOURCE
    return out


def assign(files, n: int, weights: dict[str, float], together: dict[str, str] | None = None) -> dict[str, int]:
    """{file: shard} for n shards: the longest unit first onto the least loaded shard (ties: the lower shard; units
    of equal weight in name order), so every process given the same files gets the same answer. A unit is a file,
    or a file f and every file that `together` ({file: f}) sends with it, weighing their sum (math.fsum: exactly
    rounded, so the same in any order). Each shard's process computes this on its own: a sum that followed a set's
    iteration order differed by an ulp between processes with different hash seeds, the greedy loads came out
    within an ulp of each other, and the shards disagreed, running some files twice and others not at all
    (thirty-eighth session: 188 of 1,163 tests in no shard)."""
    together = together or {}
    present = set(files)
    units = {}
    for f in sorted(present):                   # never in a set's order: that follows the process's hash seed
        lead = together.get(f, f)
        units.setdefault(lead if lead in present else f, []).append(f)
    weight = {u: math.fsum(weights.get(f, DEFAULT_SECONDS) for f in members) for u, members in units.items()}
    load = [0.0] * n
    out = {}
    for u in sorted(units, key=lambda u: (-weight[u], u)):
        k = min(range(n), key=lambda j: (load[j], j))
        for f in units[u]:
            out[f] = k
        load[k] += weight[u]
    return out


def weights_from_durlog(lines) -> dict[str, float]:
    """Per-file seconds from bench/pytest_durlog.py's "seconds<TAB>node id" lines."""
    per_file = {}
    for line in lines:
        if line.strip():
            seconds, nodeid = line.rstrip("\n").split("\t")
            name = nodeid.split("::")[0]
            per_file[name] = per_file.get(name, 0.0) + float(seconds)
    return per_file


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit("usage: python -m tests.shards DURLOG > tests/shard_weights.tsv")
    with open(argv[0]) as f:
        per_file = weights_from_durlog(f)
    print(f"# seconds a test file took (from {Path(argv[0]).name}); tests/shards.py balances the shards with them")
    for name, seconds in sorted(per_file.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"{seconds:.1f}\t{name}")


if __name__ == "__main__":
    main()
