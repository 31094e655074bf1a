"""Delivery to a REAL ``mlflow server`` on 127.0.0.1 (SQLite backend, temporary artifact root).

One server for the whole module (started once, stopped by its PID). What arrived is read back
through the MLflow client and compared with the raw files: ``events.jsonl``, ``recipe.json``,
``eval/metrics.json``, the store's manifests.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import copy_run, minifield_in_process, read_events, run_snakemake
from recovery_cases import events_of

from minifield import cli
from minifield.digest import sha256_file
from minifield.supervision import supervise
from minifield.tracking import settings

pytestmark = pytest.mark.slow  # a real tracking server, real workers, real Snakemake
# No usage reports from the client in this process (and no sender thread in forked children).
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``mlflow server`` with a SQLite backend; waits for /health; stopped by its PID."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    command = [
        str(Path(sys.executable).parent / "mlflow"), "server",
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination", str(root / "artifacts"),
    ]  # fmt: skip
    log = open(root / "server.log", "wb")
    # No background job runner (workers for MLflow's own scheduled jobs): not used here.
    quiet = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    process = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True, env=quiet)
    uri = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            if process.poll() is not None:
                raise AssertionError(f"mlflow server exited: {(root / 'server.log').read_text()}")
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            raise AssertionError("mlflow server did not answer /health")
        yield uri
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


@pytest.fixture(scope="module")
def client(server):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=server, registry_uri=server)


def _config(path: Path, uri: str, experiment: str, state_dir: Path, **extra) -> Path:
    tracking = {"enabled": True, "uri": uri, "experiment": experiment}
    tracking.update(state_dir=str(state_dir), **extra)
    path.write_text(yaml.safe_dump({"tracking": tracking}))
    return path


def _runs(client, experiment: str, kind: str) -> list:
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    return client.search_runs(
        [found.experiment_id], filter_string=f"tags.`minifield.kind` = '{kind}'"
    )


def _expected_points(events: list[dict]) -> dict[str, list[tuple]]:
    """By hand from the raw events: every number of each update (``seconds`` as
    ``update_seconds``) and of each evaluation's metrics, at the event's step and time."""
    expected: dict[str, list[tuple]] = {}
    for event in events:
        if event["type"] == "update":
            values = {k: v for k, v in event.items() if k not in ("seq", "time", "mono", "step")}
        elif event["type"] == "evaluation":
            values = {f"eval/{k}": v for k, v in event["metrics"].items()}
        else:
            continue
        for key, value in values.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                key = "update_seconds" if key == "seconds" else key
                stamp = int(round(event["time"] * 1000))
                expected.setdefault(key, []).append((event["step"], stamp, float(value)))
    return {key: sorted(points) for key, points in expected.items()}


def _held(client, run_id: str, keys) -> dict[str, list[tuple]]:
    return {
        key: sorted((m.step, m.timestamp, m.value) for m in client.get_metric_history(run_id, key))
        for key in keys
    }


# -- a computation of the pipeline, delivered by the deliver rule -----------------------------


@pytest.fixture(scope="module")
def delivered_pipeline(tmp_path_factory, linear_demo_run, server):
    """A copy of the linear demo run with tracking enabled: Snakemake runs only the deliver
    rule (and the registry mirror of nothing new), against the real server."""
    workdir = copy_run(linear_demo_run, tmp_path_factory.mktemp("tracked") / "run")
    config = yaml.safe_load((workdir / "config" / "config.yaml").read_text())
    config["tracking"] = {"enabled": True, "uri": server, "experiment": "pipeline"}
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    run_snakemake(workdir, check=True)
    return workdir


def _scheduled_deliveries(workdir: Path, uri: str) -> list[str]:
    """The deliver outputs a Snakemake dry run (``-n``) would make with ``tracking.uri: uri``."""
    config_path = workdir / "config" / "config.yaml"
    config = yaml.safe_load(config_path.read_text())
    config["tracking"]["uri"] = uri
    config_path.write_text(yaml.safe_dump(config))
    dry = run_snakemake(workdir, "-n", check=True)
    return sorted(
        {
            word
            for line in dry.stdout.splitlines()
            if line.strip().startswith("output:")
            for word in line.split("output:", 1)[1].replace(",", " ").split()
            if "/tracking/" in word
        }
    )


def test_another_tracking_server_schedules_the_delivery_again(delivered_pipeline, server):
    """The destination is part of the delivery's output: the same server is up to date, another
    one (or the first again, unchanged) is not delivered twice."""
    workdir = copy_run(delivered_pipeline, delivered_pipeline.parent / "redirected")
    (computation,) = (workdir / "results" / "computations").iterdir()
    (delivered,) = (computation / "tracking").iterdir()
    assert _scheduled_deliveries(workdir, server) == []
    other = "http://127.0.0.1:9"  # nothing is sent in a dry run
    expected = settings.from_config(
        {"tracking": {"enabled": True, "uri": other, "experiment": "pipeline"}}
    ).destination
    assert expected != delivered.stem
    assert _scheduled_deliveries(workdir, other) == [
        str((computation / "tracking" / f"{expected}.json").relative_to(workdir))
    ]


def test_deliver_rule_sends_run_params_every_metric_point_and_artifacts(delivered_pipeline, client):
    workdir = delivered_pipeline
    (computation,) = (workdir / "results" / "computations").iterdir()
    (record_path,) = (computation / "tracking").iterdir()
    record = json.loads(record_path.read_text())
    validation = json.loads((computation / "validation.json").read_text())
    recipe = json.loads((computation / "recipe.json").read_text())
    (run,) = _runs(client, "pipeline", "computation")
    assert run.info.run_id == record["run_id"] and run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags["minifield.computation_digest"] == validation["computation_digest"]
    assert tags["minifield.examples_digest"] == validation["examples_digest"]
    result = json.loads((computation / "train" / "result.json").read_text())
    assert tags["minifield.code_hash"] == result["environment"]["code_hash"]
    assert tags["minifield.source_revision"] == result["environment"]["source_revision"]
    assert json.loads(tags["minifield.environment_fingerprint"]) == result["environment"]
    # recipe fields as params, checked against the raw recipe
    assert run.data.params["training.learning_rate"] == str(recipe["training"]["learning_rate"])
    assert run.data.params["limits.max_steps"] == str(recipe["limits"]["max_steps"])
    assert run.data.params["job_id"] == recipe["job_id"]
    # one nested run per attempt, each with every metric point of its events file exactly once
    attempts = _runs(client, "pipeline", "attempt")
    attempt_dirs = sorted((workdir / "work" / computation.name / "attempts").glob("*/*"))
    assert sorted(r.data.tags["minifield.attempt_id"] for r in attempts) == sorted(
        d.name for d in attempt_dirs
    )
    for attempt_run in attempts:
        assert attempt_run.data.tags["mlflow.parentRunId"] == run.info.run_id
        directory = next(
            d for d in attempt_dirs if d.name == attempt_run.data.tags["minifield.attempt_id"]
        )
        expected = _expected_points(read_events(directory / "events.jsonl"))
        assert expected["loss"], "the attempt trained"
        assert _held(client, attempt_run.info.run_id, expected) == expected
        assert set(attempt_run.data.metrics) == set(expected)  # nothing else was sent
    # evaluation: DEV at every evaluated checkpoint, TEST at the selected step
    metrics = json.loads((computation / "eval" / "metrics.json").read_text())
    step = metrics["selection"]["step"]
    for key, value in metrics["test"].items():
        assert [
            (m.step, m.value) for m in client.get_metric_history(run.info.run_id, f"test/{key}")
        ] == [(step, value)]
    dev_rows = [
        (r["step"], r["dev"][metrics["selection"]["metric"]]) for r in metrics["checkpoints"]
    ]
    dev_key = f"dev/{metrics['selection']['metric']}"
    assert sorted(
        (m.step, m.value) for m in client.get_metric_history(run.info.run_id, dev_key)
    ) == sorted(dev_rows)
    # evidence and report plots as artifacts, byte for byte
    listed = {a.path for folder in ("evidence", "evaluation", "summary", "report")
              for a in client.list_artifacts(run.info.run_id, folder)}  # fmt: skip
    assert {"evidence/proof.json", "evaluation/metrics.json", "summary/summary.json",
            "report/loss.png", "report/goodput.png"} <= listed  # fmt: skip
    downloaded = client.download_artifacts(run.info.run_id, "evidence/proof.json", str(workdir))
    assert sha256_file(Path(downloaded)) == sha256_file(
        computation / "qualification" / "proof.json"
    )


def test_delivering_again_sends_nothing_new(delivered_pipeline, client, tmp_path):
    workdir = delivered_pipeline
    (computation,) = (workdir / "results" / "computations").iterdir()
    (run,) = _runs(client, "pipeline", "computation")
    before = {
        r.info.run_id: _held(client, r.info.run_id, r.data.metrics)
        for r in _runs(client, "pipeline", "attempt")
    }
    # The command in a forked process (the deliver rule ran it as a process of its own), from
    # the run's directory as that rule does: its default config and work directory are
    # relative to it. Forked, not in this process: the client connections a delivery pools
    # here would be inherited by the kill test's forked deliveries, one socket for them all.
    proc = _cli_forked(["deliver", str(computation)], workdir, tmp_path)
    assert proc.returncode == 0, proc.stderr
    (again,) = json.loads(proc.stdout)
    assert again["run_id"] == run.info.run_id and again["evaluation_points_sent"] == 0
    after = {
        r.info.run_id: _held(client, r.info.run_id, r.data.metrics)
        for r in _runs(client, "pipeline", "attempt")
    }
    assert after == before


# -- exactly once, whatever the moment the delivering process is killed ------------------------


def _premade_attempt(root: Path, updates: int) -> Path:
    """An attempt directory with a worker-shaped attempt.json and ``updates`` update events."""
    attempt = root / "job" / "a-premade"
    attempt.mkdir(parents=True)
    (attempt / "attempt.json").write_text(json.dumps({
        "attempt_id": "a-premade", "job_id": "premade", "computation_digest": "c" * 64,
        "examples_digest": "e" * 64, "environment": {"code_hash": "h", "source_revision": "r"},
        "resumed_from": None, "started": "2026-01-01T00:00:00+00:00",
    }))  # fmt: skip
    rng = np.random.default_rng(0)
    lines = []
    for step in range(1, updates + 1):
        lines.append({"seq": step - 1, "time": 1.8e9 + step * 0.25, "mono": float(step),
                      "type": "update", "step": step, "loss": float(rng.random()),
                      "learning_rate": 0.01, "seconds": float(rng.random()), "examples": 8})  # fmt: skip
    lines.append({"seq": updates, "time": 1.8e9 + updates, "mono": 0.0, "type": "completed",
                  "final_state_hash": "f" * 64, "steps": updates})  # fmt: skip
    (attempt / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    return attempt


def _cli_forked(argv: list[str], cwd: Path, logs: Path) -> subprocess.CompletedProcess:
    """``minifield ARGV`` in a forked child (no interpreter start-up to pay) run from ``cwd``,
    its output through files under ``logs``."""
    import multiprocessing

    out, err = logs / "forked.out", logs / "forked.err"

    def command() -> None:
        os.chdir(cwd)
        with open(out, "w") as stdout, open(err, "w") as stderr:
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                code = cli.main(argv)
        os._exit(code)

    process = multiprocessing.get_context("fork").Process(target=command)
    process.start()
    process.join(timeout=300)
    return subprocess.CompletedProcess(argv, process.exitcode, out.read_text(), err.read_text())


def _deliver_in_process(config: Path, attempt: Path) -> subprocess.CompletedProcess:
    """The same command as ``_deliver_attempt``, in this process."""
    return minifield_in_process(
        "deliver", "--config", config, "--attempt-dir", attempt, "--batch-events", "8"
    )


def _deliver_attempt(config: Path, attempt: Path, *extra) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "minifield.cli", "deliver", "--config", str(config),
         "--attempt-dir", str(attempt), "--batch-events", "8", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _forked_delivery(config: Path, attempt: Path, *extra: str):
    import multiprocessing

    argv = ["deliver", "--config", str(config), "--attempt-dir", str(attempt),
            "--batch-events", "8", *extra]  # fmt: skip

    def deliver() -> None:
        with contextlib.redirect_stdout(io.StringIO()):
            os._exit(cli.main(argv))

    process = multiprocessing.get_context("fork").Process(target=deliver)
    process.start()
    return process


def _cursor_path(state_dir: Path, uri: str, experiment: str) -> Path:
    """The premade attempt's cursor: kept per destination (server and experiment)."""
    destination = settings.from_config(
        {"tracking": {"enabled": True, "uri": uri, "experiment": experiment}}
    ).destination
    return state_dir / "destinations" / destination / "attempts" / "a-premade.json"


