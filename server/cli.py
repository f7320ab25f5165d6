"""`ds4-server -m BASE.gguf [--zchain DIR] [--posttrain DIR] [--engram-dir DIR] [--mem-budget-mb MB] [--cuda]
[--prefix-cache-mb MB] [--kv-disk-dir DIR] [--kv-disk-mb MB] [--host 127.0.0.1] [--port 8000] [--alias NAME]
[--model-alias NAME ...] [--max-running N] [--max-queue N] [--threads N] [--default-max-tokens N]
[--sse-keepalive-s S]`

Serves the stack under waitress (a production WSGI server, not Flask's development server). The port opens at once
and /health answers 503 (status "loading", then "warming_up") while the engine loads on the worker thread and then
runs every kernel once (`Engine.warm_up`: the CUDA kernels compile on a first run and load from the kernel cache
after that), so that the first request pays neither. Listening at once with a 503 is what load balancers and
orchestrators expect of a starting instance: a readiness check keeps it out of rotation, a liveness check sees it
alive (a closed port looks like a crash). If loading fails the process exits with status 1 and the reason. SIGTERM
and Ctrl-C stop it: running and queued requests get a 503 error. The engine flags are the seed's, shared with `ds4`
(ds4lib.tools.engine_args).
"""
from __future__ import annotations

import _thread
import argparse
import logging
import signal
import sys
import time
from pathlib import Path

from ds4lib.tools.argtypes import finite_float, int_at_least
from ds4lib.tools.engine_args import add_engine_args, add_prefix_cache_args, open_engine

__all__ = ["main", "build_parser"]

log = logging.getLogger("ds4.server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds4-server", description="Serve a ds4 stack over OpenAI- and Anthropic-style "
                                "HTTP APIs, with a chat page at /.")
    add_engine_args(p)
    add_prefix_cache_args(p, default_mb=1024.0)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 = LAN)")
    p.add_argument("--port", type=int_at_least(0), default=8000, help="port (default 8000; 0 = any free port)")
    p.add_argument("--alias", default=None, help="model name the API reports (default: the base file's stem)")
    p.add_argument("--model-alias", action="append", default=[], metavar="NAME",
                   help="another model name requests may use (repeatable); any other name gets a 404. The served "
                        "name and deepseek-reasoner (thinking on) are always accepted")
    p.add_argument("--max-running", type=int_at_least(1), default=4,
                   help="requests the engine interleaves, one token (or prefill block) of each in turn (default 4)")
    p.add_argument("--max-queue", type=int_at_least(0), default=32,
                   help="requests allowed to wait for a running slot; more get a 429 with Retry-After")
    p.add_argument("--threads", type=int_at_least(1), default=None,
                   help="HTTP threads (default: max-queue + max-running + 8, since each waiting or running request "
                        "holds one and /health, /metrics and the page need a few more)")
    p.add_argument("--sse-keepalive-s", type=finite_float(0.0), default=15.0,
                   help="a stream that waits this long (queue, long prefill) gets an SSE comment line; 0 = never")
    p.add_argument("--default-max-tokens", type=int_at_least(1), default=4096,
                   help="generation length when a request gives none (capped by the context)")
    return p


def _load(args):
    def load():
        t0 = time.perf_counter()
        log.info("loading %s (%s backend) ...", args.model, "cuda" if args.cuda else "cpu")
        engine = open_engine(args, warm_up=False)     # the worker warms it up, with /health saying so
        log.info("loaded in %.1f s: context %d tokens; %s", time.perf_counter() - t0, engine.context_length,
                 engine.memory.table())
        return engine
    return load


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)
    if not Path(args.model).is_file():
        print(f"ds4-server: {args.model}: no such base file", file=sys.stderr)
        return 2
    import waitress
    from server.app import create_app

    fatal = []

    def on_fatal(exc):
        fatal.append(exc)
        _thread.interrupt_main()

    app = None

    def on_term(signum, frame):
        if app is not None:
            app.extensions["ds4"].worker.stop()   # end running streams now, not after waitress's grace period
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    # on_fatal relies on SIGINT raising KeyboardInterrupt; a process started in the background by a
    # non-interactive shell inherits SIGINT as ignored, and then interrupt_main() would do nothing
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # a failed load interrupts the main thread (on_fatal) wherever it is, possibly before server.run()
    try:
        app = create_app(load=_load(args), model_name=args.alias or Path(args.model).stem, aliases=args.model_alias,
                         default_max_tokens=args.default_max_tokens, max_queue=args.max_queue,
                         max_running=args.max_running, on_fatal=on_fatal,
                         keepalive_s=args.sse_keepalive_s or None, warm_up=True)
        threads = args.threads or args.max_queue + args.max_running + 8
        server = waitress.create_server(app, host=args.host, port=args.port, threads=threads,
                                        channel_request_lookahead=1, ident="ds4-server",
                                        clear_untrusted_proxy_headers=True)
        log.info("listening on http://%s:%s (/health answers 503 until the model is loaded and warmed up)",
                 args.host, server.effective_port)
        server.run()                          # returns on KeyboardInterrupt (Ctrl-C, SIGTERM, failed load)
    except OSError as e:
        print(f"ds4-server: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    finally:
        if app is not None:
            app.extensions["ds4"].worker.stop()   # running and queued requests get a 503 error
    if fatal:
        print(f"ds4-server: the engine failed to load: {fatal[0]}", file=sys.stderr)
        return 1
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
