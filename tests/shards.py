"""The suite split into shards that run side by side (scripts/test.sh starts one pytest process a shard).

A shard is a set of whole test files: with DS4_TEST_SHARD=i/n, tests/conftest.py keeps the tests of the files this
module assigns to shard i and deselects the rest. Every process computes the same assignment from the same collected
files: longest first (the seconds in tests/shard_weights.tsv, a file the table lacks counting DEFAULT_SECONDS),
each onto the shard with the least so far, ties to the lower shard.

    python -m tests.shards DURLOG > tests/shard_weights.tsv   # the table from a per-test log (bench/pytest_durlog.py)
"""
import sys
from pathlib import Path

WEIGHTS = Path(__file__).with_name("shard_weights.tsv")
DEFAULT_SECONDS = 2.0


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


def assign(files, n: int, weights: dict[str, float]) -> dict[str, int]:
    """{file: shard} for n shards: the longest file first onto the least loaded shard (ties: the lower shard;
    files of equal weight in name order), so every process given the same files gets the same answer."""
    load = [0.0] * n
    out = {}
    for f in sorted(set(files), key=lambda f: (-weights.get(f, DEFAULT_SECONDS), f)):
        k = min(range(n), key=lambda j: (load[j], j))
        out[f] = k
        load[k] += weights.get(f, DEFAULT_SECONDS)
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
