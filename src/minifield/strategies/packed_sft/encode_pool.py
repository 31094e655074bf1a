"""Conversations encoded on every core: chunks of them on a pool of forked processes.

Rendering chat templates is most of the time preparing conversations takes, and one Python
process renders on one core. Here the conversations are cut into chunks, in input order; a
pool of worker processes, forked from this one (so they inherit the compiled template, the
tokenizer and the conversations: only chunk bounds go to them), encodes chunk by chunk
(:func:`.assistant_turns.encode_many`: renders, tokenization, trained spans), and the encodings
come back and are put together in input order. Each conversation's encoding depends on that
conversation alone, so the prepared examples are the same bytes whatever the number of
workers or chunks; an error is the first failing conversation in input order, as in one
process (later chunks are cancelled).

The number of workers is an operational setting, in no digest: the environment variable
``MINIFIELD_PREPARE_WORKERS`` (:data:`WORKERS_ENV`), else the CPUs this process may run on
(:func:`workers`). One worker, one chunk, or a process where JAX has started its (threaded)
backends — a fork there can deadlock — encode in this process instead.
"""

from __future__ import annotations

import gc
import math
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from . import assistant_turns
from .sft_data import Encoded

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


#: what a worker encodes: set by :func:`_start` in each forked worker
_job: tuple | None = None


def _start(*job) -> None:
    global _job
    _job = job
    # a worker is one of a pool sized to the CPUs: no tokenizer threads of its own
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _encode_chunk(bounds: tuple[int, int]) -> list[Encoded]:
    conversations, *rest = _job
    return assistant_turns.encode_many(conversations[bounds[0] : bounds[1]], *rest)


def encode(
    conversations: list[assistant_turns.Conversation],
    template,
    backend,
    eos_id: int,
    train_on: str,
    end_ids: frozenset[int],
    processes: int = 1,
) -> list[Encoded]:
    """:func:`.assistant_turns.encode_many` of ``conversations`` on ``processes`` workers (see
    the module); the same encodings, in the same order, for any ``processes``."""
    job = (template, backend, eos_id, train_on, end_ids)
    bounds = chunk_bounds(len(conversations), processes)
    if processes <= 1 or len(bounds) <= 1 or not _fork_is_safe():
        out = []
        for start in range(0, len(conversations), ENCODE_BATCH):
            out.extend(
                assistant_turns.encode_many(conversations[start : start + ENCODE_BATCH], *job)
            )
        return out
    # every object so far out of the collector's reach: a worker's collections would otherwise
    # visit (write the headers of) the whole inherited heap, copying every page of it
    gc.freeze()
    pool = ProcessPoolExecutor(
        min(processes, len(bounds)), get_context("fork"), _start, (conversations, *job)
    )
    try:
        return [one for chunk in pool.map(_encode_chunk, bounds) for one in chunk]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        gc.unfreeze()
