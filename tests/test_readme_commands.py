"""What the README shows a newcomer runs as shown.

Slow tier: the README's first command on a fresh copy of the tracked files (the session
fixture ``readme_pipeline_run``: the default demo recipes through the whole pipeline and the
report), every path its "What a run gives you" block lists, and its ``minifield generate``
lines run as written against that run's exports. Fast tier: every command line of the README's
code blocks is run by a named test (the README's test command by CI's ``.ci/run``), so a
command added to the README without a test that runs it fails here.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import LIGHT_XLA_FLAGS, NO_CONTROLLER_SLURM_CONF, REPO, readme_first_command

README = REPO / "README.md"

#: each command line of a README code block (by a pattern of its start) -> the tests that run
#: it as a user would, "file::function"
RUN_BY = {
    r"python3 -m pip install uv==\S+ && uv sync --locked --compile-bytecode && uv run --locked "
    r"snakemake --cores 2 && uv run --locked snakemake --report": [
        "tests/test_readme_commands.py::test_the_first_command_makes_every_result_the_readme_lists"
    ],
    r"python3 -m pip install uv==\S+ && uv sync --locked --compile-bytecode && uv run --locked "
    r"pytest$": ["tests/test_readme_commands.py::test_ci_runs_the_readme_test_command"],
    r"uv run --locked minifield recipe new ": [
        "tests/test_recipe_new.py::test_own_base_and_data_through_the_pipeline_to_a_trained_export"
    ],
    r"--base data/my-base |--test data/mine/test.jsonl ": [
        "tests/test_recipe_new.py::test_own_base_and_data_through_the_pipeline_to_a_trained_export"
    ],
    r"printf 'recipes:": [
        "tests/test_recipe_new.py::test_own_base_and_data_through_the_pipeline_to_a_trained_export"
    ],
    r"uv run --locked snakemake --cores 2 --configfile config/mine.yaml": [
        "tests/test_recipe_new.py::test_own_base_and_data_through_the_pipeline_to_a_trained_export"
    ],
    r"uv run --locked minifield generate ": [
        "tests/test_readme_commands.py::test_the_generate_lines_run_as_written"
    ],
    r"uv run --locked snakemake --cores 2 +#": [
        "tests/test_readme_commands.py::test_the_first_command_makes_every_result_the_readme_lists"
    ],
    # a GPU workstation: the run itself needs a GPU (CI has none; docs/device-check.md is the
    # prepared device check); here, the GPU request of the workflow and the worker's GPU flags
    r"uv sync --locked --extra cuda && uv run --locked snakemake": [
        "tests/test_slurm_profile.py::test_slurm_profile_dry_run_requests_gpu_for_train_only",
        "tests/test_gpu_determinism.py::test_a_gpu_run_gets_the_determinism_flags_after_the_users_own",
    ],
    # one TPU chip: the run itself needs the chip (CI has none; docs/tpu.md has the chip's runs
    # by benchmarks/tpu_session.py); here, which jobs request it and that no other does
    r"uv run --locked snakemake --cores 4 --config tpu=1": [
        "tests/test_tpu_pipeline.py::test_jobs_that_open_the_chip_request_it_and_no_others"
    ],
    r"uv run --locked snakemake --profile profiles/slurm": [
        "tests/test_slurm_profile.py::test_slurm_profile_runs_pipeline_like_local"
    ],
    r"minifield-worker --job JOB --input-root IN --output-root OUT": [
        "tests/test_worker_cli.py::test_completed_run_writes_result_events_checkpoints_and_export"
    ],
}
#: lines of a code block that are commands (the rest are paths, output and Python)
COMMAND = re.compile(r"^(uv |python3 |minifield|snakemake |printf )")


def readme_command_lines() -> list[str]:
    """Every command line of the README's indented code blocks, continuation lines joined."""
    lines, pending = [], ""
    for raw in README.read_text(encoding="utf-8").splitlines():
        if not raw.startswith("    "):
            continue
        text = raw.strip()
        if pending:
            pending += " " + text
        elif COMMAND.match(text):
            pending = text
        if pending and not pending.endswith("\\"):
            lines.append(pending)
            pending = ""
    return lines


def _defined(nodeid: str) -> bool:
    path, name = nodeid.split("::")
    tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


def test_every_readme_command_is_run_by_a_named_test():
    commands = readme_command_lines()
    assert len(commands) >= 10, commands  # the parser sees the README's blocks
    unmapped = [c for c in commands if not any(re.search(p, c) for p in RUN_BY)]
    assert not unmapped, f"README commands that no test runs: {unmapped}"
    missing = [t for tests in RUN_BY.values() for t in tests if not _defined(t)]
    assert not missing, f"tests named in RUN_BY that do not exist: {missing}"


