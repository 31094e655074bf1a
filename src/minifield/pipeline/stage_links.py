"""The workflow's view of two-stage computations: config ``two_stage`` entries, the link
stage between the stages, and the comparison the report shows.

Stage 2's computation digest covers stage 1's export, which exists only once stage 1 has
trained, so stage 2's digest is unknown when the Snakefile is parsed. The pipeline makes the
concrete stage-2 recipe in a Snakemake ``checkpoint`` (``two_stage_link``) whose output path
is known at parse time: ``results/two-stage/{s1}/{s2}/`` with ``s1`` the stage-1 digest and
``s2`` the digest of the stage-2 recipe as written (the random-initialisation baseline). After
it ran, the stage-2 computation is registered by its own digest and goes through the usual
rules (validate … evaluate, publish). See docs/two-stage.md.
"""

from __future__ import annotations

import html
import shutil
from dataclasses import dataclass
from pathlib import Path

from .. import atomic
from .. import recipe as recipes
from ..digest import sha256_file, short
from ..strategies.two_stage import link as links
from . import computations as comps

LINK_DIR = "results/two-stage"


class LinkConfigError(comps.ConfigError):
    pass


@dataclass(frozen=True)
class StageLink:
    stage1: comps.Computation
    stage2_path: Path
    #: the stage-2 recipe as written (from a random initialisation): the baseline
    stage2_written: recipes.Recipe

    @property
    def s1(self) -> str:
        return self.stage1.cdigest

    @property
    def s2(self) -> str:
        return short(self.stage2_written.computation_digest)

    @property
    def directory(self) -> str:
        return f"{LINK_DIR}/{self.s1}/{self.s2}"


def load_links(config: dict, computations: dict) -> list[StageLink]:
    """Every ``two_stage`` entry, checked: stage 1 is a configured pretrain recipe, stage 2
    a valid sft recipe from a random initialisation (the link adds the start)."""
    found, problems = [], []
    by_path = {str(Path(c.path)): c for c in computations.values()}
    for index, entry in enumerate(config.get("two_stage") or []):
        where = f"config two_stage[{index}]"
        stage1 = by_path.get(str(Path(entry["stage1"])))
        if stage1 is None:
            problems.append(f"{where}.stage1: {entry['stage1']} is not one of the config's recipes")
            continue
        if stage1.recipe.data["strategy"]["name"] != "two-stage" or (
            stage1.recipe.data["training"].get("stage") != "pretrain"
        ):
            problems.append(f"{where}.stage1: {entry['stage1']} is not a two-stage pretrain recipe")
            continue
        try:
            written = recipes.load(entry["stage2"])
        except recipes.RecipeError as exc:
            problems.append(f"{where}.stage2: {exc}")
            continue
        data = written.data
        if data["strategy"]["name"] != "two-stage" or data["training"].get("stage") != "sft":
            problems.append(f"{where}.stage2: {entry['stage2']} is not a two-stage sft recipe")
        elif "init" in data["model"]:
            problems.append(
                f"{where}.stage2: {entry['stage2']} has model.init; the pipeline writes it from "
                "stage 1's export (leave it out)"
            )
        else:
            found.append(StageLink(stage1, Path(entry["stage2"]), written))
    if problems:
        raise LinkConfigError("invalid two_stage entries:\n" + "\n".join(problems))
    return found


def register_stage2(computations: comps.Computations, link_dir: str) -> comps.Computation:
    """The concrete stage-2 computation the link wrote into ``link_dir``, registered."""
    path = Path(link_dir) / "stage2.json"
    computation = comps.Computation(path, recipes.load(path), own_root=f"{link_dir}/inputs")
    return computations.register(computation)


