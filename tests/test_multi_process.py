"""Multi-process training on one machine: worker processes joined through
``MINIFIELD_COORDINATOR`` / ``MINIFIELD_NUM_PROCESSES`` / ``MINIFIELD_PROCESS_ID`` on
127.0.0.1, with gloo CPU collectives. This is the code path ``srun -n 2 minifield-worker
--distributed`` takes (there the three values come from SLURM's environment); the run on
the real SLURM cluster is in ``test_slurm_profile.py``.

Why two processes must give the *same bits* as one process over two devices: the compiled
update is the same program over the same two-device mesh, and the only cross-device
arithmetic is an all-reduce of two partial sums. Adding two floating-point numbers is
commutative, so however the collective orders its two operands the sum is the same. (With
more devices the grouping of the additions could differ between implementations; that is
why the process count is part of the recorded environment a resume is checked against.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    in_a_started_process,
    read_events,
    run_snakemake,
    run_worker,
    small_sft_inputs,
    small_sft_recipe,
    started_xla_flags,
    worker_command,
    write_recipe,
)

from minifield import recipe as recipes

pytestmark = pytest.mark.slow  # every test starts worker processes

# Short runs: every update of a two-process run is an all-reduce over loopback, paid by both
# processes; 3 checkpoints still (every one kept), and the proof's defaults (steps
# 2*EVERY+2 = MAX_STEPS, the crash one update after the first checkpoint) still cross one
MAX_STEPS = 6
EVERY = 2
STALL_STEP = 3  # the preemption test holds both processes after this update (off the cadence)


@pytest.fixture(scope="module")
def space(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("multi-process")
    return {"root": root, **small_sft_inputs(root)}


def mp_recipe(space, name: str, devices: int = 2, shard_params: bool = True) -> Path:
    recipe = small_sft_recipe(
        space["pins"],
        "mp-test",
        devices,
        training={"data_parallel": {"devices": devices, "shard_params": shard_params}},
        limits={"max_steps": MAX_STEPS},
        checkpoint={"every_steps": EVERY, "keep": 5},
    )
    return write_recipe(space["root"] / f"{name}.json", recipe)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_processes(out: Path, *, count: int = 2, per_process=None, **options) -> list[dict]:
    """Start ``count`` workers of one attempt (``options`` as ``worker_command`` takes them,
    ``per_process(rank)`` adds a process's own); stdout/stderr of each go to files in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(count):
        env = {
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": started_xla_flags(),  # one CPU device each
            "MINIFIELD_COORDINATOR": f"127.0.0.1:{port}",
            "MINIFIELD_NUM_PROCESSES": str(count),
            "MINIFIELD_PROCESS_ID": str(rank),
        }
        own = per_process(rank) if per_process else {}
        stdout, stderr = out / f"process-{rank}.out", out / f"process-{rank}.err"
        with open(stdout, "w") as o, open(stderr, "w") as e:
            proc = subprocess.Popen(
                worker_command("--distributed", **options, **own),
                stdout=o,
                stderr=e,
                env={**os.environ, **env},
            )
        procs.append({"proc": proc, "stdout": stdout, "stderr": stderr})
    return procs


def wait_all(procs: list[dict], timeout: float = 240) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p["proc"].wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q["proc"].kill()
            raise AssertionError(f"processes did not finish: {describe(procs)}") from None
    return codes


def describe(procs: list[dict]) -> str:
    return "\n".join(
        f"--- process {rank} stderr:\n{p['stderr'].read_text()[-2500:]}"
        for rank, p in enumerate(procs)
    )


def attempts(out: Path) -> list[Path]:
    return sorted((out / "mp-test").iterdir(), key=lambda p: (p / "attempt.json").stat().st_mtime)


def update_hashes(attempt: Path) -> dict[int, str]:
    return {
        e["step"]: e["state_hash"]
        for e in read_events(attempt / "events.jsonl")
        if e["type"] == "update"
    }


def result(attempt: Path) -> dict:
    return json.loads((attempt / "result.json").read_text())


@pytest.fixture(scope="module")
def reference(space) -> Path:
    """One process over two forced host devices: what the two-process runs must equal."""
    out = space["root"] / "one-process"
    run_worker(
        job=mp_recipe(space, "reference"),
        input_root=space["input_root"],
        output_root=out,
        record_state_hashes=True,
        check_codes=(0,),
        env={
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": started_xla_flags("--xla_force_host_platform_device_count=2"),
        },
    )
    (attempt,) = attempts(out)
    return attempt


def test_two_processes_train_one_attempt_bit_identical_to_one_process(space, reference):
    out = space["root"] / "two-processes"
    procs = start_processes(
        out,
        job=mp_recipe(space, "two"),
        input_root=space["input_root"],
        output_root=out,
        record_state_hashes=True,
    )
    assert wait_all(procs) == [0, 0], describe(procs)

    # one attempt, written by process 0 alone
    (attempt,) = attempts(out)
    done = result(attempt)
    assert done["status"] == "completed" and done["steps_completed"] == MAX_STEPS
    assert done["environment"]["process_count"] == 2 and done["environment"]["device_count"] == 2
    processes = json.loads((attempt / "attempt.json").read_text())["processes"]
    assert processes["count"] == 2 and processes["source"] == "environment"
    events = read_events(attempt / "events.jsonl")
    assert [e["seq"] for e in events] == list(range(len(events)))
    committed = [e["step"] for e in events if e["type"] == "checkpoint_committed"]
    assert committed == list(range(EVERY, MAX_STEPS + 1, EVERY))  # each step committed once
    steps = sorted(p.name for p in (attempt / "checkpoints").iterdir())
    assert steps == [f"step-{s:08d}" for s in committed]  # no temporaries left behind
    placement = next(e for e in events if e["type"] == "compiled")["placement"]
    assert placement["shard_params"] and placement["sharded_arrays"] > 0
    # process 0's stdout is the event stream; process 1 writes no events anywhere
    streamed = [
        json.loads(line)
        for line in procs[0]["stdout"].read_text().splitlines()
        if line.startswith("{")
    ]
    assert [e["seq"] for e in streamed] == [e["seq"] for e in events]
    assert not [line for line in procs[1]["stdout"].read_text().splitlines() if "{" in line]
    assert "process 0 records the attempt" in procs[1]["stderr"].read_text()

    # the same bits as one process over two devices, update by update
    assert update_hashes(attempt) == update_hashes(reference)
    assert len(update_hashes(attempt)) == MAX_STEPS
    assert done["final_state_hash"] == result(reference)["final_state_hash"]
    assert done["metrics"] == result(reference)["metrics"]
    exported = sorted(p.name for p in (attempt / "export").iterdir())
    assert exported == sorted(p.name for p in (reference / "export").iterdir())


def test_signal_to_one_process_preempts_both_at_the_same_step(space, reference):
    """Crash-and-resume over two processes is the recovery proof's job (see the pipeline test
    below); here: a SIGTERM that reaches one process only still stops both, together."""
    out = space["root"] / "preempted"
    # Both processes pause after update STALL_STEP; process 1 alone gets SIGTERM meanwhile.
    procs = start_processes(
        out,
        job=mp_recipe(space, "preempt"),
        input_root=space["input_root"],
        output_root=out,
        stall_after_step=STALL_STEP,
        stall_seconds=3,
    )
    deadline = time.monotonic() + 180
    while f"update {STALL_STEP}/" not in procs[1]["stderr"].read_text():
        assert time.monotonic() < deadline and procs[1]["proc"].poll() is None, describe(procs)
        time.sleep(0.1)
    procs[1]["proc"].send_signal(signal.SIGTERM)
    assert wait_all(procs) == [3, 3], describe(procs)

    (attempt,) = attempts(out)
    assert result(attempt)["status"] == "preempted"
    events = read_events(attempt / "events.jsonl")
    preempted = next(e for e in events if e["type"] == "preempted")
    # both stopped at the same step; process 0 records whose signal it was
    assert preempted["step"] == STALL_STEP and preempted["signal"] == "SIGTERM (on process 1)"
    commits = {e["step"]: e for e in events if e["type"] == "checkpoint_committed"}
    assert sorted(commits) == [EVERY, STALL_STEP]
    # the committed state is exactly the reference's state after that update
    assert commits[STALL_STEP]["state_hash"] == update_hashes(reference)[STALL_STEP]
    assert preempted["checkpoint_sha256"] == commits[STALL_STEP]["sha256"]


def test_a_set_up_failure_in_one_process_fails_every_process(space, tmp_path):
    # process 1 reads a copy of the inputs whose train split was edited after pinning
    other_root = tmp_path / "in"
    (other_root / "sft").mkdir(parents=True)
    for path in (space["input_root"] / "sft").iterdir():
        (other_root / "sft" / path.name).write_bytes(path.read_bytes())
    with open(other_root / "sft" / "train.jsonl", "a") as handle:
        handle.write('{"prompt": "ab", "response": "ba"}\n')
    out = tmp_path / "out"
    procs = start_processes(
        out,
        job=mp_recipe(space, "setup"),
        output_root=out,
        per_process=lambda rank: {"input_root": space["input_root"] if rank == 0 else other_root},
    )
    assert wait_all(procs) == [2, 2], describe(procs)
    (attempt,) = attempts(out)
    failed = result(attempt)
    assert failed["status"] == "failed" and failed["error"]["phase"] == "inputs"
    message = failed["error"]["message"]
    assert (
        message.startswith("process 1 failed:")
        and str(other_root / "sft" / "train.jsonl") in message
    )
    assert not (attempt / "checkpoints").exists()


def test_processes_must_hold_the_whole_mesh(space, tmp_path):
    out = tmp_path / "out"
    procs = start_processes(
        out,
        job=mp_recipe(space, "one-device", devices=1, shard_params=False),
        input_root=space["input_root"],
        output_root=out,
    )
    assert wait_all(procs) == [1, 1], describe(procs)
    error = result(attempts(out)[0])["error"]
    assert error["phase"] == "device"
    assert "training.data_parallel.devices is 1" in error["message"]
    assert "Set training.data_parallel.devices: 2" in error["message"]


def test_a_peer_that_never_starts_ends_the_wait(space, tmp_path):
    """Process 0 of 2 started alone: after --join-timeout JAX's runtime aborts it (a fatal
    error of the runtime, not a Python exception the worker could turn into exit 2); the
    worker has said beforehand whom it waited for, and the output root is untouched."""
    proc = run_worker(
        "--distributed",
        join_timeout=3,
        job=mp_recipe(space, "alone"),
        input_root=space["input_root"],
        output_root=tmp_path / "out",
        timeout=120,  # a hang guard only (the default join timeout is 300 s)
        env={
            "JAX_PLATFORMS": "cpu",
            "MINIFIELD_COORDINATOR": f"127.0.0.1:{free_port()}",
            "MINIFIELD_NUM_PROCESSES": "2",
            "MINIFIELD_PROCESS_ID": "0",
        },
    )
    assert proc.returncode not in (0, None)
    # the wait that ended is the 3 s one the worker announced: the runtime's own report of
    # its deadline, right after the announcement, is the event (not a measured duration)
    assert "process 0 of 2 joining coordinator 127.0.0.1:" in proc.stderr
    announced = proc.stderr.index("waiting at most 3 s")
    assert "DEADLINE_EXCEEDED" in proc.stderr[announced:]
    assert not (tmp_path / "out").exists()


def test_an_srun_step_of_several_tasks_needs_distributed(space, tmp_path):
    """Without --distributed, N tasks would be N independent copies writing one job."""
    proc = run_worker(
        job=mp_recipe(space, "srun"),
        input_root=space["input_root"],
        output_root=tmp_path / "out",
        check_codes=(2,),
        env={"SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2", "SLURM_PROCID": "1"},
    )
    assert "pass --distributed" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_pipeline_trains_over_two_processes(space, reference, tmp_path):
    """`train.processes: 2`: the recovery proof and the training each run as one attempt of
    two processes (minifield.supervision.launch, local processes here; srun inside a SLURM allocation),
    gated and evaluated like any other computation, with the same bits as one process over
    two devices; `evaluate.processes: 2`: the evaluate job over those two processes too."""
    project = tmp_path / "project"
    (project / "config").mkdir(parents=True)
    shutil.copytree(space["input_root"], project / "data")
    recipe = small_sft_recipe(
        space["pins"],
        "mp-pipeline",
        2,
        training={"data_parallel": {"devices": 2, "shard_params": True}},
        limits={"max_steps": MAX_STEPS},
        checkpoint={"every_steps": EVERY, "keep": 5},
    )
    recipe_path = write_recipe(project / "config" / "recipes" / "mp.json", recipe)
    config = {
        "recipes": ["config/recipes/mp.json"],
        "input_root": "data",
        "work_dir": "work",
        "train": {"retries": 0, "processes": 2},
        # the crash proof alone: preemption proofs are tested in test_proof.py
        "qualification": {"mode": "crash"},
        # the evaluate job over the same two processes' mesh (its figures: the test below)
        "evaluate": {"processes": 2},
    }
    (project / "config" / "config.yaml").write_text(json.dumps(config))
    cdigest = recipes.load(recipe_path).computation_digest
    target = f"results/computations/{cdigest[:16]}/eval/metrics.json"
    proc = run_snakemake(project, target, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]

    base = project / "results" / "computations" / cdigest[:16]
    proof = json.loads((base / "qualification" / "proof.json").read_text())
    assert proof["passed"] and proof["settings"]["processes"] == 2, proof["diagnosis"]
    result = json.loads((base / "train" / "result.json").read_text())
    assert result["status"] == "completed" and result["environment"]["process_count"] == 2
    attempt = project / result["attempt_dir"]
    processes = json.loads((attempt / "attempt.json").read_text())["processes"]
    assert processes == {
        "count": 2,
        "source": "environment",
        "coordinator": processes["coordinator"],
    }
    assert processes["coordinator"].startswith("127.0.0.1:")
    log = (project / "logs" / "train" / f"{cdigest[:16]}.log").read_text()
    assert "-m minifield.supervision.launch --processes 2 --" in log and "--distributed" in log
    # the same computation as the one-process reference run of this module's recipe
    # (same data, model, training and limits; only the job id differs, which is not in it)
    assert cdigest == recipes.load(space["root"] / "reference.json").computation_digest
    assert (
        result["final_state_hash"]
        == json.loads((reference / "result.json").read_text())["final_state_hash"]
    )
    metrics = json.loads((base / "eval" / "metrics.json").read_text())
    assert metrics["checkpoints"][-1]["step"] == MAX_STEPS
    assert metrics["checkpoints"][-1]["state_hash"] == result["final_state_hash"]
    log = (project / "logs" / "evaluate" / f"{cdigest[:16]}.log").read_text()
    assert "-m minifield.supervision.launch --processes 2 --" in log, log[-3000:]
    assert "evaluation_processes[1]: scored 3 checkpoint(s)" in log
    assert sorted(p.name for p in (base / "eval").iterdir()) == ["metrics.json", "selected-export"]
    # the final checkpoint's DEV figures: the training's own final evaluation, on the same mesh
    assert metrics["checkpoints"][-1]["dev"] == {
        k: v for k, v in result["metrics"].items() if k.startswith("dev_")
    }


def test_evaluate_stage_over_two_processes_gives_the_one_process_figures(
    space, reference, tmp_path, monkeypatch
):
    """`evaluate.processes: 2`: the reference attempt's checkpoints (written by one process
    over two devices) restored by two processes into the recipe's sharding and scored on the
    two-device mesh. The same figures, bit for bit, as the training's own final evaluation on
    that mesh (one process over two devices); against the one-process stage, which scores on
    one device, the same selection, exact-match and export, and losses equal to FP32
    rounding (the mesh sums each device's rows first, then adds the two sums)."""
    from minifield.pipeline import evaluation, preparation

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    # one CPU device per process: two in all
    monkeypatch.setenv("XLA_FLAGS", started_xla_flags())
    recipe_json = tmp_path / "recipe.json"
    preparation.validate(space["root"] / "reference.json", recipe_json, tmp_path / "v.json")
    preparation.prepare(recipe_json, space["input_root"], tmp_path / "examples")
    train_result = tmp_path / "train-result.json"
    train_result.write_text(json.dumps({**result(reference), "attempt_dir": str(reference)}))

    def stage(name: str, processes: int) -> dict:
        out = tmp_path / name
        return evaluation.evaluate(
            recipe_json, train_result, tmp_path / "examples", out / "metrics.json",
            out / "selected-export", processes=processes, log=tmp_path / f"{name}.log",
        )  # fmt: skip

    two = stage("two", 2)
    log = (tmp_path / "two.log").read_text()
    assert "-m minifield.supervision.launch --processes 2 --" in log and "--distributed" in log
    assert [p.name for p in (tmp_path / "two").iterdir()] == ["metrics.json", "selected-export"]
    steps = [row["step"] for row in two["checkpoints"]]
    assert steps == list(range(EVERY, MAX_STEPS + 1, EVERY))
    # the final checkpoint's DEV figures: those the training computed on the same mesh
    final = [e for e in read_events(reference / "events.jsonl") if e["type"] == "evaluation"]
    assert final[-1]["final"] and final[-1]["step"] == MAX_STEPS
    assert two["checkpoints"][-1]["dev"] == final[-1]["metrics"]

    # the one-process stage in a process of its own, compiled as the two are: like with like
    one = in_a_started_process(
        "import json, sys\n"
        "from pathlib import Path\n"
        "from minifield.pipeline import evaluation\n"
        "recipe, result, examples, out = map(Path, sys.argv[1:])\n"
        "metrics = evaluation.evaluate(\n"
        "    recipe, result, examples, out / 'metrics.json', out / 'selected-export'\n"
        ")\n"
        "print(json.dumps(metrics))\n",
        recipe_json, train_result, tmp_path / "examples", tmp_path / "one",
    )  # fmt: skip
    assert two["selection"] == one["selection"] and two["acceptance"] == one["acceptance"]
    for mesh, single in zip(two["checkpoints"], one["checkpoints"], strict=True):
        assert mesh["state_hash"] == single["state_hash"] and mesh["sha256"] == single["sha256"]
        for split, figures in (("dev", mesh["dev"]), ("test", two["test"])):
            other = single["dev"] if split == "dev" else one["test"]
            assert figures.keys() == other.keys()
            for name, value in figures.items():
                if name.endswith(("_loss", "_perplexity")):
                    assert value == pytest.approx(other[name], rel=2e-6), (split, name)
                else:  # counts and shares of exact matches
                    assert value == other[name], (split, name)
    # the selected export: the same files, byte for byte, whichever processes wrote it
    exports = [tmp_path / name / "selected-export" for name in ("two", "one")]
    files = [
        sorted(p.relative_to(d) for d in [d] for p in d.rglob("*") if p.is_file()) for d in exports
    ]
    assert files[0] == files[1] and files[0]
    for relative in files[0]:
        assert (exports[0] / relative).read_bytes() == (exports[1] / relative).read_bytes(), (
            relative
        )


def test_evaluation_processes_that_do_not_hold_the_mesh_are_refused(space, tmp_path, monkeypatch):
    """Two processes with two devices each hold four devices, the recipe's mesh two: every
    process refuses (exit 2) before reading anything, naming both counts; nothing written."""
    from minifield.pipeline import evaluation, preparation
    from minifield.pipeline.errors import StageError

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", started_xla_flags("--xla_force_host_platform_device_count=2"))
    recipe_json = tmp_path / "recipe.json"
    preparation.validate(mp_recipe(space, "refused"), recipe_json, tmp_path / "v.json")
    log = tmp_path / "evaluate.log"
    with pytest.raises(
        StageError, match=r"2 evaluation processes .* refused the evaluation \(exit 2\)"
    ):
        evaluation.evaluate(
            recipe_json, tmp_path / "absent-result.json", tmp_path / "absent-examples",
            tmp_path / "eval" / "metrics.json", tmp_path / "eval" / "selected-export",
            processes=2, log=log,
        )  # fmt: skip
    said = log.read_text()
    for rank in (0, 1):
        assert (
            f"evaluation_processes[{rank}]: 2 processes hold 4 devices in all, but the recipe's "
            "training.data_parallel.devices is 2"
        ) in said, said[-3000:]
    assert list((tmp_path / "eval").iterdir()) == []
