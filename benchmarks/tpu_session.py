"""Every chip check of the pipeline on a TPU, in three parts of under ten minutes, one JSON file.

A TPU machine is lent 30 minutes at a time, each call of at most ten, and starts bare: each
part installs what the pipeline needs (``tpu_wheels.py``: the carried wheels, the host's own
index), runs, and merges its figures into one JSON file (``--merge`` the one the last part
wrote, ``--out`` where this one goes); docs/tpu.md is written from it::

    python3 benchmarks/tpu_session.py --part tests    --merge docs/tpu-session.json --out $OUT/tpu-session.json
    python3 benchmarks/tpu_session.py --part pipeline --merge docs/tpu-session.json --out $OUT/tpu-session.json
    python3 benchmarks/tpu_session.py --part check    --merge docs/tpu-session.json --out $OUT/tpu-session.json

(``.whl-tpu`` carried: ``python3 benchmarks/tpu_wheels.py download`` here first.)

- ``tests``: the numeric tests in one process (pytest holds the chip; tests that start a
  process are skipped there), counts and each failure's message;
- ``pipeline``: two real Snakemake runs with the chip as one resource (config ``tpu: 1``):
  the Llama SFT demo and the GRPO learning chain, their recipes as shipped with
  ``runtime.backend: tpu`` added; each run's exit, time, the time of each job, the closing
  summary, each computation's proof and evaluation, and a second ``snakemake -n`` that must
  find nothing to do;
- ``check``: the device check's sections (``--check-args``), its JSON embedded.

This process is a parent: it never imports JAX (only a worker opens the accelerator), and
starts every child with the host's JAX first on ``PYTHONPATH``. ``--backend cpu`` runs the
pipeline part on a CPU (the suite does not; a developer checks the driver so).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SITE = Path("/tmp/site")
#: the numeric tests, as docs/tpu.md lists them ("Tests on the chip")
TESTS = ["tests/test_model.py", "tests/test_rl_objective.py", "tests/test_grouped_matmul.py",
         "tests/test_execution.py", "tests/test_grad_accum.py", "tests/test_cross_entropy.py",
         "tests/test_precision.py", "tests/test_device_claim.py", "tests/test_tpu_attention.py"]  # fmt: skip
#: what the tests need beyond the pipeline, from the host's own index
TEST_PACKAGES = ["pytest-xdist", "execnet"]
#: the pipelines: (name, recipes as shipped, chains from → to)
PIPELINES = {
    "llama_demo": (["config/recipes/llama-sft-demo.yaml"], []),
    "grpo_learn": (
        ["config/recipes/llama-sft-weak.yaml"],
        [("config/recipes/llama-sft-weak.yaml", "config/recipes/grpo-learn.yaml")],
    ),
}
CHIP_DIR = Path("work/tpu-session")  # under the repository's ignored work/


def log(message: str) -> None:
    print(f"[tpu-session {dt.datetime.now():%H:%M:%S}] {message}", file=sys.stderr, flush=True)


def child_env() -> dict[str, str]:
    """The children's environment: the host's JAX first, then the project and what was
    installed for it; this process's own JAX setting is not theirs to inherit."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(":") if p]
    env["PYTHONPATH"] = ":".join([*paths, str(REPO / "src"), str(SITE)])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def setup(extra: list[str]) -> dict:
    """Install the carried wheels and the host index's packages (once per machine)."""
    report = SITE / "installed.json"
    sys.path.append(str(SITE))
    if not report.is_file():
        started = time.monotonic()
        command = [sys.executable, str(REPO / "benchmarks" / "tpu_wheels.py"), "install",
                   "--target", str(SITE), "--report", str(report)]  # fmt: skip
        subprocess.run(command, check=True)
        log(f"installed into {SITE} in {time.monotonic() - started:.0f} s")
    for name in extra:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--isolated", "-q", "--no-deps",
             "--no-cache-dir", "--disable-pip-version-check", "--only-binary=:all:", "--index-url", "file:///opt/pypi/simple", "--target",
             str(SITE), name],
            check=False, env={**os.environ, "PIP_CONFIG_FILE": "/dev/null"},
        )  # fmt: skip
    return json.loads(report.read_text()) if report.is_file() else {}


