"""The `ds4` command line: one entry point, one module per subcommand.

`ds4 SUBCOMMAND ...` dispatches to `ds4lib.tools.<module>`; each module defines
`register(subparsers)` and sets `func` on its parser. Without a subcommand, `ds4 -m FILE -p PROMPT`
runs generation (the seed's command line), handled by `ds4lib.tools.generate`.
"""
from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main", "SUBCOMMANDS"]

# subcommand -> module under ds4lib.tools
SUBCOMMANDS = {
    "inspect": "inspect_model",
    "tiny": "tiny",
    "corpus": "corpus",
    "tokenizer": "tokenizer",
    "quantize": "quantize",
    "score": "score",
    "eval": "evaluate",
    "sidecar": "sidecar",
    "posttrain": "posttrain",
}


def _load(module):
    try:
        return importlib.import_module(f"ds4lib.tools.{module}")
    except ModuleNotFoundError as e:
        if e.name == f"ds4lib.tools.{module}":
            return None
        raise


def main(argv=None) -> int:
    """Input errors end with a one-line message and exit status 2 (argparse's usage errors, and files that cannot
    be read), Ctrl-C with 130; only a bug shows a traceback."""
    try:
        return _main(argv)
    except OSError as e:                          # a path that is missing, a directory, unreadable, ...
        print(f"ds4: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ds4: interrupted", file=sys.stderr)
        return 130


def _main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        parser = argparse.ArgumentParser(prog="ds4")
        sub = parser.add_subparsers(dest="command", required=True)
        for name, module in SUBCOMMANDS.items():
            mod = _load(module)
            if mod is not None:
                mod.register(sub)
        if argv[0] not in sub.choices:
            parser.error(f"subcommand {argv[0]!r} is not available in this build")
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    gen = _load("generate")
    if gen is None:
        print("ds4: subcommands: " + ", ".join(n for n, m in SUBCOMMANDS.items() if _load(m)), file=sys.stderr)
        return 2
    return int(gen.main(argv) or 0)


if __name__ == "__main__":
    sys.exit(main())