def test_delivery_killed_at_random_points_resumes_exactly_once(tmp_path, client, server):
    attempt = _premade_attempt(tmp_path, updates=160)  # 21 batches of 8 events
    config = _config(tmp_path / "config.yaml", server, "kills", tmp_path / "state")
    expected = _expected_points(read_events(attempt / "events.jsonl"))
    rng = random.Random(15)
    kills = 0

    def attempt_run_id():
        runs = _runs(client, "kills", "attempt")
        assert len(runs) <= 1, "a restart created a second run"
        return runs[0].info.run_id if runs else None

    # The hardest moment first: the server accepted a batch, the cursor does not say so yet
    # (the CLI's fault hook SIGKILLs its own process: a forked one, as below, with no start-up
    # to pay; the CLI as a process of its own finishes the delivery at the end).
    process = _forked_delivery(config, attempt, "--fault-kill-after-send", "2")
    process.join(timeout=300)
    assert process.exitcode == -signal.SIGKILL
    kills += 1
    cursor_path = _cursor_path(tmp_path / "state", server, "kills")
    while kills < 12:
        # A forked delivering process (the CLI's code, MLflow already imported: no start-up
        # cost), SIGKILLed after a random number of accepted batches plus a random delay.
        before = json.loads(cursor_path.read_text())["delivered_seq"]
        let_through = rng.randrange(0, 3) * 8
        process = _forked_delivery(config, attempt)
        while process.is_alive():
            if json.loads(cursor_path.read_text())["delivered_seq"] >= before + let_through:
                break
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.2))
        if process.is_alive():
            os.kill(process.pid, signal.SIGKILL)
        process.join(timeout=60)
        kills += 1
        held = _held(client, attempt_run_id(), expected)
        for key, points in held.items():
            assert len(points) == len(set(points)), f"kill {kills}: a duplicate {key} point"
            assert set(points) <= set(expected[key]), f"kill {kills}: a {key} point not in events"
    finished = _deliver_attempt(config, attempt)
    out, err = finished.communicate(timeout=300)
    assert finished.returncode == 0, err
    run_id = attempt_run_id()
    assert _held(client, run_id, expected) == expected  # every point, exactly once
    run = client.get_run(run_id)
    assert (
        run.info.status == "FINISHED" and run.data.tags["minifield.attempt_status"] == "completed"
    )
    cursor = json.loads(cursor_path.read_text())
    assert cursor["delivered_seq"] == 160 and cursor["inflight"] is None