def part_tests(args) -> dict:
    setup(TEST_PACKAGES)
    junit = CHIP_DIR / "tests.xml"
    junit.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pytest", "-n0", "-p", "no:cacheprovider", "-m",
               "not needs_host", f"--junitxml={junit}", "-q", *TESTS]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.run(command, env=child_env(), capture_output=True, text=True,
                          timeout=args.timeout)  # fmt: skip
    out = {"command": " ".join(command[1:]), "exit": proc.returncode,
           "seconds": round(time.monotonic() - started, 1), "tail": proc.stdout[-3000:]}  # fmt: skip
    if junit.is_file():
        out.update(_junit(junit))
    return out


def _junit(path: Path) -> dict:
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in suite.iter("testcase"):
        for bad in (*case.findall("failure"), *case.findall("error")):
            name = f"{case.get('classname')}::{case.get('name')}"
            failed.append({"test": name, "message": (bad.get("message") or "")[:600]})
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"counts": counts, "failed": failed}


def tpu_recipe(shipped: str, backend: str) -> str:
    """The shipped recipe with ``runtime.backend`` set, under the session's directory."""
    import yaml  # installed by setup() on a bare TPU host

    data = yaml.safe_load((REPO / shipped).read_text())
    data.setdefault("runtime", {})["backend"] = backend
    path = CHIP_DIR / "recipes" / Path(shipped).name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


_STAMP = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]$")
_RULE = re.compile(r"^(?:local)?rule (\w+):$")
_JOBID = re.compile(r"^\s+jobid: (\d+)$")
_DONE = re.compile(r"^Finished jobid: (\d+) \(Rule: (\w+)\)$")


def job_seconds(text: str) -> list[dict]:
    """Each job's rule, id and seconds, from Snakemake's own log (its stamps are to 1 s)."""
    now, rule, started, jobs = None, None, {}, []
    for line in text.splitlines():
        if m := _STAMP.match(line.strip()):
            now = dt.datetime.strptime(m.group(1), "%a %b %d %H:%M:%S %Y")
        elif m := _RULE.match(line.strip()):
            rule = m.group(1)
        elif (m := _JOBID.match(line)) and rule is not None and now is not None:
            started[m.group(1)] = (rule, now)
            rule = None
        elif (m := _DONE.match(line.strip())) and m.group(1) in started and now is not None:
            name, began = started.pop(m.group(1))
            jobs.append({"rule": name, "jobid": int(m.group(1)),
                         "seconds": (now - began).total_seconds()})  # fmt: skip
    return jobs


