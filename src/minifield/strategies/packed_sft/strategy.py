"""``packed-sft`` 12.0.0: supervised fine-tuning of a decoder-only transformer on packed rows.

Inputs (pinned JSONL, see :mod:`minifield.strategies.packed_sft.sft_data`): ``train``, ``dev``,
``test``; plus the tokenizer file when ``model.tokenizer.kind`` is
``tokenizers-json``, or the files of a base model that ``model.base`` names
(:mod:`minifield.strategies.packed_sft.base_model`: training starts from its weights, and its
tokenizer and chat template encode the examples; with ``model.lora`` only low-rank adapters
on it are trained, :mod:`minifield.strategies.packed_sft.lora`). The prepare stage packs each
split into rows (:mod:`minifield.strategies.packed_sft.packing`) and keeps the DEV/TEST prompts with their expected
answers for exact-match evaluation by greedy generation.

The rows of update ``n`` are a pure function of (seed, n): the row order of
epoch ``e`` is a fixed permutation drawn from ``(seed, e)``, so a resumed run
needs no iterator replay and sees exactly the rows the uninterrupted run saw.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ... import atomic
from ...digest import sha256_bytes
from ...state import export
from ..base import Program, Strategy
from . import base_model, chat_template, execution, lora, packing, sft_data
from . import tokenizer as tokenizers

# JAX (and what imports it: state, parallel, the model) is imported inside the methods that
# compute, so that validating a recipe, describing the strategy or hashing its data spec
# never imports JAX (the Snakefile validates every recipe when it is parsed).

SPLITS = ("train", "dev", "test")
ROW_FIELDS = ("tokens", "segments", "positions", "loss_mask")
PREPARE_VERSION = 1
#: files an export carries besides its weights (so the store can re-evaluate it alone)
EXPORT_DEV_FILE = "dev.jsonl"
EXPORT_TOKENIZER_FILE = "tokenizer.json"


def _model_api():
    """The transformer, optimizer and step (imported late: validation must not need them)."""
    from . import model, optimizer, sft_step

    return model, optimizer, sft_step


#: ``evaluation.export_dtype`` when absent: the stored tensors of an HF export (Llama only)
DEFAULT_EXPORT_DTYPE = "float32"

#: recipe keys only the Llama architecture reads, with the values an absent key means
LLAMA_DEFAULTS = {"rope_theta": 10000.0, "norm_eps": 1e-6, "qkv_bias": False}


#: model keys whose schema has no default (a base model supplies them), with the values an
#: absent key means without a base model (the values the schema held before, so every recipe
#: keeps its computation digest)
MODEL_DEFAULTS = {
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 4,
    "d_ff": 256,
    "positions": "learned",
    "tie_embeddings": True,
}


def normalize_model_section(model: dict) -> list[dict]:
    """Give the model section one spelling per computation; returns errors.

    ``architecture`` has no schema default so that every recipe written before it keeps its
    computation digest: ``gpt`` (the default) is removed, and a Llama section gets its
    defaults filled here (``n_kv_heads`` = ``n_heads``), floats as floats, and loses
    ``positions`` (Llama is always rotary). With ``base`` (a pinned base model) nothing is
    filled in: the dimensions come from its ``config.json`` at prepare, and the keys the
    recipe states are kept to be checked against it there.
    """
    if "base" in model:
        return _normalize_base_section(model)
    errors = [
        {"path": f"/model/{key}", "message": "only with model.base (a pinned base model)"}
        for key in ("chat_template",)
        if key in model
    ]
    for key, default in MODEL_DEFAULTS.items():
        model.setdefault(key, default)
    llama_keys = ["n_kv_heads", *LLAMA_DEFAULTS]
    if model.get("architecture", "gpt") == "gpt":
        model.pop("architecture", None)
        return errors + [
            {"path": f"/model/{key}", "message": "only for model.architecture llama"}
            for key in llama_keys
            if key in model
        ]
    model.setdefault("n_kv_heads", model["n_heads"])
    for key, default in LLAMA_DEFAULTS.items():
        model.setdefault(key, default)
    model["rope_theta"], model["norm_eps"] = float(model["rope_theta"]), float(model["norm_eps"])
    model.pop("positions", None)
    if model["n_heads"] % model["n_kv_heads"]:
        errors.append(
            {
                "path": "/model/n_kv_heads",
                "message": f"must divide model.n_heads={model['n_heads']} "
                f"(got {model['n_kv_heads']})",
            }
        )
    return errors


def _normalize_base_section(model: dict) -> list[dict]:
    errors = []
    if model.setdefault("architecture", "llama") != "llama":
        errors.append(
            {
                "path": "/model/architecture",
                "message": "a base model (model.base) is a Llama-family checkpoint: "
                "architecture must be llama or absent",
            }
        )
    if "positions" in model:
        errors.append({"path": "/model/positions", "message": "not with model.base (rotary)"})
    tokenizer = model.pop("tokenizer", {"kind": "byte"})
    if tokenizer.get("kind") != "byte" or tokenizer.get("special_tokens"):
        errors.append(
            {
                "path": "/model/tokenizer",
                "message": "not with model.base: the base model's tokenizer.json and "
                "tokenizer_config.json are used (model.base.tokenizer, tokenizer_config)",
            }
        )
    for key in ("rope_theta", "norm_eps"):
        if key in model:
            model[key] = float(model[key])
    return errors


def base_model_inputs(model: dict) -> list[str]:
    """Names of the pinned inputs that form the base model (empty without one)."""
    base = model.get("base")
    if not base:
        return []
    names = [base["config"], *base["weights"], base["tokenizer"], base["tokenizer_config"]]
    return names + ([base["index"]] if "index" in base else [])


def normalize_export_dtype(recipe: dict) -> list[dict]:
    """``evaluation.export_dtype`` has no schema default, so recipes written before it keep
    their digest: the default (float32) is removed. Another value is part of the
    computation digest (through the evaluation section) because it changes the published
    bytes and the figures the gate re-evaluates from them. Only a Llama model has it (the
    GPT model's export is the project's own FP32 format)."""
    evaluation = recipe["evaluation"]
    if evaluation.get("export_dtype", DEFAULT_EXPORT_DTYPE) == DEFAULT_EXPORT_DTYPE:
        evaluation.pop("export_dtype", None)
        return []
    if recipe["model"].get("architecture") != "llama":
        return [
            {
                "path": "/evaluation/export_dtype",
                "message": "only for model.architecture llama (the GPT export is FP32 .npy)",
            }
        ]
    return []


def model_config(recipe: dict, vocab_size: int):
    model, _, _ = _model_api()
    section = recipe["model"]
    if "base" in section:
        raise ValueError("a base model's config comes from its config.json (base_model_config)")
    if section.get("architecture") == "llama":
        from .llama import LlamaConfig

        return LlamaConfig(
            vocab_size=vocab_size,
            d_model=section["d_model"],
            n_layers=section["n_layers"],
            n_heads=section["n_heads"],
            n_kv_heads=section["n_kv_heads"],
            d_ff=section["d_ff"],
            max_len=recipe["training"]["seq_len"],
            rope_theta=section["rope_theta"],
            norm_eps=section["norm_eps"],
            qkv_bias=section["qkv_bias"],
            tie_embeddings=section["tie_embeddings"],
            compute_dtype=section["compute_dtype"],
        )
    return model.ModelConfig(
        vocab_size=vocab_size,
        d_model=section["d_model"],
        n_layers=section["n_layers"],
        n_heads=section["n_heads"],
        d_ff=section["d_ff"],
        max_len=recipe["training"]["seq_len"],
        positions=section["positions"],
        tie_embeddings=section["tie_embeddings"],
        compute_dtype=section["compute_dtype"],
    )


def epoch_order(seed: int, epoch: int, n_rows: int) -> np.ndarray:
    """Row permutation of one epoch: a pure function of (seed, epoch)."""
    return np.random.Generator(np.random.PCG64([seed, epoch])).permutation(n_rows)


def rows_for_step(seed: int, step: int, batch_size: int, n_rows: int) -> np.ndarray:
    """Indices of the packed rows update ``step`` (0-based) trains on."""
    start = step * batch_size
    out = np.empty(batch_size, dtype=np.int64)
    for j in range(batch_size):
        epoch, within = divmod(start + j, n_rows)
        out[j] = epoch_order(seed, epoch, n_rows)[within]
    return out


def _tokenizer_from_examples(recipe: dict, arrays: dict[str, np.ndarray]) -> tokenizers.Tokenizer:
    settings = recipe["model"]["tokenizer"]
    if settings["kind"] == "byte":
        return tokenizers.byte_tokenizer()
    return tokenizers.from_bytes(
        np.asarray(arrays["tokenizer_json"]).tobytes(), settings.get("special_tokens")
    )


def _base_tokenizer(recipe: dict, arrays: dict[str, np.ndarray], files=None):
    """The base model's tokenizer and chat template, from the prepared arrays."""
    base = recipe["model"]["base"]
    where = {
        k: str(files[base[k]]) if files else f"base model input {base[k]!r}"
        for k in ("tokenizer", "tokenizer_config")
    }
    return base_model.tokenizer_and_template(
        recipe,
        np.asarray(arrays[base_model.TOKENIZER_ARRAY]).tobytes(),
        np.asarray(arrays[base_model.TOKENIZER_CONFIG_ARRAY]).tobytes(),
        where,
        base_model.config_from_arrays(recipe, arrays).vocab_size,
    )


