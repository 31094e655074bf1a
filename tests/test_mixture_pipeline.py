"""Mixtures through a real Snakemake run.

- Two recipes mixing one source with different others prepare that source once: the second
  run lists no job for it and leaves its prepared files as they were (mtimes), while its own
  new source is prepared.
- A mixture of two weighted sources trains, is evaluated and published; the rows, trained
  tokens and epochs per source in ``summary.json`` and in the report equal the counts of a
  replay written here from the data-order rule as docs/packed-sft.md states it (source of
  each row drawn from ``PCG64([seed, 0x6d6978, block])``, epochs of each source permuted by
  ``PCG64([seed, s + 1, e])``), over the rows the prepare stage stored.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import run_snakemake, snakemake_jobs, write_project
from test_mixtures import mixed_recipe, mixture_inputs

from minifield import recipe as recipes
from minifield.data import encoding
from minifield.digest import short
from minifield.strategies.packed_sft import demo_data

pytestmark = pytest.mark.slow


def _examples_target(workdir: Path, name: str) -> str:
    loaded = recipes.load(workdir / "config" / "recipes" / name)
    return f"results/examples/{short(loaded.examples_digest)}/manifest.json"


def test_a_source_shared_by_two_mixtures_is_prepared_once(tmp_path):
    workdir = tmp_path / "project"
    space = mixture_inputs(workdir)
    first = mixed_recipe(space)  # train (3) + extra (1)
    other = encoding.to_jsonl(demo_data.demo_examples(seed=13, sizes={"train": 30})["train"])
    (workdir / "in" / "sft" / "other.jsonl").write_bytes(other)
    second = mixed_recipe(space, [{"input": "extra", "weight": 1}, {"input": "other", "weight": 2}])
    second["job_id"] = "mix-two"
    second["inputs"] = [i for i in second["inputs"] if i["name"] != "train"]
    second["inputs"].append(
        {"name": "other", "path": "sft/other.jsonl", "sha256": hashlib.sha256(other).hexdigest()}
    )

    write_project(workdir, {"first.yaml": first})
    done = run_snakemake(workdir, _examples_target(workdir, "first.yaml"), check=True)
    assert snakemake_jobs(done.stdout + done.stderr)["prepare_source"] == 2
    sources = workdir / "results" / "sources"
    prepared = {p: p.stat().st_mtime_ns for p in sources.rglob("*") if p.is_file()}
    first_digests = recipes.load(workdir / "config" / "recipes" / "first.yaml").source_digests

    write_project(workdir, {"first.yaml": first, "second.yaml": second})
    second_digests = recipes.load(workdir / "config" / "recipes" / "second.yaml").source_digests
    assert second_digests["extra"] == first_digests["extra"]
    done = run_snakemake(workdir, _examples_target(workdir, "second.yaml"), check=True)
    jobs = snakemake_jobs(done.stdout + done.stderr)
    assert jobs["prepare_source"] == 1 and jobs["prepare"] == 1  # only "other", new
    assert {p: p.stat().st_mtime_ns for p in prepared} == prepared  # nothing rewritten
    made = sorted(p.name for p in sources.iterdir())
    expected = {short(d) for d in [*first_digests.values(), *second_digests.values()]}
    assert made == sorted(expected) and len(made) == 3
    # the second recipe's examples hold the shared source's rows as prepared the first time
    manifest = json.loads((workdir / _examples_target(workdir, "second.yaml")).read_text())
    shared = json.loads((sources / short(first_digests["extra"]) / "manifest.json").read_text())
    assert manifest["meta"]["mixture"]["extra"] == shared["meta"]["stats"]


def _replay(seed: int, batch_size: int, weights: list[float], n_rows: list[int], updates: int):
    """How many times each stored row of each source is read in updates ``0 .. updates-1``,
    from the rule as documented (not the code): each update's row sources are a categorical
    draw, updates drawn in blocks of ``max(1, 65536 // batch_size)`` from one generator; a
    source is read in epochs, each a permutation of its rows."""
    shares = np.array(weights) / sum(weights)
    per_block = max(1, 65536 // batch_size)
    reads = [np.zeros(n, dtype=np.int64) for n in n_rows]
    position = [0] * len(n_rows)
    for step in range(updates):
        block, within = divmod(step, per_block)
        generator = np.random.Generator(np.random.PCG64([seed, 0x6D6978, block]))
        uniform = generator.random((per_block, batch_size))[within]
        for source in np.searchsorted(np.cumsum(shares), uniform, side="right"):
            epoch, index = divmod(position[source], n_rows[source])
            permutation = np.random.Generator(np.random.PCG64([seed, source + 1, epoch]))
            reads[source][permutation.permutation(n_rows[source])[index]] += 1
            position[source] += 1
    return reads


def test_a_weighted_mixture_trains_evaluates_and_publishes(tmp_path):
    workdir = tmp_path / "project"
    space = mixture_inputs(workdir)
    # extra (40 examples, fewer rows) weighs 3: read several times over, train about once
    entries = [{"input": "train", "weight": 1}, {"input": "extra", "weight": 3}]
    recipe = mixed_recipe(space, entries, seed=7)
    recipe["limits"]["max_steps"] = 12
    recipe["evaluation"]["min_dev_exact_match"] = 0.0
    write_project(workdir, {"mix.yaml": recipe})
    loaded = recipes.load(workdir / "config" / "recipes" / "mix.yaml")
    base = f"results/computations/{short(loaded.computation_digest)}"
    # what this test reads (capacity and the other report pages are other tests')
    targets = [f"{base}/{name}" for name in ("eval/metrics.json", "publication.json")]
    targets += [f"{base}/summary.json", f"{base}/report/throughput.html"]
    run_snakemake(workdir, *targets, check=True, timeout=1800)

    computation = workdir / base
    assert json.loads((computation / "eval" / "metrics.json").read_text())["acceptance"]["passed"]
    publication = json.loads((computation / "publication.json").read_text())
    assert (workdir / "results" / "store" / "artifacts" / publication["content_id"]).is_dir()

    # the reference: the stored rows of each source, read as often as the replay says
    examples = workdir / "results" / "examples" / short(loaded.examples_digest)
    n_rows = np.load(examples / "train_source_rows.npy").tolist()
    trained = np.load(examples / "train_loss_mask.npy").sum(axis=1)
    training = loaded.data["training"]
    reads = _replay(training["seed"], training["batch_size"], [1.0, 3.0], n_rows, 12)
    offsets = np.concatenate([[0], np.cumsum(n_rows)])
    expected = {
        name: {
            "trained_rows_count": int(reads[s].sum()),
            "trained_loss_tokens_count": int(reads[s] @ trained[offsets[s] : offsets[s + 1]]),
            "epochs_count": reads[s].sum() / n_rows[s],
        }
        for s, name in enumerate(("train", "extra"))
    }
    assert sum(e["trained_rows_count"] for e in expected.values()) == 12 * 8
    assert expected["extra"]["epochs_count"] > 1  # a source that repeats
    summary = json.loads((computation / "summary.json").read_text())
    assert summary["sources"].keys() == expected.keys()
    for name, figures in expected.items():
        got = summary["sources"][name]
        assert got["trained_rows_count"] == figures["trained_rows_count"], name
        assert got["trained_loss_tokens_count"] == figures["trained_loss_tokens_count"], name
        assert got["epochs_count"] == pytest.approx(figures["epochs_count"], rel=1e-12), name

    page = (computation / "report" / "throughput.html").read_text()
    for name, figures in expected.items():
        row = (
            f'<tr><td>{name}</td><td class="num">{figures["trained_rows_count"]}</td>'
            f'<td class="num">{figures["trained_loss_tokens_count"]}</td>'
            f'<td class="num">{figures["epochs_count"]:.6g}</td></tr>'
        )
        assert row in page, (row, page[page.find("Training mixture") :][:800])
