"""Report items of what the pipeline concluded: the evaluation and the DEV-selected
checkpoint, the recovery proof, the publication record and the capacity plan."""

from __future__ import annotations

import csv
import html
from pathlib import Path
from typing import Any

from ... import atomic
from . import page


def evaluation_table(metrics_json: Path, out_html: Path) -> None:
    metrics = atomic.read_json(metrics_json)
    selection = metrics.get("selection", {})
    rows_in = metrics.get("checkpoints", [])
    names = sorted({k for r in rows_in if isinstance(r.get("dev"), dict) for k in r["dev"]})
    rows, selected = [], set()
    for index, row in enumerate(rows_in):
        if row.get("step") == selection.get("step") and "dev" in row:
            selected.add(index)
        rows.append(
            [row.get("step"), row.get("sha256"), row.get("state_hash")]
            + [row.get("dev", {}).get(n) for n in names]
            + ["DEV-selected" if index in selected else row.get("rejected", "")]
        )
    acceptance = metrics.get("acceptance", {})
    checks = [
        [
            c.get("name"),
            c.get("value"),
            c.get("threshold"),
            "passed" if c.get("passed") else "FAILED",
        ]
        for c in acceptance.get("checks", [])
    ]
    test = metrics.get("test") or {}
    body = (
        f"<p>Selection on the <b>DEV</b> split by <code>{html.escape(str(selection.get('metric')))}</code> "
        f"({html.escape(str(selection.get('mode')))}): step <b>{html.escape(page.fmt(selection.get('step')))}</b>, "
        f"checkpoint <code>{html.escape(str(selection.get('sha256', ''))[:16])}…</code>. "
        "TEST is assessed for the selected checkpoint only.</p>"
        + page.table(
            ["step", "checkpoint sha256", "state hash"] + [f"DEV {n}" for n in names] + [""],
            rows,
            selected,
        )
        + "<h2>TEST metrics of the selected checkpoint</h2>"
        + (
            page.table(["metric", "value"], [[k, test[k]] for k in sorted(test)])
            if test
            else '<p class="note">This strategy has no separate TEST split; acceptance uses the DEV metrics.</p>'
        )
        + _harness_section(metrics.get("harness"))
        + f"<h2>Acceptance: {page.pass_badge(acceptance.get('passed'))}</h2>"
        + page.table(["check", "value", "threshold", "verdict"], checks)
    )
    page.write_page(out_html, "Evaluation and DEV-selected checkpoint", body)


def _harness_section(harness: dict | None) -> str:
    """lm-evaluation-harness results on the selected export (empty without harness tasks)."""
    if not harness:
        return ""
    samples = harness.get("samples") or {}
    rows = [
        [task, metric, value, samples.get(task)]
        for task, values in sorted((harness.get("results") or {}).items())
        for metric, value in sorted(values.items())
    ]
    return (
        "<h2>lm-evaluation-harness tasks on the selected export</h2>"
        f"<p>lm-eval {html.escape(str(harness.get('lm_eval_version')))}, settings "
        f"<code>{html.escape(str(harness.get('settings')))}</code>; task files pinned by "
        "sha256 in the recipe.</p>" + page.table(["task", "metric", "value", "documents"], rows)
    )


def _hash_sequences(value: Any, prefix: str = "") -> dict[str, list[str]]:
    """Lists of sha256 strings anywhere in a JSON value, by dotted key."""
    found = {}
    if isinstance(value, dict):
        for key, item in value.items():
            found.update(_hash_sequences(item, f"{prefix}.{key}" if prefix else key))
    elif (
        isinstance(value, list)
        and value
        and all(isinstance(v, str) and len(v) == page.HEX64_LENGTH for v in value)
    ):
        found[prefix] = value
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        # [{step, state_hash}, ...] sequences
        hashes = [v.get("state_hash") or v.get("hash") for v in value]
        if all(isinstance(h, str) and len(h) == page.HEX64_LENGTH for h in hashes):
            found[prefix] = hashes
    return found


def recovery_table(proof_json: Path | None, out_html: Path) -> None:
    title = "Recovery proof"
    proof = page.read_optional(proof_json)
    if proof is None:
        return page.missing_rule_page(out_html, title, "qualify")
    passed = proof.get("passed", proof.get("ok", proof.get("verdict") == "passed"))
    body = f"<h2>Verdict: {page.pass_badge(passed)}</h2>"
    if proof.get("diagnosis"):
        body += f"<p>{html.escape(str(proof['diagnosis']))}</p>"
    shown: set[str] = {"diagnosis"}
    comparison = proof.get("comparison")
    if isinstance(comparison, list) and comparison and all(isinstance(r, dict) for r in comparison):
        # The proof's own step-by-step comparison of complete-state hashes.
        found = list(dict.fromkeys(k for row in comparison for k in row))
        first = [c for c in ("step", "what", "reference", "resumed", "equal") if c in found]
        columns = first + [c for c in found if c not in first]
        body += "<h2>Complete-state hashes: reference vs resumed</h2>" + page.table(
            columns, [[row.get(c) for c in columns] for row in comparison]
        )
        shown.add("comparison")
    else:
        sequences = _hash_sequences(proof)
        if len(sequences) >= 2:
            (name_a, seq_a), (name_b, seq_b) = list(sequences.items())[:2]
            rows = []
            for i in range(max(len(seq_a), len(seq_b))):
                a = seq_a[i] if i < len(seq_a) else None
                b = seq_b[i] if i < len(seq_b) else None
                verdict = "—" if None in (a, b) else "equal" if a == b else "DIFFERENT"
                rows.append([i + 1, a, b, verdict])
            body += "<h2>Complete-state hash sequences</h2>" + page.table(
                ["#", name_a, name_b, "comparison"], rows
            )
            shown |= {name.split(".")[0] for name in sequences}
    other = [[k, v] for k, v in page.flatten(proof) if k.split(".")[0].split("[")[0] not in shown]
    body += "<h2>Record</h2>" + page.table(["field", "value"], other)
    page.write_page(out_html, title, body)


def publication_table(publication_json: Path | None, out_html: Path) -> None:
    title = "Publication record"
    record = page.read_optional(publication_json)
    if record is None:
        return page.missing_rule_page(out_html, title, "publish")
    content_id = record.get("content_id") or record.get("id")
    body = ""
    if content_id:
        body += f"<p>Content id: <code>{html.escape(str(content_id))}</code></p>"
    body += page.table(["field", "value"], [[k, v] for k, v in page.flatten(record)])
    page.write_page(out_html, title, body)


def capacity_table(capacity_csv: Path | None, out_html: Path) -> None:
    title = "Capacity plan (hypothetical demand and prices)"
    if capacity_csv is None:
        return page.missing_rule_page(out_html, title, "capacity_table")
    with open(capacity_csv, encoding="utf-8", newline="") as handle:
        rows = list(csv.reader(handle))
    if not rows:
        body = f'<p class="note">{html.escape(str(capacity_csv))} is empty.</p>'
    else:
        body = (
            '<p class="note">Seconds per job are measured on this machine; arrivals, workers, '
            "reserve and prices are assumptions from the configuration, not quotes. Local CPU "
            "time is not a cloud price or an accelerator throughput.</p>"
            + page.table(rows[0], [[_number_or_text(v) for v in row] for row in rows[1:]])
        )
    page.write_page(out_html, title, body)


def _number_or_text(value: str) -> Any:
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return float(value)
    except ValueError:
        return value
