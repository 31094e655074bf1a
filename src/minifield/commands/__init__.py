"""Sub-commands of ``minifield``: one module each, every module defines ``register(subparsers)``.

This package also holds what the commands and ``minifield-worker`` share: the one-line
report of an error no check anticipated, and argument types that refuse what a command
cannot use. ``argparse``'s plain ``float`` accepts ``nan``,
``inf`` and ``1e400`` (also infinite), and ``int`` accepts any size; either then fails deep
inside a command with a traceback. These types check the value where it is parsed, so
argparse reports it as a usage error (exit 2) naming the option.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections.abc import Callable

from ..supervision import supervise as supervisor


def bounded_int(minimum: int, maximum: int) -> Callable[[str], int]:
    """A whole number in [minimum, maximum]."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a whole number, got {text[:40]!r}"
            ) from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(
                f"must be between {minimum} and {maximum}, got {text[:40]}"
            )
        return value

    parse.__name__ = "whole number"  # argparse names the type in its generic message
    return parse


def bounded_float(minimum: float, maximum: float, *, above: bool = False) -> Callable[[str], float]:
    """A finite number in [minimum, maximum] (or (minimum, maximum] with ``above``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text[:40]!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text[:40]}")
        low_ok = value > minimum if above else value >= minimum
        if not (low_ok and value <= maximum):
            low = f"> {minimum:g}" if above else f">= {minimum:g}"
            raise argparse.ArgumentTypeError(f"must be {low} and <= {maximum:g}, got {text[:40]}")
        return value

    parse.__name__ = "number"
    return parse


def load_recipe(path):
    """The recipe at ``path``; None, its refusal said on stderr, when it cannot be used."""
    # imported here: loading the CLI (e.g. for `minifield supervise`) should not load JAX
    from .. import recipe as recipes

    try:
        return recipes.load(path)
    except recipes.RecipeError as exc:
        print(str(exc), file=sys.stderr)
        return None


def add_supervision_arguments(
    parser: argparse.ArgumentParser, defaults: supervisor.Settings | None = None
) -> None:
    """``--deadline-s``, ``--stall-s`` and ``--grace-s``, which :func:`supervision_settings`
    reads: required unless ``defaults`` gives them (the grace period always has one)."""
    flags = (
        ("deadline_s", "wall-clock limit of the child in seconds"),
        ("stall_s", "stop the child when no event arrives for this long (includes start-up)"),
        ("grace_s", "SIGTERM→SIGKILL grace period"),
    )
    for name, meaning in flags:
        if defaults is not None:
            default = getattr(defaults, name)
        else:  # the limits are the caller's to choose; the grace period has the project's default
            default = supervisor.Settings.grace_s if name == "grace_s" else None
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=float,
            required=default is None,
            default=default,
            help=meaning if default is None else f"{meaning} (default {default:g})",
        )


def supervision_settings(command: str, args) -> supervisor.Settings | None:
    """The supervisor's settings from ``--deadline-s``, ``--stall-s`` and ``--grace-s``;
    None, said on stderr, when one cannot be used."""
    try:
        return supervisor.Settings(
            deadline_s=args.deadline_s, stall_s=args.stall_s, grace_s=args.grace_s
        )
    except ValueError as exc:
        # the message starts with the field name: say it as the flag the user typed
        print(f"minifield {command}: --{str(exc).replace('_', '-')}", file=sys.stderr)
        return None


def report_unexpected(program: str, argv: list[str], exc: BaseException) -> None:
    """One line on stderr for an error no check anticipated: what, and on which input."""
    detail = " ".join(str(exc).split())[:500] or "(no message)"
    print(
        f"{program}: unexpected {type(exc).__name__}: {detail} (arguments: "
        f"{shlex.join(argv)[:500]}); set MINIFIELD_TRACEBACK=1 for the traceback",
        file=sys.stderr,
    )