def _encode_chat_split(path: Path, tokenizer, template) -> list[sft_data.Encoded]:
    """A split rendered with the base model's chat template (a failure is a bad input)."""
    out = []
    for index, example in enumerate(sft_data.read_jsonl(path)):
        where = f"{path} (example {index + 1})"
        try:
            out.append(
                chat_template.encode(
                    example.conversation(), template, tokenizer._backend, tokenizer.eos_id, where
                )
            )
        except chat_template.ChatTemplateError as exc:
            raise base_model.BaseModelError(str(exc)) from None
    return out


def _encode_split(path: Path, tokenizer) -> list[sft_data.Encoded]:
    return [sft_data.encode(e, tokenizer) for e in sft_data.read_jsonl(path)]


def _eval_arrays(split: str, encoded, recipe: dict, pad_id: int) -> tuple[dict, dict]:
    """Packed rows of a split plus its prompts/answers for generation (whole examples only)."""
    training = recipe["training"]
    packed = packing.pack(encoded, training["seq_len"], training["overlong"], pad_id)
    whole = [e for e in encoded if len(e) <= training["seq_len"]]
    limit = recipe["evaluation"]["max_generate_examples"]
    arrays = {f"{split}_{k}": v for k, v in packed.arrays.items()}
    generation = packing.prompts_and_answers(whole[:limit], pad_id)
    arrays.update({f"{split}_{k}": v for k, v in generation.items()})
    return arrays, {**packed.stats, "generate_examples": len(whole[:limit])}


