"""The step sections: ``step_125m`` and ``step_350m`` (our packed-SFT step against the minimal
loop of the same model, interleaved rounds), and ``determinism_cost`` (our 125M step without
the GPU determinism flags)."""

from __future__ import annotations

import os
import statistics
import time

from device_check import section_shapes
from device_check.common import count_params, log, peak_for
from device_check.settings import (
    MAX_STEPS,
    MODELS,
    SEQ_LEN,
    batch_rows,
    execution,
    llama_config,
    model_shape,
    seq_len,
    step_plan,
)


def _time_rounds(runs: dict, rounds: int, steps: int, deadline: float, report, out) -> dict:
    """Interleaved rounds: each round runs ``steps`` steps of every implementation back to back
    (order alternating), so the ratio of a round compares the same few seconds."""
    import jax

    seconds = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        # stop early rather than be killed: leave a round's worth of time
        if r and time.time() + 1.5 * sum(seconds[n][-1] * steps for n in names) > deadline:
            log(f"  stopping after {r} rounds (time limit)")
            break
        for name in names if r % 2 == 0 else names[::-1]:
            started = time.perf_counter()
            for _ in range(steps):
                result = runs[name]()
            jax.block_until_ready(result)
            seconds[name].append((time.perf_counter() - started) / steps)
        out["rounds_done"] = r + 1
        report(out)
        log(f"  round {r + 1}: " + ", ".join(f"{n} {seconds[n][-1] * 1e3:.1f} ms" for n in names))
    return seconds


def _describe(args, context, cfg, size: str, rows: int) -> dict:
    """What a step section measures: the model, its execution options, the FLOPs of a step and
    the peak its MFU is taken against; at ``--tiny`` the full size's counts from shapes."""
    import jax
    from minimal import llama as minimal

    from minifield.models import llama

    seq = cfg.max_len
    flops_per_token = llama.flops_per_token(cfg, seq)
    device_kind = jax.devices()[0].device_kind
    measured = (context.get("device") or {}).get("matmul_peak_bf16_flops")
    peak, peak_source = peak_for(device_kind, measured)
    out = {
        "model": {
            "architecture": "llama",
            **{k: getattr(cfg, k) for k in ("vocab_size", "d_model", "n_layers", "n_heads")},
            **{k: getattr(cfg, k) for k in ("n_kv_heads", "d_ff", "tie_embeddings")},
        },
        "compute_dtype": cfg.compute_dtype,
        "execution": {
            "attention": cfg.execution.attention,
            "scan_layers": cfg.execution.scan_layers,
            "remat": cfg.execution.remat,
            "loss_chunk_tokens": cfg.execution.loss_chunk_tokens,
        },
        "seq_len": seq,
        "batch_rows": rows,
        "tokens_per_step": rows * seq,
        "flops_per_token": flops_per_token,
        "flops_per_step": flops_per_token * rows * seq,
        "backend": jax.default_backend(),
        "device_kind": device_kind,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "peak_flops": peak,
        "peak_source": peak_source,
        "measured_matmul_peak_flops": measured,
    }
    if args.tiny:  # the full-size model's count, from shapes alone (nothing allocated)
        full = llama_config(minimal.Shape(*MODELS[size]), SEQ_LEN, execution(args))
        shapes = jax.eval_shape(lambda: llama.init_params(full, jax.random.key(0)))
        out["full_size"] = {
            "model": {k: getattr(full, k) for k in ("d_model", "n_layers", "n_heads", "d_ff")},
            "param_count": count_params(shapes),
            "flops_per_token": llama.flops_per_token(full, SEQ_LEN),
        }
    return out


