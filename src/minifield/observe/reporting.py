"""Figures and tables for ``snakemake --report``: one function per report item.

Every function reads result files the pipeline already wrote (events, summary,
evaluation metrics, recovery proof, publication record, capacity table) and
writes one PNG (matplotlib, Agg backend) or one self-contained HTML table.
Nothing here computes a new measurement: numbers come from the files, so the
report shows exactly what the pipeline recorded.
"""

from __future__ import annotations

import csv
import html
import io
import math
from pathlib import Path
from typing import Any

from .. import atomic
from ..attempt.events import read as read_events
from .summarize import attempt_event_files

HEX64_LENGTH = 64
STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:1.2em;color:#222}
h1{font-size:1.25em;margin:0 0 .4em} h2{font-size:1.05em;margin:1.2em 0 .4em}
p.note{color:#555;font-size:.9em;max-width:60em}
table{border-collapse:collapse;font-size:.88em;margin:.3em 0 1em}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f0f3f7} td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.selected td{background:#fff6d6;font-weight:600}
.pass{color:#11692b;font-weight:600} .fail{color:#a3161b;font-weight:600}
code{font-size:.95em}
"""


# -- small helpers ----------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display: figures are rendered to files only
    import matplotlib.pyplot as plt

    return plt


def _save_png(fig, out_png: Path) -> None:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    _pyplot().close(fig)
    atomic.write_bytes(out_png, buffer.getvalue())


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e6):
            return f"{value:.4g}"
        return f"{value:.6g}"
    return str(value)


def _cell(value: Any) -> str:
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    return f'<td class="num">{html.escape(_fmt(value))}</td>' if numeric else _text_cell(value)


def _text_cell(value: Any) -> str:
    text = _fmt(value)
    if isinstance(value, str) and len(value) == HEX64_LENGTH:
        return f'<td><code title="{html.escape(value)}">{html.escape(value[:16])}…</code></td>'
    return f"<td>{html.escape(text)}</td>"


def _table(headers: list[str], rows: list[list[Any]], selected: set[int] | None = None) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = []
    for index, row in enumerate(rows):
        css = ' class="selected"' if selected and index in selected else ""
        body.append(f"<tr{css}>" + "".join(_cell(v) for v in row) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _page(title: str, body: str) -> str:
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>"
        f"<body><h1>{html.escape(title)}</h1>{body}</body></html>\n"
    )


def _write_page(out_html: Path, title: str, body: str) -> None:
    atomic.write_bytes(out_html, _page(title, body).encode("utf-8"))


def _verdict(passed: Any) -> str:
    if passed is None:
        return "—"
    return '<span class="pass">passed</span>' if passed else '<span class="fail">FAILED</span>'


def _flatten(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Nested JSON as (dotted key, scalar) rows; long lists are summarized, not dumped."""
    if isinstance(value, dict):
        rows = []
        for key in sorted(value):
            rows += _flatten(value[key], f"{prefix}.{key}" if prefix else str(key))
        return rows or [(prefix, "{}")]
    if isinstance(value, list):
        if len(value) > 6 or any(isinstance(v, dict | list) for v in value):
            if value and all(isinstance(v, dict | list) for v in value) and len(value) <= 6:
                rows = []
                for index, item in enumerate(value):
                    rows += _flatten(item, f"{prefix}[{index}]")
                return rows
            return [(prefix, f"{len(value)} items")]
        return [(prefix, ", ".join(_fmt(v) for v in value) if value else "[]")]
    return [(prefix, value)]


def _read_optional(path: Path | None) -> Any:
    return atomic.read_json(path) if path is not None else None


# -- loss curves ------------------------------------------------------------------------
def plot_loss(train_result: Path, metrics_json: Path, out_png: Path) -> None:
    """Train loss per update (every attempt), DEV metric per checkpoint, checkpoints marked."""
    plt = _pyplot()
    result = atomic.read_json(train_result)
    metrics = atomic.read_json(metrics_json)
    selection = metrics.get("selection", {})
    metric = selection.get("metric", "loss")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    committed: set[int] = set()
    plotted: list[float] = []  # every value on the loss axis, to choose its scale
    evaluations: list[tuple[int, float]] = []
    for path in attempt_event_files(Path(result["attempt_dir"])):
        events, _ = read_events(path)
        updates = [e for e in events if e["type"] == "update" and "loss" in e]
        label = next((e.get("attempt_id") for e in events if e["type"] == "attempt_started"), None)
        if updates:
            ax.plot(
                [e["step"] for e in updates],
                [e["loss"] for e in updates],
                marker=".",
                markersize=3 if len(updates) > 60 else 6,
                linewidth=1.2,
                label=f"train loss, attempt {label or path.parent.name}",
            )
            plotted += [e["loss"] for e in updates]
        committed |= {int(e["step"]) for e in events if e["type"] == "checkpoint_committed"}
        evaluations += [
            (int(e["step"]), float(e["metrics"][metric]))
            for e in events
            if e["type"] == "evaluation"
            and isinstance(e.get("metrics"), dict)
            and isinstance(e["metrics"].get(metric), int | float)
        ]
    for index, step in enumerate(sorted(committed)):
        ax.axvline(
            step,
            color="0.6",
            linestyle=":",
            linewidth=1,
            label="committed checkpoint" if index == 0 else None,
        )
    dev_ax = ax.twinx() if selection.get("mode") == "max" else ax
    scored = [r for r in metrics.get("checkpoints", []) if isinstance(r.get("dev"), dict)]
    if scored:
        dev_ax.plot(
            [r["step"] for r in scored],
            [r["dev"][metric] for r in scored],
            marker="o",
            color="tab:red",
            linewidth=1.4,
            label=f"DEV {metric} per retained checkpoint",
        )
    if evaluations:
        dev_ax.scatter(
            [s for s, _ in evaluations],
            [v for _, v in evaluations],
            marker="x",
            color="tab:purple",
            zorder=5,
            label=f"{metric} from evaluation events",
        )
    chosen = next((r for r in scored if r["step"] == selection.get("step")), None)
    if chosen is not None:
        dev_ax.scatter(
            [chosen["step"]],
            [chosen["dev"][metric]],
            marker="*",
            s=260,
            color="gold",
            edgecolor="black",
            zorder=6,
            label=f"DEV-selected checkpoint (step {chosen['step']})",
        )
    if dev_ax is ax:
        plotted += [r["dev"][metric] for r in scored] + [v for _, v in evaluations]
    if plotted and min(plotted) > 0 and max(plotted) / min(plotted) > 50:
        ax.set_yscale("log")  # a loss falling by orders of magnitude: keep its tail readable
    ax.set_xlabel("update step")
    ax.set_ylabel("train loss" if dev_ax is not ax else f"train loss / DEV {metric}")
    if dev_ax is not ax:
        dev_ax.set_ylabel(f"DEV {metric} (higher is better)")
    ax.set_title(f"Loss curves — computation {str(result.get('computation_digest'))[:16]}")
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if dev_ax is not ax:
        more_handles, more_labels = dev_ax.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax.legend(handles, labels, fontsize=8, loc="upper right")
    _save_png(fig, out_png)


# -- throughput and goodput -------------------------------------------------------------
GOODPUT_PARTS = [
    ("productive_update_s", "productive updates", "tab:green"),
    ("redone_update_s", "redone updates (lost to restarts)", "tab:red"),
    ("compile_s", "compile", "tab:orange"),
    ("checkpoint_s", "checkpoint commits", "tab:blue"),
    ("evaluation_s", "evaluation", "tab:purple"),
    ("between_attempts_s", "between attempts", "tab:brown"),
    ("other_s", "other (start-up, inputs, restore, export)", "0.75"),
]


def plot_goodput(summary_json: Path, out_png: Path) -> None:
    """Where the job's wall time went, per attempt and in total (stacked seconds)."""
    plt = _pyplot()
    summary = atomic.read_json(summary_json)
    rows = []
    for index, attempt in enumerate(summary["attempts"]):
        accounted = sum(
            attempt[k] for k in ("update_s", "compile_s", "checkpoint_s", "evaluation_s")
        )
        rows.append(
            (
                f"attempt {index + 1}\n{attempt.get('attempt_id') or ''}",
                {
                    "productive_update_s": attempt["update_s"] - attempt["redone_update_s"],
                    "redone_update_s": attempt["redone_update_s"],
                    "compile_s": attempt["compile_s"],
                    "checkpoint_s": attempt["checkpoint_s"],
                    "evaluation_s": attempt["evaluation_s"],
                    "between_attempts_s": 0.0,
                    "other_s": max(0.0, attempt["wall_s"] - accounted),
                },
            )
        )
    rows.append(("whole job", summary["goodput"]))
    fig, ax = plt.subplots(figsize=(8, 1.6 + 0.6 * len(rows)))
    names = [name for name, _ in rows]
    left = [0.0] * len(rows)
    for key, label, color in GOODPUT_PARTS:
        widths = [max(0.0, parts.get(key, 0.0)) for _, parts in rows]
        total = summary["goodput"].get(key, 0.0)
        ax.barh(
            names, widths, left=left, color=color, label=f"{label}: {_fmt(total)} s", height=0.55
        )
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds of wall time")
    fraction = summary["goodput"].get("productive_fraction")
    share = "—" if fraction is None else f"{fraction * 100:.3g} %"
    ax.set_title(
        f"Goodput: productive updates are {share} of the job's "
        f"{_fmt(summary['job_wall_time_s'])} s wall time"
    )
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, frameon=False)
    ax.grid(True, axis="x", alpha=0.3)
    _save_png(fig, out_png)


THROUGHPUT_ROWS = [
    ("attempts_count", "attempts in the job", "count"),
    ("final_status", "status of the last attempt", ""),
    ("updates_count", "update events (including redone ones)", "count"),
    ("processed_examples_count", "examples processed by all updates", "count"),
    ("processed_tokens_count", "tokens processed by all updates", "count"),
    ("processed_loss_tokens_count", "tokens that carried loss (when the events say)", "count"),
    ("update_time_s", "sum of synchronized update durations", "s"),
    ("update_examples_per_s", "update-path throughput: examples ÷ update time", "examples/s"),
    ("update_tokens_per_s", "update-path throughput: tokens ÷ update time", "tokens/s"),
    ("job_wall_time_s", "job wall time: first to last event (+ gaps between attempts)", "s"),
    ("job_examples_per_s", "whole-job throughput: examples ÷ job wall time", "examples/s"),
    ("job_tokens_per_s", "whole-job throughput: tokens ÷ job wall time", "tokens/s"),
    (
        "job_productive_examples_per_s",
        "whole-job goodput: non-redone examples ÷ wall",
        "examples/s",
    ),
    ("update_duty_fraction", "update duty fraction: update time ÷ job wall time", "fraction"),
    ("completed_steps_count", "steps completed by the current state", "count"),
    ("checkpointed_steps_count", "steps covered by the newest committed checkpoint", "count"),
    (
        "uncheckpointed_updates_count",
        "completed updates not yet in a committed checkpoint",
        "count",
    ),
    ("committed_checkpoints_count", "committed checkpoints", "count"),
    ("compile_s", "compile time", "s"),
    ("checkpoint_s", "checkpoint commit time", "s"),
    ("evaluation_s", "evaluation time", "s"),
]
RESTART_ROWS = [
    ("restarts_count", "restarts (attempts after the first)", "count"),
    ("redone_updates_count", "updates redone after a resume", "count"),
    ("redone_examples_count", "examples redone after a resume", "count"),
    ("redone_update_s", "update time spent redoing lost work", "s"),
    (
        "lost_uncheckpointed_updates_count",
        "updates lost with a dead process (not committed)",
        "count",
    ),
    ("between_attempts_s", "wall time between attempts", "s"),
    ("resumed_compile_s", "compile time of resumed attempts", "s"),
    ("lost_s", "time lost to restarts: redone + between + resumed compile", "s"),
    ("lost_fraction", "time lost to restarts ÷ job wall time", "fraction"),
]


def throughput_table(summary_json: Path, out_html: Path) -> None:
    summary = atomic.read_json(summary_json)
    headers = ["field", "value", "unit", "meaning"]
    main = [[k, summary.get(k), unit, meaning] for k, meaning, unit in THROUGHPUT_ROWS]
    restarts = [
        [f"restarts.{k}", summary["restarts"].get(k), unit, meaning]
        for k, meaning, unit in RESTART_ROWS
    ]
    wall = summary["job_wall_time_s"]
    goodput = [
        [
            f"goodput.{key}",
            summary["goodput"][key],
            "s",
            label,
            (summary["goodput"][key] / wall) if wall > 0 else None,
        ]
        for key, label, _ in GOODPUT_PARTS
    ]
    attempts = [
        [
            index + 1,
            a.get("attempt_id"),
            a["status"],
            a["restored_step_count"],
            a["first_update_step_count"],
            a["completed_steps_count"],
            a["updates_count"],
            a["redone_updates_count"],
            a["uncheckpointed_updates_count"],
            a["wall_s"],
            a["update_s"],
            a["compile_s"],
            a["checkpoint_s"],
        ]
        for index, a in enumerate(summary["attempts"])
    ]
    body = (
        f'<p class="note">{html.escape(summary.get("note", ""))} Measured on this machine for this '
        "job; not an accelerator or fleet throughput claim.</p>"
        + _table(headers, main)
        + "<h2>Goodput breakdown (sums to the job wall time)</h2>"
        + _table(["component", "seconds", "unit", "meaning", "fraction of wall time"], goodput)
        + "<h2>Time lost to restarts</h2>"
        + _table(headers, restarts)
        + "<h2>Attempts (oldest first)</h2>"
        + _table(
            [
                "#",
                "attempt",
                "status",
                "restored step",
                "first update step",
                "steps at end",
                "updates",
                "redone",
                "uncheck- pointed",
                "wall s",
                "update s",
                "compile s",
                "checkpoint s",
            ],
            attempts,
        )
    )
    _write_page(out_html, "Throughput and goodput", body)


# -- evaluation -------------------------------------------------------------------------
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
        f"({html.escape(str(selection.get('mode')))}): step <b>{html.escape(_fmt(selection.get('step')))}</b>, "
        f"checkpoint <code>{html.escape(str(selection.get('sha256', ''))[:16])}…</code>. "
        "TEST is assessed for the selected checkpoint only.</p>"
        + _table(
            ["step", "checkpoint sha256", "state hash"] + [f"DEV {n}" for n in names] + [""],
            rows,
            selected,
        )
        + "<h2>TEST metrics of the selected checkpoint</h2>"
        + (
            _table(["metric", "value"], [[k, test[k]] for k in sorted(test)])
            if test
            else '<p class="note">This strategy has no separate TEST split; acceptance uses the DEV metrics.</p>'
        )
        + f"<h2>Acceptance: {_verdict(acceptance.get('passed'))}</h2>"
        + _table(["check", "value", "threshold", "verdict"], checks)
    )
    _write_page(out_html, "Evaluation and DEV-selected checkpoint", body)


