"""The quantized base as a product (``results/quantized-bases/{qdigest}``, docs/quantized-base.md
"The quantized base is a product"): the host's codes against ``quantize.quantize`` on the CPU
bit for bit (double quantization's mean against an exact mean computed here with fractions),
the address, the product written and verified, a worker that loads it training the states of
one that quantizes in memory, kill → resume on it, and two recipes sharing one product
through a real Snakemake run."""

from __future__ import annotations

import json
import re
from fractions import Fraction
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import read_events, run_snakemake, snakemake_jobs, write_project, write_recipe
from test_base_model import _run, make_inputs
from test_lora import LORA, lora_recipe

from minifield import recipe as recipes
from minifield.digest import short
from minifield.hf import quantized_base, stored_base
from minifield.models import quantize
from minifield.pipeline import preparation

# the test base's matrices have 32 or 48 inputs: blocks of 16 divide them all
NF4 = {**LORA, "base_quantization": "nf4", "quantization_block": 16, "double_quantization": True}
INT8 = {**LORA, "base_quantization": "int8"}


def trained_recipe(root, section):
    """The LoRA recipe the workers here train: what they check is the updates, their state
    hashes and the product each was given, so no greedy decoding in the final evaluations
    (each worker would compile the generation loop for nothing checked)."""
    recipe = lora_recipe(root, section)
    recipe["evaluation"]["max_generate_examples"] = 0
    return recipe


def _stored(K, N, out_in, dtype, seed=0):
    """A random ``[in, out]`` matrix with a zero output channel, stored as a base stores it
    (HF's ``[out, in]`` when ``out_in``) in ``dtype``; and its float32 ``[in, out]`` values."""
    w = (np.random.default_rng(seed).standard_normal((K, N)) * 0.05).astype(np.float32)
    w[:, 3] = 0.0
    stored = np.ascontiguousarray((w.T if out_in else w).astype(dtype))
    values = np.asarray(stored, np.float32)
    return stored, values.T if out_in else values


# the fast tier keeps one scheme: each case compiles quantize.quantize (about 0.5 s)
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    ("scheme", "block"),
    [pytest.param("int8", None, marks=SLOW), pytest.param("int8", 16, marks=SLOW), ("nf4", 64)],
)
def test_the_hosts_codes_are_quantize_on_the_cpu_bit_for_bit(scheme, block, monkeypatch):
    # 1100 output channels: two slices of ROWS, the last one short, each quantized 300 channels
    # at a time (the last one short again); each stored dtype and layout
    monkeypatch.setattr(quantized_base, "SLICE_VALUES", 300 * 128)
    for dtype in (np.float32, ml_dtypes.bfloat16, np.float16):
        for out_in in (True, False):
            stored, w_KxN = _stored(128, 1100, out_in, dtype)
            ours = quantized_base.quantize_matrix(stored, out_in, scheme, block, False)
            ref = quantize.quantize(jnp.asarray(w_KxN), scheme, block, False)
            assert ours["codes"].dtype == np.asarray(ref.codes).dtype
            np.testing.assert_array_equal(ours["codes"], np.asarray(ref.codes))
            np.testing.assert_array_equal(ours["scales"], np.asarray(ref.scales))
            assert ours["scale_scales"] is None and ours["offset"] is None


def test_the_nearest_nf4_entry_is_the_binary_searchs_at_every_edge():
    """The 15 comparisons against NumPy's binary search over the midpoints: at each midpoint,
    one float32 step either side, the table's ends, zeros, infinities and NaN (last)."""
    mid = (quantized_base.NF4[1:] + quantized_base.NF4[:-1]) / np.float32(2.0)
    inf = np.float32(np.inf)
    edges = np.concatenate([mid, np.nextafter(mid, inf), np.nextafter(mid, -inf)])
    special = np.array([-1, 1, 0, -0.0, np.inf, -np.inf, np.nan, 1.5, -1.5], np.float32)
    rng = np.random.default_rng(0).uniform(-1, 1, 10_000).astype(np.float32)
    values = np.concatenate([edges, special, rng])
    want = np.searchsorted(mid, values)
    assert np.array_equal(quantized_base._nearest_nf4(values), want)
    assert want[np.isnan(values)].tolist() == [15]


