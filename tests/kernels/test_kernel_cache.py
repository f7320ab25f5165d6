"""numba-cuda's on-disk kernel cache: where it lives (ds4lib.config.Env, kernels/__init__.py), that every kernel
declares it, and that a lookup finds the kernel that was saved and no other (docs/toolchain.md §4.5).

A real save and load needs a GPU (numba-cuda links the cubin before it caches); what decides a hit does not: the
index file and the index key of each kernel's signature, read here from a child process without the simulator
(tests/kernels/compile_sm90.py --cache)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ds4lib.config import Env

ROOT = Path(__file__).resolve().parents[2]

# Modules whose kernels do not declare cache=True yet (none today); a module listed here runs as a strict xfail, so
# the set cannot go stale.
PENDING = set()


def _clear(monkeypatch):
    for k in ("DS4_KERNEL_CACHE", "NUMBA_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(k, raising=False)


def test_kernel_cache_dir_default_and_overrides(monkeypatch, tmp_path):
    _clear(monkeypatch)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert Env.read().kernel_cache_dir == tmp_path / "home" / ".cache" / "ds4" / "numba"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")            # the XDG spec: absolute paths only
    assert Env.read().kernel_cache_dir == tmp_path / "home" / ".cache" / "ds4" / "numba"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert Env.read().kernel_cache_dir == tmp_path / "xdg" / "ds4" / "numba"
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))
    assert Env.read().kernel_cache_dir == tmp_path / "numba"
    monkeypatch.setenv("DS4_KERNEL_CACHE", str(tmp_path / "ds4k"))
    assert Env.read().kernel_cache_dir == tmp_path / "ds4k"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DS4_KERNEL_CACHE", "rel")                       # fixed against the directory of the read
    assert Env.read().kernel_cache_dir == tmp_path / "rel"


def test_kernels_package_points_numba_cuda_at_the_cache():
    import kernels
    from numba.cuda.core import config
    assert config.CACHE_DIR == str(kernels.KERNEL_CACHE_DIR)
    assert kernels.KERNEL_CACHE_DIR == Env.read().kernel_cache_dir / f"kernels-{kernels.source_fingerprint()}"


def test_source_fingerprint_follows_every_kernel_source_and_the_formats_they_import(tmp_path):
    """A device function in another module, or a ds4lib.formats constant, is frozen into a kernel without being
    part of numba's key: such an edit must move the cache to a fresh directory."""
    from kernels import source_fingerprint
    (tmp_path / "ds4lib").mkdir()
    shutil.copytree(ROOT / "kernels", tmp_path / "kernels", ignore=shutil.ignore_patterns("__pycache__", "dev"))
    shutil.copytree(ROOT / "ds4lib" / "formats", tmp_path / "ds4lib" / "formats",
                    ignore=shutil.ignore_patterns("__pycache__"))
    here = tmp_path / "kernels"
    assert source_fingerprint(here) == source_fingerprint()
    formats = sorted((tmp_path / "ds4lib" / "formats").glob("*.py"))
    sources = "".join(p.read_text() for p in here.glob("*.py"))
    imported = [p for p in formats if f"from ds4lib.formats.{p.stem} import" in sources]
    not_imported = next(p for p in formats if p not in imported and p.stem != "__init__")
    assert imported, "no kernel module imports ds4lib.formats constants any more: update this test"
    edits = [here / "bf16.py", imported[0]]
    seen = {source_fingerprint(here)}
    for p in edits:
        p.write_text(p.read_text() + "\n# edited\n")
        seen.add(source_fingerprint(here))
    assert len(seen) == 1 + len(edits)
    before = source_fingerprint(here)
    not_imported.write_text(not_imported.read_text() + "\n# edited\n")
    assert source_fingerprint(here) == before


def _cache_rows(cache_root: Path, hashseed: str) -> list:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "NUMBA_CACHE_DIR")}
    env.update(DS4_KERNEL_CACHE=str(cache_root), PYTHONHASHSEED=hashseed)
    p = subprocess.run([sys.executable, "-m", "tests.kernels.compile_sm90", "--cache"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert rows, p.stderr[-3000:]
    return rows


@pytest.fixture(scope="module")
def cache_rows(tmp_path_factory):
    root = tmp_path_factory.mktemp("kernel_cache")
    return root, _cache_rows(root, "1"), _cache_rows(root, "2")


def _modules():
    import pkgutil

    import kernels
    mods = [i.name for i in pkgutil.iter_modules(kernels.__path__)
            if "SIGNATURES" in (ROOT / "kernels" / f"{i.name}.py").read_text()]
    return [pytest.param(m, marks=pytest.mark.xfail(strict=True, reason="cache=True pending in a rewrite"))
            if m in PENDING else m for m in mods]


@pytest.mark.parametrize("module", _modules())
def test_every_kernel_declares_the_disk_cache(cache_rows, module):
    root, rows, _ = cache_rows
    mine = [r for r in rows if r["module"] == module]
    assert mine, f"kernels.{module} lists SIGNATURES but no kernel was found"
    missing = [r["kernel"] for r in mine if not r["cached"]]
    assert not missing, f"kernels.{module}: @cuda.jit without cache=True: {missing}"
    import kernels
    for r in mine:                               # numba-cuda adds one level per source directory below ours
        assert Path(r["dir"]).parent == root / kernels.KERNEL_CACHE_DIR.name, r


def test_a_cache_lookup_finds_its_own_kernel_in_a_later_process(cache_rows):
    """Each kernel's (index file, key) is unique, so a hit cannot return another kernel; a factory's kernels share
    an index file and differ by the closure variables in the key. The same pairs come back in a second process
    (another hash seed), so a warm cache hits."""
    _, rows, again = cache_rows
    entries = {}
    for r in rows:
        entries.setdefault((r["index"], r["key"]), []).append(f"{r['module']}:{r['kernel']}")
    assert not [k for k in entries.values() if len(k) > 1], "kernels that would share one cache entry"
    shared = {}
    for r in rows:
        shared.setdefault(r["index"], set()).add(r["kernel"])
    assert any(len(v) > 1 for v in shared.values()), "expected factory-built kernels sharing an index file"
    assert [(r["kernel"], r["index"], r["key"]) for r in again] == [(r["kernel"], r["index"], r["key"]) for r in rows]
