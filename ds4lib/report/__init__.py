"""Plotting, tables and save_summary() for notebooks. Functions take rows that ds4lib computed; nothing here
derives numbers."""
from ds4lib.report.quant_plots import (plot_bitwidth_curve, plot_layer_errors, plot_shared_vs_per_expert,
                                       size_table_markdown)
from ds4lib.report.sidecar_plots import plot_lambda_curves, plot_sidecar_layers, plot_stack_comparison
from ds4lib.report.summary import markdown_table, save_summary, to_jsonable

__all__ = ["plot_lambda_curves", "plot_sidecar_layers", "plot_stack_comparison", "plot_bitwidth_curve", "plot_layer_errors", "plot_shared_vs_per_expert", "size_table_markdown",
           "markdown_table", "save_summary", "to_jsonable"]
