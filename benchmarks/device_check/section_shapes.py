"""The ``shapes`` section: the most rows of 2048 tokens a step can take on this device, for full
fine-tuning and for LoRA, of Qwen2.5-0.5B-, Llama-3.2-1B- and Llama-3.2-3B-shaped models.

Each step is ours as the worker compiles it (``LlamaConfig`` + ``make_optimizer`` +
``make_train_step``, jit with the state donated; LoRA: ``lora.make_train_step`` with the base an
argument), compiled against abstract shapes (``jax.ShapeDtypeStruct``: nothing is allocated,
so a 3B model's state need not exist to be measured). Its peak is read from the compiled
program's ``memory_analysis()``: arguments + outputs + temporaries − the outputs aliased to
donated arguments (the device's ``peak_bytes_in_use`` after a step misses the temporaries).
On a TPU a program that does not fit fails to compile (``RESOURCE_EXHAUSTED``): it does not
fit, and the compiler's "Used X of Y hbm" is recorded where it says so.

The search (:func:`largest_fitting`) compiles 1 and 2 rows, extrapolates linearly to the
memory, then confirms the predicted largest and one more, refitting where the line was off: a
handful of compiles per model and mode. A state whose arguments alone exceed the memory fits
no rows without a compile (the peak is at least the arguments). Each compile is timed; the
section stops before a compile it has no time left for (``--deadline``), with what it has.
The six searches run side by side, a thread each (a compile is mostly one core's work).
"""

from __future__ import annotations

import concurrent.futures
import copy
import math
import os
import re
import threading
import time

from device_check.common import log
from device_check.settings import MAX_STEPS, SEQ_LEN, TINY_SEQ_LEN

#: the models, from their HF ``config.json``: hidden_size, num_hidden_layers,
#: num_attention_heads, num_key_value_heads, intermediate_size, vocab_size; all three tie
#: their embeddings; Qwen2 has biases on q, k and v (the Llama 3.2 rotary scaling changes no
#: shape and is left out)
MODELS = {
    "qwen2.5-0.5b": dict(d_model=896, n_layers=24, n_heads=14, n_kv_heads=2, d_ff=4864,
                         vocab_size=151936, qkv_bias=True, rope_theta=1e6, norm_eps=1e-6),
    "llama-3.2-1b": dict(d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192,
                         vocab_size=128256, rope_theta=5e5, norm_eps=1e-5),
    "llama-3.2-3b": dict(d_model=3072, n_layers=28, n_heads=24, n_kv_heads=8, d_ff=8192,
                         vocab_size=128256, rope_theta=5e5, norm_eps=1e-5),
}  # fmt: skip
#: the same kinds of model, tiny (--tiny: the CPU run of the tests)
TINY_MODELS = {
    "qwen2.5-0.5b": dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                         vocab_size=256, qkv_bias=True, rope_theta=1e6, norm_eps=1e-6),
    "llama-3.2-1b": dict(d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                         vocab_size=320, rope_theta=5e5, norm_eps=1e-5),
    "llama-3.2-3b": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                         vocab_size=384, rope_theta=5e5, norm_eps=1e-5),
}  # fmt: skip
#: --tiny's made-up device memory: a few rows of the tiny models fit, not many
TINY_DEVICE_MEMORY = 3 * 2**20
#: LoRA as the project's on every linear layer of a dense model (QLoRA's setting)
LORA_RANK, LORA_TARGETS = 16, (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)  # fmt: skip
#: the frozen base held in BF16 (``model.lora.base_dtype``): as its checkpoint stores it
LORA_BASE_DTYPE = "bfloat16"
MODES = ("full", "lora")
#: a search gives up above this many rows (none of these models comes near it)
MAX_ROWS = 1024
_USED = re.compile(r"Used ([0-9.]+)([KMGT])? of ([0-9.]+)([KMGT])? hbm")


def largest_fitting(measure, limit: int, may_continue=lambda: True, max_rows: int = MAX_ROWS):
    """``(rows, complete)``: the most rows whose step fits in ``limit`` bytes, assuming a peak
    that grows with the rows. ``measure(rows) -> peak bytes`` (None: did not fit, figure
    unknown); ``may_continue()`` is asked before every measure after the first (False: stop,
    ``complete`` False, ``rows`` the most found to fit so far)."""
    peaks: dict[int, int | None] = {}

    def fits(rows: int) -> bool:
        if rows not in peaks:
            peaks[rows] = measure(rows)
        return peaks[rows] is not None and peaks[rows] <= limit

    lo, hi = 0, None  # the most rows known to fit; the fewest known not to
    for rows in (1, 2):
        if peaks and not may_continue():
            return lo, False
        if not fits(rows):
            return lo, True
        lo = rows
    while hi is None or hi > lo + 1:
        if lo >= max_rows:
            return lo, True
        guess = _predict(peaks, limit, lo, hi, max_rows)
        for rows in (guess, guess + 1):  # the prediction, then one more
            if hi is not None and rows >= hi:
                break
            if not may_continue():
                return lo, False
            if not fits(rows):
                hi = rows
                break
            lo = rows
    return lo, True