def test_a_refused_request_is_a_clear_failure_not_a_retry(tmp_path, server):
    attempt = _premade_attempt(tmp_path, updates=3)
    events = (attempt / "events.jsonl").read_text().splitlines()
    bad = json.loads(events[1])
    bad["bad key?"] = 1.0  # not a metric name MLflow accepts: the server answers 400
    (attempt / "events.jsonl").write_text(
        "\n".join([events[0], json.dumps(bad), *events[2:]]) + "\n"
    )
    config = _config(tmp_path / "config.yaml", server, "refused", tmp_path / "state")
    process = _deliver_in_process(config, attempt)
    assert process.returncode == 2, (process.stdout, process.stderr)
    assert "refused log metrics (HTTP 400)" in process.stderr
    cursor = json.loads(_cursor_path(tmp_path / "state", server, "refused").read_text())
    assert cursor["delivered_seq"] == -1 and cursor["inflight"] is not None  # not advanced


# -- live delivery while training; the server goes away mid-training ---------------------------


class _Proxy:
    """A TCP relay in front of the server that can be taken down and brought back: to the
    client, the tracking server itself goes away (connections reset, then refused)."""

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.port = _free_port()
        self.sockets: list[socket.socket] = []
        self.listener: socket.socket | None = None

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener) -> None:
        while True:
            try:
                downstream, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.sockets += [downstream, upstream]
            for a, b in ((downstream, upstream), (upstream, downstream)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source, sink) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def stop(self) -> None:
        # shutdown first: it wakes the thread blocked in accept() (close alone would not)
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self.sockets.clear()