def _state_from_params(params: dict, optimizer, seed: int, stacked: bool = False) -> dict:
    """The step-0 state starting from given FP32 parameters (a base model's): the same layout
    as ``sft_step.init_train_state``, whose random initialisation it replaces (``stacked``:
    the blocks stacked, as a scanned run holds them, see ``layer_stack``)."""
    import jax
    import jax.numpy as jnp

    from . import layer_stack

    params = jax.tree_util.tree_map(lambda a: jnp.array(a, dtype=jnp.float32), params)
    if stacked:
        params = layer_stack.stack_layers(params)
    return {
        "params": params,
        "opt_state": optimizer.init(params),
        "rng": jax.random.key_data(jax.random.key(seed)),
        "step": jnp.zeros((), jnp.int32),
        "cursor": jnp.zeros((), jnp.int32),
    }


class Evaluator:
    """DEV/TEST loss over packed rows and greedy exact-match, jit-compiled once per shape."""

    def __init__(self, cfg, batch_size: int, eos_id: int, pad_id: int):
        import jax

        model, _, _ = _model_api()
        self.model, self.cfg = model, cfg
        self.batch_size, self.eos_id, self.pad_id = batch_size, eos_id, pad_id
        self._loss = jax.jit(lambda p, b: model.loss_fn(p, cfg, b)[1])
        self._rows_sharding = None  # set by on_mesh: loss rows split over the data axis
        self._loss_rows = batch_size

    def on_mesh(self, rows_sharding, devices: int) -> None:
        """Evaluate the loss on the data-parallel mesh: the parameters stay in the state's
        shardings and each batch of rows is split over the devices like a training batch,
        padded up to a multiple of ``devices`` (padding rows count nothing)."""
        self._rows_sharding = rows_sharding
        self._loss_rows = -(-self.batch_size // devices) * devices

    def loss(self, params, rows: dict[str, np.ndarray]) -> dict[str, float]:
        """Mean loss per trained token and perplexity, summed over every row (padding batches
        repeat row 0 with an all-zero loss mask, so they add nothing)."""
        from ...state.arrays import to_host
        from .parallel import place

        n = rows["tokens"].shape[0]
        total, count = 0.0, 0.0
        for start in range(0, n, self._loss_rows):
            index = np.arange(start, start + self._loss_rows)
            valid = index < n
            index = np.where(valid, index, 0)
            batch = {k: np.asarray(rows[k][index]) for k in ROW_FIELDS}
            batch["loss_mask"] = batch["loss_mask"] * valid[:, None].astype(np.float32)
            if self._rows_sharding is not None:
                batch = {k: place(v, self._rows_sharding) for k, v in batch.items()}
            out = self._loss(params, batch)
            # to_host: the replicated sums of a mesh spanning processes are read locally
            total += float(to_host(out["loss_sum"]))
            count += float(to_host(out["tokens"]))
        mean = total / count if count else float("nan")
        return {"loss": mean, "perplexity": math.exp(mean) if mean < 700 else float("inf")}

    def exact_match(self, params, prompts, prompt_len, answers, answer_len) -> dict[str, float]:
        """Share of prompts whose greedy continuation is the answer followed by ``<eos>``.

        ``answers`` end with ``<eos>``; generation may produce as many tokens as
        the longest answer holds (``<eos>`` included), so a continuation that
        does not stop right after the answer has an extra token and never matches.
        Prompts go in fixed-size chunks (the last padded with repeats) so one
        compilation serves every chunk.
        """
        n = int(prompts.shape[0])
        if n == 0:
            # Nothing generated: no figure (null in JSON) rather than a NaN events cannot hold.
            return {"exact_match": None, "generated": 0}
        max_new = int(np.max(answer_len))
        correct = 0
        for start in range(0, n, self.batch_size):
            index = [min(i, n - 1) for i in range(start, start + self.batch_size)]
            chunk = [np.asarray(prompts[i, : prompt_len[i]]).tolist() for i in index]
            outputs = self.model.greedy_generate_batch(
                params, self.cfg, chunk, max_new, self.eos_id
            )
            for i, new in zip(range(start, min(start + self.batch_size, n)), outputs, strict=False):
                expected = np.asarray(answers[i, : answer_len[i] - 1]).tolist()
                correct += new == expected
        return {"exact_match": correct / n, "generated": n}

    def split_metrics(self, params, arrays: dict[str, np.ndarray], split: str) -> dict[str, float]:
        rows = {k: arrays[f"{split}_{k}"] for k in ROW_FIELDS}
        loss = self.loss(params, rows)
        match = self.exact_match(
            params,
            arrays[f"{split}_prompts"],
            arrays[f"{split}_prompt_len"],
            arrays[f"{split}_answers"],
            arrays[f"{split}_answer_len"],
        )
        return {
            f"{split}_loss": loss["loss"],
            f"{split}_perplexity": loss["perplexity"],
            f"{split}_exact_match": match["exact_match"],
            f"{split}_generated": match["generated"],
        }


class PackedSFTProgram(Program):
    def __init__(self, recipe: dict, arrays: dict[str, np.ndarray]):
        from . import parallel

        model, optimizer, sft_step = _model_api()
        self.recipe = recipe
        self.arrays = arrays
        training = recipe["training"]
        self.base_params = None
        self.lora = lora.LoraSettings.from_recipe(recipe["model"])  # None: full fine-tuning
        if "base" in recipe["model"]:
            self.tokenizer, _ = _base_tokenizer(recipe, arrays)
            self.cfg = base_model.config_from_arrays(recipe, arrays)
            self.base_params = base_model.params_from_arrays(arrays)
        else:
            self.tokenizer = _tokenizer_from_examples(recipe, arrays)
            self.cfg = model_config(recipe, self.tokenizer.vocab_size)
        # how the model computes (attention kernel, scan, remat, loss chunks): execution.py
        self.cfg = execution.with_recipe_options(self.cfg, recipe)
        self.seed = training["seed"]
        self.batch_size = training["batch_size"]
        self.n_rows = int(arrays["train_tokens"].shape[0])
        self.examples_per_step = self.batch_size
        self.tokens_per_step = self.batch_size * training["seq_len"]
        self.eval_every = recipe["evaluation"]["eval_every"]
        max_steps = recipe["limits"]["max_steps"]
        self.optimizer = optimizer.make_optimizer(training, max_steps)
        # the schedule only adds the update's learning rate to its metrics (the optimizer
        # applies its own copy), so the state, and its hash, are the same with or without it
        self._step_fn = sft_step.make_train_step(
            self.cfg, self.optimizer, optimizer.make_schedule(training, max_steps)
        )
        self._init = sft_step.init_train_state
        self._compiled = None
        if self.lora is not None:
            self._lora_setup(training, max_steps)
        self.data_parallel = parallel.DataParallel.from_training(training)
        # set by compile(): the mesh and the shardings of the state and the batch
        self._mesh = None
        self._state_shardings = None
        self._batch_sharding = None
        self._mesh_init = None  # the initialisation compiled for the mesh (init_state)
        self.evaluator = Evaluator(
            self.cfg,
            recipe["evaluation"]["batch_size"],
            self.tokenizer.eos_id,
            self.tokenizer.pad_id,
        )

    def _lora_setup(self, training: dict, max_steps: int) -> None:
        """LoRA: the step trains the adapters against the frozen base (held on the device
        once, in ``base_dtype``); evaluation runs on the merged weights."""
        import jax

        _, optimizer, _ = _model_api()
        self._base = lora.frozen_base(self.base_params, self.lora)
        self._base_identity = lora.base_identity(
            self.recipe, base_model_inputs(self.recipe["model"])
        )
        self._step_fn = lora.make_train_step(
            self.cfg, self.lora, self.optimizer, optimizer.make_schedule(training, max_steps)
        )
        self._merge = jax.jit(lambda base, adapters: lora.merged(base, adapters, self.lora))

    def init_state(self) -> dict:
        if self._state_shardings is not None:
            return self._init_on_mesh()
        return self._init_on_one_device()

    def _init_on_one_device(self) -> dict:
        """The step-0 state on the default device, op by op (also its shapes for compiling)."""
        if self.lora is not None:
            return lora.init_state(
                self.cfg, self.lora, self.optimizer, self.seed, self._base_identity
            )
        if self.base_params is None:
            return self._init(self.cfg, self.optimizer, self.seed)
        from . import layer_stack

        return _state_from_params(
            self.base_params, self.optimizer, self.seed, layer_stack.holds_stacked(self.cfg)
        )

    def _init_on_mesh(self) -> dict:
        """The step-0 state created in the compiled update's shardings (never whole on one
        device): random parameters computed slice by slice on the devices that hold them, or
        a base model's host weights placed slice by slice; the same bits as ``init_state``
        on one device. Compiled once (a resume builds a template state first)."""
        from . import layer_stack, parallel

        shardings = self._state_shardings
        if self.base_params is None:
            make, args = (lambda: self._init(self.cfg, self.optimizer, self.seed)), ()
        else:
            host = self.base_params
            if layer_stack.holds_stacked(self.cfg):  # stacked on the host, placed slice by slice
                host = layer_stack.stack_layers(host, stack=np.stack)
            args = (parallel.place_tree(host, shardings["params"]),)

            def make(params):
                return _state_from_params(params, self.optimizer, self.seed)

        if self._mesh_init is None:
            self._mesh_init = parallel.sharded_program(make, shardings).lower(*args).compile()
        return self._mesh_init(*args)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        index = np.sort(rows_for_step(self.seed, step, self.batch_size, self.n_rows))
        return {k: np.asarray(self.arrays[f"train_{k}"][index]) for k in ROW_FIELDS}

    def compile(self) -> None:
        """One executable for the whole update: with data parallelism, compiled for the mesh
        with the batch split over ``data`` and the state replicated (or sharded), donating
        the state's buffers. Without it (``devices: 1``) a plain single-device jit."""
        import jax

        abstract_state = jax.tree_util.tree_map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
            jax.eval_shape(self._init_on_one_device),
        )
        abstract_batch = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in self.batch(0).items()
        }
        if self.lora is not None:  # one device (checked at validation); the base an argument
            fn = jax.jit(self._step_fn, donate_argnums=(0,))
            abstract_base = jax.eval_shape(lambda: self._base)
            step = fn.lower(abstract_state, abstract_base, abstract_batch).compile()
            self._compiled = lambda state, batch: step(state, self._base, batch)
            return
        if self.data_parallel.devices == 1:
            fn = jax.jit(self._step_fn, donate_argnums=(0,))
            self._compiled = fn.lower(abstract_state, abstract_batch).compile()
            return
        self.lay_out_mesh()
        batch_shardings = {k: self._batch_sharding for k in abstract_batch}
        fn = jax.jit(
            self._step_fn,
            in_shardings=(self._state_shardings, batch_shardings),
            out_shardings=(self._state_shardings, self.data_parallel.replicated(self._mesh)),
            donate_argnums=(0,),
        )
        self._compiled = fn.lower(abstract_state, abstract_batch).compile()

    def lay_out_mesh(self) -> None:
        """The data-parallel mesh and the shardings of the state and the batch, without
        compiling the update (``compile`` starts with it; a no-op on one device or done
        twice). From then on ``init_state`` creates the state in its shardings and
        evaluation runs on the mesh; before, a one-device state (the template a process that
        only evaluates checkpoints restores into)."""
        import jax

        from . import parallel

        dp = self.data_parallel
        if self._mesh is not None or self.lora is not None or dp.devices == 1:
            return
        abstract_state = jax.eval_shape(self._init_on_one_device)
        self._mesh = dp.mesh()
        self._state_shardings = dp.state_shardings(self._mesh, abstract_state)
        self._batch_sharding = dp.batch_sharding(self._mesh)
        self.evaluator.on_mesh(self._batch_sharding, dp.devices)
        self.placement = {
            "devices": dp.devices,
            "shard_params": dp.shard_params,
            "mesh": {parallel.AXIS: dp.devices},
            **parallel.describe(self._state_shardings),
        }

    def place(self, state: dict) -> dict:
        """Put a fresh or restored state on the mesh with the compiled step's shardings: a
        fresh state is already there (``init_state``), a restored one arrives as host arrays
        and each device receives only its slices (``parallel.place``)."""
        from . import parallel

        self.lay_out_mesh()
        if self._state_shardings is None:
            return state
        return parallel.place_tree(state, self._state_shardings)

    def step(self, state: dict) -> tuple[dict, dict[str, float]]:
        import jax

        new_state, read_metrics = self.dispatch(state, int(state["step"]))
        jax.block_until_ready(new_state)
        return new_state, read_metrics()

    def _batch_and_counts(self, step: int) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        batch = self.batch(step)
        # the step's "tokens" counts trained targets; the event's "tokens" means tokens consumed
        counts = {
            "examples": int(np.count_nonzero((batch["positions"] == 0) & (batch["segments"] > 0))),
            "tokens": int(np.count_nonzero(batch["segments"])),
        }
        return batch, counts

    def dispatch(self, state: dict, step: int):
        """Queue the update on the device and return at once: the batch was built ahead on
        the host (:class:`~minifield.strategies.packed_sft.batch_prefetch.Prefetcher`), the metrics are read back
        when the caller asks for them (no device sync here)."""
        import jax

        from .batch_prefetch import Prefetcher

        if self._compiled is None:
            self.compile()
        if getattr(self, "_batches", None) is None:
            self._batches = Prefetcher(self._batch_and_counts)
        batch, counts = self._batches.get(step)
        device_batch = batch
        if self._batch_sharding is not None:
            device_batch = jax.device_put(batch, self._batch_sharding)
        new_state, metrics = self._compiled(state, device_batch)

        def read_metrics() -> dict[str, float]:
            host = {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}
            host["loss_tokens"] = host.pop("tokens", float("nan"))
            return {**host, **counts}

        return new_state, read_metrics

    def _eval_params(self, state: dict):
        """The parameters evaluation runs with. On a data-parallel mesh they stay in the
        state's shardings (a host copy, which the end of a multi-process attempt passes, is
        placed there slice by slice): never gathered onto one device, so a model that needs
        ``shard_params`` to fit is evaluated as it trains. Per layer: a scanned run's state
        holds its blocks stacked (``layer_stack``)."""
        from . import layer_stack, parallel

        if self.lora is not None:  # the merged FP32 weights, as the export holds them
            return self._merge(self._base, state["params"])
        if self._state_shardings is None:
            return layer_stack.per_layer(state["params"])
        return layer_stack.per_layer(
            parallel.place_tree(state["params"], self._state_shardings["params"])
        )

    def evaluate(self, state: dict) -> dict[str, float]:
        return self.evaluator.split_metrics(self._eval_params(state), self.arrays, "dev")

    def evaluate_test(self, state: dict) -> dict[str, float]:
        return self.evaluator.split_metrics(self._eval_params(state), self.arrays, "test")

    def export(self, state: dict, directory: Path) -> None:
        from ...state.arrays import named_arrays
        from . import layer_stack

        state = {**state, "params": layer_stack.per_layer(state["params"])}  # scanned runs
        directory.mkdir(parents=True, exist_ok=True)
        dev_bytes = np.asarray(self.arrays["dev_jsonl"]).tobytes()
        if self.cfg.architecture == "llama":
            # A HuggingFace directory (see hf_export); the GPT model keeps the .npy format.
            import jax

            from ...state.arrays import to_host
            from . import hf_export

            tokenizer_json = tokenizer_config_json = None
            if "tokenizer_json" in self.arrays:
                tokenizer_json = np.asarray(self.arrays["tokenizer_json"]).tobytes()
            if "base" in self.recipe["model"]:
                tokenizer_config_json = base_model.export_tokenizer_config(
                    self.recipe,
                    np.asarray(self.arrays[base_model.TOKENIZER_CONFIG_ARRAY]).tobytes(),
                )
            params, config = (
                state["params"],
                export_config(
                    self.recipe,
                    self.cfg,
                    self.tokenizer,
                    EXPORT_TOKENIZER_FILE if tokenizer_json is not None else None,
                    dev_bytes,
                ),
            )
            if self.lora is not None:
                # the PEFT adapter in adapter/, beside the merged model (what transformers,
                # the store's gate and `minifield generate` load without the base)
                config["lora"] = self._export_adapter(state, directory / lora.ADAPTER_DIR)
                params = self._merge(self._base, state["params"])
            hf_export.write(
                directory,
                self.cfg,
                jax.tree_util.tree_map(to_host, params),  # gathered if sharded
                self.tokenizer,
                tokenizer_json,
                {EXPORT_DEV_FILE: dev_bytes},
                config,
                self.recipe["evaluation"].get("export_dtype", DEFAULT_EXPORT_DTYPE),
                tokenizer_config_json,
            )
            return
        atomic.write_bytes(directory / EXPORT_DEV_FILE, dev_bytes)
        tokenizer_file = None
        if "tokenizer_json" in self.arrays:
            tokenizer_file = EXPORT_TOKENIZER_FILE
            atomic.write_bytes(
                directory / tokenizer_file, np.asarray(self.arrays["tokenizer_json"]).tobytes()
            )
        export.write(
            directory,
            named_arrays(state["params"]),
            export_config(self.recipe, self.cfg, self.tokenizer, tokenizer_file, dev_bytes),
        )

    def _export_adapter(self, state: dict, directory: Path) -> dict:
        """Write the PEFT adapter; returns what ``model.json`` records of it."""
        items = {i["name"]: i for i in self.recipe["inputs"]}
        config_item = items[self.recipe["model"]["base"]["config"]]
        # PEFT's base_model_name_or_path: where the pinned base model's config.json lives
        where = config_item.get("path") or config_item.get("url") or config_item["name"]
        base_name = where.rsplit("/", 1)[0] if "/" in where else "."
        lora.write_adapter(directory, self.lora, state["params"], base_name)
        names = base_model_inputs(self.recipe["model"])
        return {
            **self.lora.to_dict(),
            "adapter_dir": lora.ADAPTER_DIR,
            "base_inputs": {name: items[name]["sha256"] for name in sorted(names)},
        }