def _step_section(args, context, report, size: str, deterministic: bool = True) -> dict:
    from minifield.attempt import environment

    if deterministic:
        environment.add_gpu_determinism_flags()
    import jax
    import jax.numpy as jnp
    from minimal import llama as minimal

    from minifield.training.optimizer import make_optimizer
    from minifield.training.train_step import init_train_state, make_train_step

    shape, seq, rows = model_shape(args, size), seq_len(args), batch_rows(args, size)
    if rows % args.grad_accum_steps:
        raise ValueError(
            f"--grad-accum-steps {args.grad_accum_steps} does not divide the {rows} rows of {size}"
        )
    plan = step_plan(args, size)  # --remat auto: what a recipe of this model gets
    accum = plan.grad_accum_steps
    cfg = llama_config(shape, seq, execution(args, plan.remat))
    out = _describe(args, context, cfg, size, rows)
    out.update(grad_accum_steps=accum, remat_asked=args.remat, memory_plan=plan.describe())
    report(out)
    batch = minimal.packed_batch(rows, seq, shape.vocab_size)
    implementations = {}
    optimizer = make_optimizer({}, MAX_STEPS)
    # one compiled program, created on the device (op by op it is a dispatch per array)
    state = jax.jit(lambda: init_train_state(cfg, optimizer, seed=0))()
    out["param_count"] = count_params(state["params"])
    started = time.perf_counter()
    ours = jax.jit(make_train_step(cfg, optimizer, accum_steps=accum), donate_argnums=(0,))
    ours = ours.lower(state, batch).compile()
    out.setdefault("ours", {})["compile_s"] = time.perf_counter() - started
    log(f"  ours compiled in {out['ours']['compile_s']:.1f} s ({out['param_count']:,} params)")
    box = {"state": state}

    def run_ours():
        box["state"], metrics = ours(box["state"], batch)
        return metrics["loss"]

    implementations["ours"] = run_ours
    first_loss = {"ours": float(run_ours())}  # the warm-up step, before another model exists
    # the device's own count (None where it keeps none, the CPU): what this step needs
    stats = jax.devices()[0].memory_stats() or {}
    out["ours"]["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
    report(out)
    if not args.ours_only:
        # the same remat as ours: on a TPU, every layer's scores kept at once do not fit
        step, params, opt_state = minimal.make_step(
            shape, jnp.bfloat16, MAX_STEPS, attention=cfg.execution.attention,
            remat=cfg.execution.remat, accum=accum,
        )  # fmt: skip
        out["minimal"] = {"param_count": count_params(params)}
        started = time.perf_counter()
        try:
            step = step.lower(params, opt_state, batch).compile()
        except Exception as exc:  # a plan ours fits, the minimal loop may not (its logits whole)
            if not section_shapes.out_of_memory(exc):
                raise
            out["minimal"].update(fits=False, error=str(exc)[:600])
            log(f"  minimal loop does not fit at this plan, ours timed alone: {str(exc)[:200]}")
            step = None
        if step is not None:
            out["minimal"]["compile_s"] = time.perf_counter() - started
            log(f"  minimal compiled in {out['minimal']['compile_s']:.1f} s")
            mini = {"params": params, "opt_state": opt_state}

            def run_minimal():
                mini["params"], mini["opt_state"], loss = step(
                    mini["params"], mini["opt_state"], batch
                )
                return loss

            implementations["minimal"] = run_minimal
            first_loss["minimal"] = float(run_minimal())
        report(out)
    seconds = _time_rounds(
        implementations, args.rounds, args.steps_per_round, args.deadline, report, out
    )
    _rates(out, implementations, seconds, first_loss)
    return out


def _rates(out: dict, implementations: dict, seconds: dict, first_loss: dict) -> None:
    """Each implementation's median step time and what follows from it (tokens/s, FLOP/s,
    MFU against the section's peak and against the measured one), and ours ÷ minimal."""
    peak, measured = out["peak_flops"], out["measured_matmul_peak_flops"]
    for name, run in implementations.items():
        step_s = statistics.median(seconds[name])
        row = out[name]
        row.update(
            step_s=step_s,
            step_s_rounds=seconds[name],
            loss_first=first_loss[name],
            loss_last=float(run()),
            tokens_per_s=out["tokens_per_step"] / step_s,
            model_flops_per_s=out["flops_per_step"] / step_s,
            mfu=out["flops_per_step"] / step_s / peak if peak else None,
            # against what a plain BF16 matmul reaches on this device (the achievable peak)
            mfu_vs_measured_peak=out["flops_per_step"] / step_s / measured if measured else None,
        )
        log(
            f"  {name}: {step_s * 1e3:.1f} ms/step, {row['tokens_per_s']:.0f} tokens/s, "
            f"{row['model_flops_per_s'] / 1e12:.2f} TFLOP/s"
            + (f", MFU {row['mfu']:.1%}" if row["mfu"] is not None else "")
        )
    if "minimal" in implementations:
        out["ours_over_minimal"] = statistics.median(
            o / m for o, m in zip(seconds["ours"], seconds["minimal"], strict=True)
        )
        log(f"  ours / minimal = {out['ours_over_minimal']:.3f}")


def step_125m(args, context, report) -> dict:
    return _step_section(args, context, report, "125m")


def step_350m(args, context, report) -> dict:
    return _step_section(args, context, report, "350m")


def determinism_cost(args, context, report) -> dict:
    # run without the determinism flags (the parent removed them from XLA_FLAGS); compared
    # with step_125m's "ours", which ran with them
    args.ours_only = True
    out = _step_section(args, context, report, "125m", deterministic=False)
    with_flags = ((context.get("step_125m") or {}).get("ours") or {}).get("step_s")
    if with_flags:
        out["deterministic_over_default"] = with_flags / out["ours"]["step_s"]
    return out
