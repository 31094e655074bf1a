"""Tokenizers for supervised fine-tuning: a built-in byte tokenizer, or a pinned ``tokenizer.json``.

Byte tokenizer (``kind: byte``, nothing to download or pin): ids 0..255 are the
UTF-8 bytes of the text, followed by four special tokens::

    256 <pad>   padding of unused slots (never attended to, never in the loss)
    257 <bos>   starts every example
    258 <eos>   ends every response; generation stops on it
    259 <sep>   separates the prompt from the response

so its vocabulary has 260 entries. The alternative (``kind: tokenizers-json``)
loads a ``tokenizer.json`` of the Hugging Face ``tokenizers`` library from a
pinned input file; its special tokens are named in the recipe and must exist in
its vocabulary. Both encode without adding special tokens themselves: the
example layout ``<bos> prompt <sep> response <eos>`` is fixed by
:mod:`minifield.data.encoding`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BYTE_VOCAB_SIZE = 260
PAD_ID, BOS_ID, EOS_ID, SEP_ID = 256, 257, 258, 259
SPECIAL_NAMES = ("pad", "bos", "eos", "sep")
#: default token strings of the special tokens in a ``tokenizer.json``
DEFAULT_SPECIAL_TOKENS = {"pad": "<pad>", "bos": "<bos>", "eos": "<eos>", "sep": "<sep>"}


class TokenizerError(Exception):
    pass


@dataclass(frozen=True)
class Tokenizer:
    """Encode/decode text and name the special ids; ``config()`` is what an export records."""

    kind: str
    vocab_size: int
    pad_id: int
    bos_id: int
    eos_id: int
    sep_id: int
    backend: Any = None  # tokenizers.Tokenizer for kind "tokenizers-json"
    special_tokens: dict | None = None

    def encode(self, text: str) -> list[int]:
        if self.kind == "byte":
            return list(text.encode("utf-8"))
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with special tokens dropped (invalid UTF-8 replaced, never raised)."""
        specials = {self.pad_id, self.bos_id, self.eos_id, self.sep_id}
        kept = [int(i) for i in ids if int(i) not in specials]
        if self.kind == "byte":
            return bytes(i for i in kept if 0 <= i < 256).decode("utf-8", errors="replace")
        return self.backend.decode(kept, skip_special_tokens=True)

    def config(self, file: str | None = None) -> dict:
        """JSON description that :func:`from_config` turns back into this tokenizer."""
        if self.kind == "byte":
            return {"kind": "byte", "vocab_size": self.vocab_size}
        return {
            "kind": self.kind,
            "file": file,
            "vocab_size": self.vocab_size,
            "special_tokens": dict(self.special_tokens or {}),
        }


def unknown_id(backend) -> int | None:
    """The id ``backend`` (a ``tokenizers.Tokenizer``) maps text it cannot spell to (its model's
    unknown token, ``<unk>``), or None where it has none (a byte-level BPE spells every text)."""
    model = backend.model
    token = getattr(model, "unk_token", None)  # BPE, WordPiece, WordLevel
    if token is not None:
        return backend.token_to_id(token)
    if type(model).__name__ == "Unigram":  # names its unknown token by id, in its state only
        return json.loads(model.__getstate__()).get("unk_id")
    return None


def byte_tokenizer() -> Tokenizer:
    return Tokenizer("byte", BYTE_VOCAB_SIZE, PAD_ID, BOS_ID, EOS_ID, SEP_ID)


def from_file(path: Path, special_tokens: dict | None = None) -> Tokenizer:
    """A ``tokenizers`` library tokenizer from ``path``; every special token must be in its vocabulary."""
    from tokenizers import Tokenizer as HFTokenizer

    try:
        backend = HFTokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - the library raises plain Exception subclasses
        raise TokenizerError(f"{path}: not a loadable tokenizer.json ({exc})") from exc
    return _wrap(backend, special_tokens, str(path))


