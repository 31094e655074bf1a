"""Text a tokenizer cannot spell: the characters it maps to its unknown token.

A tokenizer without byte fallback (the Llama demo base's knows a–z, space and colon) encodes
any other character as its unknown token (``<unk>``, :func:`.tokenizer.unknown_id`). Trained,
such a row teaches the model to write ``<unk>`` where the data had ``E``, ``1`` or ``.``, and
the answer it was meant to learn is lost. So packed-sft refuses such rows before training
(:func:`check`): one line naming the first one's ``file:line``, the characters and how many
rows hold them. With ``training.allow_unknown_tokens: true`` (:data:`KEY`) they are trained as
encoded and counted: what :func:`check` returns, the prepared examples' manifest records in
the input's format decision (``meta.formats.<input>.unknown_tokens``). ``<unk>`` never ends an assistant turn
(:func:`.assistant_turns.end_of_turn_ids`): it stands for text inside the turn.
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

from .. import schemas
from .encoding import Encoded
from .formats import DataError, Example, Source, read, rows
from .tokenizer import Tokenizer, unknown_id

#: the recipe's ``training`` key that trains unknown tokens instead of refusing them
KEY = "allow_unknown_tokens"
#: what an absent key means (the schema's ``x-absent``): refused
ABSENT = schemas.load(schemas.TRAINING)["properties"][KEY]["x-absent"]
#: the most characters one message lists
SHOWN = 24


def allowed(training: dict) -> bool:
    return training.get(KEY, ABSENT)


def normalize(training: dict) -> None:
    """Drop the key spelled at its absent value: both are one computation (one digest)."""
    if training.get(KEY) == ABSENT:
        del training[KEY]


def not_read(training: dict, strategy: str) -> list[dict]:
    """The error of a strategy that does not read the key, where the recipe sets it (after
    :func:`normalize`)."""
    if KEY in training:
        return [{"path": f"/training/{KEY}", "message": f"not read by {strategy}"}]
    return []


def pieces(example: Example, backend, unk: int) -> list[str]:
    """The pieces of ``example``'s texts that ``backend`` encodes as ``unk``, one per token."""
    if example.text:
        texts = [example.response]
    else:
        texts = [m["content"] for m in example.conversation() if isinstance(m.get("content"), str)]
    found = []
    encodings = backend.encode_batch(texts, add_special_tokens=False)
    for text, encoding in zip(texts, encodings, strict=True):
        offsets = zip(encoding.ids, encoding.offsets, strict=True)
        found += [text[s:e] for i, (s, e) in offsets if i == unk]
    return found


def _listed(found: set[str]) -> str:
    shown = sorted(found)[:SHOWN]
    more = f" and {len(found) - len(shown)} more" if len(found) > len(shown) else ""
    return ", ".join(repr(piece) for piece in shown) + more


def _rows_with_unknown(encoded, tokenizer: Tokenizer, unk: int, examples) -> list[int]:
    """The indices of the examples holding ``unk``: from their tokens, or from their texts where
    the example layout writes ``unk`` itself (a ``tokenizer.json`` whose sep is ``<unk>``)."""
    layout = {tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.sep_id}
    if unk in layout:
        return [
            i for i, example in enumerate(examples()) if pieces(example, tokenizer.backend, unk)
        ]
    return [i for i, e in enumerate(encoded) if unk in e.prompt or unk in e.response]


def check(
    encoded: list[Encoded],
    tokenizer: Tokenizer,
    path: Path,
    source: Source,
    allow: bool,
    tokenizer_where: str,
) -> dict | None:
    """The unknown tokens of the file ``path``'s examples (``encoded``, read with ``source``):
    a :class:`DataError` where there are any and ``allow`` is false; else, with ``allow``, what
    the manifest records (``rows`` holding any, ``tokens`` in their texts, ``characters``), and
    None without."""
    backend = tokenizer.backend
    unk = None if backend is None else unknown_id(backend)
    examples = functools.cache(lambda: read(path, source).examples)  # read again only if needed
    hit = [] if unk is None else _rows_with_unknown(encoded, tokenizer, unk, examples)
    if not hit:
        return {"rows": 0, "tokens": 0, "characters": []} if allow else None
    found = [pieces(examples()[i], backend, unk) for i in hit]
    characters = set().union(*found)
    token = backend.id_to_token(unk)
    if not allow:
        where = next(itertools.islice(rows(path, source), hit[0], None))[1]
        text = _listed(characters) or "text of the chat template or tool definitions"
        raise DataError(
            f"{where}: {len(hit)} of {len(encoded)} rows hold text the tokenizer "
            f"({tokenizer_where}) cannot spell, encoded as {token}: {text} (first here); "
            f"rewrite it with characters the tokenizer knows, or set training.{KEY}: true "
            f"to train it as {token}"
        )
    tokens = sum(map(len, found))
    return {"rows": len(hit), "tokens": tokens, "characters": sorted(characters)}
