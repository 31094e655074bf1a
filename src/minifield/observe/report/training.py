"""Report items of training: the loss curves, goodput and throughput (from the events and
the summary)."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path

from ... import atomic
from ...attempt.events import read as read_events
from ..summarize import attempt_event_files
from . import experts, page


@dataclass
class _AttemptCurves:
    """What every attempt's events give the loss figure, attempt by attempt in order."""

    losses: list[tuple[str, list[int], list[float]]] = field(default_factory=list)
    # reinforcement learning's updates carry the rollouts' mean reward: its curve goes beside
    # the loss, on the DEV metric's axis (grpo selects on DEV reward)
    rewards: list[tuple[str, list[int], list[float]]] = field(default_factory=list)
    committed: set[int] = field(default_factory=set)
    evaluations: list[tuple[int, float]] = field(default_factory=list)
    loads: list[list[float]] = field(default_factory=list)


def _read_attempt_curves(attempt_dir: Path, metric: str) -> _AttemptCurves:
    curves = _AttemptCurves()
    for path in attempt_event_files(attempt_dir):
        events, _ = read_events(path)
        updates = [e for e in events if e["type"] == "update" and "loss" in e]
        started = next(
            (e.get("attempt_id") for e in events if e["type"] == "attempt_started"), None
        )
        name = started or path.parent.name
        if updates:
            curves.losses.append((name, [e["step"] for e in updates], [e["loss"] for e in updates]))
        curves.loads += experts.expert_loads(updates)
        rewarded = [e for e in updates if isinstance(e.get("reward"), int | float)]
        if rewarded:
            curves.rewards.append(
                (name, [e["step"] for e in rewarded], [e["reward"] for e in rewarded])
            )
        curves.committed |= {int(e["step"]) for e in events if e["type"] == "checkpoint_committed"}
        curves.evaluations += [
            (int(e["step"]), float(e["metrics"][metric]))
            for e in events
            if e["type"] == "evaluation"
            and isinstance(e.get("metrics"), dict)
            and isinstance(e["metrics"].get(metric), int | float)
        ]
    return curves


def _draw_training(ax, curves: _AttemptCurves) -> None:
    """The train loss of each attempt and a line at each committed checkpoint."""
    for name, steps, losses in curves.losses:
        ax.plot(
            steps,
            losses,
            marker=".",
            markersize=3 if len(steps) > 60 else 6,
            linewidth=1.2,
            label=f"train loss, attempt {name}",
        )
    for index, step in enumerate(sorted(curves.committed)):
        ax.axvline(
            step,
            color="0.6",
            linestyle=":",
            linewidth=1,
            label="committed checkpoint" if index == 0 else None,
        )


def _draw_dev(dev_ax, curves: _AttemptCurves, metrics: dict, metric: str) -> list[float]:
    """The rollouts' mean reward, DEV per retained checkpoint, evaluation events and the
    DEV-selected checkpoint; returns the DEV values drawn."""
    for name, steps, values in curves.rewards:
        dev_ax.plot(
            steps, values, linestyle="--", linewidth=1.2, color="tab:green",
            label=f"train mean reward (rollouts), attempt {name}",
        )  # fmt: skip
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
    if curves.evaluations:
        dev_ax.scatter(
            [s for s, _ in curves.evaluations],
            [v for _, v in curves.evaluations],
            marker="x",
            color="tab:purple",
            zorder=5,
            label=f"{metric} from evaluation events",
        )
    selected = metrics.get("selection", {}).get("step")
    chosen = next((r for r in scored if r["step"] == selected), None)
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
    return [r["dev"][metric] for r in scored] + [v for _, v in curves.evaluations]


def _label_axes(ax, dev_ax, metric: str, rewarded: bool) -> None:
    ax.set_xlabel("update step")
    ax.set_ylabel("train loss" if dev_ax is not ax else f"train loss / DEV {metric}")
    if dev_ax is not ax:
        reward = " / train mean reward" if rewarded else ""
        dev_ax.set_ylabel(f"DEV {metric}{reward} (higher is better)")
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if dev_ax is not ax:
        more_handles, more_labels = dev_ax.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax.legend(handles, labels, fontsize=8, loc="upper right")


def plot_loss(train_result: Path, metrics_json: Path, out_png: Path) -> None:
    """Train loss per update (every attempt), DEV metric per checkpoint, checkpoints marked;
    with rollouts (grpo), each update's mean reward beside them; a mixture of experts'
    expert load in a panel of its own (:mod:`.experts`)."""
    plt = page.pyplot()
    result = atomic.read_json(train_result)
    metrics = atomic.read_json(metrics_json)
    metric = metrics.get("selection", {}).get("metric", "loss")
    curves = _read_attempt_curves(Path(result["attempt_dir"]), metric)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    _draw_training(ax, curves)
    dev_ax = ax.twinx() if metrics.get("selection", {}).get("mode") == "max" else ax
    dev_values = _draw_dev(dev_ax, curves, metrics, metric)
    # every value on the loss axis chooses its scale
    plotted = [loss for _, _, losses in curves.losses for loss in losses]
    if dev_ax is ax:
        plotted += dev_values
    # (not for a policy-gradient loss, which hovers around 0 with either sign)
    if not curves.rewards and plotted and min(plotted) > 0 and max(plotted) / min(plotted) > 50:
        ax.set_yscale("log")  # a loss falling by orders of magnitude: keep its tail readable
    ax.set_title(f"Loss curves — computation {str(result.get('computation_digest'))[:16]}")
    _label_axes(ax, dev_ax, metric, bool(curves.rewards))
    if curves.loads:
        experts.draw(fig, curves.loads)
    page.save_png(fig, out_png)


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
    plt = page.pyplot()
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
            names,
            widths,
            left=left,
            color=color,
            label=f"{label}: {page.fmt(total)} s",
            height=0.55,
        )
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("seconds of wall time")
    fraction = summary["goodput"].get("productive_fraction")
    share = "—" if fraction is None else f"{fraction * 100:.3g} %"
    ax.set_title(
        f"Goodput: productive updates are {share} of the job's "
        f"{page.fmt(summary['job_wall_time_s'])} s wall time"
    )
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, frameon=False)
    ax.grid(True, axis="x", alpha=0.3)
    page.save_png(fig, out_png)


