"""Every benchmark still imports: a module the library moved or renamed fails here, not on the
day someone runs the benchmark (``preference_demo_seeds.py`` imported ``chain_base`` from the
package it had left). Imported, never run (each runs only as ``__main__``), in one process of
their own: several put ``benchmarks/`` or ``benchmarks/device_check/`` first on ``sys.path``,
which this process must not inherit. Two benchmarks that had rotted past their imports also run
here at small sizes, each in a process of its own: ``grpo_update.py`` and
``prepare_conversations.py``."""

import json
import re
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.slow  # starts a process

#: imports each file under its own name with ``benchmarks/`` on the path, as ``python
#: benchmarks/NAME.py`` would, and prints the ones that failed with their error
IMPORT_EACH = """
import importlib, importlib.util, json, sys, traceback
from pathlib import Path
root = Path(sys.argv[1])
sys.path.insert(0, str(root))
failed = {}
for path in sorted(root.glob("*.py")) + sorted(root.glob("*/__init__.py")):
    name = path.stem if path.name != "__init__.py" else path.parent.name
    try:
        if path.name == "__init__.py":
            importlib.import_module(name)
        else:
            spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
            module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
    except Exception:
        failed[str(path.relative_to(root))] = traceback.format_exc(limit=-2)
print(json.dumps(failed))
"""


def test_every_benchmark_imports():
    benchmarks = REPO / "benchmarks"
    assert len(list(benchmarks.glob("*.py"))) > 40  # the glob sees them
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH, str(benchmarks)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = proc.stdout.strip().splitlines()[-1]
    assert failed == "{}", failed


#: ``grpo_update.py``'s comparison, then its ``--split``, at the grpo demo's tiny model (what the
#: demo's 400 updates run), one repeat each, by its own ``main`` in one process: the typed batch
#: the update takes since 86213ae had left both calling it with a dict
GRPO_UPDATE_TINY = """
import sys
sys.path.insert(0, sys.argv[1])
import grpo_update
sys.argv = ["grpo_update.py", *sys.argv[2:]]
grpo_update.main()
sys.argv.append("--split")
grpo_update.main()
"""
TINY_SHAPE = "--vocab 33 --d-model 64 --heads 4 --kv-heads 2 --ffn 192 --layers 2 --dtype float32"


def test_the_grpo_update_benchmark_runs_and_its_loops_agree():
    proc = subprocess.run(
        [sys.executable, "-c", GRPO_UPDATE_TINY, str(REPO / "benchmarks"), *TINY_SHAPE.split(),
         "--prompts", "2", "--G", "4", "--prompt-len", "8", "--new", "8", "--repeats", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the first update from the same parameters: the two loops' gradient norms agree
    (relative,) = re.findall(r"relative difference ([0-9.e+-]+)\)", proc.stdout)
    assert float(relative) < 1e-5, proc.stdout
    assert "policy_seconds" in proc.stdout and "minifield / minimal (CPU)" in proc.stdout


def test_the_prepare_benchmark_runs_and_packs_its_conversations():
    # `packed.arrays` had outlived the typed rows (6fe5a46) here
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "prepare_conversations.py"), "--n", "20",
         "--repeat", "1", "--seq-len", "512"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["conversations"] == 20 and result["trained_tokens"] > 0
    assert len(result["prepared_sha256"]) == 64
