"""Tracking delivery logic without a server: settings, event reading, metric identities, cursor."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from minifield.inputs.credentials import CredentialsError
from minifield.tracking import attempt_events, settings
from minifield.tracking.cursor import Cursor
from minifield.tracking.runs import recipe_params


def test_tracking_is_off_by_default_and_in_the_shipped_config(repo):
    assert settings.from_config({}).enabled is False
    assert settings.load(repo / "config" / "config.yaml").enabled is False


@pytest.mark.parametrize(
    ("section", "named"),
    [
        ({"enabled": True}, "tracking.uri is required"),
        ({"enabled": True, "uri": "ftp://x"}, "tracking.uri must be an http(s) URL"),
        ({"enabled": True, "uri": "https://u:p@host"}, "must not carry credentials"),
        ({"enabled": "yes", "uri": "https://host"}, "tracking.enabled must be bool"),
        ({"enabled": True, "uri": "https://h", "colour": 1}, "unknown field(s) ['colour']"),
        (
            {"enabled": True, "uri": "http://tracking.example", "credentials": "/c.json"},
            "plain http to a host that is not loopback",
        ),
        ({"enabled": True, "uri": "https://h", "ca_bundle": "/no/such.pem"}, "tracking.ca_bundle"),
        ({"enabled": True, "uri": "https://h", "max_retry_wait_s": 0}, "max_retry_wait_s"),
    ],
)
def test_unusable_settings_are_refused_naming_the_field(section, named):
    with pytest.raises(settings.SettingsError) as caught:
        settings.from_config({"tracking": section}, "cfg.yaml")
    assert named in str(caught.value) and "cfg.yaml" in str(caught.value)


def test_state_dir_defaults_under_the_work_dir():
    found = settings.from_config({"work_dir": "w", "tracking": {"state_dir": None}})
    assert found.state_dir == Path("w/tracking")


def test_token_file_must_be_owner_only_and_the_token_is_never_shown(tmp_path):
    from minifield.tracking.connection import Connection

    token = "s3cr3t-token-value"
    path = tmp_path / "credentials.json"
    path.write_text(json.dumps({"http://127.0.0.1:5999": {"bearer_token": token}}))
    os.chmod(path, 0o644)
    chosen = settings.from_config(
        {"tracking": {"enabled": True, "uri": "http://127.0.0.1:5999", "credentials": str(path)}}
    )
    with pytest.raises(CredentialsError, match="mode 0644"):
        Connection(chosen)
    os.chmod(path, 0o600)
    link = Connection(chosen)
    assert token not in repr(link._credentials)
    assert link.redact(f"failed with Authorization: Bearer {token}") == (
        "failed with Authorization: Bearer [redacted]"
    )
    # The token is in the environment only during a call, never beside it.
    assert "MLFLOW_TRACKING_TOKEN" not in os.environ
    seen = link.call("probe", lambda: os.environ.get("MLFLOW_TRACKING_TOKEN"))
    assert seen == token and "MLFLOW_TRACKING_TOKEN" not in os.environ


def test_a_token_for_another_origin_is_not_used(tmp_path):
    from minifield.tracking.connection import Connection, TrackingError

    path = tmp_path / "credentials.json"
    path.write_text(json.dumps({"https://elsewhere.example:443": {"bearer_token": "t"}}))
    os.chmod(path, 0o600)
    chosen = settings.from_config(
        {"tracking": {"enabled": True, "uri": "https://tracking.example", "credentials": str(path)}}
    )
    with pytest.raises(TrackingError, match="no token for the tracking server's origin"):
        Connection(chosen)


def test_errors_are_classified_retry_on_connection_and_5xx_refuse_on_4xx():
    from mlflow.exceptions import MlflowException, RestException

    from minifield.tracking.connection import classify

    assert classify(RestException({"error_code": "INTERNAL_ERROR", "message": "x"})) == (500, True)
    assert classify(RestException({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "x"})) == (
        404,
        False,
    )
    assert classify(MlflowException("API request to http://h failed with exception boom")) == (
        None,
        True,
    )
    assert classify(MlflowException("failed with error code 503 != 200. Body: busy")) == (
        503,
        True,
    )
    assert classify(MlflowException("failed with error code 403 != 200. Body: no")) == (
        403,
        False,
    )


def test_a_refused_request_fails_at_once_a_failing_server_is_retried_with_backoff():
    from mlflow.exceptions import RestException

    from minifield.tracking.connection import Connection, DeliveryRefused, ServerUnavailable

    pauses: list[float] = []
    chosen = settings.from_config(
        {"tracking": {"enabled": True, "uri": "http://127.0.0.1:5999", "max_retry_wait_s": 20}}
    )
    link = Connection(chosen, sleep=pauses.append)
    calls = []

    def refuse():
        calls.append(1)
        raise RestException({"error_code": "INVALID_PARAMETER_VALUE", "message": "bad"})

    with pytest.raises(DeliveryRefused, match="HTTP 400"):
        link.call("log metrics", refuse)
    assert len(calls) == 1 and pauses == []

    def failing():
        raise RestException({"error_code": "INTERNAL_ERROR", "message": "down"})

    with pytest.raises(ServerUnavailable, match="unavailable for log metrics"):
        link.call("log metrics", failing)
    assert sum(pauses) >= 20 and len(pauses) >= 4
    assert all(b >= a * 0.99 for a, b in zip(pauses[::2], pauses[2::2], strict=False))

    outcomes = iter([OSError("refused"), OSError("refused"), "ok"])

    def flaky():
        value = next(outcomes)
        if isinstance(value, Exception):
            raise value
        return value

    assert link.call("log metrics", flaky) == "ok"


def _event(seq: int, type_: str, **fields) -> dict:
    return {"seq": seq, "time": 1700000000.0 + seq / 8, "mono": 5.0 + seq, "type": type_, **fields}


def test_update_and_evaluation_events_become_points_with_their_own_identity():
    update = _event(4, "update", step=3, loss=0.5, learning_rate=0.01, seconds=0.2, tokens=64,
                    examples=8, state_hash="ab", part_hashes={"params": "cd"})  # fmt: skip
    points = attempt_events.metric_points(update)
    # by hand: every number but seq/time/mono/step; timestamp = time in ms
    stamp = round((1700000000.0 + 4 / 8) * 1000)
    assert {(p.key, p.value, p.step, p.timestamp) for p in points} == {
        ("loss", 0.5, 3, stamp),
        ("learning_rate", 0.01, 3, stamp),
        ("update_seconds", 0.2, 3, stamp),
        ("tokens", 64.0, 3, stamp),
        ("examples", 8.0, 3, stamp),
    }
    evaluation = _event(9, "evaluation", step=8, final=True, metrics={"heldout_mse": 0.7})
    assert [(p.key, p.value, p.step) for p in attempt_events.metric_points(evaluation)] == [
        ("eval/heldout_mse", 0.7, 8)
    ]
    assert attempt_events.metric_points(_event(1, "device", backend="cpu")) == []
    assert attempt_events.run_tags(_event(9, "completed", final_state_hash="ff")) == {
        "minifield.attempt_status": "completed",
        "minifield.final_state_hash": "ff",
    }


def test_only_complete_lines_are_read_and_offsets_resume_exactly(tmp_path):
    path = tmp_path / "events.jsonl"
    lines = [json.dumps(_event(i, "update", step=i + 1, loss=float(i))) for i in range(5)]
    path.write_text("\n".join(lines[:4]) + "\n" + lines[4][:10])  # the last line is half-written
    first = attempt_events.read_batch(path, 0, 3)
    assert [e["seq"] for e in first.events] == [0, 1, 2]
    assert first.end_offset == sum(len(line) + 1 for line in lines[:3])
    second = attempt_events.read_batch(path, first.end_offset, 3)
    assert [e["seq"] for e in second.events] == [3]
    with open(path, "a") as handle:
        handle.write(lines[4][10:] + "\n")
    third = attempt_events.read_batch(path, second.end_offset, 3)
    assert [e["seq"] for e in third.events] == [4] and third.end_offset == path.stat().st_size


def test_cursor_round_trip_and_refuses_another_attempt(tmp_path):
    path = tmp_path / "a1.json"
    cursor = Cursor("a1", "d" * 64, run_id="r", delivered_seq=7, offset=100)
    cursor.save(path)
    assert Cursor.load(path, "a1", "d" * 64) == cursor
    with pytest.raises(ValueError, match="not of a2"):
        Cursor.load(path, "a2", "d" * 64)
    assert Cursor.load(tmp_path / "none.json", "a3", "e" * 64).delivered_seq == -1


def test_recipe_fields_become_dotted_params():
    params = recipe_params(
        {"job_id": "j", "training": {"learning_rate": 0.04, "seed": 3}, "inputs": [{"n": 1}]}
    )
    assert params == {
        "job_id": "j",
        "training.learning_rate": "0.04",
        "training.seed": "3",
        "inputs": '[{"n":1}]',
    }


def test_harness_results_are_evaluation_points_at_the_selected_step():
    from minifield.tracking.computation import evaluation_points

    metrics = {
        "selection": {"step": 6},
        "harness": {"results": {"t": {"acc": 0.5, "exact_match,strict": 1.0}}},
    }
    points = {(p.key, p.value, p.step) for p in evaluation_points(metrics, 0)}
    assert ("harness/t/acc", 0.5, 6) in points
    assert ("harness/t/exact_match:strict", 1.0, 6) in points  # MLflow names have no comma
