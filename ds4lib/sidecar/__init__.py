"""The ② domain sidecar solver: teacher fixture, capture on the deployment path, router-bias and gain solves
layer by layer with their gates (the math lives in ds4lib.solvers; the directory format in
ds4lib.formats.sidecar; our description in docs/sidecar.md)."""
from ds4lib.sidecar.capture import CaptureError, LayerCapture, capture_layer, reconstruct
from ds4lib.sidecar.compare import compare_stacks
from ds4lib.sidecar.fixture import TeacherFixture, build_fixture, fixture_sequences
from ds4lib.sidecar.solve import GATE, SidecarReport, SolveError, heldout_mask, solve_sidecar

__all__ = ["CaptureError", "LayerCapture", "capture_layer", "reconstruct", "compare_stacks", "TeacherFixture",
           "build_fixture", "fixture_sequences", "GATE", "SidecarReport", "SolveError", "heldout_mask",
           "solve_sidecar"]