def export_config(recipe, cfg, tokenizer, tokenizer_file, dev_bytes: bytes) -> dict:
    tokenizer_settings = tokenizer.config(tokenizer_file)
    layout = "<bos> prompt <sep> response <eos>"
    if "base" in recipe["model"]:
        # the base model's tokenizer files, beside the weights under their HF names
        from .hf_export import TOKENIZER_CONFIG_FILE

        tokenizer_settings = {
            "kind": base_model.EXPORT_TOKENIZER_KIND,
            "file": tokenizer_file,
            "config_file": TOKENIZER_CONFIG_FILE,
            "vocab_size": tokenizer.vocab_size,
        }
        layout = "chat_template (tokenizer_config.json)"
    return {
        "strategy": {"name": PackedSFT.name, "version": PackedSFT.version},
        "model": cfg.to_dict(),
        "tokenizer": tokenizer_settings,
        "layout": layout,
        "packing": {
            "seq_len": recipe["training"]["seq_len"],
            "overlong": recipe["training"]["overlong"],
        },
        "dev": {"file": EXPORT_DEV_FILE, "sha256": sha256_bytes(dev_bytes)},
    }


class ExportedModel:
    """An exported packed-sft model: parameters, config and tokenizer, ready to generate."""

    def __init__(self, directory: Path):
        import jax

        from ...state.arrays import restore_like

        model, _, _ = _model_api()
        self.directory = Path(directory)
        flat, self.config = export.read(self.directory)
        # two-stage exports are this model family too (stage 1 continues raw text)
        if self.config.get("strategy", {}).get("name") not in (PackedSFT.name, "two-stage"):
            raise export.ExportError(
                f"{self.directory / export.MODEL_FILE}: not a packed-sft or two-stage export "
                f"(strategy {self.config.get('strategy')!r})"
            )
        self.model = model
        self.template = None  # a base-model run's chat template (prompts are rendered with it)
        if self.config.get("tokenizer", {}).get("kind") == base_model.EXPORT_TOKENIZER_KIND:
            try:
                self.tokenizer, self.template = base_model.exported_tokenizer(
                    self.directory, self.config["tokenizer"]
                )
            except base_model.BaseModelError as exc:
                raise export.ExportError(str(exc)) from None
        else:
            self.tokenizer = tokenizers.from_config(self.config["tokenizer"], self.directory)
        if "weights" in self.config:  # a HuggingFace directory (Llama architecture)
            from . import hf_export

            self.cfg, self.params = hf_export.load(self.directory, self.config)
            return
        self.cfg = model.config_from_dict(self.config["model"])
        template = jax.eval_shape(lambda: model.init_params(self.cfg, jax.random.key(0)))
        template = jax.tree_util.tree_map(lambda a: np.zeros(a.shape, a.dtype), template)
        try:
            self.params = restore_like(template, flat)
        except ValueError as exc:
            raise export.ExportError(f"{self.directory}: {exc}") from exc

    def prompt_ids(self, prompt: str) -> list[int]:
        """``prompt`` encoded as training laid it out: the chat template's user turn and
        generation prompt for a base-model run, ``<bos> prompt`` for a causal-LM stage
        (raw text continues), else ``<bos> prompt <sep>``."""
        if self.config.get("stage") == "pretrain":
            head = [] if self.tokenizer.bos_id is None else [self.tokenizer.bos_id]
            return [*head, *self.tokenizer.encode(prompt)]
        if self.template is not None:
            try:
                return base_model.generation_prompt(self.template, self.tokenizer._backend, prompt)
            except chat_template.ChatTemplateError as exc:
                raise ValueError(str(exc)) from None
        return sft_data.encode(sft_data.Example(prompt, "x"), self.tokenizer).prompt

    def generate(self, prompt: str, max_new_tokens: int = 64) -> str:
        ids = self.prompt_ids(prompt)
        budget = min(max_new_tokens, self.cfg.max_len - len(ids))
        if budget <= 0:
            raise ValueError(
                f"prompt is {len(ids)} tokens; the model's maximum length is {self.cfg.max_len}"
            )
        out = self.model.greedy_generate(self.params, self.cfg, ids, budget, self.tokenizer.eos_id)
        return self.tokenizer.decode(out)


