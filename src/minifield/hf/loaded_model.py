"""A model loaded for use: logits, generation, its tokenizer and chat template.

:class:`LoadedModel` is what ``minifield.load_model`` returns: for an HF directory
(:func:`from_hf_directory`: ``config.json`` and safetensors weights as :mod:`.checkpoint`
reads them, ``tokenizer.json`` and ``tokenizer_config.json``, and ``generation_config.json``
when there is one), and for a minifield export (:class:`minifield.strategies.lm.export_format.ExportedModel`, a subclass
whose prompts follow the layout its run trained). Importing this module does not import JAX.

Prompts: a string is the user's turn rendered with the model's chat template and its
generation prompt, or, with ``chat_template=False`` or for a model without a template, the
raw text encoded as the tokenizer's own ``tokenizer.json`` post-processor says (for
Llama 3 that adds ``<|begin_of_text|>``, as transformers' ``tokenizer(text)`` does). A list of
``{"role", "content"}`` messages always goes through the chat template. Generation stops on
any of :attr:`LoadedModel.stop_ids`: every ``eos_token_id`` of ``generation_config.json`` and
``config.json`` (an id or a list) and the tokenizer's ``eos_token``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import numbers
from pathlib import Path

import numpy as np

from ..data import chat_template
from ..models import sampling as sampling_rules
from . import checkpoint as hf_checkpoint
from . import directory as hf_directory
from . import pinned_base


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded; the message names the file and field."""


@functools.cache
def _forward():
    import jax

    from ..models import model

    return jax.jit(model.forward, static_argnums=1)


class LoadedModel:
    """Parameters, config, tokenizer and chat template (None without one) of a model.

    ``generation``: the sampling defaults of its ``generation_config.json``;
    ``stop_ids``: the ids generation stops on; ``where``: the directory, for messages."""

    def __init__(self, cfg, params, tokenizer, template, generation, stop_ids, where):
        self.cfg, self.params = cfg, params
        self.tokenizer, self.template = tokenizer, template
        self.generation: sampling_rules.GenerationDefaults = generation
        self.stop_ids: tuple[int, ...] = tuple(stop_ids)
        self.where = str(where)

    def with_compute_dtype(self, compute_dtype: str) -> LoadedModel:
        """The same model (a shallow copy) computing in ``compute_dtype`` (``float32`` or
        ``bfloat16``)."""
        changed = copy.copy(self)
        changed.cfg = dataclasses.replace(self.cfg, compute_dtype=compute_dtype)
        return changed

    def logits(self, token_ids) -> np.ndarray:
        """FP32 next-token logits: ``[T]`` ids give ``[T, V]``, ``[B, T]`` give ``[B, T, V]``
        (each row from position 0, one sequence per row). Attention is causal, so rows may be
        right-padded with any id: a slot's logits see only the slots up to it."""
        ids = np.asarray(token_ids)
        if ids.ndim not in (1, 2) or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                "token_ids must be a non-empty [T] or [B, T] array of integer ids, got "
                f"shape {ids.shape} of {ids.dtype}"
            )
        bad = (ids < 0) | (ids >= self.cfg.vocab_size)
        if bad.any():
            raise ValueError(
                f"token id {int(ids[bad][0])} is outside the vocabulary "
                f"(0..{self.cfg.vocab_size - 1})"
            )
        if ids.shape[-1] > self.cfg.max_len:
            raise ValueError(
                f"{ids.shape[-1]} tokens, more than the model's maximum length {self.cfg.max_len}"
            )
        import jax.numpy as jnp

        from ..models.execution import Execution

        rows = jnp.asarray(ids.reshape(-1, ids.shape[-1]), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(rows.shape[1], dtype=jnp.int32), rows.shape)
        # the XLA attention: the fused kernel wants whole blocks, and nothing trains here
        cfg = dataclasses.replace(
            self.cfg, execution=Execution(scan_layers=self.cfg.execution.scan_layers)
        )
        out = np.asarray(_forward()(self.params, cfg, rows, jnp.ones_like(rows), positions))
        return out[0] if ids.ndim == 1 else out

    def raw_ids(self, text: str) -> list[int]:
        """``text`` encoded for a raw continuation (the ``tokenizer.json`` post-processor's
        special tokens around it, nothing else)."""
        return list(self.tokenizer.backend.encode(text, add_special_tokens=True).ids)

    def prompt_ids(self, prompt, chat_template: bool = True) -> list[int]:
        """Token ids of a prompt string or a list of messages (see the module)."""
        if isinstance(prompt, str):
            if chat_template and self.template is not None:
                return self._render([{"role": "user", "content": prompt}])
            return self.raw_ids(prompt)
        messages = _messages(prompt)
        if not chat_template:
            raise ValueError("messages need the chat template (chat_template=False was given)")
        if self.template is None:
            raise ValueError(
                f"{self.where}: the model has no chat_template, so it takes a prompt string "
                "(continued as raw text), not messages"
            )
        return self._render(messages)

    def _render(self, messages: list[dict]) -> list[int]:
        try:
            text = self.template.render(messages, add_generation_prompt=True)
        except chat_template.ChatTemplateError as exc:
            raise ValueError(str(exc)) from None
        return list(self.tokenizer.backend.encode(text, add_special_tokens=False).ids)

    def generate_ids(
        self,
        prompt_ids: list[int],
        max_new_tokens: int = 64,
        *,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
    ) -> list[int]:
        """The new token ids after ``prompt_ids`` (the stop token not included); sampling as
        :mod:`minifield.models.sampling` resolves it (the arguments win over ``generation_config.json``)."""
        from ..models import model

        if type(seed) is not int or not 0 <= seed <= sampling_rules.MAX_SEED:
            raise ValueError(
                f"seed must be a whole number 0..{sampling_rules.MAX_SEED}, got {seed!r}"
            )
        sampling = sampling_rules.resolve(self.generation, temperature, top_k, top_p)
        budget = min(max_new_tokens, self.cfg.max_len - len(prompt_ids))
        if budget <= 0:
            raise ValueError(
                f"prompt is {len(prompt_ids)} tokens; the model's maximum length is "
                f"{self.cfg.max_len}"
            )
        return model.generate_batch(
            self.params, self.cfg, [prompt_ids], budget, self.stop_ids, sampling=sampling, seed=seed
        )[0]

    def generate(
        self,
        prompt,
        max_new_tokens: int = 64,
        *,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        chat_template: bool = True,
    ) -> str:
        """The decoded continuation of a prompt string or messages (special tokens dropped)."""
        ids = self.prompt_ids(prompt, chat_template)
        new = self.generate_ids(
            ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed
        )
        return self.tokenizer.decode(new)


