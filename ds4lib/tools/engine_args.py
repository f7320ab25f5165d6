"""Command-line flags that open an engine stack, shared by `ds4`, `ds4 score`, `ds4 eval` and `ds4-server`."""
from __future__ import annotations

from ds4lib.tools.argtypes import finite_float

__all__ = ["add_engine_args", "add_prefix_cache_args", "open_engine"]


def add_engine_args(p, model_required: bool = True):
    p.add_argument("-m", "--model", required=model_required, help="the ① base GGUF file")
    p.add_argument("--zchain", default=None, help="② sidecar directory")
    p.add_argument("--posttrain", default=None, help="③ post-training directory (needs --zchain)")
    p.add_argument("--engram-dir", default=None, help="original checkpoint directory holding the Engram tables "
                                                      "(default: the one recorded in the base file)")
    p.add_argument("--cuda", action="store_true", help="run on the GPU (Numba CUDA kernels)")
    p.add_argument("--mem-budget-mb", type=finite_float(0.0, lo_open=True), default=None,
                   help="refuse to start if the stack needs more")
    p.add_argument("--no-dspark", action="store_true",
                   help="decode plainly: no speculative decoding with the DSpark draft stages (on by default where "
                        "the backend supports it)")


def add_prefix_cache_args(p, default_mb: float = 0.0):
    """Prefix KV reuse (ds4lib.engine.prefix_cache): for tools that serve conversations (ds4-server). With --cuda the
    states stay in device memory and the disk tier holds host snapshots of them."""
    p.add_argument("--prefix-cache-mb", type=finite_float(0.0), default=None,
                   help=f"memory for recent sessions' states (device memory with --cuda), reused by requests that "
                        f"extend them (default {default_mb:g}; 0 = off)")
    p.set_defaults(prefix_cache_default_mb=default_mb)
    p.add_argument("--kv-disk-dir", default=None, help="also keep those states on disk here (checksummed files; "
                                                       "survives restarts; servers of other model stacks or backends "
                                                       "may share it: each keeps its own subdirectory)")
    p.add_argument("--kv-disk-mb", type=finite_float(0.0, lo_open=True), default=4096.0,
                   help="size cap of this model stack's subdirectory of --kv-disk-dir, not of the whole directory "
                        "(default 4096)")


def open_engine(args, *, warm_up: bool = True):
    """The Engine the flags describe. With `warm_up` and --cuda, every kernel is compiled (first run) or loaded from
    the kernel cache before this returns, with one line on stderr (Engine.warm_up); the CPU backend compiles
    nothing, so there it is skipped."""
    from ds4lib.engine import Engine
    cache = {k: getattr(args, k) for k in ("prefix_cache_mb", "kv_disk_dir", "kv_disk_mb") if hasattr(args, k)}
    if cache and cache["prefix_cache_mb"] is None:
        cache["prefix_cache_mb"] = args.prefix_cache_default_mb
    engine = Engine(args.model, zchain=args.zchain, posttrain=args.posttrain, engram_dir=args.engram_dir,
                    backend="cuda" if args.cuda else "cpu", mem_budget_mb=args.mem_budget_mb,
                    dspark=not getattr(args, "no_dspark", False), **cache)
    if warm_up and args.cuda:
        engine.warm_up()
    return engine
