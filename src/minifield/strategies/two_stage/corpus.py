"""Raw-text documents for causal-language-model training (stage 1 of ``two-stage``).

A split is one pinned file: ``*.jsonl`` holds one document per line as ``{"text": "..."}``
(blank lines skipped); a Parquet file (told by its ``PAR1`` magic bytes, as for the supervised
formats; what pandas, pyarrow and ``datasets.to_parquet`` write) one document per row of its
string column ``text`` (other columns ignored; blank documents skipped); any other file is
one plain-text document. Text must be UTF-8.

Each document becomes the token sequence ``<bos> text <eos>`` and is cut into chunks for
rows of ``seq_len`` slots. Consecutive chunks overlap by one token: a chunk's first slot is
context only (not trained), every later slot is trained, so every token of the document but
``<bos>`` is predicted exactly once, from the tokens of its own chunk. A chunk is one packed
segment (its own segment id, positions from 0), packed with
:func:`minifield.data.packing.pack` as an example whose "prompt" is that
first token and whose "response" is the rest: the loss mask is 1 on every slot but the
first of each chunk.

Bits per byte: the summed next-token loss (nats) over every trained token, divided by
``ln 2`` times the UTF-8 bytes of the documents' text. ``<eos>`` (no bytes) is one of the
predicted tokens, as it would be for any tokenizer, so the figure compares across tokenizers.
"""

from __future__ import annotations

import math
from pathlib import Path

from ...data.encoding import Encoded
from ...data.formats import PARQUET_MAGIC, json_rows
from ...inputs.pinned import InputError


class CorpusError(InputError):
    """A corpus file this stage cannot train on; the message names the file and the reason."""


def read_documents(path: Path) -> list[str]:
    """The documents of one pinned corpus file (see the module docstring)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise CorpusError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if data.startswith(PARQUET_MAGIC):
        documents = [text for text in _parquet_texts(path) if text.strip()]
    else:
        documents = _text_documents(path, data)
    if not documents:
        raise CorpusError(f"{path}: empty corpus (no document with text)")
    return documents


def _text_documents(path: Path, data: bytes) -> list[str]:
    """The documents of a JSONL corpus (``*.jsonl``) or of one plain-text document."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise CorpusError(
            f"{path}: not valid UTF-8 (line {line}, byte offset {exc.start}: "
            f"{data[exc.start : exc.start + 1]!r}); save the corpus as UTF-8"
        ) from None
    if Path(path).suffix.lower() != ".jsonl":
        return [text] if text.strip() else []
    documents = []
    for row, where in json_rows(text.splitlines(), path, CorpusError):
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise CorpusError(f'{where}: expected a JSON object with a string "text" field')
        if row["text"].strip():
            documents.append(row["text"])
    return documents


def _parquet_texts(path: Path) -> list[str]:
    """The ``text`` column of a Parquet corpus; a missing or non-string column, or a null
    row, is refused naming the file (and the row, counted from 0)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
        if "text" not in schema.names:
            raise CorpusError(
                f"{path}: Parquet corpus has no 'text' column (columns {schema.names})"
            )
        column = schema.field("text").type
        if not (pa.types.is_string(column) or pa.types.is_large_string(column)):
            raise CorpusError(f"{path}: Parquet column 'text' holds {column}, expected strings")
        texts = pq.read_table(path, columns=["text"]).column("text").to_pylist()
    except (OSError, pa.ArrowException) as exc:
        raise CorpusError(f"{path}: not a readable Parquet file ({exc})") from None
    missing = next((index for index, text in enumerate(texts) if text is None), None)
    if missing is not None:
        raise CorpusError(f'{path} (row {missing}): "text" is null, expected a string')
    return texts


def document_tokens(text: str, tokenizer) -> list[int]:
    """``<bos> text <eos>`` (without ``<bos>`` for a tokenizer that has none)."""
    head = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    return [*head, *tokenizer.encode(text), tokenizer.eos_id]


def chunks(tokens: list[int], seq_len: int) -> list[Encoded]:
    """Chunks of at most ``seq_len`` tokens overlapping by one: each chunk's first token is
    context (the ``Encoded`` prompt), the rest are trained (its response)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2 (got {seq_len})")
    out, start = [], 0
    while start < len(tokens) - 1:
        piece = tokens[start : start + seq_len]
        out.append(Encoded(piece[:1], piece[1:]))
        start += seq_len - 1
    return out


def encode_split(documents: list[str], tokenizer, seq_len: int) -> tuple[list[Encoded], int]:
    """Every document's chunks, and the UTF-8 bytes of all documents (bits per byte)."""
    encoded: list[Encoded] = []
    n_bytes = 0
    for text in documents:
        encoded += chunks(document_tokens(text, tokenizer), seq_len)
        n_bytes += len(text.encode("utf-8"))
    return encoded, n_bytes


def bits_per_byte(loss_sum_nats: float, n_bytes: int) -> float:
    """Summed next-token loss in nats over every trained token → bits per UTF-8 byte."""
    return loss_sum_nats / (math.log(2) * n_bytes) if n_bytes else float("nan")