def _predict(peaks: dict, limit: int, lo: int, hi: int | None, max_rows: int) -> int:
    """The most rows a line says fit, kept strictly between ``lo`` (fits) and ``hi`` (does
    not): the line through ``lo`` and ``hi`` where both peaks are known, else through the
    fewest and the most rows known (the longest baseline); doubling or halving where no line
    rises."""
    known = sorted((r, p) for r, p in peaks.items() if p is not None)
    if hi is not None and peaks.get(hi) is None:
        # the fewest rows known not to fit gave no figure (the compile only failed): halve
        # the interval rather than walk down from it a row at a time
        return (lo + hi) // 2
    if hi is not None and lo in peaks:
        (r0, p0), (r1, p1) = (lo, peaks[lo]), (hi, peaks[hi])
    else:
        (r0, p0), (r1, p1) = known[0], known[-1]
    slope = (p1 - p0) / (r1 - r0) if r1 != r0 else 0.0
    if slope > 0:
        guess = r0 + math.floor((limit - p0) / slope)
    else:
        guess = 2 * lo if hi is None else (lo + hi) // 2
    upper = max_rows if hi is None else hi - 1
    return max(lo + 1, min(guess, upper))


def out_of_memory(exc: Exception) -> bool:
    text = str(exc)
    return "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text


def _used_bytes(text: str) -> int | None:
    """The bytes a TPU compile that ran out of memory says it needed ("Used 47.58G of 15.75G
    hbm"), or None."""
    found = _USED.search(text)
    if not found:
        return None
    scale = {None: 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[found.group(2)]
    return int(float(found.group(1)) * scale)


def config(name: str, tiny: bool, exec_options):
    from minifield.models.llama import LlamaConfig

    shape = (TINY_MODELS if tiny else MODELS)[name]
    seq = TINY_SEQ_LEN if tiny else SEQ_LEN
    return LlamaConfig(
        **shape, max_len=seq, tie_embeddings=True, compute_dtype="bfloat16",
        execution=exec_options,
    )  # fmt: skip


def abstract_step(cfg, mode: str):
    """``(jitted step, its arguments before the batch, parameters trained)``: ours as the worker
    compiles it, every argument a ``jax.ShapeDtypeStruct``."""
    import jax
    import numpy as np

    from minifield.training import lora, optimizer
    from minifield.training.train_step import init_train_state, make_train_step

    opt = optimizer.make_optimizer({}, MAX_STEPS)
    if mode == "full":
        state = jax.eval_shape(lambda: init_train_state(cfg, opt, seed=0))
        step = jax.jit(make_train_step(cfg, opt), donate_argnums=(0,))
        return step, (state,), _count(state["params"])
    settings = lora.LoraSettings(LORA_RANK, float(2 * LORA_RANK), LORA_TARGETS, LORA_BASE_DTYPE)
    schedule = optimizer.make_schedule({}, MAX_STEPS)
    base = jax.eval_shape(lambda: _frozen_base(cfg))
    state = jax.eval_shape(lambda: lora.init_state(cfg, settings, opt, 0, np.zeros(32, np.uint8)))
    step = jax.jit(lora.make_train_step(cfg, settings, opt, schedule), donate_argnums=(0,))
    return step, (state, base), _count(state["params"])


def _frozen_base(cfg):
    """The frozen base as a one-device LoRA run places it (``placement.frozen_base``): its
    checkpoint's tensors in BF16, held as stored, then stacked for the scan where the layers
    are scanned."""
    from minifield.hf import stored_base

    base = stored_base.zeros(cfg, LORA_BASE_DTYPE)
    return stored_base.stacked(base) if cfg.execution.scan_layers else base


def _count(tree) -> int:
    import jax

    return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(tree))


def _nbytes(tree) -> int:
    import jax
    import numpy as np

    leaves = jax.tree_util.tree_leaves(tree)
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in leaves)


def compile_rows(step, leading: tuple, rows: int, seq: int) -> dict:
    """Compile ``step`` for ``rows`` rows of ``seq`` tokens; its memory analysis and seconds."""
    import jax
    import jax.numpy as jnp

    from minifield.data.packing import Rows

    ints = jax.ShapeDtypeStruct((rows, seq), jnp.int32)
    batch = Rows(ints, ints, ints, jax.ShapeDtypeStruct((rows, seq), jnp.float32))
    started = time.perf_counter()
    try:
        compiled = step.lower(*leading, batch).compile()
    except Exception as exc:  # a TPU refuses a program that does not fit at compile time
        if not out_of_memory(exc):
            raise
        text = str(exc)
        return {"rows": rows, "compile_s": time.perf_counter() - started, "peak_bytes": None,
                "compiler_used_bytes": _used_bytes(text), "error": text[:400]}  # fmt: skip
    seconds = time.perf_counter() - started
    m = compiled.memory_analysis()
    parts = {
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
        "alias_bytes": int(m.alias_size_in_bytes),
        "generated_code_bytes": int(m.generated_code_size_in_bytes),
    }
    peak = parts["argument_bytes"] + parts["output_bytes"] + parts["temp_bytes"]
    return {"rows": rows, "compile_s": seconds, "peak_bytes": peak - parts["alias_bytes"],
            **parts}  # fmt: skip