def _messages(prompt) -> list[dict]:
    """``prompt`` checked to be a non-empty list of ``{"role": str, "content": str}``."""
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise ValueError(f"a prompt is a string or a non-empty list of messages, got {prompt!r}")
    for number, message in enumerate(prompt, 1):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise ValueError(
                f"message {number} must be {{'role': str, 'content': str}}, got {message!r}"
            )
    return list(prompt)


def single_user_text(prompt) -> str:
    """The text of a prompt string, or of messages that are one user turn (what a model
    trained in the ``<bos> prompt <sep>`` layout can be asked)."""
    if isinstance(prompt, str):
        return prompt
    messages = _messages(prompt)
    if len(messages) != 1 or messages[0]["role"] != "user":
        raise ValueError(
            "this model was trained on single prompts (<bos> prompt <sep>), so its messages "
            "must be one user turn"
        )
    return messages[0]["content"]


def read_generation_config(directory: Path) -> dict:
    """``generation_config.json`` as an object; ``{}`` when the directory has none."""
    path = directory / hf_directory.GENERATION_CONFIG_FILE
    if not path.exists():
        return {}
    return _read_object(path)


def read_config(directory: Path) -> dict:
    """``config.json`` as an object."""
    return _read_object(directory / hf_checkpoint.CONFIG_FILE)


def _read_object(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return value


def eos_ids(config: dict, where: str):
    """``config``'s ``eos_token_id``: None, an id or a list of ids (else refused)."""
    value = config.get("eos_token_id")
    values = value if isinstance(value, list) else [value]
    if value is not None and not all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0 for v in values
    ):
        raise ModelLoadError(
            f"{where}: eos_token_id must be a token id or a list of them, got {value!r}"
        )
    return value


def generation_settings(directory: Path, tokenizer, config: dict | None):
    """``(sampling defaults, stop ids)`` of a model directory: its ``generation_config.json``
    (when there is one), ``config`` (its ``config.json``, when there is one) and the
    tokenizer's ``eos_token``."""
    generation = read_generation_config(directory)
    where = str(directory / hf_directory.GENERATION_CONFIG_FILE)
    try:
        defaults = sampling_rules.defaults_from(generation, where)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    stops = sampling_rules.stop_ids(
        eos_ids(generation, where),
        eos_ids(config or {}, str(directory / hf_checkpoint.CONFIG_FILE)),
        tokenizer.eos_id,
    )
    return defaults, stops


def from_hf_directory(directory: str | Path, compute_dtype: str = "float32") -> LoadedModel:
    """The model of an HF directory (see the module); every problem is a
    :class:`ModelLoadError` naming the file."""
    from safetensors import SafetensorError

    directory = Path(directory)
    try:
        cfg, params = hf_checkpoint.load(directory, None, compute_dtype)
        tokenizer, template = pinned_base.exported_tokenizer(
            directory,
            {
                "file": hf_directory.TOKENIZER_FILE,
                "config_file": hf_directory.TOKENIZER_CONFIG_FILE,
            },
            template_required=False,
        )
        pinned_base.check_vocab(
            tokenizer, cfg.vocab_size, str(directory / hf_directory.TOKENIZER_FILE)
        )
    except (hf_checkpoint.CheckpointError, pinned_base.BaseModelError) as exc:
        raise ModelLoadError(str(exc)) from None
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"{directory}: weights not readable ({exc})") from None
    defaults, stops = generation_settings(directory, tokenizer, read_config(directory))
    return LoadedModel(cfg, params, tokenizer, template, defaults, stops, directory)
