"""Sub-commands of ``minifield``: one module each, every module defines ``register(subparsers)``.

This package also holds the argument types the commands and ``minifield-worker`` share:
they refuse what a command cannot use. ``argparse``'s plain ``float`` accepts ``nan``,
``inf`` and ``1e400`` (also infinite), and ``int`` accepts any size; either then fails deep
inside a command with a traceback. These types check the value where it is parsed, so
argparse reports it as a usage error (exit 2) naming the option.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


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
