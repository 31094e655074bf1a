"""The computations this package accepts: every strategy, registered by (name, version)."""

from __future__ import annotations

from .base import Program, Strategy
from .grpo import GRPO
from .linear_momentum import LinearMomentum
from .packed_sft import PackedSFT
from .preference import Preference
from .registry import available, get, register
from .two_stage import TwoStage

register(GRPO())
register(LinearMomentum())
register(PackedSFT())
register(Preference())
register(TwoStage())

__all__ = ["Program", "Strategy", "available", "get", "register"]
