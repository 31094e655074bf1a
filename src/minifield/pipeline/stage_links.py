"""The two-stage case of a chained computation (:mod:`.chains`, config ``two_stage``): which
recipes may be linked as stages, and the comparison the report shows.

Stage 2 starts from stage 1's export (``model.init.stage1``); the link itself, its
checkpoint and the registration of the concrete stage-2 computation are the chains'
mechanism. See docs/two-stage.md.
"""

from __future__ import annotations

import html
from pathlib import Path

from .. import atomic
from .. import recipe as recipes
from ..digest import sha256_file


def check_stages(stage1: recipes.Recipe, written: recipes.Recipe) -> str | None:
    """A configuration problem of a two-stage entry, or None: stage 1 is a two-stage pretrain
    recipe, stage 2 a two-stage sft recipe from a random initialisation (the link adds the
    start)."""
    if stage1.data["strategy"]["name"] != "two-stage" or (
        stage1.data["training"].get("stage") != "pretrain"
    ):
        return "stage1 is not a two-stage pretrain recipe"
    data = written.data
    if data["strategy"]["name"] != "two-stage" or data["training"].get("stage") != "sft":
        return "stage2 is not a two-stage sft recipe"
    if "init" in data["model"]:
        return "stage2 has model.init; the pipeline writes it from stage 1's export (leave it out)"
    return None


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
