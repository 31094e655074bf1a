"""The ``two-stage`` strategy: continued pretraining on raw text, then SFT from its export.

``strategy`` (the recipe sections, prepare, the program: packed-sft's, with a stage's start,
evaluation and export), ``corpus`` (raw documents → chunks, bits per byte),
``stage1_export`` (stage 2's start: the pinned stage-1 export, checked), ``demo_data`` (the
demo corpus and the supervised pairs derived from it).
"""

# the package's face: what the pipeline and the commands use (never a module below it)
from . import demo_data, link
from .strategy import TwoStage

__all__ = ["TwoStage", "demo_data", "link"]
