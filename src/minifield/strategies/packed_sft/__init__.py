"""The ``packed-sft`` strategy: ``strategy`` (checks, data spec, prepare, acceptance) and
``demo_data`` (its demos' data: the string-reversal task, and the Llama demo's corpus, tokenizer
and fine-tuning task).

Everything it trains with is the library's: the model (:mod:`minifield.models`), the data
(:mod:`minifield.data`), the Hugging Face format (:mod:`minifield.hf`), the training machinery
(:mod:`minifield.training`) and what the language-model strategies share
(:mod:`minifield.strategies.lm`: the recipe's model section, the program, the export format).
"""

# the package's face: what the commands use (never a module below it)
from . import demo_data
from .strategy import PackedSFT

__all__ = ["PackedSFT", "demo_data"]