def test_the_nf4_table_is_the_quantizers():
    np.testing.assert_array_equal(quantized_base.NF4, np.asarray(quantize.NF4, np.float32))


@SLOW
@pytest.mark.slow  # 0.8 s a case: the fast tier's 90 s under 3.12
@pytest.mark.parametrize(("scheme", "block"), [("int8", 16), ("nf4", 16)])
def test_double_quantization_centres_on_the_exact_mean(scheme, block):
    """The offset is the exact mean of the scales rounded to float32 (fractions here), the
    scales' codes ``round(127 (s - offset) / group absmax)`` in float64 but for ties."""
    stored, w_KxN = _stored(64, 600, True, np.float32, seed=3)  # 2400 scales: 10 groups
    ours = quantized_base.quantize_matrix(stored, True, scheme, block, True)
    plain = quantized_base.quantize_matrix(stored, True, scheme, block, False)
    np.testing.assert_array_equal(ours["codes"], plain["codes"])
    scales = plain["scales"].reshape(-1)
    exact = sum(Fraction(float(s)) for s in scales) / scales.size
    offset = float(ours["offset"])
    assert abs(Fraction(offset) - exact) <= Fraction(float(np.spacing(np.float32(offset)))) / 2
    centred = scales.astype(np.float64) - offset
    pad = np.pad(centred, (0, (-centred.size) % 256)).reshape(-1, 256)
    top = np.abs(pad).max(axis=1)
    np.testing.assert_allclose(ours["scale_scales"], top, rtol=1e-6)
    scaled = (127.0 * pad / top[:, None]).reshape(-1)[: scales.size]
    near_tie = np.abs(np.abs(scaled % 1) - 0.5) < 1e-4
    codes = ours["scales"].reshape(-1)
    assert np.array_equal(codes[~near_tie], np.round(scaled[~near_tie]).astype(np.int8))
    # and it makes back what quantize.quantize's double quantization does, within its rounding
    ref = quantize.quantize(jnp.asarray(w_KxN), scheme, block, True)
    weight = quantize.QuantizedWeight(
        *(ours[leaf] for leaf in quantized_base.LEAVES), scheme, block, w_KxN.shape
    )
    np.testing.assert_allclose(
        np.asarray(quantize.dequantize(weight)),
        np.asarray(quantize.dequantize(ref)),
        atol=2e-3 * float(np.abs(w_KxN).max()),
    )


def _loaded(root, section, **training):
    recipe = lora_recipe(root, section)
    recipe["training"].update(training)
    return recipes.validate(recipe)


