"""The pipeline's light stages stay light: a Snakemake job that validates, hashes or prepares
inputs does not import ``requests`` (whose ``chardet`` costs ~2.5 s of CPU to import), and the
stages that supervise workers (``qualify``, ``train``) do not import JAX (~2 s): each job is
a fresh process, so an import they do not use is paid again in every job of every run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: the modules the workflow's scripts import (workflow/scripts/*.py), with what each must not load
STAGES = {
    "minifield.pipeline.preparation": ("requests", "jax"),
    "minifield.pipeline.chains": ("requests", "jax"),
    "minifield.pipeline.training": ("requests", "jax"),
    "minifield.proof.prove": ("requests", "jax"),
    "minifield.observe.report.results": ("requests", "jax"),
    "minifield.observe.summarize": ("requests", "jax"),
    "minifield.store": ("requests", "jax"),
}


@pytest.mark.slow
@pytest.mark.parametrize("module", sorted(STAGES))
def test_a_stage_module_does_not_import_what_it_does_not_use(module):
    probe = f"import importlib, json, sys; importlib.import_module({module!r}); print(json.dumps(sorted(sys.modules)))"
    loaded = set(json.loads(subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout))  # fmt: skip
    assert module in loaded  # the probe really imported it
    for heavy in STAGES[module]:
        assert heavy not in loaded, f"importing {module} loads {heavy}"