# -- recovery proof, publication, capacity ----------------------------------------------
def _hash_sequences(value: Any, prefix: str = "") -> dict[str, list[str]]:
    """Lists of sha256 strings anywhere in a JSON value, by dotted key."""
    found = {}
    if isinstance(value, dict):
        for key, item in value.items():
            found.update(_hash_sequences(item, f"{prefix}.{key}" if prefix else key))
    elif (
        isinstance(value, list)
        and value
        and all(isinstance(v, str) and len(v) == HEX64_LENGTH for v in value)
    ):
        found[prefix] = value
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        # [{step, state_hash}, ...] sequences
        hashes = [v.get("state_hash") or v.get("hash") for v in value]
        if all(isinstance(h, str) and len(h) == HEX64_LENGTH for h in hashes):
            found[prefix] = hashes
    return found


def _missing_rule_page(out_html: Path, title: str, rule: str) -> None:
    _write_page(
        out_html,
        title,
        f'<p class="note">This workflow has no <code>{html.escape(rule)}</code> rule, so there is '
        "nothing to show here.</p>",
    )


def recovery_table(proof_json: Path | None, out_html: Path) -> None:
    title = "Recovery proof"
    proof = _read_optional(proof_json)
    if proof is None:
        return _missing_rule_page(out_html, title, "qualify")
    passed = proof.get("passed", proof.get("ok", proof.get("verdict") == "passed"))
    body = f"<h2>Verdict: {_verdict(passed)}</h2>"
    if proof.get("diagnosis"):
        body += f"<p>{html.escape(str(proof['diagnosis']))}</p>"
    shown: set[str] = {"diagnosis"}
    comparison = proof.get("comparison")
    if isinstance(comparison, list) and comparison and all(isinstance(r, dict) for r in comparison):
        # The proof's own step-by-step comparison of complete-state hashes.
        found = list(dict.fromkeys(k for row in comparison for k in row))
        first = [c for c in ("step", "what", "reference", "resumed", "equal") if c in found]
        columns = first + [c for c in found if c not in first]
        body += "<h2>Complete-state hashes: reference vs resumed</h2>" + _table(
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
            body += "<h2>Complete-state hash sequences</h2>" + _table(
                ["#", name_a, name_b, "comparison"], rows
            )
            shown |= {name.split(".")[0] for name in sequences}
    other = [[k, v] for k, v in _flatten(proof) if k.split(".")[0].split("[")[0] not in shown]
    body += "<h2>Record</h2>" + _table(["field", "value"], other)
    _write_page(out_html, title, body)


def publication_table(publication_json: Path | None, out_html: Path) -> None:
    title = "Publication record"
    record = _read_optional(publication_json)
    if record is None:
        return _missing_rule_page(out_html, title, "publish")
    content_id = record.get("content_id") or record.get("id")
    body = ""
    if content_id:
        body += f"<p>Content id: <code>{html.escape(str(content_id))}</code></p>"
    body += _table(["field", "value"], [[k, v] for k, v in _flatten(record)])
    _write_page(out_html, title, body)


def capacity_table(capacity_csv: Path | None, out_html: Path) -> None:
    title = "Capacity plan (hypothetical demand and prices)"
    if capacity_csv is None:
        return _missing_rule_page(out_html, title, "capacity_table")
    with open(capacity_csv, encoding="utf-8", newline="") as handle:
        rows = list(csv.reader(handle))
    if not rows:
        body = f'<p class="note">{html.escape(str(capacity_csv))} is empty.</p>'
    else:
        body = (
            '<p class="note">Seconds per job are measured on this machine; arrivals, workers, '
            "reserve and prices are assumptions from the configuration, not quotes. Local CPU "
            "time is not a cloud price or an accelerator throughput.</p>"
            + _table(rows[0], [[_number_or_text(v) for v in row] for row in rows[1:]])
        )
    _write_page(out_html, title, body)


def _number_or_text(value: str) -> Any:
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return float(value)
    except ValueError:
        return value