def search_one(cfg, mode: str, limit: int, clock: dict, out: dict, report, label="") -> None:
    """The search for one model and mode into ``out``: every compile's figures and the
    answer. ``clock``: the section's ``deadline`` and its ``longest`` compile so far (no
    compile is started with less than 1.5 times that left)."""
    step, leading, trained = abstract_step(cfg, mode)
    out.update(trained_params=trained, state_bytes=_nbytes(leading[0]),
               argument_bytes_without_batch=_nbytes(leading), compiles=[])  # fmt: skip
    if mode == "lora":
        out["lora"] = {"rank": LORA_RANK, "targets": list(LORA_TARGETS),
                       "base_dtype": LORA_BASE_DTYPE}  # fmt: skip
    if out["argument_bytes_without_batch"] > limit:  # the peak is at least the arguments
        out.update(largest_rows=0, complete=True, not_compiled="its arguments alone exceed "
                   "the memory")  # fmt: skip
        return

    def measure(rows: int) -> int | None:
        row = compile_rows(step, leading, rows, cfg.max_len)
        out["compiles"].append(row)
        clock["longest"] = max(clock["longest"], row["compile_s"])  # one float: atomic
        report()
        peak = row["peak_bytes"]
        log(f"  {label} {mode} {rows} rows: {'does not fit' if peak is None else f'{peak / 2**30:.3f} GiB'}"
            f" ({row['compile_s']:.1f} s)")  # fmt: skip
        if peak is None and row.get("compiler_used_bytes"):
            # the compiler's own figure draws the next line; above the limit however it
            # rounds, since the program did not compile
            return max(row["compiler_used_bytes"], limit + 1)
        return peak

    def may_continue() -> bool:
        return time.time() + 1.5 * clock["longest"] < clock["deadline"]

    if not may_continue():
        out.update(complete=False, stopped="the section's time ran out")
        return
    rows, complete = largest_fitting(measure, limit, may_continue)
    out.update(largest_rows=rows, complete=complete)
    if not complete:
        out["stopped"] = "the section's time ran out"


def run(args, context, report) -> dict:
    import jax

    from device_check.settings import execution

    stats = jax.devices()[0].memory_stats() or {}
    limit = args.device_memory_bytes or (TINY_DEVICE_MEMORY if args.tiny else None)
    limit = limit or stats.get("bytes_limit")
    if not limit:
        raise RuntimeError("this device reports no memory limit: give --device-memory-bytes")
    how = execution(args)
    given = bool(args.device_memory_bytes or args.tiny)
    out = {"device_memory_bytes": int(limit),
           "memory_source": "given" if given else "the device's bytes_limit",
           "device_kind": jax.devices()[0].device_kind,
           "seq_len": TINY_SEQ_LEN if args.tiny else SEQ_LEN,
           "compute_dtype": "bfloat16", "master_dtype": "float32",
           "execution": {"attention": how.attention, "scan_layers": how.scan_layers,
                         "remat": how.remat, "loss_chunk_tokens": how.loss_chunk_tokens},
           "models": {}}  # fmt: skip
    clock = {"deadline": args.deadline, "longest": 0.0}
    searches = []
    for name in args.shapes_models or list(MODELS):
        cfg = config(name, args.tiny, how)
        shape = (TINY_MODELS if args.tiny else MODELS)[name]
        model = out["models"][name] = {"shape": shape}
        for mode in args.shapes_modes or MODES:
            model[mode] = {"mode": mode}
            searches.append((name, cfg, mode, model[mode]))
    # one thread a search: a compile is mostly one core's work and the searches are
    # independent, so the section takes about its longest search, not their sum
    lock = threading.Lock()

    def one(name, cfg, mode, into):
        mine = dict(into)  # written by this thread only; copied into ``out`` under the lock

        def publish():
            copied = copy.deepcopy(mine)
            with lock:
                into.update(copied)
                report(out)

        log(f"  {name} {mode}: searching")
        try:
            search_one(cfg, mode, int(limit), clock, mine, publish, name)
        finally:
            publish()

    threads = max(1, min(len(searches), (os.cpu_count() or 1) - 1))
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for done in [pool.submit(one, *search) for search in searches]:
            done.result()
    report(out)
    return out
