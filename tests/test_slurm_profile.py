"""The SLURM profile on a real single-node cluster (slurmctld, slurmd, munge, slurmdbd + MariaDB).

The fixture installs the Debian packages if they are missing (tests/slurm/install-packages.sh),
starts the cluster (tests/slurm/start-cluster.sh) and stops exactly the daemons it started, by
PID. Where that is impossible (not root, no apt-get, the install fails) the test is SKIPPED with
the reason; it never passes without having run the pipeline on the cluster.

The same small linear pipeline runs twice from the repository's Snakefile: once locally (the
default workflow profile) and once with ``--profile profiles/slurm`` where the train rule asks
for one (fake) GPU. Both must produce the same computation digest, final state hash and
per-checkpoint state hashes; sacct must show every cluster job, the train job with a GPU in its
allocation, and the worker must have seen exactly one device in CUDA_VISIBLE_DEVICES.

Multi-host: ``srun -n 2`` starts two tasks that find each other from SLURM's environment,
first for a psum, then for a whole two-process training attempt that is crashed and resumed
and must end with the same bits as the uninterrupted two-process run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import (
    NO_CONTROLLER_SLURM_CONF,
    read_events,
    small_sft_inputs,
    small_sft_recipe,
    snakemake_command,
    worker_args,
    write_recipe,
)

from minifield import recipe as recipes

REPO = Path(__file__).resolve().parents[1]
SLURM_DIR = REPO / "tests" / "slurm"
VENV_BIN = Path(sys.executable).parent
PREFIX = os.environ.get("MINIFIELD_SLURM_PREFIX", "/tmp/minifield-slurm")
FAKE_GPUS = 2
RUN_TIMEOUT = 420  # seconds for one snakemake run (outer guard; the test budget is far below)


# ---------------------------------------------------------------- profile files (no cluster)


@pytest.mark.parametrize("profile", ["default", "slurm"])
def test_every_profile_entry_is_commented(profile):
    """Each top-level key of a profile is preceded by a comment saying what it does."""
    path = REPO / "profiles" / profile / "config.yaml"
    lines = path.read_text().splitlines()
    keys = list(yaml.safe_load(path.read_text()))
    assert keys, f"{path} has no entries"
    for key in keys:
        index = next(i for i, line in enumerate(lines) if line.startswith(f"{key}:"))
        assert index > 0 and lines[index - 1].startswith("#"), (
            f"{path}: entry '{key}' (line {index + 1}) has no comment line above it"
        )


def test_slurm_profile_maps_gpu_and_status_checks():
    profile = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
    assert profile["executor"] == "slurm"
    assert profile["slurm-init-seconds-before-status-checks"] <= 5
    assert profile["groups"] == {
        "validate": "prep",
        "hash_inputs": "prep",
        "prepare_source": "prep",
        "prepare": "prep",
        "qualify": "training",
        "train": "training",
    }
    # the GPU request comes from the train rule's `gpu` resource, never from a `gres`
    # default (the plugin rejects a rule that has both)
    flat = json.dumps(profile)
    assert "gres" not in flat.replace("gres/", "")


@pytest.mark.slow
def test_slurm_profile_dry_run_requests_gpu_for_train_only(tmp_path):
    """Without a cluster: Snakemake accepts every profile key (both profiles layered), groups
    the bookkeeping rules, and gives train the GPU request and its own runtime/memory; with
    `train.processes: 2`, qualify and train ask for 2 tasks as an `mpi` job (the executor
    submits --ntasks=2 and does not wrap the job in a one-task srun), with
    `evaluate.processes: 2` evaluate too, nothing else does."""
    workdir = _workspace(tmp_path, gpus=1, processes=2, evaluate_processes=2)
    profile = ("--profile", str(REPO / "profiles" / "slurm"))
    proc = _snakemake(workdir, *profile, "-n", _target(), cluster=False)
    output = _finish(proc, workdir, "dry-run")
    assert "workflow specific profile" in output and "profiles/default" in output
    assert "Group job prep" in output and "Group job training" in output
    blocks = {
        m.group(1): m.group(2)
        for m in re.finditer(r"rule (\w+):\n(.*?)(?=\n\s*\n|\Z)", output, re.S)
    }
    assert {"validate", "hash_inputs", "prepare", "qualify", "train", "evaluate"} <= set(blocks)
    for rule, block in blocks.items():
        resources = re.search(r"resources: (.*)", block)
        if rule == "all" or resources is None:
            continue
        items = dict(kv.split("=", 1) for kv in resources.group(1).split(", "))
        multi_process = (items.get("tasks"), items.get("mpi")) == ("2", "srun")
        assert multi_process == (rule in ("qualify", "train", "evaluate")), f"{rule}: {items}"
        if rule == "train":
            assert (items["gpu"], items["mem_mb"], items["runtime"]) == ("1", "4000", "120")
        elif rule == "qualify":
            assert (items["gpu"], items["mem_mb"], items["runtime"]) == ("1", "4000", "60")
        else:
            assert "gpu" not in items and items["runtime"] == "30", f"{rule}: {items}"


# ---------------------------------------------------------------- the cluster


def _skip(reason: str):
    print(f"SKIP slurm: {reason}", file=sys.stderr)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm_cluster():
    if os.geteuid() != 0:
        _skip("needs root to run slurmctld/slurmd/munged/slurmdbd (not root here)")
    if shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        _skip("no apt-get to install slurm-wlm, and slurmctld is not installed")
    t0 = time.monotonic()
    install = subprocess.run(
        ["bash", str(SLURM_DIR / "install-packages.sh")],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if install.returncode != 0:
        _skip(f"installing the SLURM packages failed: {(install.stderr or install.stdout)[-500:]}")
    t1 = time.monotonic()
    env = {**os.environ, "MINIFIELD_SLURM_PREFIX": PREFIX, "MINIFIELD_SLURM_GPUS": str(FAKE_GPUS)}
    start = subprocess.run(
        ["timeout", "-k", "10", "180", "bash", str(SLURM_DIR / "start-cluster.sh")],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    started = []
    for line in start.stdout.splitlines():
        if line.startswith("STARTED:"):
            started = line.split(":", 1)[1].split()
    t2 = time.monotonic()
    print(
        f"slurm fixture: packages {t1 - t0:.1f} s, cluster start {t2 - t1:.1f} s, "
        f"started: {started or 'nothing (already running)'}",
        file=sys.stderr,
    )
    try:
        if start.returncode != 0:
            pytest.fail(
                f"start-cluster.sh exited {start.returncode}\n{start.stdout[-2000:]}\n"
                f"{start.stderr[-2000:]}"
            )
        yield {"started": started, "env": env}
    finally:
        if started:
            stop = subprocess.run(
                ["bash", str(SLURM_DIR / "stop-cluster.sh"), *started],
                capture_output=True,
                text=True,
                env=env,
                timeout=120,
                check=False,
            )
            print(f"slurm fixture stop:\n{stop.stdout}", file=sys.stderr)
            for name in started:  # every daemon we started is gone
                assert not Path(PREFIX, "run", f"{name}.pid").exists(), (
                    f"{name} still has a PID file"
                )


def _target() -> str:
    """Only the chain up to evaluation: later stages (publication, capacity) are not what
    this test is about and would only add cluster jobs."""
    cdigest = recipes.load(REPO / "config" / "recipes" / "linear-demo.yaml").computation_digest
    return f"results/computations/{cdigest[:16]}/eval/metrics.json"


def _workspace(root: Path, gpus: int, processes: int = 1, evaluate_processes: int = 1) -> Path:
    """A fresh working directory with the demo recipe, its pinned data and a small config."""
    (root / "config" / "recipes").mkdir(parents=True)
    shutil.copytree(REPO / "data" / "linear", root / "data" / "linear")
    shutil.copy(REPO / "config" / "recipes" / "linear-demo.yaml", root / "config" / "recipes")
    config = {
        "recipes": ["config/recipes/linear-demo.yaml"],
        "input_root": "data",
        "work_dir": "work",
        # no retries: a failure must show, not be papered over by a second try
        "train": {"retries": 0, "request_gpus": gpus, "processes": processes},
        # the crash proof alone: preemption proofs are tested in test_proof.py
        "qualification": {"mode": "crash"},
        "evaluate": {"processes": evaluate_processes},
    }
    (root / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    return root


def _snakemake(workdir: Path, *args: str, cluster: bool = True) -> subprocess.Popen:
    """Snakemake in the background; ``cluster=False``: no controller is expected (a dry run),
    so scontrol is told there is none (``NO_CONTROLLER_SLURM_CONF``) rather than retrying."""
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    for key in [k for k in env if k.startswith("SLURM_")]:
        del env[key]  # a pytest run inside a SLURM job must not leak its job into ours
    if not cluster:
        env["SLURM_CONF"] = str(NO_CONTROLLER_SLURM_CONF)
    log = open(workdir / "snakemake.out", "w")  # noqa: SIM115 - closed by the caller via wait
    command = [
        "timeout",
        "-k",
        "10",
        str(RUN_TIMEOUT),
        *snakemake_command(workdir, *args, cores=None),
    ]
    return subprocess.Popen(command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, workdir: Path, what: str) -> str:
    code = proc.wait()
    output = (workdir / "snakemake.out").read_text()
    assert code == 0, f"{what} snakemake exited {code} (124 = timed out)\n{output[-5000:]}"
    return output


def _single(pattern: str, root: Path) -> Path:
    found = sorted(root.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} under {root}, found {found}"
    return found[0]


def _sacct(job_ids: list[str]) -> dict[str, dict]:
    """Accounting rows of the given jobs; slurmdbd records them asynchronously, so poll."""
    rows: dict[str, dict] = {}
    for _ in range(60):
        out = subprocess.run(
            ["sacct", "-X", "-n", "-P", "-j", ",".join(job_ids), "-o", "JobID,State,AllocTRES"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        ).stdout
        rows = {}
        for line in out.splitlines():
            job_id, state, tres = line.split("|")
            rows[job_id] = {"state": state, "tres": tres}
        if set(rows) == set(job_ids) and all(r["state"] == "COMPLETED" for r in rows.values()):
            break
        time.sleep(0.5)
    return rows


@pytest.mark.slurm
@pytest.mark.slow
def test_slurm_profile_runs_pipeline_like_local(slurm_cluster, tmp_path):
    local = _workspace(tmp_path / "local", gpus=0)
    cluster = _workspace(tmp_path / "cluster", gpus=1)

    # Both runs at once: the cluster run spends most of its time waiting for status checks.
    t0 = time.monotonic()
    local_proc = _snakemake(local, "--cores", "1", _target())
    cluster_proc = _snakemake(cluster, "--profile", str(REPO / "profiles" / "slurm"), _target())
    local_out = _finish(local_proc, local, "local")
    t_local = time.monotonic() - t0
    cluster_out = _finish(cluster_proc, cluster, "cluster")
    t_cluster = time.monotonic() - t0
    print(f"local run {t_local:.1f} s, cluster run {t_cluster:.1f} s", file=sys.stderr)
    assert "SLURM jobid" not in local_out

    # Every job of the cluster run went through sbatch, grouped as the profile says: the
    # bookkeeping rules as "prep", the recovery proof and the training as "training" (the GPU
    # job), evaluation on its own. Map each to its SLURM job id from the log.
    submitted = {}
    for job_id, rule, group in re.findall(
        r"submitted with SLURM jobid (\d+) \(log: \S*/slurm_logs/(?:rule_(\w+)/|group_(prep|training)_)",
        cluster_out,
    ):
        submitted[rule or group] = job_id
    assert set(submitted) == {"prep", "training", "evaluate"}, cluster_out[-3000:]
    for group, rules in (
        ("prep", ("validate", "hash_inputs", "prepare")),
        ("training", ("qualify", "train")),
    ):
        for rule in rules:
            assert re.search(rf"group_{group}_\S*{rule}", cluster_out), f"{rule} not in {group}"
    rows = _sacct(list(submitted.values()))
    assert set(rows) == set(submitted.values()), f"sacct rows {rows} for jobs {submitted}"
    for rule, job_id in submitted.items():
        assert rows[job_id]["state"] == "COMPLETED", f"{rule}: {rows[job_id]}"
        has_gpu = "gres/gpu=1" in rows[job_id]["tres"]
        assert has_gpu == (rule == "training"), f"{rule} job {job_id} AllocTRES {rows[job_id]}"

    # Same computation digest: computed independently from the recipe, and the same
    # directory in both runs.
    cdigest = recipes.load(REPO / "config" / "recipes" / "linear-demo.yaml").computation_digest
    results = {}
    for name, root in (("local", local), ("cluster", cluster)):
        result_path = root / "results" / "computations" / cdigest[:16] / "train" / "result.json"
        assert result_path.is_file(), f"{name}: no {result_path}"
        results[name] = json.loads(result_path.read_text())
        assert results[name]["status"] == "completed"
        assert results[name]["computation_digest"] == cdigest
        assert results[name]["steps_completed"] == 8
    assert results["cluster"]["final_state_hash"] == results["local"]["final_state_hash"]

    # The complete-state hash of every evaluated checkpoint agrees too, not only the last one.
    metrics = {
        name: json.loads(
            (root / "results" / "computations" / cdigest[:16] / "eval" / "metrics.json").read_text()
        )
        for name, root in (("local", local), ("cluster", cluster))
    }
    hashes = {
        name: [(c["step"], c["state_hash"]) for c in m["checkpoints"]]
        for name, m in metrics.items()
    }
    assert hashes["cluster"] == hashes["local"] and len(hashes["local"]) >= 2
    assert metrics["cluster"]["acceptance"] == metrics["local"]["acceptance"]

    # The GPU-requesting job saw exactly one of the node's devices.
    attempt = json.loads(
        _single(f"work/{cdigest[:16]}/attempts/*/*/attempt.json", cluster).read_text()
    )
    visible = attempt["environment"]["env"].get("CUDA_VISIBLE_DEVICES")
    assert visible is not None, (
        f"train job recorded no CUDA_VISIBLE_DEVICES: {attempt['environment']}"
    )
    devices = visible.split(",")
    assert len(devices) == 1 and devices[0] in {str(i) for i in range(FAKE_GPUS)}, visible


@pytest.mark.slow
@pytest.mark.slurm
def test_two_tasks_under_srun_initialise_jax_and_psum(slurm_cluster, tmp_path):
    """`srun -n 2`: each task finds the coordinator from SLURM's environment, JAX's distributed
    runtime starts, and a psum over the global 2-device mesh adds both processes' values."""
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    for key in [k for k in env if k.startswith(("SLURM_", "MINIFIELD_"))]:
        del env[key]
    proc = subprocess.run(
        ["timeout", "-k", "10", "240", "srun", "-N1", "-n2", "--mem-per-cpu=1000", "-t", "4",
         str(VENV_BIN / "python"), "-m", "minifield.supervision.distributed", "--probe"],
        capture_output=True, text=True, cwd=tmp_path, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, f"srun exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["process_id"] for r in reports) == [0, 1], proc.stdout
    for report in reports:
        assert report["source"] == "slurm"
        assert report["process_count"] == 2 and report["process_index"] == report["process_id"]
        assert report["device_count"] == 2 and report["local_device_count"] == 1
        assert report["psum"] == 1.0 + 2.0  # (0 + 1) + (1 + 1): both processes contributed
    assert len({r["coordinator"] for r in reports}) == 1


def _srun_two_tasks(out: Path, **options) -> subprocess.CompletedProcess:
    """``srun -n 2 minifield-worker --distributed ...`` (``options`` as ``worker_args`` takes
    them), each task's output in its own file."""
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    for key in [k for k in env if k.startswith(("SLURM_", "MINIFIELD_"))]:
        del env[key]
    env.update({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
    out.mkdir(parents=True)
    return subprocess.run(
        ["timeout", "-k", "10", "300", "srun", "-N1", "-n2", "--mem-per-cpu=1500", "-t", "5",
         "--output", str(out / "task-%t.out"), "--error", str(out / "task-%t.err"),
         str(VENV_BIN / "minifield-worker"), *worker_args("--distributed", **options)],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip


def _task_logs(out: Path) -> str:
    return "\n".join(
        f"--- {path.name}:\n{path.read_text()[-2000:]}" for path in sorted(out.glob("task-*"))
    )


@pytest.mark.slurm
@pytest.mark.slow
def test_two_process_training_under_srun_resumes_bit_identically(slurm_cluster, tmp_path):
    inputs = small_sft_inputs(tmp_path)
    recipe = small_sft_recipe(
        inputs["pins"],
        "srun-test",
        2,
        limits={"max_steps": 8},
        checkpoint={"every_steps": 2, "keep": 4},
    )
    recipe_path = write_recipe(tmp_path / "recipe.json", recipe)
    output_root = tmp_path / "attempts"
    common = {
        "job": recipe_path,
        "input_root": inputs["input_root"],
        "output_root": output_root,
        "record_state_hashes": True,
    }

    def new_attempt(before: set) -> Path:
        (attempt,) = set((output_root / "srun-test").iterdir()) - before
        return attempt

    def hashes(attempt: Path) -> dict[int, str]:
        events = read_events(attempt / "events.jsonl")
        return {e["step"]: e["state_hash"] for e in events if e["type"] == "update"}

    # 1. uninterrupted, two processes
    proc = _srun_two_tasks(tmp_path / "whole", **common)
    assert proc.returncode == 0, f"srun exited {proc.returncode}\n{_task_logs(tmp_path / 'whole')}"
    whole = new_attempt(set())
    result = json.loads((whole / "result.json").read_text())
    assert result["status"] == "completed" and result["environment"]["process_count"] == 2
    processes = json.loads((whole / "attempt.json").read_text())["processes"]
    assert processes["count"] == 2 and processes["source"] == "slurm"
    # task 0 streams the events; task 1 writes none
    task0 = (tmp_path / "whole" / "task-0.out").read_text()
    assert '"type": "completed"' in task0
    assert '"type"' not in (tmp_path / "whole" / "task-1.out").read_text()
    assert len(hashes(whole)) == 8

    # 2. both tasks crash right after update 5: the checkpoint of step 4 is the last commit
    proc = _srun_two_tasks(tmp_path / "crash", **common, fail_after_step=5)
    assert proc.returncode != 0, _task_logs(tmp_path / "crash")
    crashed = new_attempt({whole})
    assert not (crashed / "result.json").exists()  # a hard exit leaves no result
    committed = sorted(p.name for p in (crashed / "checkpoints").iterdir())
    assert committed == ["step-00000002", "step-00000004"]

    # 3. resumed by two new tasks: the same bits as the uninterrupted run, update by update
    proc = _srun_two_tasks(tmp_path / "resume", **common, resume_from=crashed)
    assert proc.returncode == 0, f"srun exited {proc.returncode}\n{_task_logs(tmp_path / 'resume')}"
    resumed = new_attempt({whole, crashed})
    events = read_events(resumed / "events.jsonl")
    assert next(e for e in events if e["type"] == "restored")["step"] == 4
    assert {s: h for s, h in hashes(crashed).items() if s <= 4} == {
        s: h for s, h in hashes(whole).items() if s <= 4
    }
    assert hashes(resumed) == {s: h for s, h in hashes(whole).items() if s > 4}
    final = json.loads((resumed / "result.json").read_text())
    assert final["status"] == "completed" and final["steps_completed"] == 8
    assert final["final_state_hash"] == result["final_state_hash"]


@pytest.mark.slow
@pytest.mark.slurm
def test_launcher_preempts_a_two_task_step_gracefully(slurm_cluster, tmp_path):
    """SIGTERM to ``minifield.supervision.launch`` inside an allocation (what a supervisor sends) reaches
    the srun step's tasks as SIGTERM — srun would kill them outright — so both tasks commit
    a checkpoint at the same step and the launch exits 3 (preempted), whichever task leaves
    first (with ``--kill-on-bad-exit`` the first exit 3 killed the other: 143)."""
    inputs = small_sft_inputs(tmp_path)
    recipe = small_sft_recipe(
        inputs["pins"], "launch-test", 2,
        limits={"max_steps": 400}, checkpoint={"every_steps": 100, "keep": 2},
    )  # fmt: skip
    recipe_path = write_recipe(tmp_path / "recipe.json", recipe)
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    for key in [k for k in env if k.startswith(("SLURM_", "MINIFIELD_"))]:
        del env[key]
    env.update({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
    python = str(VENV_BIN / "python")
    stderr = tmp_path / "launch.err"
    with open(stderr, "w") as err:
        proc = subprocess.Popen(
            ["timeout", "-k", "10", "240", "salloc", "-n2", "--mem-per-cpu=1500", "-t", "5",
             python, "-m", "minifield.supervision.launch", "--processes", "2", "--",
             python, "-m", "minifield.worker",
             *worker_args("--distributed", job=recipe_path, input_root=inputs["input_root"],
                          output_root=tmp_path / "out", stall_after_step=3, stall_seconds=5)],
            stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=tmp_path,
        )  # fmt: skip
    deadline = time.monotonic() + 180
    while "update 3/" not in stderr.read_text():
        assert time.monotonic() < deadline and proc.poll() is None, stderr.read_text()[-3000:]
        time.sleep(0.1)
    launchers = subprocess.run(
        # this test's launcher only: its command line names this test's output root (another
        # pytest worker may run a launcher of its own at the same time)
        ["pgrep", "-f", "-n", f"{python} -m minifield.supervision.launch --processes 2 .*{tmp_path}/out"],
        capture_output=True, text=True, check=False,
    ).stdout.split()  # fmt: skip
    assert len(launchers) == 1, "launcher process not found"
    os.kill(int(launchers[0]), signal.SIGTERM)
    assert proc.wait(timeout=120) == 3, stderr.read_text()[-3000:]
    assert "srun in SLURM job" in stderr.read_text()
    (attempt,) = (tmp_path / "out" / "launch-test").iterdir()
    result = json.loads((attempt / "result.json").read_text())
    assert result["status"] == "preempted" and result["steps_completed"] == 3
    preempted = next(e for e in read_events(attempt / "events.jsonl") if e["type"] == "preempted")
    assert preempted["step"] == 3 and preempted["signal"] == "SIGTERM"
    assert (attempt / "checkpoints" / "step-00000003" / "manifest.json").is_file()


@pytest.mark.slow
@pytest.mark.slurm
def test_under_srun_a_failed_task_leaves_its_peer_the_grace_then_the_step_ends(
    slurm_cluster, tmp_path
):
    """Task 1 exits 5 at once, task 0 would sleep for ten minutes: srun's ``--wait`` (the
    launcher's grace) ends the step a few seconds later, and the launch reports a failure."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MINIFIELD_"))}
    python = str(VENV_BIN / "python")
    task = "import os, sys, time; sys.exit(5) if os.environ['SLURM_PROCID'] == '1' else time.sleep(600)"
    started = time.monotonic()
    proc = subprocess.run(
        ["timeout", "-k", "10", "120", "salloc", "-n2", "--mem-per-cpu=500", "-t", "3",
         python, "-m", "minifield.supervision.launch", "--processes", "2", "--grace-seconds", "3",
         "--", python, "-c", task],
        capture_output=True, text=True, env=env, cwd=tmp_path, check=False,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert "srun in SLURM job" in proc.stderr, proc.stderr
    # srun ends the step after the grace: task 0 killed (137, as a local launch reports a
    # process 0 killed after the grace), well before the 600 s sleep or the 120 s timeout
    assert "task 1: Exited with exit code 5" in proc.stderr, proc.stderr
    assert proc.returncode == 137 and elapsed < 60, (proc.returncode, elapsed, proc.stderr)
