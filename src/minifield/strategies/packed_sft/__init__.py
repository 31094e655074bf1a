"""The ``packed-sft`` strategy and the fine-tuning modules only it uses.

``strategy`` (the recipe sections, prepare, the program), ``model`` (the
transformer), ``optimizer`` (AdamW with warmup + cosine), ``sft_step`` (the
jitted update), ``sft_data`` (chat JSONL → token ids), ``packing`` (rows with
segment ids), ``tokenizer`` (byte-level or ``tokenizers`` JSON), ``parallel``
(the data-parallel mesh).
"""

from .strategy import PackedSFT

__all__ = ["PackedSFT"]
