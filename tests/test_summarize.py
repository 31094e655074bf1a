"""``minifield summarize``: figures checked against event files written here, by hand.

Every expected value below is worked out in the comments from the events the
test writes; durations are multiples of 1/8 s so the arithmetic is exact.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, linear_recipe, read_events, run_worker, write_recipe

from minifield.observe import summarize


def write_events(path: Path, events: list[dict], *, time0: float, mono0: float) -> Path:
    """One attempt's events.jsonl: ``at`` is seconds since the attempt's first event."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for seq, event in enumerate(events):
        at = event.pop("at")
        lines.append(json.dumps({"seq": seq, "time": time0 + at, "mono": mono0 + at, **event}))
    path.write_text("\n".join(lines) + "\n")
    return path


def update(at, step, seconds, examples=8, tokens=100, loss=1.0, **more):
    return {
        **more,
        "at": at,
        "type": "update",
        "step": step,
        "examples": examples,
        "tokens": tokens,
        "seconds": seconds,
        "loss": loss,
    }


def summarize_cli(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "minifield.cli", "summarize", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def summary_of(*files: Path) -> dict:
    """In-process (the CLI costs seconds of imports per call; it is exercised below)."""
    return json.loads(json.dumps(summarize.summarize(list(files)), allow_nan=False))


@pytest.fixture
def completed_attempt(tmp_path) -> Path:
    # One attempt, 4 s of wall time (mono 10.0 -> 14.0), 4 updates of 8 examples / 100 tokens.
    return write_events(
        tmp_path / "a1" / "events.jsonl",
        [
            {"at": 0.0, "type": "attempt_started", "attempt_id": "a1"},
            {"at": 0.0, "type": "device", "backend": "cpu"},
            {"at": 0.125, "type": "inputs_verified", "inputs": []},
            {"at": 0.75, "type": "compiled", "seconds": 0.5},
            update(1.0, 1, 0.25, loss_tokens=40),
            update(1.25, 2, 0.25, loss_tokens=40),
            {"at": 1.5, "type": "checkpoint_committed", "step": 2, "seconds": 0.125},
            update(2.0, 3, 0.5, loss_tokens=60),
            update(2.5, 4, 0.5, loss_tokens=60),
            {"at": 2.75, "type": "checkpoint_committed", "step": 4, "seconds": 0.125},
            {"at": 3.0, "type": "evaluation", "step": 4, "seconds": 0.25, "metrics": {}},
            {"at": 4.0, "type": "completed", "steps": 4},
        ],
        time0=1_000.0,
        mono0=10.0,
    )


def test_single_attempt_figures_by_hand(completed_attempt):
    s = summary_of(completed_attempt)
    assert s["attempts_count"] == 1 and s["final_status"] == "completed"
    assert s["updates_count"] == 4
    assert s["processed_examples_count"] == 4 * 8 == 32
    assert s["processed_tokens_count"] == 4 * 100 == 400
    assert s["processed_loss_tokens_count"] == 40 + 40 + 60 + 60
    # update time: 0.25 + 0.25 + 0.5 + 0.5
    assert s["update_time_s"] == pytest.approx(1.5)
    assert s["update_examples_per_s"] == pytest.approx(32 / 1.5)
    assert s["update_tokens_per_s"] == pytest.approx(400 / 1.5)
    # job wall time: first event mono 10.0 to last event mono 14.0
    assert s["job_wall_time_s"] == pytest.approx(4.0)
    assert s["attempts_wall_time_s"] == pytest.approx(4.0)  # one attempt: no gap
    assert s["attempts"][0]["checkpoints_count"] == 2
    assert s["job_examples_per_s"] == pytest.approx(8.0)
    assert s["job_tokens_per_s"] == pytest.approx(100.0)
    assert s["update_duty_fraction"] == pytest.approx(1.5 / 4.0)
    assert s["compile_s"] == pytest.approx(0.5)
    assert s["checkpoint_s"] == pytest.approx(0.25)
    assert s["evaluation_s"] == pytest.approx(0.25)
    assert s["committed_checkpoints_count"] == 2
    assert s["completed_steps_count"] == 4
    assert s["checkpointed_steps_count"] == 4
    assert s["uncheckpointed_updates_count"] == 0
    g = s["goodput"]
    assert g["productive_update_s"] == pytest.approx(1.5)
    assert g["redone_update_s"] == 0
    # other: 4.0 - (1.5 updates + 0.5 compile + 0.25 checkpoints + 0.25 evaluation)
    assert g["other_s"] == pytest.approx(1.5)
    assert s["restarts"]["restarts_count"] == 0
    assert s["restarts"]["lost_s"] == 0
    assert "not hardware utilization" in s["note"]
    assert "utilization" not in " ".join(k for k in _all_keys(s))


def _all_keys(value) -> list[str]:
    if isinstance(value, dict):
        return [k for k in value] + [k for v in value.values() for k in _all_keys(v)]
    if isinstance(value, list):
        return [k for v in value for k in _all_keys(v)]
    return []


def test_every_field_name_carries_its_unit(completed_attempt):
    s = summary_of(completed_attempt)
    units = ("_s", "_per_s", "_fraction", "_count")
    descriptive = {"schema", "event_files", "final_status", "note", "attempts", "restarts"}
    descriptive |= {"goodput", "attempt_id", "status", "events_file"}
    for key in _all_keys(s):
        assert key in descriptive or key.endswith(units), key


def two_attempts(tmp_path) -> tuple[Path, Path]:
    # Attempt 1: updates 1, 2, checkpoint at 2, update 3, then the process dies (no terminal
    # event). Wall 2.0 s (mono 10.0 -> 12.0, time 1000.0 -> 1002.0).
    first = write_events(
        tmp_path / "a1" / "events.jsonl",
        [
            {"at": 0.0, "type": "attempt_started", "attempt_id": "a1"},
            {"at": 0.625, "type": "compiled", "seconds": 0.5},
            update(1.0, 1, 0.25),
            update(1.25, 2, 0.25),
            {"at": 1.5, "type": "checkpoint_committed", "step": 2, "seconds": 0.125},
            update(2.0, 3, 0.25),
        ],
        time0=1_000.0,
        mono0=10.0,
    )
    # Attempt 2 starts 3.0 s later by the wall clock (time 1005.0); its monotonic clock is
    # another process's (mono 500.0). Restores step 2, redoes update 3, does update 4.
    # Wall 3.0 s (mono 500.0 -> 503.0).
    second = write_events(
        tmp_path / "a2" / "events.jsonl",
        [
            {"at": 0.0, "type": "attempt_started", "attempt_id": "a2", "resumed_from": "a1"},
            {"at": 0.625, "type": "compiled", "seconds": 0.5},
            {"at": 0.75, "type": "restored", "step": 2},
            update(1.0, 3, 0.25),
            update(1.25, 4, 0.25),
            {"at": 1.5, "type": "checkpoint_committed", "step": 4, "seconds": 0.125},
            {"at": 2.0, "type": "evaluation", "step": 4, "seconds": 0.25, "metrics": {}},
            {"at": 3.0, "type": "completed", "steps": 4},
        ],
        time0=1_005.0,
        mono0=500.0,
    )
    return first, second


def test_restart_losses_across_attempts_by_hand(tmp_path):
    first, second = two_attempts(tmp_path)
    s = summary_of(first, second)
    assert s["attempts_count"] == 2 and s["final_status"] == "completed"
    assert [a["status"] for a in s["attempts"]] == ["interrupted", "completed"]
    # attempt 1 died with update 3 done but only step 2 committed
    assert s["attempts"][0]["uncheckpointed_updates_count"] == 1
    assert s["attempts"][1]["restored_step_count"] == 2
    assert s["updates_count"] == 5  # 1, 2, 3 | 3, 4
    assert s["processed_examples_count"] == 40
    assert s["update_time_s"] == pytest.approx(5 * 0.25)
    # job wall: 2.0 (attempt 1) + 3.0 (gap by wall clock) + 3.0 (attempt 2)
    assert s["job_wall_time_s"] == pytest.approx(8.0)
    # worker time: the two spans alone, 2.0 + 3.0
    assert s["attempts_wall_time_s"] == pytest.approx(5.0)
    assert [a["checkpoints_count"] for a in s["attempts"]] == [1, 1]
    assert s["update_examples_per_s"] == pytest.approx(40 / 1.25)
    assert s["job_examples_per_s"] == pytest.approx(40 / 8.0)
    assert s["job_productive_examples_per_s"] == pytest.approx(32 / 8.0)
    assert s["update_duty_fraction"] == pytest.approx(1.25 / 8.0)
    r = s["restarts"]
    assert r["restarts_count"] == 1
    assert r["redone_updates_count"] == 1  # update 3 ran twice
    assert r["redone_examples_count"] == 8
    assert r["redone_update_s"] == pytest.approx(0.25)
    assert r["lost_uncheckpointed_updates_count"] == 1
    assert r["between_attempts_s"] == pytest.approx(3.0)
    assert r["resumed_compile_s"] == pytest.approx(0.5)
    # lost: redone 0.25 + gap 3.0 + the resumed attempt's compile 0.5
    assert r["lost_s"] == pytest.approx(3.75)
    assert r["lost_fraction"] == pytest.approx(3.75 / 8.0)
    g = s["goodput"]
    assert g["productive_update_s"] == pytest.approx(1.0)
    assert g["redone_update_s"] == pytest.approx(0.25)
    assert g["compile_s"] == pytest.approx(1.0)
    assert g["checkpoint_s"] == pytest.approx(0.25)
    assert g["evaluation_s"] == pytest.approx(0.25)
    assert g["between_attempts_s"] == pytest.approx(3.0)
    # other: 8.0 - (1.0 + 0.25 + 1.0 + 0.25 + 0.25 + 3.0)
    assert g["other_s"] == pytest.approx(2.25)
    assert g["productive_fraction"] == pytest.approx(1.0 / 8.0)
    parts = [v for k, v in g.items() if k.endswith("_s")]
    assert sum(parts) == pytest.approx(s["job_wall_time_s"])
    assert s["uncheckpointed_updates_count"] == 0


def test_interrupted_attempt_reports_uncheckpointed_updates(tmp_path):
    first, _ = two_attempts(tmp_path)
    s = summary_of(first)
    assert s["final_status"] == "interrupted"
    assert s["completed_steps_count"] == 3
    assert s["checkpointed_steps_count"] == 2
    assert s["uncheckpointed_updates_count"] == 1


def test_malformed_lines_are_counted_not_fatal(completed_attempt):
    with open(completed_attempt, "a") as handle:
        handle.write('{"truncated": \n')
    s = summary_of(completed_attempt)
    assert s["malformed_lines_count"] == 1
    assert s["updates_count"] == 4


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        (
            '{"seq": 1, "time": 1.0, "mono": 1.0, "type": "update", "step": 1, "examples": 8, "tokens": 0}',
            "'seconds'",
        ),
        (
            '{"seq": 1, "time": 1.0, "mono": 1.0, "type": "update", "step": 1, "examples": 8, "tokens": 0, "seconds": NaN}',
            "finite",
        ),
        ('{"seq": 1, "time": 1.0, "mono": 1.0, "type": "compiled", "seconds": -2}', ">= 0"),
        ('{"seq": 1, "time": 1.0, "type": "device"}', "'mono'"),
        (
            '{"seq": 1, "time": 1.0, "mono": 1.0, "type": "update", "step": 1, "examples": 8, "tokens": 0, "seconds": 0.5, "loss_tokens": "x"}',
            "'loss_tokens'",
        ),
    ],
)
def test_bad_events_are_rejected_naming_file_and_field(tmp_path, line, needle):
    path = tmp_path / "events.jsonl"
    path.write_text(
        '{"seq": 0, "time": 0.0, "mono": 0.0, "type": "attempt_started"}\n' + line + "\n"
    )
    with pytest.raises(summarize.SummaryError) as caught:
        summarize.summarize([path])
    assert str(path) in str(caught.value) and needle in str(caught.value)