def test_ci_runs_the_readme_test_command():
    command = next(c for c in readme_command_lines() if c.endswith("uv run --locked pytest"))
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert command in ci, "CI's .ci/run must run the README's test command as written"


# -- the README's first command, run --------------------------------------------------------


def _computations(workdir: Path) -> dict[str, Path]:
    """recipe file -> its computation directory, for the recipes the default config runs."""
    import minifield

    config = yaml.safe_load((workdir / "config" / "config.yaml").read_text())
    out = {}
    for recipe in config["recipes"]:
        digest = minifield.validate(workdir / recipe).computation_digest
        out[recipe] = workdir / "results" / "computations" / digest[:16]
    return out


def _listed_paths() -> list[str]:
    """The paths of the README's "What a run gives you" block."""
    section = README.read_text(encoding="utf-8").split("## What a run gives you", 1)[1]
    section = section.split("\n## ", 1)[0]
    return [
        line.split()[0]
        for line in section.splitlines()
        if line.startswith("    results/") or line.startswith("    work/")
    ]


@pytest.mark.slow
def test_the_first_command_makes_every_result_the_readme_lists(readme_pipeline_run):
    workdir = readme_pipeline_run
    listed = _listed_paths()
    assert len(listed) >= 15, listed
    assert (workdir / "results" / "report.html").stat().st_size > 0
    for recipe, directory in _computations(workdir).items():
        result = json.loads((directory / "train" / "result.json").read_text())
        assert result["status"] == "completed", (recipe, result["error"])
        proof = json.loads((directory / "qualification" / "proof.json").read_text())
        assert proof["passed"] is True, (recipe, proof["diagnosis"])
        validation = json.loads((directory / "validation.json").read_text())
        edigest = validation["examples_digest"][:16]
        cdigest = directory.name
        for path in listed:
            if "{sdigest}" in path:  # a mixture's sources: none of the demo recipes mixes
                continue
            if "{qdigest}" in path:  # a quantized LoRA base: no demo recipe quantizes one
                continue
            concrete = path.replace("{cdigest}", cdigest).replace("{edigest}", edigest)
            if "<job_id>" in concrete:  # work/{cdigest}/attempts/<job_id>/<attempt_id>/
                attempts = list((workdir / concrete.split("<job_id>")[0]).glob("*/*/events.jsonl"))
                assert attempts, (recipe, concrete)
                for events in attempts:  # compiled as users' runs are (tests/conftest.py)
                    env = json.loads((events.parent / "attempt.json").read_text())
                    env = env["environment"]["env"]
                    assert env.get("JAX_DISABLE_MOST_OPTIMIZATIONS") == "0", (events, env)
                    light = set(env.get("XLA_FLAGS", "").split()) & set(LIGHT_XLA_FLAGS)
                    assert not light, (events, env)
                continue
            assert (workdir / concrete).exists(), (recipe, concrete)
    # the first command's run again: nothing to do (a dry run writes nothing of the run's)
    again = subprocess.run(
        [sys.executable, "-m", *readme_first_command()[0], "-n"],
        cwd=workdir, capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "SLURM_CONF": str(NO_CONTROLLER_SLURM_CONF)},
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Nothing to be done" in again.stdout + again.stderr, again.stdout[-3000:]


def _generate_lines() -> list[str]:
    return [
        c for c in readme_command_lines() if c.startswith("uv run --locked minifield generate ")
    ]


@pytest.mark.slow
def test_the_generate_lines_run_as_written(readme_pipeline_run):
    """Each line with ``<cdigest>`` filled in for the demo it names (the Llama demo's when its
    comment says so, else the default ``sft-demo``), ``uv run --locked`` being this
    environment."""
    computations = _computations(readme_pipeline_run)
    digests = {
        "llama": computations["config/recipes/llama-sft-demo.yaml"].name,
        "sft": computations["config/recipes/sft-demo.yaml"].name,
    }
    lines = _generate_lines()
    assert len(lines) == 4, lines
    minifield_cli = Path(sys.executable).with_name("minifield")
    for line in lines:
        command, _, comment = line.partition("#")
        demo = "llama" if "Llama demo" in comment else "sft"
        argv = shlex.split(command.replace("<cdigest>", digests[demo]))
        assert argv[:4] == ["uv", "run", "--locked", "minifield"], argv
        proc = subprocess.run(
            [str(minifield_cli), *argv[4:], "--max-new-tokens", "8"],
            cwd=readme_pipeline_run,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (line, proc.stderr)
        assert proc.stdout.endswith("\n"), (line, proc.stdout)
