"""Environment fingerprint: everything outside the recipe that can change the bits of a run.

A resume under a different fingerprint is refused unless explicitly allowed
(and the override is recorded), because library versions, XLA flags, thread
settings, device kinds or counts can each change floating-point results.
"""

from __future__ import annotations

import hashlib
import os
import platform
from importlib import metadata
from pathlib import Path

#: environment variables that change numerics or device placement
RELEVANT_ENV = (
    "XLA_FLAGS",
    "JAX_PLATFORMS",
    "JAX_ENABLE_X64",
    "JAX_DEFAULT_PRNG_IMPL",
    "JAX_DEFAULT_MATMUL_PRECISION",
    "JAX_DISABLE_MOST_OPTIMIZATIONS",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "TF_NUM_INTRAOP_THREADS",
    "TF_NUM_INTEROP_THREADS",
    "JAX_THREEFRY_PARTITIONABLE",
    "TF_CPP_MIN_LOG_LEVEL",
    "CUDA_VISIBLE_DEVICES",
)
#: fields compared before a resume; the rest is recorded for provenance only
BIT_DEFINING = (
    "python",
    "jax",
    "jaxlib",
    "optax",
    "numpy",
    "backend",
    "device_kind",
    "device_count",
    "process_count",
    "xla_flags",
    "threads",
    "prng_impl",
    "threefry_partitionable",
    "matmul_precision",
    "x64",
)
#: bit-defining fields recorded only where they apply (absent on CPU hosts, so CPU
#: fingerprints and results are unchanged); compared before a resume like the others
OPTIONAL_BIT_DEFINING = ("jax_cuda12_plugin", "jax_cuda13_plugin")

#: XLA flags a run on a GPU gets by default (:func:`add_gpu_determinism_flags`): without them
#: XLA:GPU may use atomics for scatter-add (the embedding gradient) and reductions, and pick
#: kernels by timing, so two runs of the same program can differ in their last bits and the
#: recovery proof's bit-exact resume would fail. ``xla_gpu_deterministic_ops`` also implies
#: ``xla_gpu_exclude_nondeterministic_ops``. Their cost on a training step is not measured here.
GPU_DETERMINISM_FLAGS = ("--xla_gpu_deterministic_ops=true",)
#: JAX's CUDA plugins: the ``cuda`` extra installs the CUDA 12 one; a GPU host that brings its
#: own JAX may have the CUDA 13 one (docs/device-check.md, offline hosts)
CUDA_PLUGINS = ("jax-cuda12-plugin", "jax-cuda13-plugin")


def cuda_plugins() -> dict[str, str]:
    """The installed CUDA plugins, as fingerprint fields (``jax_cuda12_plugin``: version)."""
    found = {name.replace("-", "_"): _version(name) for name in CUDA_PLUGINS}
    return {name: version for name, version in found.items() if version is not None}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def code_hash() -> str:
    """sha256 over the package's own source files (what ran, even without git)."""
    root = Path(__file__).parents[1]  # the whole package, not this subpackage
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.suffix in (".py", ".json") and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(root)).encode() + b"\0")
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _git_dir(start: Path) -> Path | None:
    for directory in (start, *start.parents):
        dot_git = directory / ".git"
        if dot_git.is_dir():
            return dot_git
        if dot_git.is_file():  # a worktree or submodule: "gitdir: <path>"
            text = dot_git.read_text(encoding="utf-8").strip()
            if text.startswith("gitdir:"):
                target = Path(text.removeprefix("gitdir:").strip())
                return target if target.is_absolute() else (directory / target).resolve()
    return None


def _read_ref(git_dir: Path, ref: str) -> str | None:
    common = git_dir
    if (git_dir / "commondir").is_file():
        common = (git_dir / (git_dir / "commondir").read_text().strip()).resolve()
    for base in (git_dir, common):
        path = base / ref
        if path.is_file():
            return path.read_text().strip() or None
    packed = common / "packed-refs"
    if packed.is_file():
        for line in packed.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == ref:
                return parts[0]
    return None


def source_revision() -> str | None:
    """The git commit the package was loaded from, read from the files in ``.git``.

    No ``git`` subprocess: the worker never starts processes of its own.
    """
    if os.environ.get("MINIFIELD_SOURCE_REVISION"):
        return os.environ["MINIFIELD_SOURCE_REVISION"]
    try:
        git_dir = _git_dir(Path(__file__).resolve().parent)
        if git_dir is None:
            return None
        head = (git_dir / "HEAD").read_text().strip()
        if head.startswith("ref:"):
            return _read_ref(git_dir, head.removeprefix("ref:").strip())
        return head or None
    except OSError:
        return None


def runs_on_gpu(environ=os.environ) -> bool:
    """Whether JAX will pick a GPU in this process (decided before JAX starts): JAX_PLATFORMS
    names cuda/gpu, or it is unset and the CUDA plugin is installed."""
    platforms = [p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return platforms[0] in ("cuda", "gpu")
    return bool(cuda_plugins())


def add_gpu_determinism_flags(environ=os.environ) -> list[str]:
    """Before JAX starts: append :data:`GPU_DETERMINISM_FLAGS` to ``XLA_FLAGS`` for a process
    that runs on a GPU, except a flag the user already set (their value is kept). The flags
    then show in the fingerprint's ``xla_flags`` like any other. A CPU process is left alone
    (its fingerprint does not change). Returns the flags added."""
    if not runs_on_gpu(environ):
        return []
    current = environ.get("XLA_FLAGS", "")
    named = {flag.split("=", 1)[0] for flag in current.split()}
    added = [flag for flag in GPU_DETERMINISM_FLAGS if flag.split("=", 1)[0] not in named]
    if added:
        environ["XLA_FLAGS"] = " ".join([*current.split(), *added])
    return added


def fingerprint(*, devices: bool = True) -> dict:
    """The fingerprint of this process; ``devices=False`` when the backend could not be
    started (the accelerator was busy): the device fields are then None."""
    import jax

    found = jax.devices() if devices else None
    extra = cuda_plugins()  # only where installed: CPU fingerprints unchanged
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "jax": _version("jax"),
        "jaxlib": _version("jaxlib"),
        "optax": _version("optax"),
        "numpy": _version("numpy"),
        "backend": jax.default_backend() if devices else None,
        "device_kind": sorted({d.device_kind for d in found}) if devices else None,
        "device_count": len(found) if devices else None,
        "process_count": jax.process_count() if devices else None,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "threads": {k: os.environ[k] for k in RELEVANT_ENV if "THREADS" in k and k in os.environ},
        "env": {k: os.environ[k] for k in RELEVANT_ENV if k in os.environ},
        "prng_impl": str(jax.config.jax_default_prng_impl),
        "threefry_partitionable": bool(jax.config.jax_threefry_partitionable),
        "matmul_precision": str(jax.config.jax_default_matmul_precision),
        "x64": bool(jax.config.jax_enable_x64),
        "cpu_count": os.cpu_count(),
        # the installed distribution's version (pyproject.toml), not an import of the package
        # root: the root imports the API, which imports the attempt
        "package_version": _version("minifield"),
        "code_hash": code_hash(),
        "source_revision": source_revision(),
        **extra,
    }


def differences(recorded: dict, current: dict) -> dict:
    """``{field: {"recorded": a, "current": b}}`` for every bit-defining field that differs."""
    return {
        key: {"recorded": recorded.get(key), "current": current.get(key)}
        for key in (*BIT_DEFINING, *OPTIONAL_BIT_DEFINING)
        if recorded.get(key) != current.get(key)
    }