def link(
    stage2_path: Path,
    stage1_recipe: Path,
    stage1_metrics: Path,
    export_dir: Path,
    input_root: Path,
    out_recipe: Path,
    out_root: Path,
) -> dict:
    """The link stage: stage 2's recipe and input root from stage 1's export.

    Refuses (a failed rule, nothing for stage 2 to train on) a stage 1 whose evaluation did
    not pass its acceptance, a missing export or another computation's."""
    stage1 = recipes.load(stage1_recipe)
    metrics = atomic.read_json(stage1_metrics)
    if metrics.get("computation_digest") != stage1.computation_digest:
        raise links.LinkError(
            f"{stage1_metrics}: evaluation of computation {metrics.get('computation_digest')}, "
            f"not of stage 1 ({stage1.computation_digest})"
        )
    if not metrics.get("acceptance", {}).get("passed", False):
        raise links.LinkError(f"{stage1_metrics}: stage 1 did not pass its acceptance evaluation")
    written = recipes.read_document(stage2_path)
    concrete = links.stage2_recipe(written, export_dir, stage1.computation_digest)
    recipe = recipes.validate(concrete, str(out_recipe))
    if out_root.exists():
        shutil.rmtree(out_root)
    links.make_input_root(recipe.data, input_root, export_dir, out_root)
    atomic.write_json(out_recipe, concrete)
    return {"computation_digest": recipe.computation_digest}


def _row(metrics_path: Path | None) -> dict:
    if metrics_path is None or not Path(metrics_path).is_file():
        return {}
    metrics = atomic.read_json(metrics_path)
    return {
        "computation_digest": metrics["computation_digest"],
        "selected_step": metrics["selection"].get("step"),
        "dev": metrics.get("selected_dev", {}),
        "test": metrics.get("test", {}),
    }


def comparison(
    stage1_metrics: Path,
    stage2_metrics: Path,
    baseline_metrics: Path | None,
    stage2_recipe: Path,
    stage1_publication: Path | None,
    stage2_publication: Path | None,
    out_json: Path,
    out_html: Path,
) -> dict:
    """Both stages and the random-initialisation baseline side by side, with the lineage."""
    recipe = atomic.read_json(stage2_recipe)
    stage1 = recipe["model"]["init"]["stage1"]
    pins = {i["name"]: i["sha256"] for i in recipe["inputs"]}

    def content_id(path):
        return atomic.read_json(path).get("content_id") if path and Path(path).is_file() else None

    record = {
        "stage1": _row(stage1_metrics),
        "stage2": _row(stage2_metrics),
        "baseline": _row(baseline_metrics),
        "lineage": {
            "stage1_computation_digest": stage1["computation_digest"],
            "stage1_export_record_sha256": pins[stage1["record"]],
            "stage1_content_id": content_id(stage1_publication),
            "stage2_content_id": content_id(stage2_publication),
            "stage2_recipe_sha256": sha256_file(stage2_recipe),
        },
    }
    atomic.write_json(out_json, record)
    atomic.write_bytes(out_html, render_html(record).encode("utf-8"))
    return record


def _fmt(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4f}"
    return html.escape(str(value))


def render_html(record: dict) -> str:
    s1, s2, base = record["stage1"], record["stage2"], record["baseline"]
    rows = [
        ("stage 1 (pretrain)", s1, ["loss", "perplexity", "bits_per_byte"]),
        ("stage 2 from stage 1", s2, ["loss", "perplexity", "exact_match"]),
        ("stage 2 from random init (baseline)", base, ["loss", "perplexity", "exact_match"]),
    ]
    body = []
    for label, row, keys in rows:
        if not row:
            body.append(f"<tr><td>{label}</td><td colspan='8'>not run</td></tr>")
            continue
        cells = [f"<td>{label}</td>", f"<td><code>{row['computation_digest'][:16]}</code></td>"]
        cells.append(f"<td>{_fmt(row['selected_step'])}</td>")
        for split in ("dev", "test"):
            for key in ("loss", "perplexity", "bits_per_byte", "exact_match"):
                value = row[split].get(f"{split}_{key}") if key in keys else None
                cells.append(f"<td>{_fmt(value)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    head = "".join(
        f"<th>{split} {key}</th>"
        for split in ("DEV", "TEST")
        for key in ("loss", "perplexity", "bits/byte", "exact-match")
    )
    lineage = "".join(
        f"<tr><td>{html.escape(k)}</td><td><code>{_fmt(v)}</code></td></tr>"
        for k, v in record["lineage"].items()
    )
    return (
        "<html><body><h3>Two stages</h3><table border='1'><tr><th>computation</th>"
        f"<th>digest</th><th>selected step</th>{head}</tr>{''.join(body)}</table>"
        "<p>Both stage-2 rows are the same stage-2 recipe and number of updates; only the "
        "start differs (stage 1's export vs a random initialisation). Figures of the "
        "DEV-selected checkpoint.</p>"
        f"<h4>Lineage</h4><table border='1'>{lineage}</table></body></html>\n"
    )