#: the summary's fields the throughput page tables, named as it names them (a section's
#: field: ``section.field``) with their meaning; the unit is read from the name
#: (:mod:`minifield.observe.summarize` ends every field's name with its unit)
FIELD_MEANINGS = {
    "attempts_count": "attempts in the job",
    "final_status": "status of the last attempt",
    "updates_count": "update events (including redone ones)",
    "processed_examples_count": "examples processed by all updates",
    "processed_tokens_count": "tokens processed by all updates",
    "processed_loss_tokens_count": "tokens that carried loss (when the events say)",
    "update_time_s": "sum of synchronized update durations",
    "update_examples_per_s": "update-path throughput: examples ÷ update time",
    "update_tokens_per_s": "update-path throughput: tokens ÷ update time",
    "job_wall_time_s": "job wall time: first to last event (+ gaps between attempts)",
    "job_examples_per_s": "whole-job throughput: examples ÷ job wall time",
    "job_tokens_per_s": "whole-job throughput: tokens ÷ job wall time",
    "job_productive_examples_per_s": "whole-job goodput: non-redone examples ÷ wall",
    "update_duty_fraction": "update duty fraction: update time ÷ job wall time",
    "completed_steps_count": "steps completed by the current state",
    "checkpointed_steps_count": "steps covered by the newest committed checkpoint",
    "uncheckpointed_updates_count": "completed updates not yet in a committed checkpoint",
    "committed_checkpoints_count": "committed checkpoints",
    "compile_s": "compile time",
    "checkpoint_s": "checkpoint commit time",
    "evaluation_s": "evaluation time",
    "restarts.restarts_count": "restarts (attempts after the first)",
    "restarts.redone_updates_count": "updates redone after a resume",
    "restarts.redone_examples_count": "examples redone after a resume",
    "restarts.redone_update_s": "update time spent redoing lost work",
    "restarts.lost_uncheckpointed_updates_count": "updates lost with a dead process (not committed)",
    "restarts.between_attempts_s": "wall time between attempts",
    "restarts.resumed_compile_s": "compile time of resumed attempts",
    "restarts.lost_s": "time lost to restarts: redone + between + resumed compile",
    "restarts.lost_fraction": "time lost to restarts ÷ job wall time",
}


#: a field name's ending and the unit it says; a rate's ending first, since it ends in "_s" too
UNITS = (
    ("_examples_per_s", "examples/s"),
    ("_tokens_per_s", "tokens/s"),
    ("_s", "s"),
    ("_fraction", "fraction"),
    ("_count", "count"),
)


def _unit(field: str) -> str:
    return next((unit for ending, unit in UNITS if field.endswith(ending)), "")


def _field_rows(summary: dict, section: str) -> list[list]:
    """Rows (name, value, unit, meaning) of the summary's top-level fields (``section`` "")
    or of one section's."""
    values = summary[section] if section else summary
    rows = []
    for name, meaning in FIELD_MEANINGS.items():
        where, _, field = name.rpartition(".")
        if where == section:
            rows.append([name, values.get(field), _unit(field), meaning])
    return rows


def throughput_table(summary_json: Path, out_html: Path) -> None:
    summary = atomic.read_json(summary_json)
    headers = ["field", "value", "unit", "meaning"]
    main = _field_rows(summary, "")
    restarts = _field_rows(summary, "restarts")
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
        + page.table(headers, main)
        + "<h2>Goodput breakdown (sums to the job wall time)</h2>"
        + page.table(["component", "seconds", "unit", "meaning", "fraction of wall time"], goodput)
        + "<h2>Time lost to restarts</h2>"
        + page.table(headers, restarts)
        + "<h2>Attempts (oldest first)</h2>"
        + page.table(
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
        + sources_section(summary)
    )
    page.write_page(out_html, "Throughput and goodput", body)


def sources_section(summary: dict) -> str:
    """A mixture's sources: what the final state was trained on of each (empty without one)."""
    sources = summary.get("sources")
    if not sources:
        return ""
    rows = [
        [
            name,
            figures["trained_rows_count"],
            figures["trained_loss_tokens_count"],
            figures["epochs_count"],
        ]
        for name, figures in sources.items()
    ]
    return "<h2>Training mixture: trained per source</h2>" + page.table(
        ["source (input)", "rows", "trained tokens", "epochs read"], rows
    )


# -- evaluation -------------------------------------------------------------------------
