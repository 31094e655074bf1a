"""The conda environment specs agree with uv.lock, and every rule that runs code uses one."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
ENV_FILE = REPO / "envs" / "minifield.yaml"
PYTHON = "3.11"
#: the environment the conda spec describes (conda-forge Linux, the project's Python)
TARGET = {"python_full_version": f"{PYTHON}.0", "python_version": PYTHON, "sys_platform": "linux"}
#: packages whose versions change the bits of a training run: they must be pinned
KEY_PACKAGES = {"jax", "jaxlib", "optax", "numpy", "ml-dtypes", "scipy"}


def locked_versions() -> dict[str, str]:
    """Package -> version that uv.lock resolves for Python 3.11 on Linux.

    A package can appear once per Python-version fork; its ``resolution-markers``
    say which fork, so pick the entry whose markers match the target.
    """
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    versions: dict[str, str] = {}
    for package in lock["package"]:
        markers = package.get("resolution-markers")
        if markers and not any(Marker(m).evaluate(TARGET) for m in markers):
            continue
        name = canonicalize_name(package["name"])
        assert name not in versions, f"uv.lock resolves {name} twice for Python {PYTHON}/Linux"
        versions[name] = package["version"]
    return versions


def env_spec(env_file: Path = ENV_FILE) -> tuple[list[str], dict[str, str]]:
    spec = yaml.safe_load(env_file.read_text())
    conda, pip = [], {}
    for dependency in spec["dependencies"]:
        if isinstance(dependency, dict):
            for line in dependency["pip"]:
                requirement = Requirement(line)
                specifier = str(requirement.specifier)
                assert specifier.startswith("=="), f"{env_file}: '{line}' is not an exact pin"
                pip[canonicalize_name(requirement.name)] = specifier[2:]
        else:
            conda.append(dependency)
    return conda, pip


def test_env_pins_match_the_lock_file():
    locked = locked_versions()
    conda, pip = env_spec()
    assert f"python={PYTHON}" in conda, f"{ENV_FILE}: expected python={PYTHON}, got {conda}"
    mismatched = {
        name: {"env": version, "uv.lock": locked.get(name)}
        for name, version in pip.items()
        if locked.get(name) != version
    }
    assert not mismatched, f"{ENV_FILE} disagrees with uv.lock: {mismatched}"


def test_env_pins_every_runtime_dependency_of_the_project():
    """Every dependency in pyproject.toml (except Snakemake itself) and the bit-defining
    packages are pinned in the environment."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    required = {canonicalize_name(Requirement(line).name) for line in project["dependencies"]} - {
        "snakemake",
        "snakemake-executor-plugin-slurm",
    }
    required |= KEY_PACKAGES
    _, pip = env_spec()
    missing = sorted(required - set(pip))
    assert not missing, f"{ENV_FILE} does not pin {missing}"


def test_post_deploy_script_installs_the_project():
    script = ENV_FILE.with_name("minifield.post-deploy.sh")
    text = script.read_text()
    assert "--no-deps" in text and "pip install" in text


def _rules(path: Path):
    """(name, body) of every rule in a Snakefile-syntax file."""
    text = path.read_text()
    starts = [m for m in re.finditer(r"^(?:rule|checkpoint) (\w+):", text, re.M)]
    for i, match in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        yield match.group(1), text[match.end() : end]


@pytest.mark.parametrize(
    "path",
    [REPO / "Snakefile", *sorted((REPO / "workflow" / "rules").glob("*.smk"))],
    ids=lambda p: p.name,
)
def test_every_rule_that_runs_code_declares_the_conda_env(path):
    for name, body in _rules(path):
        if not re.search(r"^    (script|shell|notebook|wrapper):", body, re.M):
            continue  # rules without code (e.g. `all`) need no environment
        match = re.search(r'^    conda:\n\s+"([^"]+)"', body, re.M)
        assert match, f"{path.name}: rule {name} has no conda: directive"
        env = (path.parent / match.group(1)).resolve()
        assert env.is_file(), f"{path.name}: rule {name} uses missing env {env}"
        assert env.parent == REPO / "envs"


GPU_ENV_FILE = REPO / "envs" / "minifield-gpu.yaml"


def locked_closure(name: str, extra: str) -> dict[str, str]:
    """``name[extra]`` and everything it pulls in, as uv.lock resolves them for Python 3.11 on
    Linux (x86_64)."""
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    versions = locked_versions()
    environment = {**TARGET, "platform_machine": "x86_64", "platform_system": "Linux"}
    packages = {
        canonicalize_name(p["name"]): p
        for p in lock["package"]
        if versions.get(canonicalize_name(p["name"])) == p["version"]
    }
    found: dict[str, str] = {}
    todo = [(canonicalize_name(name), extra)]
    while todo:
        current, wanted_extra = todo.pop()
        package = packages[current]
        found[current] = package["version"]
        dependencies = list(package.get("dependencies", []))
        if wanted_extra:
            dependencies += package.get("optional-dependencies", {}).get(wanted_extra, [])
        for dependency in dependencies:
            marker = dependency.get("marker")
            if marker and not Marker(marker).evaluate(environment):
                continue
            if canonicalize_name(dependency["name"]) not in found:
                todo.append((canonicalize_name(dependency["name"]), None))
    return found


def test_gpu_env_is_the_cpu_env_plus_the_locked_cuda_plugin():
    conda, cpu = env_spec()
    gpu_conda, gpu = env_spec(GPU_ENV_FILE)
    assert gpu_conda == conda
    cuda = locked_closure("jax-cuda12-plugin", "with-cuda")
    assert {"jax-cuda12-pjrt", "nvidia-cudnn-cu12"} <= set(cuda)
    assert gpu == {**cpu, **cuda}
    assert cuda["jax-cuda12-plugin"] == cpu["jax"] == cpu["jaxlib"]
    script = GPU_ENV_FILE.with_name("minifield-gpu.post-deploy.sh")
    assert "--no-deps" in script.read_text()
