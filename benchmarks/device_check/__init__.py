"""One prepared device check: what to run when an accelerator (a GPU or a TPU) is available,
written to one JSON file.

Sections, in order, each in its own process with its own time limit inside one overall budget
(9 minutes by default, compilation included: ``settings.SECTION_LIMIT_S``), so a failure, a crash or a timeout in one is
recorded with its error and the others still run; the JSON is rewritten after every section
(and while a section runs), so even a killed check leaves what it measured:

- ``device``: backend, devices, versions and XLA flags (the GPU determinism flags the worker
  adds), the project's device check (``device_check.check``) against a recipe that requires
  this backend, the measured BF16 matrix-multiply peak and memory bandwidth, and the part's
  nominal peaks where :data:`NOMINAL_PEAKS` knows it (H100, H200, TPU v5e);
- ``step_125m``, ``step_350m``: our packed-SFT step (``LlamaConfig`` + ``make_optimizer`` +
  ``make_train_step``, as the worker compiles it) against a minimal JAX+optax loop of the same
  model (``minimal/llama.py``), Llama-style at about 125M and 350M parameters, BF16, sequence
  2048, fused (Pallas) attention in both; compile time, step time, tokens/s, model FLOP/s and
  MFU against the nominal dense BF16 peak (:data:`NOMINAL_PEAKS`; elsewhere the measured
  peak) and against the measured peak;
- ``recovery``: the recovery proof (``prove``: real workers under the supervisor) of a
  small Llama recipe on this device with the same execution options: a reference run, a run
  that crashes after update k, a resume from its last checkpoint; complete-state hashes
  compared update by update, judged by ``verdict``;
- ``checkpoint``: the 125M model's complete training state, a fresh copy on the device for
  every measurement, committed synchronously (``checkpoint.save``) and in the background
  (``CheckpointCadence``) against its two floors in the same rounds (the device→host copy
  alone, the raw fsync'd write alone): commit ÷ the slower floor, bandwidths, blocking time ÷
  synchronous time, one per-update state hash;
- ``shapes``: the most rows of 2048 tokens a full fine-tune and a LoRA step of Qwen2.5-0.5B-,
  Llama-3.2-1B- and Llama-3.2-3B-shaped models can take in the device's memory, the peak from
  the compiled program's memory analysis (abstract shapes: nothing allocated);
- ``determinism_cost`` (GPU only): our 125M step without the GPU determinism flags, to price
  them against ``step_125m``.

Only a worker opens the accelerator: the parent (``cli.main``) keeps off it before anything
could start JAX; the sections that measure the device are started with ``worker_env``; the
recovery section's process is a prover and keeps off too (``parent.child_env``).

A ``summary`` lists the goals with the measured value and whether each is met: the GPU
issue's, and on a TPU the chip's (issue 49: MFU against the measured BF16 peak, as that issue
measures it).

On a GPU host (the ``cuda`` extra installs ``jax[cuda12]``)::

    benchmarks/gpu_check.sh [OUT.json]
    uv run --locked --extra cuda python benchmarks/device_check --out device_check.json

On a TPU host, ``--backend tpu``: XLA attention (the minimal loop's fused kernel is the GPU
one) and the memory options a packed-sft recipe naming the TPU gets (``remat: auto``, the
policy and micro-batches chosen per model; the loss over 1024-token chunks); each step section records the device's peak bytes in use. See
docs/tpu.md.

On a TPU, in one chip call (at most 9.5 minutes)::

    python benchmarks/device_check --backend tpu --sections device recovery shapes checkpoint --proof-mode both --out tpu_check.json

On CPU, ``--tiny`` runs every section end to end with tiny models (the test suite does, so
the check cannot rot). See docs/device-check.md.
"""
