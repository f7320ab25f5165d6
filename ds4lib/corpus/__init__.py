"""Offline, reproducible text corpora for ds4-tiny: sources, slices and the training set.

Pipeline (each step a function; `ds4 corpus ...` / `ds4 tokenizer train` call the same ones):

    build_corpus            pinned packages (pins) -> per-source JSON lines + manifest (cache/corpus/)
    reserve_documents       corpus -> documents held back for the fitting/judging slices (split)
    train_corpus_tokenizer  allowed documents -> data/tokenizer/ (ds4lib.tokenizer)
    build_slices            reserved documents + tokenizer -> data/slices/ (load_slice reads them)
    build_training_set      allowed documents + definition chats -> cache/corpus/train/*.npy

Modules: pins, fetch, document, markup, rserialize, dictionary, sources, build, split, slices,
definitions, training.
"""
from .build import build_corpus, load_manifest, load_source
from .document import Document
from .slices import Slice, SliceError, build_slices, load_slice
from .split import SLICE_PLAN, reserve_documents, slice_names
from .training import MIXTURE, TrainingSet, build_training_set, load_training_set, train_corpus_tokenizer

__all__ = ["build_corpus", "load_manifest", "load_source", "Document", "Slice", "SliceError", "build_slices",
           "load_slice", "SLICE_PLAN", "reserve_documents", "slice_names", "MIXTURE", "TrainingSet",
           "build_training_set", "load_training_set", "train_corpus_tokenizer"]
