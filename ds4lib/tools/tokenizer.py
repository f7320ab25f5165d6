"""`ds4 tokenizer train | info`: argparse -> dataclass -> ds4lib entry points.

    ds4 tokenizer train [--corpus DIR] [--out DIR] [--per-source-bytes N]
    ds4 tokenizer info [--path FILE]

`train` needs the corpus (`ds4 corpus build`) and writes `data/tokenizer/` by default; `info`
prints the vocabulary size, the special ids and the Engram compressed vocabulary size.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ..config import Env

__all__ = ["register", "TrainCommand", "InfoCommand"]


@dataclass(frozen=True)
class TrainCommand:
    corpus: Path
    out: Path
    per_source_bytes: int

    def run(self) -> int:
        from ..corpus.training import train_corpus_tokenizer
        t = time.perf_counter()
        path = train_corpus_tokenizer(corpus_dir=self.corpus, out_dir=self.out, per_source_bytes=self.per_source_bytes)
        print(f"tokenizer written to {path} ({path.stat().st_size / 1e3:.0f} KB) in {time.perf_counter() - t:.1f} s")
        return InfoCommand(path).run()


@dataclass(frozen=True)
class InfoCommand:
    path: Path

    def run(self) -> int:
        from ..tokenizer import SPECIAL_TOKENS, load_tokenizer, tokenizer_sha256
        from ..tokenmap import compressed_token_map
        tok = load_tokenizer(self.path)
        _, compressed = compressed_token_map(tok)
        print(f"{self.path}: sha256 {tokenizer_sha256(self.path)}")
        print(f"vocab {tok.get_vocab_size(with_added_tokens=True)}, Engram compressed vocab {compressed}")
        for s in SPECIAL_TOKENS:
            print(f"  {s.id}  {s.text}  ({s.role})")
        return 0


def register(subparsers) -> None:
    from ..tokenizer import TOKENIZER_DIR
    cache = Env.read().cache_dir
    p = subparsers.add_parser("tokenizer", help="train or inspect the byte-level BPE tokenizer")
    sub = p.add_subparsers(dest="tokenizer_command", required=True)
    t = sub.add_parser("train", help="train on the training-set sample of the corpus")
    t.add_argument("--corpus", default=str(cache / "corpus"))
    t.add_argument("--out", default=str(TOKENIZER_DIR))
    t.add_argument("--per-source-bytes", type=int, default=2_000_000)
    t.set_defaults(func=lambda a: TrainCommand(Path(a.corpus), Path(a.out), a.per_source_bytes).run())
    i = sub.add_parser("info", help="vocabulary, special ids, Engram compressed vocabulary size")
    i.add_argument("--path", default=str(TOKENIZER_DIR / "tokenizer.json"))
    i.set_defaults(func=lambda a: InfoCommand(Path(a.path)).run())

