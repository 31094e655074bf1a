"""A trained Llama-architecture model as a HuggingFace directory (what ``train/export/`` holds).

Files, all written by this module and then listed with their sha256 in ``model.json``
(:func:`minifield.state.export.write_files`), so the store's manifest and gate verify them as they
verify any export::

    config.json              a base model's own, every field kept but the dtype; from
                             scratch LlamaForCausalLM / Qwen2ForCausalLM (config_to_hf)
    model.safetensors        PyTorch names and [out, in] layouts, in the recipe's export dtype;
                             over the recipe's max shard size model-0000i-of-0000N.safetensors
                             and model.safetensors.index.json instead (:mod:`.shards`)
    tokenizer.json           the run's tokenizers-library file, copied byte for byte; for the
                             built-in byte tokenizer an equivalent one built here
    tokenizer_config.json    the special tokens (strings and ids), model_max_length
    generation_config.json   a pinned base model's own, byte for byte; else bos/eos/pad ids,
                             max_length, greedy
    dev.jsonl                the DEV split (the gate re-evaluates the export on it)
    model.json               this project's metadata: strategy, model config, tokenizer, files

Everything but ``model.json`` is what transformers reads; ``model.json`` is what
:class:`minifield.strategies.lm.export_format.ExportedModel` and the store read.
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import atomic
from ..data import tokenizer as tokenizers
from ..state import export
from . import checkpoint as hf_checkpoint

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
#: ``weights`` entry of an HF export's ``model.json`` config
WEIGHTS_FORMAT = "huggingface-safetensors"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which the ``ByteLevel`` pre-tokenizer uses."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer_json() -> bytes:
    """A ``tokenizer.json`` that encodes and decodes exactly as the built-in byte tokenizer:
    id b is the UTF-8 byte b (a byte-level BPE with no merges), ids 256..259 the special
    tokens ``<pad> <bos> <eos> <sep>``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in _bytes_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    specials = [tokenizers.DEFAULT_SPECIAL_TOKENS[name] for name in tokenizers.SPECIAL_NAMES]
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return backend.to_str().encode("utf-8")


def _special_strings(tokenizer) -> dict[str, str]:
    if tokenizer.kind == "byte":
        return dict(tokenizers.DEFAULT_SPECIAL_TOKENS)
    return {**tokenizers.DEFAULT_SPECIAL_TOKENS, **(tokenizer.special_tokens or {})}


def tokenizer_config(tokenizer, max_len: int) -> dict:
    """``tokenizer_config.json``: transformers' names for the special tokens, their ids in
    ``added_tokens_decoder``; nothing is added around a text when encoding (the example
    layout ``<bos> prompt <sep> response <eos>`` is the caller's)."""
    strings = _special_strings(tokenizer)
    ids = {name: getattr(tokenizer, f"{name}_id") for name in tokenizers.SPECIAL_NAMES}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": strings["bos"],
        "eos_token": strings["eos"],
        "pad_token": strings["pad"],
        "sep_token": strings["sep"],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "added_tokens_decoder": {
            str(ids[name]): {
                "content": strings[name],
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for name in tokenizers.SPECIAL_NAMES
        },
    }


def generation_config(tokenizer, max_len: int) -> dict:
    return {
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.pad_id,
        "max_length": max_len,
        "do_sample": False,
    }


