"""The ``packed-sft`` strategy and the fine-tuning modules only it uses.

``strategy`` (the strategy: checks, data spec, prepare, acceptance), ``settings`` (the recipe's
model section: one spelling per computation, the model config and tokenizer it selects),
``program`` (the compiled update over the complete state), ``batches`` (the rows of each
update), ``evaluator`` (DEV/TEST loss and exact-match), ``exported`` (the export: written, read
back to generate); the model: ``model`` (forward, losses, generation, either family), ``gpt``
and ``llama`` (the two blocks), ``primitives`` (what they share), ``attention``,
``layer_stack``, ``cross_entropy``, ``execution``; ``optimizer`` (AdamW with warmup + decay),
``sft_step`` (the jitted update), ``sft_data`` (chat JSONL → token ids), ``packing`` (rows with
segment ids), ``tokenizer``, ``parallel`` (the data-parallel mesh); base models and LoRA:
``base_model``, ``hf_checkpoint``, ``hf_export``, ``chat_template``, ``lora``, ``llama_demo``.
"""

from .strategy import PackedSFT

__all__ = ["PackedSFT"]
