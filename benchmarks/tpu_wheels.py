"""The pipeline's packages for a TPU host that reaches no package index but its own.

The TPU machine (docs/tpu.md) has Python 3.11 with JAX, jaxlib, libtpu, numpy and scipy
installed, and a package index on its own disk that holds some of what minifield needs, but
not Snakemake and what Snakemake needs. This script, here, downloads exactly the versions
``uv.lock`` pins for CPython 3.11 on x86-64 Linux, each wheel checked against the lock's
sha256, into a folder git ignores (``.whl-tpu/``) that travels with the working tree; there,
it installs them and the rest from the machine's own index into one target folder::

    python3 benchmarks/tpu_wheels.py download [--dry-run]      # here (a Python with pip)
    python3 benchmarks/tpu_wheels.py install --target /tmp/site      # on the chip
    export PYTHONPATH=$PYTHONPATH:$PWD/src:/tmp/site                # its JAX first

The packages are the closure of minifield's own dependencies (``[project].dependencies``,
Snakemake's ``reports`` extra included) under the lock's markers for that Python, less
:data:`ON_THE_HOST` (installed there: its JAX stays the one used) and :data:`FROM_ITS_INDEX`
(large wheels its index holds; their versions there are recorded by ``install``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tomllib
from pathlib import Path

try:
    from packaging import markers, tags, utils
except ImportError:  # a Python with pip alone (the TPU host): pip's own copy
    from pip._vendor.packaging import markers, tags, utils

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "uv.lock"
DEST = REPO / ".whl-tpu"
#: installed on the TPU host with its JAX (never carried: the host's own build stays first)
ON_THE_HOST = {"jax", "jaxlib", "numpy", "scipy", "ml-dtypes", "opt-einsum", "libtpu"}
#: held by the TPU host's own package index (read there on 2026-12-01), large as wheels
FROM_ITS_INDEX = {"pandas", "pyarrow", "tokenizers", "safetensors", "optax", "pyyaml",
                  "jinja2", "markupsafe", "absl-py", "matplotlib", "pillow", "fonttools",
                  "kiwisolver", "contourpy"}  # fmt: skip
#: CPython 3.11 on x86-64 Linux, as the TPU host runs it
ENVIRONMENT = {
    "python_version": "3.11", "python_full_version": "3.11.0", "sys_platform": "linux",
    "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
    "implementation_name": "cpython", "platform_python_implementation": "CPython",
}  # fmt: skip
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]  # fmt: skip
INDEX = "file:///opt/pypi/simple"


def _applies(marker: str | None, extra: str | None = None) -> bool:
    return marker is None or markers.Marker(marker).evaluate({**ENVIRONMENT, "extra": extra or ""})


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


class Lock:
    """uv.lock's packages, by name (and version where a name has several)."""

    def __init__(self, path: Path = LOCK):
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        self.packages: dict[str, list[dict]] = {}
        for package in data["package"]:
            self.packages.setdefault(_normal(package["name"]), []).append(package)

    def package(self, name: str, version: str | None = None) -> dict:
        candidates = self.packages[_normal(name)]
        if version is not None:
            candidates = [p for p in candidates if p["version"] == version]
        applying = [
            p for p in candidates
            if not p.get("resolution-markers") or any(map(_applies, p["resolution-markers"]))
        ]  # fmt: skip
        (package,) = applying or candidates
        return package

    def closure(self, root: str = "minifield") -> dict[str, dict]:
        """Every package the root's dependencies need on the TPU host's Python, by name."""
        found: dict[str, dict] = {}
        todo = [(d, None) for d in self.package(root).get("dependencies", [])]
        while todo:
            dependency, _ = todo.pop()
            if not _applies(dependency.get("marker")):
                continue
            package = self.package(dependency["name"], dependency.get("version"))
            name = _normal(package["name"])
            wanted = [] if name in found else list(package.get("dependencies", []))
            for extra in dependency.get("extra", []):
                wanted += package.get("optional-dependencies", {}).get(extra, [])
            found[name] = package
            todo += [(d, name) for d in wanted]
        return found


def _wheel(package: dict) -> dict:
    """The package's wheel for CPython 3.11 on x86-64 Linux, as the lock names it; a package
    published as source alone (pure Python) gives its source, built into a wheel here."""
    if not package.get("wheels") and package.get("sdist"):
        return package["sdist"]
    wanted = list(tags.cpython_tags((3, 11), platforms=[*PLATFORMS, "linux_x86_64"]))
    wanted += list(tags.compatible_tags((3, 11), "cp311", platforms=PLATFORMS))
    rank = {tag: i for i, tag in enumerate(wanted)}
    best = None
    for wheel in package.get("wheels", []):
        filename = wheel["url"].rsplit("/", 1)[-1]
        found = [rank[t] for t in utils.parse_wheel_filename(filename)[3] if t in rank]
        if found and (best is None or min(found) < best[0]):
            best = (min(found), wheel)
    if best is None:
        raise SystemExit(
            f"tpu_wheels: uv.lock has no wheel of {package['name']} {package['version']} for "
            f"CPython 3.11 on x86-64 Linux (cp311, {PLATFORMS[0]})"
        )
    return best[1]