@pytest.mark.slow
def test_cli_prints_json_and_exits_2_on_bad_input(completed_attempt, tmp_path):
    proc = summarize_cli(completed_attempt)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["processed_examples_count"] == 32
    proc = summarize_cli(tmp_path / "nope.jsonl")
    assert proc.returncode == 2 and "no such events file" in proc.stderr
    assert proc.stdout == ""


def test_missing_and_empty_files_are_rejected(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for files, needle in [
        ([tmp_path / "nope.jsonl"], "no such events file"),
        ([empty], "no events"),
        ([], "no events files given"),
    ]:
        with pytest.raises(summarize.SummaryError, match=needle):
            summarize.summarize(files)


@pytest.mark.slow
def test_real_crash_and_resume_against_raw_events(tmp_path):
    """A real worker fails after update 3 and is resumed; totals recomputed here from raw lines."""
    recipe = write_recipe(tmp_path / "recipe.json", linear_recipe())
    out = tmp_path / "out"
    common = {"job": recipe, "input_root": REPO / "data", "output_root": out}
    run_worker(**common, attempt_id="a1", fail_after_step=3, check_codes={1})
    first = out / "linear-test" / "a1"
    run_worker(**common, attempt_id="a2", resume_from=first, check_codes={0})
    second = out / "linear-test" / "a2"
    proc = summarize_cli("--attempt-dir", second)
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout)
    raw = [read_events(first / "events.jsonl"), read_events(second / "events.jsonl")]
    updates = [e for events in raw for e in events if e["type"] == "update"]
    assert [e["step"] for e in updates] == [1, 2, 3, 3, 4, 5, 6, 7, 8]
    assert s["updates_count"] == 9
    assert s["processed_examples_count"] == sum(e["examples"] for e in updates) == 72
    assert s["update_time_s"] == pytest.approx(sum(e["seconds"] for e in updates))
    walls = [events[-1]["mono"] - events[0]["mono"] for events in raw]
    gap = raw[1][0]["time"] - raw[0][-1]["time"]
    assert s["job_wall_time_s"] == pytest.approx(sum(walls) + max(gap, 0.0))
    assert s["update_duty_fraction"] == pytest.approx(
        sum(e["seconds"] for e in updates) / (sum(walls) + max(gap, 0.0))
    )
    assert s["restarts"]["redone_updates_count"] == 1
    assert s["restarts"]["redone_update_s"] == pytest.approx(updates[3]["seconds"])
    assert s["attempts"][0]["status"] == "interrupted"
    assert s["attempts"][0]["uncheckpointed_updates_count"] == 1
    assert s["attempts"][1]["restored_step_count"] == 2
    assert s["final_status"] == "completed" and s["uncheckpointed_updates_count"] == 0


def test_attempt_chain_matches_the_worker_resume_chain(tmp_path):
    """The summary's own chain walk agrees with the worker's (newest first there)."""
    from minifield.attempt import chain as attempts

    for name, previous in [("a1", None), ("a2", "a1"), ("a3", "a2")]:
        (tmp_path / name).mkdir()
        resumed = str(tmp_path / previous) if previous else None
        (tmp_path / name / "attempt.json").write_text(json.dumps({"resumed_from": resumed}))
    ours = summarize.attempt_chain(tmp_path / "a3")
    assert [p.name for p in ours] == ["a1", "a2", "a3"]
    assert list(reversed(attempts.newest_first(tmp_path / "a3"))) == ours
