"""The ③ post-training file (docs/design.md §4): capture of margin rows on the deployment path and their check against
a real forward (capture), "keep top-1" rows of ordinary text (keep), the rival pass (rivals), the solve from requests with right answers and its gates (solve, `ds4 posttrain`), the
effect on requests solved on or held out (heldout) and the report's plot (plots). The margin math lives in
ds4lib.solvers.margins; the directory format in ds4lib.formats.sidecar."""
from ds4lib.posttrain.capture import (MARGIN_RTOL, NORM_MODES, CaptureError, PositionCapture, RowCheck, RowMeta,
                                      capture_positions, capture_rows, capture_text, check_rows, pair_coefficients,
                                      rows_from_capture)
from ds4lib.posttrain.keep import KeepRows, keep_rows, keep_slices
from ds4lib.posttrain.heldout import RequestsEffect, generation_examples, measure_requests
from ds4lib.posttrain.plots import plot_margins
from ds4lib.posttrain.rivals import logit_change, rival_pairs
from ds4lib.posttrain.solve import (NoDecisionPoints, PosttrainError, PosttrainReport, format_report, read_requests,
                                    solve_posttrain)

__all__ = ["MARGIN_RTOL", "NORM_MODES", "CaptureError", "PositionCapture", "RowCheck", "RowMeta",
           "capture_positions", "capture_rows", "capture_text", "check_rows", "pair_coefficients", "rows_from_capture", "KeepRows",
           "keep_rows", "keep_slices", "RequestsEffect",
           "generation_examples", "measure_requests", "plot_margins", "logit_change", "rival_pairs", "NoDecisionPoints", "PosttrainError",
           "PosttrainReport", "format_report", "read_requests", "solve_posttrain"]