def carried(lock: Lock) -> list[tuple[dict, dict]]:
    """(package, wheel) for every package that travels, by name."""
    skip = ON_THE_HOST | FROM_ITS_INDEX
    closure = lock.closure()
    return [(closure[n], _wheel(closure[n])) for n in sorted(closure) if n not in skip]


def from_its_index(lock: Lock) -> list[str]:
    """The closure's packages the TPU host's own index installs (``name==locked version``)."""
    closure = lock.closure()
    return [f"{n}=={closure[n]['version']}" for n in sorted(closure) if n in FROM_ITS_INDEX]


def download(dest: Path, dry_run: bool) -> int:
    rows = carried(Lock())
    total = sum(wheel["size"] for _, wheel in rows)
    for package, wheel in rows:
        print(f"{package['name']}=={package['version']}  {wheel['size'] / 1e6:6.2f} MB")
    print(f"{len(rows)} wheels, {total / 2**20:.1f} MiB, into {dest}")
    print("from the TPU host's own index: " + " ".join(from_its_index(Lock())))
    if dry_run:
        return 0
    dest.mkdir(exist_ok=True)
    wheels = [(p, w) for p, w in rows if w["url"].endswith(".whl")]
    sources = [(p, w) for p, w in rows if not w["url"].endswith(".whl")]
    requirements, built = dest / "requirements.txt", dest / "sources.txt"
    for path, part in ((requirements, wheels), (built, sources)):
        path.write_text(
            "".join(f"{p['name']}=={p['version']} --hash={w['hash']}\n" for p, w in part)
        )
    if sources:  # pure Python published as source only: its wheel is built here, once
        wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--require-hashes", "-r"]
        if subprocess.run([*wheel, str(built), "-w", str(dest)], check=False).returncode:
            return 1
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
               "--abi", "abi3", "--abi", "none", "--require-hashes", "-r", str(requirements),
               "-d", str(dest)]  # fmt: skip
    for platform in PLATFORMS:
        command += ["--platform", platform]
    return subprocess.run([*command, "--platform", "any"], check=False).returncode


def install(dest: Path, target: Path, report: Path | None) -> int:
    """On the TPU host: the carried wheels, then the rest from its own index (unpinned there
    where its version differs from the lock's: what it installed is reported)."""
    pip = [sys.executable, "-m", "pip", "install", "--isolated", "-q", "--no-deps",
           "--no-compile", "--no-cache-dir", "--disable-pip-version-check", "--target",
           str(target), "--only-binary=:all:"]  # fmt: skip
    env_free = {"PIP_CONFIG_FILE": "/dev/null"}
    wheels = sorted(str(p) for p in dest.glob("*.whl"))
    code = subprocess.run([*pip, "--no-index", *wheels], env=env_free, check=False).returncode
    installed = {}
    for requirement in from_its_index(Lock()):
        name = requirement.split("==")[0]
        for spec in (requirement, name):  # the locked version where the index has it
            if not subprocess.run([*pip, "--index-url", INDEX, spec], env=env_free).returncode:
                installed[name] = spec
                break
        else:
            installed[name] = None
            code = code or 1
    versions = {}  # what the index gave, read back from what was installed
    for info in target.glob("*.dist-info"):
        name, _, version = info.name[: -len(".dist-info")].partition("-")
        if _normal(name) in installed:
            versions[_normal(name)] = version
    installed = {name: versions.get(name) if spec else None for name, spec in installed.items()}
    if report is not None:
        report.write_text(json.dumps({"wheels": wheels, "from_its_index": installed}, indent=1))
    print(json.dumps(installed))
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    down = sub.add_parser("download", help="here: the locked wheels into --dest")
    down.add_argument("--dry-run", action="store_true", help="list them and their size only")
    inst = sub.add_parser("install", help="on the TPU host: into --target")
    inst.add_argument("--target", type=Path, required=True)
    inst.add_argument("--report", type=Path, help="what was installed, as JSON")
    for verb in (down, inst):
        verb.add_argument("--dest", type=Path, default=DEST)
    args = parser.parse_args(argv)
    if args.verb == "download":
        return download(args.dest, args.dry_run)
    return install(args.dest, args.target, args.report)


if __name__ == "__main__":
    sys.exit(main())
