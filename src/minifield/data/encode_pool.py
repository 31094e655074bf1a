"""A supervised file's examples encoded with a chat template on every core: chunks of them on a
pool of forked processes.

Reading the rows, rendering chat templates and finding the trained spans are most of the time
preparing conversations takes, and one Python process works on one core. Here the examples are
cut into chunks, in input order; a pool of worker processes, forked from this one (so they
inherit the compiled template, the tokenizer and the rows: only chunk bounds go to them),
takes chunk by chunk: a JSONL file's lines are parsed and checked there
(:func:`.formats.row_example`, with the ``file:line`` each names), then encoded
(:func:`encode_examples`: renders, tokenization, trained spans), and the encodings come back and
are put together in input order. Each example's encoding depends on that example alone, so the
prepared examples are the same bytes whatever the number of workers or chunks. Errors are those
of one process, which reads the whole file before it encodes: the first bad row in input order
if any row is bad, else the first conversation that fails to encode (once one has failed, later
chunks are only read, not encoded).

The number of workers is an operational setting, in no digest: the environment variable
``MINIFIELD_PREPARE_WORKERS`` (:data:`WORKERS_ENV`), else the CPUs this process may run on
(:func:`workers`). One worker, one chunk, or a process where JAX has started its (threaded)
backends — a fork there can deadlock — encode in this process instead.

The collector is paused while a worker encodes a chunk and while the parent takes the
encodings back: what they build (rows, encodings) holds no reference cycles, and its
collections cost a third of that work; each chunk is bounded, so a template that did leave
cycles behind leaves them for the next collection, a chunk later.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

from . import assistant_turns, formats
from .chat_template import ChatTemplate, ChatTemplateError
from .encoding import Encoded

WORKERS_ENV = "MINIFIELD_PREPARE_WORKERS"
#: conversations rendered, then tokenized together (one ``encode_batch``), at a time
ENCODE_BATCH = 4096
#: a pool's chunks: at most this many conversations each (a worker's ``encode_batch``) ...
MAX_CHUNK = 1024
#: ... at least this many (fewer go to one process: a fork costs more than they take) ...
MIN_CHUNK = 64
#: ... and this many chunks per worker where the conversations allow (a slow chunk then delays
#: the others less)
CHUNKS_PER_WORKER = 4


class WorkersError(ValueError):
    """``MINIFIELD_PREPARE_WORKERS`` is not a whole number ≥ 1."""


def workers() -> int:
    """How many processes encode conversations: :data:`WORKERS_ENV`, else this process's CPUs."""
    value = os.environ.get(WORKERS_ENV)
    if value is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        return len(cpus) if cpus else os.cpu_count() or 1
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise WorkersError(
            f"environment variable {WORKERS_ENV}={value!r}: expected a whole number of "
            "processes, at least 1"
        )
    return count


def chunk_bounds(count: int, processes: int) -> list[tuple[int, int]]:
    """``(start, end)`` of each chunk of ``count`` conversations for ``processes`` workers."""
    size = math.ceil(count / (CHUNKS_PER_WORKER * max(processes, 1)))
    size = min(MAX_CHUNK, max(MIN_CHUNK, size))
    return [(start, min(start + size, count)) for start in range(0, count, size)]


def _fork_is_safe() -> bool:
    """False once JAX has started its backends (threads a forked child would find locked;
    JAX warns at such a fork for that reason)."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is None:  # JAX not even imported
        return True
    # JAX's own test before it warns at a fork (private: where it is gone, assume started)
    started = getattr(bridge, "backends_are_initialized", lambda: True)
    return not started()


@contextlib.contextmanager
def _collector_paused():
    """No cyclic garbage collection inside (see the module); as it was after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class ChatJob:
    """What every example of a file is encoded with: the tokenizer (its bos, eos and backend),
    the chat template, what is trained, and the file (named in errors)."""

    tokenizer: object
    template: ChatTemplate
    train_on: str
    path: Path

    def end_ids(self) -> frozenset[int]:
        return assistant_turns.end_of_turn_ids(self.tokenizer.backend, self.tokenizer.eos_id)


def encode_examples(
    examples: list[formats.Example], first: int, job: ChatJob, end_ids: frozenset[int]
) -> list[Encoded]:
    """Examples ``first``, ``first + 1``, … of ``job.path`` rendered with the chat template (a
    failure names the file and example); a ``text`` row is its tokens between the bos (when
    the tokenizer has one) and the eos, all trained."""
    tokenizer = job.tokenizer
    backend, eos = tokenizer.backend, tokenizer.eos_id
    head = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    out: list[Encoded | None] = [None] * len(examples)
    chats, indices = [], []
    for index, example in enumerate(examples):
        if example.text:
            ids = [*head, *tokenizer.encode(example.response), eos]
            out[index] = Encoded(ids[:1], ids[1:])
        else:
            tools = None if example.tools is None else list(example.tools)
            where = example.where or f"{job.path} (example {first + index + 1})"
            # the checked messages as read (the sandbox cannot change them): no copy
            messages = list(example.messages or ()) or example.conversation()
            chats.append(assistant_turns.Conversation(messages, where, tools))
            indices.append(index)
    encoded = []
    for start in range(0, len(chats), ENCODE_BATCH):
        batch = chats[start : start + ENCODE_BATCH]
        encoded += assistant_turns.encode_many(
            batch, job.template, backend, eos, job.train_on, end_ids
        )
    for index, one in zip(indices, encoded, strict=True):
        out[index] = one
    return out


