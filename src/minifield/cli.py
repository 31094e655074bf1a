"""``minifield``: operator commands around the worker.

Each sub-command lives in its own module under ``minifield.commands`` and
exposes ``register(subparsers)``; this file only discovers and dispatches them.

No command ends in a traceback: each refuses bad input itself (exit 2, naming
the input), and whatever still escapes is reported here as one line naming the
command and its arguments (exit 1). ``MINIFIELD_TRACEBACK=1`` shows the
traceback instead, for debugging.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

from . import commands
from .commands import report_unexpected
from .supervision import accelerator

EXIT_UNEXPECTED = 1
EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minifield", description="Operate minifield training runs."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{module_info.name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if not getattr(sys.modules[args.func.__module__], "OPENS_ACCELERATOR", False):
        accelerator.keep_off()  # commands start, judge or serve workers: only those open it
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"minifield {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if os.environ.get("MINIFIELD_TRACEBACK"):
            raise
        report_unexpected(f"minifield {args.command}", argv, exc)
        return EXIT_UNEXPECTED


if __name__ == "__main__":
    sys.exit(main())
