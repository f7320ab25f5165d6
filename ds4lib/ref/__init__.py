"""The full-precision NumPy reference of DeepSeek V4.1: the teacher and the spec (never reads quantized
formats of our own)."""
from ds4lib.ref.model import ForwardOut, ReferenceModel, State

__all__ = ["ReferenceModel", "State", "ForwardOut"]
