"""The ds4 engine: run the ① base with optional ② sidecar and ③ post-training gains on CPU or CUDA."""
from ds4lib.engine.constrain import GrammarError, JsonFormat, ToolCallFormat
from ds4lib.engine.engine import (Cancelled, Engine, EngineError, MemoryPlan, PendingDecode, SamplingParams,
    Session)
from ds4lib.ref.sampling import NonFiniteLogits

__all__ = ["Engine", "Session", "SamplingParams", "EngineError", "Cancelled", "MemoryPlan", "JsonFormat",
           "ToolCallFormat", "GrammarError", "NonFiniteLogits", "PendingDecode"]