def test_server_gone_mid_training_changes_nothing_and_delivery_catches_up(
    tmp_path, linear_demo_run, server, client
):
    from minifield.tracking import live
    from minifield.tracking import settings as tracking_settings

    (computation,) = (linear_demo_run / "results" / "computations").iterdir()
    reference = json.loads((computation / "train" / "result.json").read_text())
    validation = json.loads((computation / "validation.json").read_text())
    examples = linear_demo_run / "results" / "examples" / validation["examples_digest"][:16]
    proxy = _Proxy(int(server.rsplit(":", 1)[1]))
    proxy.start()
    relayed = f"http://127.0.0.1:{proxy.port}"
    config = _config(tmp_path / "config.yaml", relayed, "live", tmp_path / "state")
    chosen = tracking_settings.load(config)
    attempt_dir = tmp_path / "out" / reference["job_id"] / "a-live"
    companion = live.LiveDelivery(chosen, attempt_dir, recipe_json=computation / "recipe.json",
                                  log_path=tmp_path / "delivery.log", drain_s=2)  # fmt: skip
    command = supervise.worker_command(
        "--job", computation / "recipe.json", "--input-root", linear_demo_run / "data",
        "--output-root", tmp_path / "out", "--examples", examples, "--attempt-id", "a-live",
        "--record-state-hashes",
        # holds still after update 4 (no change to the computation): time to watch it live;
        # the test holds it (SIGSTOP) within about 0.1 s, and the rest of the 5 s runs after
        "--stall-after-step", "4", "--stall-seconds", "5",
    )  # fmt: skip
    outcome: dict = {}
    worker = threading.Thread(
        target=lambda: outcome.update(
            supervise.supervise(command, tmp_path / "run", supervise.Settings(forward_signals=False), companion=companion)
        )
    )  # fmt: skip
    worker.start()
    # Live: updates 1-4 reach the server while the worker is still training. The worker is
    # held (SIGSTOP) as soon as its update 4 is in its event file, during its stall, so how
    # long delivery takes does not matter; the stall is only the window to hold it in.
    held = _hold_after_update(attempt_dir, 4, worker)
    try:
        steps: list = []
        deadline = time.monotonic() + 300  # a hang guard only
        while len(steps) < 4:
            assert time.monotonic() < deadline, (
                f"hang guard: the server holds loss steps {steps} after 300 s",
                (tmp_path / "delivery.log").read_text(),
            )
            time.sleep(0.2)
            runs = _runs(client, "live", "attempt")
            steps = [
                m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")
            ] if runs else []  # fmt: skip
        events = read_events(attempt_dir / "events.jsonl")
        assert not any(e["type"] == "completed" for e in events)
        assert sorted(steps) == [1, 2, 3, 4]
    finally:
        os.kill(held, signal.SIGCONT)
    proxy.stop()  # the server goes away mid-training
    worker.join(timeout=600)
    assert outcome["classification"] == "completed", outcome["reason"]
    result = json.loads((attempt_dir / "result.json").read_text())
    assert result["final_state_hash"] == reference["final_state_hash"]  # training unchanged
    assert outcome["companion"]["started"]
    (run,) = _runs(client, "live", "attempt")
    expected = _expected_points(read_events(attempt_dir / "events.jsonl"))
    assert _held(client, run.info.run_id, ["loss"])["loss"] != expected["loss"]  # it lagged
    proxy.start()  # the server is back: delivery resumes from the cursor
    process = _deliver_in_process(config, attempt_dir)
    assert process.returncode == 0, process.stderr
    assert _held(client, run.info.run_id, expected) == expected
    proxy.stop()