class PackedSFT(Strategy):
    name = "packed-sft"
    version = "12.0.0"
    description = (
        "Supervised fine-tuning of a decoder-only transformer on packed sequences (segment ids, "
        "per-segment positions, block-diagonal causal attention, loss on response tokens only); "
        "AdamW with warmup and decay, global-norm clipping, BF16 compute by default; DEV loss and "
        "greedy exact-match evaluation; export for generation."
    )
    schema_file = "strategy-packed-sft.schema.json"
    default_max_steps = 300
    default_every_steps = 50
    selection_metric = ("dev_loss", "min")

    def check(self, recipe: dict) -> list[dict]:
        model = recipe["model"]
        errors = normalize_model_section(model)
        names = [i["name"] for i in recipe.get("inputs", [])]
        wanted = list(SPLITS) + base_model_inputs(model)
        tokenizer = model.get("tokenizer", {"kind": "byte"})
        if tokenizer["kind"] == "tokenizers-json":
            wanted.append(tokenizer["input"])
        missing = [n for n in wanted if n not in names]
        if missing:
            errors.append(
                {
                    "path": "/inputs",
                    "message": f"packed-sft needs pinned inputs named {wanted}; missing {missing}",
                }
            )
        unknown = [n for n in names if n not in wanted]
        if unknown:
            errors.append(
                {
                    "path": "/inputs",
                    "message": f"packed-sft accepts only inputs {wanted}; got unexpected {unknown}",
                }
            )
        errors += normalize_export_dtype(recipe)
        errors += lora.normalize_section(recipe)
        errors += execution.normalize_recipe(recipe)
        if "d_model" not in model or "n_heads" not in model:
            pass  # a base model's config.json gives them (checked at prepare)
        elif model["d_model"] % model["n_heads"]:
            errors.append(
                {
                    "path": "/model/n_heads",
                    "message": f"must divide model.d_model={model['d_model']} (got {model['n_heads']})",
                }
            )
        elif (
            model.get("positions", "rotary") == "rotary"
            and (model["d_model"] // model["n_heads"]) % 2
        ):
            errors.append(
                {
                    "path": "/model/positions",
                    "message": "rotary positions need an even head width (d_model / n_heads)",
                }
            )
        if tokenizer["kind"] == "byte" and (tokenizer.get("special_tokens") or {}):
            errors.append(
                {
                    "path": "/model/tokenizer/special_tokens",
                    "message": "only for kind tokenizers-json (the byte tokenizer's are fixed)",
                }
            )
        evaluation = recipe["evaluation"]
        if evaluation["min_dev_exact_match"] > 0 and evaluation["max_generate_examples"] == 0:
            errors.append(
                {
                    "path": "/evaluation/min_dev_exact_match",
                    "message": "needs evaluation.max_generate_examples > 0 (no prompt would be "
                    "generated from, so exact-match could never be measured)",
                }
            )
        data_parallel = recipe["training"]["data_parallel"]
        if recipe["training"]["batch_size"] % data_parallel["devices"]:
            errors.append(
                {
                    "path": "/training/data_parallel/devices",
                    "message": f"must divide training.batch_size={recipe['training']['batch_size']} "
                    f"(every device gets the same number of rows; got {data_parallel['devices']})",
                }
            )
        warmup = recipe["training"]["warmup_steps"]
        if warmup >= recipe["limits"]["max_steps"]:
            errors.append(
                {
                    "path": "/training/warmup_steps",
                    "message": f"must be below limits.max_steps={recipe['limits']['max_steps']} "
                    f"(got {warmup})",
                }
            )
        return errors

    def devices_required(self, recipe: dict) -> int:
        return recipe["training"]["data_parallel"]["devices"]

    def data_spec(self, recipe: dict) -> dict:
        pinned = {i["name"]: i["sha256"] for i in recipe.get("inputs", [])}
        training, evaluation = recipe["training"], recipe["evaluation"]
        spec = {
            "strategy": self.name,
            "prepare_version": PREPARE_VERSION,
            "inputs": pinned,
            "tokenizer": recipe["model"].get("tokenizer"),
            "seq_len": training["seq_len"],
            "overlong": training["overlong"],
            "max_generate_examples": evaluation["max_generate_examples"],
        }
        if "base" in recipe["model"]:
            # only with a base model, so every other recipe keeps its examples digest
            spec["tokenizer"] = None
            spec["base"] = recipe["model"]["base"]
            spec["chat_template"] = recipe["model"].get("chat_template")
        return spec

    def prepare(self, recipe: dict, files: dict[str, Path]) -> tuple[dict[str, np.ndarray], dict]:
        training = recipe["training"]
        arrays: dict[str, np.ndarray] = {}
        meta: dict[str, Any] = {"splits": {}}
        if "base" in recipe["model"]:
            arrays, meta["base_model"] = base_model.load(recipe, files)
            tokenizer, template = _base_tokenizer(recipe, arrays, files)
            meta["chat_template"] = template.source

            def encode_split(split):
                return _encode_chat_split(files[split], tokenizer, template)
        else:
            tokenizer = tokenizers.from_settings(recipe["model"]["tokenizer"], files)

            def encode_split(split):
                return _encode_split(files[split], tokenizer)

        meta["tokenizer"] = tokenizer.config()
        for split in SPLITS:
            encoded = encode_split(split)
            if split == "train":
                packed = packing.pack(
                    encoded, training["seq_len"], training["overlong"], tokenizer.pad_id
                )
                if packed.stats["rows"] == 0:
                    raise sft_data.DataError(
                        f"{files[split]}: no example fits training.seq_len={training['seq_len']}"
                    )
                arrays.update({f"train_{k}": v for k, v in packed.arrays.items()})
                meta["splits"][split] = packed.stats
            else:
                split_arrays, stats = _eval_arrays(split, encoded, recipe, tokenizer.pad_id)
                arrays.update(split_arrays)
                meta["splits"][split] = stats
        arrays["dev_jsonl"] = np.frombuffer(files["dev"].read_bytes(), dtype=np.uint8)
        if tokenizer.kind == "tokenizers-json" and "base" not in recipe["model"]:
            arrays["tokenizer_json"] = np.frombuffer(
                files[recipe["model"]["tokenizer"]["input"]].read_bytes(), dtype=np.uint8
            )
        meta["packing_efficiency"] = meta["splits"]["train"]["efficiency"]
        return arrays, meta

    def build(self, recipe: dict, examples: dict[str, np.ndarray]) -> Program:
        return PackedSFTProgram(recipe, examples)

    def acceptance(self, recipe: dict, metrics: dict[str, Any]) -> dict:
        evaluation = recipe["evaluation"]
        checks = []

        def add(name, threshold, ok):
            value = metrics.get(name)
            passed = value is not None and np.isfinite(value) and ok(value)
            checks.append(
                {"name": name, "value": value, "threshold": threshold, "passed": bool(passed)}
            )

        if evaluation["max_generate_examples"] > 0:
            add(
                "dev_exact_match",
                evaluation["min_dev_exact_match"],
                lambda v: v >= evaluation["min_dev_exact_match"],
            )
        if evaluation["max_dev_loss"] is not None:
            add("dev_loss", evaluation["max_dev_loss"], lambda v: v <= evaluation["max_dev_loss"])
        return {"passed": all(c["passed"] for c in checks), "checks": checks}

    def evaluate_export(self, recipe: dict, export_dir: Path) -> dict[str, Any]:
        """DEV metrics from the export alone: its weights, its tokenizer and its copy of the
        DEV split, which must be the file this recipe pins as ``dev``."""
        exported = ExportedModel(Path(export_dir))
        dev = exported.config["dev"]
        dev_path = Path(export_dir) / dev["file"]
        data = dev_path.read_bytes() if dev_path.is_file() else b""
        pinned = {i["name"]: i["sha256"] for i in recipe.get("inputs", [])}.get("dev")
        actual = sha256_bytes(data)
        if actual != dev["sha256"] or actual != pinned:
            raise export.ExportError(
                f"{dev_path}: sha256 {actual}, but the export records {dev['sha256']} and the "
                f"recipe pins {pinned}"
            )
        if exported.template is not None:
            encoded = _encode_chat_split(dev_path, exported.tokenizer, exported.template)
        else:
            encoded = _encode_split(dev_path, exported.tokenizer)
        arrays, _ = _eval_arrays("dev", encoded, recipe, exported.tokenizer.pad_id)
        evaluator = Evaluator(
            exported.cfg,
            recipe["evaluation"]["batch_size"],
            exported.tokenizer.eos_id,
            exported.tokenizer.pad_id,
        )
        return evaluator.split_metrics(exported.params, arrays, "dev")
