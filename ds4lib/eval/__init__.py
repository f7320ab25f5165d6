"""Quality measurement: one comparator (metrics.compare) for every number, teacher logits from the reference."""
from ds4lib.eval.metrics import Comparison, compare, merge, per_position
from ds4lib.eval.slices import evaluate_slice, evaluate_windows
from ds4lib.eval.teacher import Teacher

__all__ = ["Comparison", "compare", "merge", "per_position", "evaluate_slice", "evaluate_windows", "Teacher"]