def _hold_after_update(attempt_dir: Path, step: int, worker: threading.Thread) -> int:
    """Stop (SIGSTOP) the worker writing ``attempt_dir`` once update ``step`` is in its
    event file; its pid, for SIGCONT."""

    def updates() -> list[int]:  # (a line being written is left for the next look)
        if not (attempt_dir / "events.jsonl").is_file():
            return []
        return [e["step"] for e in events_of(attempt_dir) if e["type"] == "update"]

    deadline = time.monotonic() + 300  # a hang guard only
    while step not in updates():
        assert worker.is_alive(), "the supervised worker ended before its update 4"
        assert time.monotonic() < deadline, f"hang guard: no update {step} after 300 s"
        time.sleep(0.05)
    (pid,) = [
        int(p.parent.name)
        for p in Path("/proc").glob("[0-9]*/cmdline")
        if _cmdline(p)[1:3] == ["-m", "minifield.worker"] and str(attempt_dir.parent.parent) in
        _cmdline(p)
    ]  # fmt: skip
    os.kill(pid, signal.SIGSTOP)
    # held: the stall after update 4 is still running, or the next update would be there
    assert max(updates()) == step, "the worker went past its stall before it could be held"
    return pid


def _cmdline(path: Path) -> list[str]:
    try:
        return path.read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:  # a process that ended meanwhile
        return []