def test_the_address_is_the_base_and_the_settings_and_the_digest_names_it(tmp_path):
    root = tmp_path / "in"
    make_inputs(root)
    nf4 = _loaded(root, NF4)
    other_rate = _loaded(root, NF4, learning_rate=0.01)
    assert nf4.computation_digest != other_rate.computation_digest
    assert nf4.quantized_base_digest == other_rate.quantized_base_digest
    # NF4's absent block is 64: the same codes, the same product
    spelled = _loaded(root, {**LORA, "base_quantization": "nf4", "quantization_block": 64})
    absent = _loaded(root, {**LORA, "base_quantization": "nf4"})
    assert spelled.quantized_base_digest == absent.quantized_base_digest
    # the dtype the step sees the base in is not the codes'
    bf16 = _loaded(root, {**NF4, "base_dtype": "bfloat16"})
    assert bf16.quantized_base_digest == nf4.quantized_base_digest
    others = [
        _loaded(root, INT8),
        _loaded(root, {**NF4, "quantization_block": 32}),
        _loaded(root, {**NF4, "double_quantization": False}),
    ]
    digests = {nf4.quantized_base_digest, *(o.quantized_base_digest for o in others)}
    assert len(digests) == 4
    assert _loaded(root, LORA).quantized_base_digest is None
    from minifield.strategies.base import computation_fields

    assert computation_fields(nf4.data)["quantized_base"] == nf4.quantized_base_digest
    assert "quantized_base" not in computation_fields(_loaded(root, LORA).data)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A prepared NF4 recipe and its product written by the pipeline's stage function."""
    tmp = tmp_path_factory.mktemp("qproduct")
    root = tmp / "in"
    make_inputs(root)
    path = write_recipe(tmp / "recipe.json", trained_recipe(root, NF4))
    recipe_json = tmp / "validated.json"
    preparation.validate(path, recipe_json, tmp / "validation.json")
    preparation.prepare(recipe_json, root, tmp / "examples")
    manifest = preparation.quantize_base(recipe_json, tmp / "examples", tmp / "product")
    return {"tmp": tmp, "root": root, "path": path, "json": recipe_json, "manifest": manifest}