def _wrap(backend, special_tokens: dict | None, path: str) -> Tokenizer:
    specials = {**DEFAULT_SPECIAL_TOKENS, **(special_tokens or {})}
    ids = {}
    for name in SPECIAL_NAMES:
        token = specials[name]
        token_id = backend.token_to_id(token)
        if token_id is None:
            raise TokenizerError(
                f"{path}: special token {name}={token!r} is not in the tokenizer's vocabulary "
                "(add it to tokenizer.json or set model.tokenizer.special_tokens)"
            )
        ids[name] = token_id
    if len(set(ids.values())) != len(ids):
        raise TokenizerError(f"{path}: special tokens {specials} do not map to distinct ids {ids}")
    return Tokenizer(
        "tokenizers-json",
        backend.get_vocab_size(with_added_tokens=True),
        ids["pad"],
        ids["bos"],
        ids["eos"],
        ids["sep"],
        backend,
        specials,
    )


def from_bytes(
    data: bytes, special_tokens: dict | None = None, where: str = "tokenizer.json"
) -> Tokenizer:
    """Like :func:`from_file` from the file's bytes (prepared examples carry them)."""
    from tokenizers import Tokenizer as HFTokenizer

    try:
        backend = HFTokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # noqa: BLE001
        raise TokenizerError(f"{where}: not a loadable tokenizer.json ({exc})") from exc
    return _wrap(backend, special_tokens, where)


def _token_string(value, where: str, key: str) -> str | None:
    """A ``tokenizer_config.json`` special token: a string, an AddedToken dict, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(
        f"{where}: {key} must be a string or {{'content': string}} (got {value!r})"
    )


def from_base_model(
    tokenizer_json: bytes, tokenizer_config: dict, where: str, config_where: str
) -> tuple[Tokenizer, dict[str, str | None]]:
    """A base model's tokenizer: ``tokenizer.json`` plus ``tokenizer_config.json``'s special
    tokens; returns it with the special token strings (what a chat template sees).

    Ids come from the files: ``eos_token`` is required (it ends every trained turn and stops
    generation); ``bos_token`` may be null (Qwen2 has none); without ``pad_token`` padding uses
    the eos id (padded slots are never attended to nor trained, so any id serves). There is
    no ``<sep>``: the chat template separates the turns.
    """
    from tokenizers import Tokenizer as HFTokenizer

    try:
        backend = HFTokenizer.from_str(tokenizer_json.decode("utf-8"))
    except Exception as exc:  # noqa: BLE001 - the library raises plain Exception subclasses
        raise TokenizerError(f"{where}: not a loadable tokenizer.json ({exc})") from exc
    strings = {
        key: _token_string(tokenizer_config.get(key), config_where, key)
        for key in ("bos_token", "eos_token", "pad_token", "unk_token")
    }
    ids = {}
    for key, token in strings.items():
        if token is None:
            continue
        token_id = backend.token_to_id(token)
        if token_id is None:
            raise TokenizerError(
                f"{config_where}: {key}={token!r} is not in the vocabulary of {where}"
            )
        ids[key] = token_id
    if "eos_token" not in ids:
        raise TokenizerError(
            f"{config_where}: no eos_token (needed to end each assistant turn and generation)"
        )
    eos = ids["eos_token"]
    names = {"pad": strings["pad_token"] or strings["eos_token"], "eos": strings["eos_token"]}
    if strings["bos_token"] is not None:
        names["bos"] = strings["bos_token"]
    tokenizer = Tokenizer(
        "tokenizers-json",
        backend.get_vocab_size(with_added_tokens=True),
        ids.get("pad_token", eos),
        ids.get("bos_token"),
        eos,
        None,
        backend,
        names,
    )
    return tokenizer, strings


def from_settings(settings: dict, files: dict[str, Path]) -> Tokenizer:
    """The tokenizer a recipe's ``model.tokenizer`` names (``files``: verified inputs by name)."""
    if settings.get("kind", "byte") == "byte":
        return byte_tokenizer()
    name = settings.get("input", "tokenizer")
    if name not in files:
        raise TokenizerError(
            f"model.tokenizer.input={name!r}: no pinned input of that name (inputs: {sorted(files)})"
        )
    return from_file(files[name], settings.get("special_tokens"))


def from_config(config: dict, directory: Path) -> Tokenizer:
    """Rebuild the tokenizer recorded by :meth:`Tokenizer.config` (files relative to ``directory``)."""
    if config.get("kind") == "byte":
        return byte_tokenizer()
    if config.get("kind") == "tokenizers-json":
        return from_file(directory / config["file"], config.get("special_tokens"))
    raise TokenizerError(f"{directory}: unknown tokenizer kind {config.get('kind')!r}")
