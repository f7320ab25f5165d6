"""The ③ post-training file (docs/design.md §4): capture of margin rows on the deployment path and their check against
a real forward (the margin math lives in ds4lib.solvers.margins; the directory format in ds4lib.formats.sidecar)."""
from ds4lib.posttrain.capture import (MARGIN_RTOL, NORM_MODES, CaptureError, PositionCapture, RowCheck, RowMeta,
                                      capture_positions, capture_rows, check_rows, rows_from_capture)

__all__ = ["MARGIN_RTOL", "NORM_MODES", "CaptureError", "PositionCapture", "RowCheck", "RowMeta",
           "capture_positions", "capture_rows", "check_rows", "rows_from_capture"]