def test_the_product_holds_every_block_matrix_quantized_from_the_stored_base(made):
    from minifield.inputs import examples

    loaded = recipes.load(made["json"])
    manifest = made["manifest"]
    assert manifest["quantized_base_digest"] == loaded.quantized_base_digest
    assert manifest["meta"]["spec"] == quantized_base.spec(loaded.data)
    arrays = quantized_base.load(made["tmp"] / "product", loaded.data)
    base, _ = examples.load(made["tmp"] / "examples", loaded.examples_digest)
    matrices = 0
    for path, value, out_in in stored_base.stored(base):
        name = f"qbase.{path.replace('/', '.')}"
        if not quantize.is_quantized(path, value.ndim):
            assert not any(key.startswith(name) for key in arrays), path
            continue
        matrices += 1  # the host's codes (quantize's bits: above), from the stored bytes
        expected = quantized_base.quantize_matrix(value, out_in, "nf4", 16, True)
        for leaf in quantized_base.LEAVES:
            np.testing.assert_array_equal(arrays[f"{name}.{leaf}"], expected[leaf])
    assert matrices == 2 * 7  # two layers, q k v o gate up down


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_an_altered_missing_or_other_product_is_refused_by_name(made, tmp_path):
    loaded = recipes.load(made["json"])
    altered = _copy(made["tmp"] / "product", tmp_path / "altered")
    victim = sorted(altered.glob("qbase.*.codes.npy"))[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1
    victim.write_bytes(bytes(data))
    with pytest.raises(quantized_base.QuantizedBaseError, match=re.escape(str(victim))):
        quantized_base.load(altered, loaded.data)
    missing = _copy(made["tmp"] / "product", tmp_path / "missing")
    (missing / "manifest.json").unlink()
    with pytest.raises(quantized_base.QuantizedBaseError, match="quantized base not prepared"):
        quantized_base.load(missing, loaded.data)
    int8 = recipes.validate(lora_recipe(made["root"], INT8))
    with pytest.raises(quantized_base.QuantizedBaseError, match="quantized base digest"):
        quantized_base.load(made["tmp"] / "product", int8.data)
    plain = recipes.validate(lora_recipe(made["root"], LORA))
    with pytest.raises(quantized_base.QuantizedBaseError, match="does not quantize its base"):
        quantized_base.load(made["tmp"] / "product", plain.data)


def _hashes(attempts) -> dict[int, str]:
    return {
        e["step"]: e["state_hash"]
        for a in attempts
        for e in read_events(a / "events.jsonl")
        if e["type"] == "update"
    }


@pytest.mark.slow
def test_the_worker_on_the_product_trains_the_in_memory_states_and_resumes_bit_exactly(made):
    """Crash after update 3, resumed from the step-2 checkpoint, both attempts loading the
    product: every update's state hash is the one of a worker that quantizes in memory."""
    tmp, root, path = made["tmp"], made["root"], made["path"]
    given = ("--examples", tmp / "examples", "--quantized-base", tmp / "product")
    (crashed,) = _run(tmp, path, root, "crash", *given, "--fail-after-step", "3", codes=(1,))
    (_, resumed) = _run(tmp, path, root, "crash", *given, "--resume-from", crashed)
    (in_memory,) = _run(tmp, path, root, "memory")
    assert sorted(_hashes([crashed])) == [1, 2, 3]
    assert _hashes([crashed, resumed]) == _hashes([in_memory])
    final = json.loads((resumed / "result.json").read_text())["final_state_hash"]
    assert final == json.loads((in_memory / "result.json").read_text())["final_state_hash"]


@pytest.mark.slow
def test_the_evaluation_reads_the_product_and_scores_what_quantizing_in_memory_scores(
    made, tmp_path
):
    """The evaluate stage given the product (as the pipeline's evaluate rule gives it) scores
    every checkpoint exactly as the evaluation that quantizes the prepared base again in
    memory, and an altered product is refused naming its file: the product is what it read."""
    from minifield.pipeline import evaluation
    from minifield.pipeline.errors import StageError

    tmp = made["tmp"]
    given = ("--examples", tmp / "examples", "--quantized-base", tmp / "product")
    (attempt,) = _run(tmp_path, made["path"], made["root"], "scored", *given)
    result, examples_dir = tmp_path / "train-result.json", tmp / "examples"
    worker = json.loads((attempt / "result.json").read_text())  # as the train stage records it
    result.write_text(json.dumps({**worker, "attempt_dir": str(attempt)}))
    quantized, in_memory = (
        evaluation.evaluate(
            made["json"],
            result,
            examples_dir,
            tmp_path / name / "metrics.json",
            quantized_base_dir=product,
        )  # fmt: skip
        for name, product in (("product", tmp / "product"), ("memory", None))
    )
    assert quantized["checkpoints"] and quantized == in_memory
    altered = _copy(tmp / "product", tmp_path / "altered")
    victim = sorted(altered.glob("qbase.*.codes.npy"))[0]
    victim.write_bytes(victim.read_bytes()[:-1] + b"\x07")
    with pytest.raises(StageError, match=re.escape(str(victim))):
        evaluation.evaluate(made["json"], result, examples_dir, tmp_path / "m.json",
                            quantized_base_dir=altered)  # fmt: skip


@pytest.mark.slow
def test_a_worker_given_an_altered_product_ends_with_exit_2_naming_the_file(made, tmp_path):
    altered = _copy(made["tmp"] / "product", tmp_path / "altered")
    victim = sorted(altered.glob("qbase.*.scales.npy"))[0]
    victim.write_bytes(victim.read_bytes()[:-1] + b"\x01")
    given = ("--examples", made["tmp"] / "examples", "--quantized-base", altered)
    (attempt,) = _run(tmp_path, made["path"], made["root"], "out", *given, codes=(2,))
    result = json.loads((attempt / "result.json").read_text())
    assert result["error"]["phase"] == "quantized base"
    assert str(victim) in result["error"]["message"]
    assert not [e for e in read_events(attempt / "events.jsonl") if e["type"] == "update"]


# -- through Snakemake (slow) ----------------------------------------------------------------


@pytest.mark.slow
def test_two_computations_on_one_base_and_settings_share_one_product(tmp_path):
    workdir = tmp_path / "project"
    root = workdir / "in"
    make_inputs(root)
    first = trained_recipe(root, NF4)  # its paths are under the input root, "in"
    second = {**first, "job_id": "base-test-rate", "training": {**first["training"]}}
    second["training"]["learning_rate"] = 0.02
    third = {**first, "job_id": "base-test-int8", "model": {**first["model"], "lora": INT8}}
    files = {"first.yaml": first, "second.yaml": second, "third.yaml": third}
    write_project(workdir, files)
    loaded = {name: recipes.load(workdir / "config" / "recipes" / name) for name in files}
    cd = {name: short(r.computation_digest) for name, r in loaded.items()}
    qd = {name: short(r.quantized_base_digest) for name, r in loaded.items()}
    assert qd["first.yaml"] == qd["second.yaml"] != qd["third.yaml"]
    train = [f"results/computations/{cd[n]}/train/result.json" for n in files]
    # the DAG: one product for the first two computations' qualify and train, one for the third
    planned = run_snakemake(workdir, "-n", *train, check=True)
    jobs = snakemake_jobs(planned.stdout + planned.stderr)
    assert jobs["quantize_base"] == 2 and jobs["qualify"] == 3 and jobs["train"] == 3
    products = [f"results/quantized-bases/{qd[n]}/manifest.json" for n in files]
    run_snakemake(workdir, *products, check=True)
    made = sorted(p.name for p in (workdir / "results" / "quantized-bases").iterdir())
    assert made == sorted({qd["first.yaml"], qd["third.yaml"]})
    manifest = workdir / products[0]
    written = {p: p.stat().st_mtime_ns for p in manifest.parent.iterdir()}
    # the first computation's recovery proof and training run on the product, left as made
    proof = f"results/computations/{cd['first.yaml']}/qualification/proof.json"
    done = run_snakemake(workdir, train[0], check=True)
    assert "quantize_base" not in snakemake_jobs(done.stdout + done.stderr)
    assert {p: p.stat().st_mtime_ns for p in manifest.parent.iterdir()} == written
    assert json.loads((workdir / proof).read_text())["passed"] is True
    assert json.loads((workdir / train[0]).read_text())["status"] == "completed"
    work = workdir / "work" / cd["first.yaml"]
    proving = list(work.glob("qualification/*/runs/*/run.json"))
    training = list(work.glob("runs/*/run.json"))
    assert proving and training
    for run in proving + training:  # every worker was given the product
        command = json.loads(run.read_text())["command"]
        given = command[command.index("--quantized-base") + 1]
        assert Path(given).parts[-2:] == ("quantized-bases", qd["first.yaml"])


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 3])
def test_making_the_product_holds_about_one_matrix_a_thread_on_the_host(tmp_path, threads):
    """Eight memory-mapped 1024 × 2048 float32 matrices (8 MiB each, 64 MiB in all): the
    traced peak of making their product is under one and a half matrices' bytes a thread
    (one thread: 11.6 MB when this was written, one matrix's codes, a 1024-channel slice and
    its temporaries), not the eight matrices' codes and more."""
    import tracemalloc

    layout, names = {}, []
    rng = np.random.default_rng(0)
    for i in range(8):
        path = f"blocks/{i:02d}/mlp/w_up"
        name = stored_base.PARAM_PREFIX + path.replace("/", ".")
        np.save(tmp_path / f"{name}.npy", rng.standard_normal((2048, 1024), np.float32))
        layout[path] = {"dtype": "float32", "out_in": True}
        names.append(name)
    arrays = {n: np.load(tmp_path / f"{n}.npy", mmap_mode="r") for n in names}
    arrays[stored_base.LAYOUT_ARRAY] = np.frombuffer(json.dumps(layout).encode(), np.uint8)
    data = {
        "model": {"lora": {"base_quantization": "int8"}, "base": {"config": "c", "weights": ["w"]}},
        "inputs": [{"name": "c", "sha256": "0" * 64}, {"name": "w", "sha256": "1" * 64}],
    }
    tracemalloc.start()
    try:
        manifest = quantized_base.make(data, arrays, tmp_path / "product", threads)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(manifest["arrays"]) == 16  # codes and scales of each
    assert peak < threads * 1.5 * 2048 * 1024 * 4 < 8 * 2048 * 1024 * 4, peak