def _pipeline(name: str, backend: str, timeout: float) -> dict:
    recipes, chains = PIPELINES[name]
    tpu = {shipped: tpu_recipe(shipped, backend) for shipped in {*recipes, *sum(chains, ())}}
    config = {"recipes": [tpu[r] for r in recipes],
              "chains": [{"from": tpu[a], "to": tpu[b]} for a, b in chains],
              "tpu": 1 if backend == "tpu" else 0}  # fmt: skip
    path = CHIP_DIR / f"{name}.json"
    path.write_text(json.dumps(config, indent=1))
    command = [sys.executable, "-m", "snakemake", "--cores", "4", "--configfile", str(path)]
    log(f"{name}: {' '.join(command[1:])}")
    started = time.monotonic()
    proc = subprocess.run(command, cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    seconds = time.monotonic() - started
    (CHIP_DIR / f"{name}.log").write_text(proc.stdout + proc.stderr)
    again = subprocess.run([*command, "-n"], cwd=REPO, env=child_env(), capture_output=True,
                           text=True, timeout=300)  # fmt: skip
    log(f"{name}: exit {proc.returncode} in {seconds:.0f} s")
    return {
        "command": " ".join(command[1:]), "config": config, "exit": proc.returncode,
        "seconds": round(seconds, 1), "jobs": job_seconds(proc.stdout + proc.stderr),
        "tail": (proc.stdout + proc.stderr)[-4000:],
        "rerun_nothing_to_do": again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr,
        "computations": computations(),
    }  # fmt: skip


def computations() -> dict:
    """Each computation's proof, evaluation, result and publication, as the run left them."""
    out = {}
    for directory in sorted((REPO / "results" / "computations").glob("*")):
        record = {}
        for key, rel in (("proof", "qualification/proof.json"), ("result", "train/result.json"),
                         ("metrics", "eval/metrics.json"), ("publication", "publication.json")):  # fmt: skip
            path = directory / rel
            record[key] = json.loads(path.read_text()) if path.is_file() else None
        proof, result, metrics = record["proof"], record["result"], record["metrics"]
        out[directory.name] = {
            "job_id": (result or {}).get("job_id"),
            "proof_passed": (proof or {}).get("passed"),
            "proof_mode": ((proof or {}).get("settings") or {}).get("mode"),
            "proof_diagnosis": (proof or {}).get("diagnosis"),
            "status": (result or {}).get("status"),
            "backend": ((result or {}).get("environment") or {}).get("backend"),
            "device_kind": ((result or {}).get("environment") or {}).get("device_kind"),
            "final_state_hash": (result or {}).get("final_state_hash"),
            "selected_dev": (metrics or {}).get("selected_dev"),
            "test": (metrics or {}).get("test"),
            "acceptance": ((metrics or {}).get("acceptance") or {}).get("passed"),
            "published": record["publication"] is not None,
        }
    return out


def part_pipeline(args) -> dict:
    if args.backend == "tpu":  # on a CPU the developer's own environment has it all
        setup([])
    out = {}
    for name in args.pipelines:
        shutil.rmtree(REPO / "results", ignore_errors=True)  # one pipeline's records at a time
        try:
            out[name] = _pipeline(name, args.backend, args.timeout)
        except subprocess.TimeoutExpired as exc:
            out[name] = {"exit": None, "error": f"timed out after {exc.timeout} s"}
    return out


def part_check(args) -> dict:
    setup([])
    target = CHIP_DIR / "device-check.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(REPO / "benchmarks" / "device_check"), *args.check_args,
               "--out", str(target)]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.run(command, cwd=REPO, env=child_env(), timeout=args.timeout, check=False)
    return {
        "command": " ".join(command[1:]), "exit": proc.returncode,
        "seconds": round(time.monotonic() - started, 1),
        "report": json.loads(target.read_text()) if target.is_file() else None,
    }  # fmt: skip


PARTS = {"tests": part_tests, "pipeline": part_pipeline, "check": part_check}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=PARTS, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--merge", type=Path, help="the JSON an earlier part wrote")
    parser.add_argument("--backend", default="tpu", choices=("tpu", "cpu"))
    parser.add_argument("--commit", help="the tree's commit (a copy without .git: say it)")
    parser.add_argument("--pipelines", nargs="+", default=list(PIPELINES), choices=PIPELINES)
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds for the part")
    parser.add_argument("--check-args", nargs=argparse.REMAINDER, default=[],
                        help="the device check's arguments (last on the line)")  # fmt: skip
    args = parser.parse_args(argv)
    merged = json.loads(args.merge.read_text()) if args.merge and args.merge.is_file() else {}
    revision = (
        args.commit
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    )
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    figures = PARTS[args.part](args)
    stamp = {"started": started, "commit": revision or None}
    if args.part == "pipeline":  # each pipeline's record its own: a later run adds or replaces
        merged[args.part] = {**merged.get(args.part, {}),
                             **{name: {**stamp, **run} for name, run in figures.items()}}  # fmt: skip
    else:
        merged[args.part] = {**stamp, **figures}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    log(f"{args.part}: written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