def write(
    directory: Path,
    cfg,
    params,
    tokenizer,
    tokenizer_json: bytes | None,
    extra_files: dict[str, bytes],
    config: dict,
    dtype: str,
    tokenizer_config_json: bytes | None = None,
    base_config: dict | None = None,
    max_shard_size: int | None = None,
    fetch=None,
    group=None,
) -> dict | None:
    """Write the HF directory and its ``model.json`` (written last: a directory without it
    is not an export). ``tokenizer_json``: the run's tokenizer file, None for the byte
    tokenizer. ``extra_files``: written byte for byte (a base model's
    ``generation_config.json`` among them replaces the generated one).
    ``tokenizer_config_json``: a base model's ``tokenizer_config.json`` (its
    special tokens and chat template), written as given; None writes the one
    :func:`tokenizer_config` describes. ``base_config``: the base model's ``config.json``,
    carried over field by field (:func:`.checkpoint.exported_config`). ``config``: the
    project's export config; returns the ``model.json`` content. ``max_shard_size``,
    ``fetch``, ``group``: as :func:`.checkpoint.write`'s (None: one weights file;
    ``numpy.asarray``; one process); with a ``group``, every process writes its slices of the
    weights and process 0 alone the rest (the others return None)."""
    directory.mkdir(parents=True, exist_ok=True)
    more = {} if fetch is None else {"fetch": fetch}
    hf_checkpoint.write(
        directory, cfg, params, dtype, base_config, max_shard_size, group=group, **more
    )
    if group is not None and group.rank != 0:
        return None
    files = {
        TOKENIZER_FILE: tokenizer_json if tokenizer_json is not None else byte_tokenizer_json(),
        **extra_files,
    }
    generated = []
    if GENERATION_CONFIG_FILE not in files:  # a base model's own, when pinned, else ours
        generated.append((GENERATION_CONFIG_FILE, generation_config(tokenizer, cfg.max_len)))
    if tokenizer_config_json is not None:
        files[TOKENIZER_CONFIG_FILE] = tokenizer_config_json
    else:
        generated.append((TOKENIZER_CONFIG_FILE, tokenizer_config(tokenizer, cfg.max_len)))
    for name, data in files.items():
        atomic.write_bytes(directory / name, data)
    for name, content in generated:
        atomic.write_bytes(directory / name, (json.dumps(content, indent=2) + "\n").encode())
    return export.write_files(
        directory, {**config, "weights": {"format": WEIGHTS_FORMAT, "dtype": dtype}}
    )


def is_weights_file(name: str) -> bool:
    """Whether the file ``name`` (relative to an export) holds the model's weights: the
    safetensors files beside ``model.json`` (not the adapter's)."""
    return "/" not in name and name.endswith(".safetensors")


def load(directory: Path, config: dict, streamed: bool = False):
    """``(cfg, FP32 params)`` of an HF export whose ``model.json`` config is ``config``; the
    ``config.json`` architecture must be the one the export recorded. ``streamed``: the
    params are a :class:`LayerFiles`, nothing read but the headers (each tensor's shape and
    dtype checked) until a layer is asked for.

    The weights files' sha256 (:func:`is_weights_file`, against ``model.json``) is computed
    while they are read, on a thread of its own (hashing releases the GIL), and checked before
    anything is returned: a changed file is an :class:`~minifield.state.export.ExportError`
    naming it, as :func:`minifield.state.export.read` names any other; the caller reads the
    export with ``later=is_weights_file`` so no file is hashed twice."""
    from concurrent.futures import ThreadPoolExecutor

    from ..models.model import config_from_dict

    recorded = config_from_dict(config["model"])
    only = (lambda path: False) if streamed else None  # noqa: E731 - the headers alone
    with ThreadPoolExecutor(1) as pool:
        verified = pool.submit(export.verify_files, directory, is_weights_file)
        try:
            cfg, params = hf_checkpoint.load(
                directory, recorded.max_len, recorded.compute_dtype, only=only
            )
        except Exception as exc:  # a damaged header is the safetensors library's error
            verified.result()  # a file that is not the one recorded is named as such first
            if isinstance(exc, hf_checkpoint.CheckpointError):
                raise export.ExportError(str(exc)) from exc
            raise
        verified.result()
    # the architecture (to_dict): config.json also says how the model was trained (a mixture
    # of experts' output_router_logits), which model.json does not record
    if cfg.to_dict() != recorded.to_dict():
        raise export.ExportError(
            f"{directory / hf_checkpoint.CONFIG_FILE}: describes {cfg}, but "
            f"{directory / export.MODEL_FILE} records {recorded}"
        )
    return cfg, LayerFiles(directory, cfg) if streamed else params


class LayerFiles:
    """An HF export's FP32 parameters read a part at a time from its memory-mapped
    safetensors files (:class:`minifield.models.streamed.Weights`): every parameter outside
    the layers, or one layer's; each read anew when asked (the caller lets go of the last).
    The files were verified when :func:`load` opened them."""

    def __init__(self, directory: Path, cfg):
        self.directory, self.cfg = Path(directory), cfg

    def _read(self, only) -> dict:
        try:
            return hf_checkpoint.load(
                self.directory, self.cfg.max_len, self.cfg.compute_dtype, only=only
            )[1]
        except hf_checkpoint.CheckpointError as exc:
            raise export.ExportError(str(exc)) from exc

    def outer(self) -> dict:
        """The embedding, the final norm and the head."""
        params = self._read(lambda path: not path.startswith("blocks/"))
        params.pop("blocks", None)
        return params

    def layer(self, index: int) -> dict:
        """Layer ``index``'s parameters (one block)."""
        name = f"{index:02d}"
        return self._read(lambda path: path.startswith(f"blocks/{name}/"))["blocks"][name]
