"""Offline math of the toolchain: (weights, format, knobs) -> (codes, scales, stats). No files, model objects or
argparse; no kernels (a CUDA path plugs in through a backend object, see ds4lib.solvers.vq.LloydBackend)."""
from ds4lib.solvers.gains import (LAMBDAS, GainProblem, GainSolution, choose_lambda, heldout_gain, make_problem,
                                  solve_gains)
from ds4lib.solvers.router_bias import ALPHAS, MIN_EVENTS, BiasSolution, same_set_rate, solve_router_bias
from ds4lib.solvers.vq import (CpuLloyd, LloydBackend, PreparedCodebook, TrainResult, assign_reference,
                               equidistant, finalize_update, matrix_error, normalize_rows, prepare_codebook,
                               round_sig12, row_gains, train_codebook)

__all__ = ["LAMBDAS", "GainProblem", "GainSolution", "choose_lambda", "heldout_gain", "make_problem", "solve_gains",
           "ALPHAS", "MIN_EVENTS", "BiasSolution", "same_set_rate", "solve_router_bias",
           "CpuLloyd", "LloydBackend", "PreparedCodebook", "TrainResult", "assign_reference", "equidistant",
           "finalize_update", "matrix_error", "normalize_rows", "prepare_codebook", "round_sig12", "row_gains",
           "train_codebook"]