# -- the model registry follows the store -------------------------------------------------------


def _store_cli(config: Path, store: Path, *args) -> subprocess.CompletedProcess:
    return minifield_in_process("store", "--store", store, "--config", config, *args)


def _altered_export(source: Path, destination: Path, scale: float) -> Path:
    """The export with its weights scaled (a different model, same computation)."""
    shutil.copytree(source, destination)
    model = json.loads((destination / "model.json").read_text())
    for entry in model["weights"]:
        values = np.load(destination / entry["file"], allow_pickle=False) * scale
        np.save(destination / entry["file"], values.astype(entry["dtype"]), allow_pickle=False)
        entry["sha256"] = sha256_file(destination / entry["file"])
    (destination / "model.json").write_text(json.dumps(model))
    return destination


def test_publish_activate_rollback_move_the_registry_and_a_refusal_leaves_the_alias(
    tmp_path, linear_demo_run, client, server
):
    (computation,) = (linear_demo_run / "results" / "computations").iterdir()
    config = _config(tmp_path / "config.yaml", server, "registry", tmp_path / "state")
    store = tmp_path / "store"
    sources = ["--recipe", computation / "recipe.json",
               "--train-result", computation / "train" / "result.json",
               "--metrics", computation / "eval" / "metrics.json",
               "--proof", computation / "qualification" / "proof.json"]  # fmt: skip
    exports = {
        "a": computation / "train" / "export",
        "b": _altered_export(computation / "train" / "export", tmp_path / "b", 1.001),
        "bad": _altered_export(computation / "train" / "export", tmp_path / "bad", 0.0),
    }
    ids = {}
    for name, export in exports.items():
        proc = _store_cli(config, store, "publish", export, *sources)
        assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr
        ids[name] = proc.stdout.strip()
    product = json.loads((computation / "recipe.json").read_text())["product"]["name"]
    versions = client.search_model_versions(f"name = '{product}'")
    by_content = {v.tags["minifield.content_id"]: v for v in versions}
    assert set(by_content) == set(ids.values())  # one version per published artifact
    validation = json.loads((computation / "validation.json").read_text())
    proof_sha = sha256_file(computation / "qualification" / "proof.json")
    for version in by_content.values():
        assert version.tags["minifield.computation_digest"] == validation["computation_digest"]
        assert version.tags["minifield.proof_sha256"] == proof_sha

    def champion() -> str:
        return client.get_model_version_by_alias(product, "champion").tags["minifield.content_id"]

    assert _store_cli(config, store, "activate", ids["a"]).returncode == 0
    assert champion() == ids["a"]
    assert _store_cli(config, store, "activate", ids["b"]).returncode == 0
    assert champion() == ids["b"]
    assert _store_cli(config, store, "rollback").returncode == 0
    assert champion() == ids["a"]
    refused = _store_cli(config, store, "activate", ids["bad"])
    assert refused.returncode == 1 and "acceptance re-evaluation failed" in refused.stderr
    assert champion() == ids["a"]  # the refusal never reached the registry
    assert _store_cli(config, store, "verify", ids["a"]).returncode == 0
    # Someone moves the alias behind the store's back: verify names the disagreement.
    client.set_registered_model_alias(product, "champion", by_content[ids["b"]].version)
    disagreeing = _store_cli(config, store, "verify", ids["a"])
    assert disagreeing.returncode == 1
    assert "the store's current, but alias 'champion'" in disagreeing.stderr
    report = json.loads(disagreeing.stdout)
    assert report["registry"]["agrees"] is False