@dataclass(frozen=True)
class _ReadExamples:
    """Rows already read (a Parquet file, or examples given): a chunk is a slice of them."""

    examples: list

    def take(self, start: int, end: int) -> list[formats.Example]:
        return self.examples[start:end]


@dataclass(frozen=True)
class _JsonlLines:
    """A JSONL file's lines, read and checked chunk by chunk: ``line_of[i]`` is the index of
    example ``i``'s line (blank lines hold none), ``fmt`` the file's format (its first row's,
    or the declared one)."""

    lines: list[str]
    line_of: list[int]
    path: Path
    source: formats.Source
    fmt: str

    def take(self, start: int, end: int) -> list[formats.Example]:
        first, last = self.line_of[start], self.line_of[end - 1] + 1
        examples = []
        rows = formats.json_rows(self.lines[first:last], self.path, formats.DataError, first + 1)
        for index, (row, where) in enumerate(rows, start=start):
            one, _ = formats.row_example(row, where, self.fmt, self.source, index == 0)
            examples.append(one)
        return examples


def _jsonl_lines(path: Path, source: formats.Source) -> _JsonlLines | None:
    """``path``'s lines for the workers to read, or None where the file is to be read here
    (Parquet, unreadable, not UTF-8, no rows, a first row that is not an example: the reading
    here names the problem exactly)."""
    try:
        if formats.is_parquet(path):
            return None
        # text mode, as the reader: its universal newlines, the same lines
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().split("\n")
    except (OSError, UnicodeDecodeError):
        return None
    line_of = [number for number, line in enumerate(lines) if line.strip()]
    if not line_of or source.format not in (None, *formats.FORMATS):
        return None
    try:
        first = next(formats.json_rows([lines[line_of[0]]], path, formats.DataError))
        _, fmt = formats.row_example(*first, source.format, source, True)
    except formats.DataError:
        return None
    return _JsonlLines(lines, line_of, path, source, fmt)


#: what a worker encodes: set by :func:`_start` in each forked worker
_job: tuple | None = None


def _start(*job) -> None:
    global _job
    _job = job
    # a worker is one of a pool sized to the CPUs: no tokenizer threads of its own
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _encode_chunk(bounds: tuple[int, int]) -> list[Encoded]:
    rows, job, end_ids, failed = _job
    with _collector_paused():
        examples = rows.take(*bounds)
        if failed.is_set():  # an earlier chunk's error is the answer: this one only checked
            return []
        return encode_examples(examples, bounds[0], job, end_ids)


def _encode_rows(rows, count: int, job: ChatJob, processes: int) -> list[Encoded] | None:
    """The ``count`` examples of ``rows`` encoded on a pool (see the module), or None where
    this process is to encode them."""
    bounds = chunk_bounds(count, processes)
    if processes <= 1 or len(bounds) <= 1 or not _fork_is_safe():
        return None
    context = get_context("fork")
    failed = context.Event()
    # every object so far out of the collector's reach: a worker's collections would otherwise
    # visit (write the headers of) the whole inherited heap, copying every page of it
    gc.freeze()
    pool = ProcessPoolExecutor(
        min(processes, len(bounds)), context, _start, (rows, job, job.end_ids(), failed)
    )
    out, error = [], None
    try:
        futures = [pool.submit(_encode_chunk, one) for one in bounds]
        for future in futures:
            with _collector_paused():
                try:
                    out += future.result()
                except ChatTemplateError as exc:  # a bad row later on would be the answer
                    error = error or exc
                    failed.set()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        gc.unfreeze()
    if error is not None:
        raise error
    return out


def encode(examples: list[formats.Example], job: ChatJob, processes: int = 1) -> list[Encoded]:
    """:func:`encode_examples` of ``examples`` (all of ``job.path``) on ``processes`` workers
    (see the module); the same encodings, in the same order, for any ``processes``."""
    pooled = _encode_rows(_ReadExamples(examples), len(examples), job, processes)
    return encode_examples(examples, 0, job, job.end_ids()) if pooled is None else pooled


def read_and_encode(
    source: formats.Source, job: ChatJob, processes: int = 1
) -> tuple[list[Encoded], dict]:
    """Every example of the file ``job.path`` read (as :func:`.formats.read` with
    ``source``) and encoded, on ``processes`` workers (see the module); and the format
    decision the manifest records (:func:`.formats.record`)."""
    # the lines are split here only for a pool (one process reads the file as it goes)
    lines = _jsonl_lines(job.path, source) if processes > 1 and _fork_is_safe() else None
    if lines is not None:
        pooled = _encode_rows(lines, len(lines.line_of), job, processes)
        if pooled is not None:
            return pooled, formats.record(lines.fmt, source.format is None, len(pooled))
    read = formats.read(job.path, source)
    return encode(read.examples, job, processes), read.record()
