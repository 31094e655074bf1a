"""Shared test helpers: the repository root, recipe writers, and running the real CLIs."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytest_plugins = ["pytester"]  # test_fast_tier runs this conftest on probe tests


# -- the fast tier -------------------------------------------------------------------------------
# `pytest -m "not slow"` is the in-process tier. A test that starts a process (worker, Snakemake,
# the CLI, a server, a cluster) must be marked `slow`; one that is not fails here, naming the
# command, so the tier cannot quietly grow process start-ups. The guard covers fixture set-up
# too (a fixture that starts a process makes every test using it slow), not tear-down: a
# module's fixtures end in its last test's tear-down, whichever tier that test is in.


#: the fast tier's marker expression, exactly as the development notes give it
FAST_TIER = "not slow"


def pytest_configure(config):
    """The sources byte-compiled once, then this process compiles lightly (:func:`compiled_as`)
    and collects its oldest garbage less often (:func:`collect_the_old_generation_rarely`).
    The process that starts xdist workers runs no test: it only sets the environment they
    inherit, so it neither imports JAX nor waits for the flag probe before byte-compiling
    (each on the path to the first test: about 1.2 and 1.3 s)."""
    runs_tests = os.environ.get("PYTEST_XDIST_WORKER") or not getattr(
        config.option, "numprocesses", None
    )
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        start_asking_xla(*LIGHT_XLA_FLAGS)
        byte_compile_the_sources()
    compile_lightly_from_here_on(import_jax=bool(runs_tests))
    collect_the_old_generation_rarely()


#: Python's third collection threshold in the pytest processes (its default is 10)
OLD_GENERATION_THRESHOLD = 100


def collect_the_old_generation_rarely() -> None:
    """Full collections a tenth as often in this process. A pytest worker's heap grows with
    every test it runs (JAX's caches of traced and compiled programs, the test modules), and
    each full collection walks all of it: in a worker that had run five compile-heavy files,
    15 full collections took 7.7 of its 154 CPU-s, 4 of them 1.7 s at this threshold, its
    peak memory the same (1.47 GB; docs/performance.md). Cyclic garbage is still collected,
    later; a test that counts what is freed collects itself (test_streamed_evaluation)."""
    import gc

    first, second, _ = gc.get_threshold()
    gc.set_threshold(first, second, OLD_GENERATION_THRESHOLD)


def byte_compile_the_sources() -> None:
    """Write the bytecode of ``src/`` and ``tests/`` once, before any process starts: the
    processes the suite starts (workers, Snakemake jobs, probes) import them, and where
    ``PYTHONDONTWRITEBYTECODE`` is set (CI) no process writes it, so each one compiled every
    module it imported afresh. ``uv sync --compile-bytecode`` (the README's command) does this
    for the installed packages, not for the project's own editable source. The bytecode files
    are Python's usual cache (checked against each source file's time stamp), so nothing they
    run changes. Called once, by the process that starts the xdist workers."""
    import compileall

    for folder in ("src", "tests"):
        compileall.compile_dir(REPO / folder, quiet=1, workers=1)


_XLA_FLAG_PROBE = "MINIFIELD_TEST_XLA_FLAG_KNOWN"
#: the probe of :func:`start_asking_xla` still running, by flag
_asking: dict[str, subprocess.Popen] = {}


def start_asking_xla(*flags: str) -> None:
    """Start the probes of :func:`_xla_knows` for ``flags`` (one fresh interpreter each,
    about 1.3 s), so that the session's start goes on while they run."""
    if os.environ.get(_XLA_FLAG_PROBE) is not None:
        return
    for flag in flags:
        if flag not in _asking:  # one probe a flag: _xla_knows asks again for the one it waits on
            _asking[flag] = subprocess.Popen(
                [sys.executable, "-c", "import jax; jax.devices()"],
                env={**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )


def _xla_knows(flag: str) -> bool:
    """Whether this jaxlib's XLA accepts ``flag`` in ``XLA_FLAGS``: an unknown one is fatal
    when the backend starts, and XLA drops flags between releases (the elemental emitters'
    switch is gone from the jaxlib that Python 3.12 resolves to). Asked of a fresh interpreter
    once per session (:func:`start_asking_xla`): the answer reaches the xdist workers through
    the environment they inherit."""
    known = os.environ.get(_XLA_FLAG_PROBE)
    if known is None:
        start_asking_xla(flag)
        known = os.environ[_XLA_FLAG_PROBE] = str(int(_asking.pop(flag).wait() == 0))
    return known == "1"


# -- how the suite compiles: one setting in-process and in started processes ---------------------
# Compiling is most of a small test's CPU time, and XLA's optimizations are most of compiling.
# This pytest process (both tiers) and every process the tests start — workers, Snakemake jobs,
# CLI commands — compile lightly: JAX's `jax_disable_most_optimizations`
# (`JAX_DISABLE_MOST_OPTIMIZATIONS`, which JAX reads when it starts) and XLA:CPU's elemental
# emitters where the jaxlib has them (`XLA_FLAGS`, read when the CPU backend starts); the worker
# records both in the environment fingerprint, so a resume under the other setting is refused as
# any environment change is. The in-process tests' bodies compile in about half the CPU, a
# started worker's programs that miss the session's compilation cache in about 15 % less
# (docs/performance.md). The runs users make keep production's programs: the tests marked
# `production_compile` (the README's pipeline, the demo pipelines) start their processes
# compiled as production does, and a test whose claim is about production's programs (a
# bit-for-bit identity that XLA's optimizations decide) computes it in a process started so.
#
# A figure is compared only with one computed under the same setting, and `compiled_as` is the
# one place that says what a setting is: a started process compiles as this one does
# (`compiled_as(THIS_PROCESS)`, the default of every process a test starts) or as production
# (`compiled_as(PRODUCTION)`), and a figure compared with a production run's is computed in a
# process started so (`in_a_started_process(..., compiled=PRODUCTION)`), never here.
LIGHT, PRODUCTION = "light", "production"
#: how this pytest process compiles, in both tiers
THIS_PROCESS = LIGHT
#: XLA:CPU's older elemental code emitters instead of its MLIR fusion emitters: the same
#: programs compiled in about 40 % less CPU time (a MoE LoRA update and the gradient
#: accumulation cases, 25 -> 15 CPU-s; docs/performance.md)
LIGHT_XLA_FLAGS = ["--xla_cpu_use_fusion_emitters=false"]
#: ``XLA_FLAGS`` as pytest was started (a user's or CI's own), less the light ones
_given_xla_flags: list[str] = []


def compiled_as(setting: str) -> dict[str, str]:
    """The environment (``JAX_DISABLE_MOST_OPTIMIZATIONS``, ``XLA_FLAGS``) of a process that
    compiles under ``setting``: ``LIGHT`` (``THIS_PROCESS``: this pytest process and, unless a
    test says otherwise, every process the tests start) or ``PRODUCTION`` (a user's run)."""
    base = list(_given_xla_flags)
    if setting == PRODUCTION:
        return {"JAX_DISABLE_MOST_OPTIMIZATIONS": "0", "XLA_FLAGS": " ".join(base)}
    assert setting == LIGHT, setting
    return {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1", "XLA_FLAGS": started_xla_flags(*base)}


def compile_lightly_from_here_on(import_jax: bool = True) -> None:
    """This process, and every process started from its environment, compile lightly (before
    JAX's backend starts: it reads ``XLA_FLAGS`` then). ``import_jax``: whether this process
    runs tests (JAX may have been imported before the environment was set)."""
    given = os.environ.get("XLA_FLAGS", "").split()
    _given_xla_flags[:] = [f for f in given if f not in LIGHT_XLA_FLAGS]
    os.environ.update(compiled_as(LIGHT))
    if not import_jax:
        return
    import jax

    # JAX read JAX_DISABLE_MOST_OPTIMIZATIONS when imported, maybe before the line above
    jax.config.update("jax_disable_most_optimizations", True)


def started_xla_flags(*flags: str) -> str:
    """``XLA_FLAGS`` for a process a test starts with flags of its own (a forced device
    count): ``flags`` and the light ones (those this jaxlib knows), each once."""
    light = [f for f in LIGHT_XLA_FLAGS if _xla_knows(f)]
    return " ".join(dict.fromkeys([*flags, *light]))


def fusion_emitters_turned_off() -> bool:
    """Whether this process compiles with XLA:CPU's elemental emitters (where this jaxlib
    still has them): a test that needs the fusion emitters' bits asks for them with
    ``compiler_options={"xla_cpu_use_fusion_emitters": True}`` only then, since a jaxlib
    without the switch refuses the option and has only the fusion emitters."""
    return all(_xla_knows(f) for f in LIGHT_XLA_FLAGS)


def in_a_started_process(code: str, *args, compiled: str = THIS_PROCESS, timeout: int = 300):
    """Run the Python ``code`` (``args`` as ``sys.argv[1:]``) in a process started from this
    one's environment, compiling under ``compiled`` (:func:`compiled_as`), and return the JSON
    value it printed last. For a figure compared with one a worker computed (the worker's
    setting: ``THIS_PROCESS`` unless the test is ``production_compile``), or a claim about
    production's programs (``PRODUCTION``)."""
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **compiled_as(compiled)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def in_production_programs(check) -> object:
    """Call ``check`` (a module-level function of a test module, taking nothing, returning
    JSON) in a process compiled as production (:func:`compiled_as`), and return what it
    returned; its failed assertion fails the calling test with the process's traceback. For
    an in-process claim about the programs users run that XLA's optimizations decide (a bit
    for bit identity of two programs, an agreement within a tolerance measured there): this
    process compiles lightly and cannot compile otherwise (XLA reads its flags once)."""
    code = (
        "import importlib, json, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "check = getattr(importlib.import_module(sys.argv[2]), sys.argv[3])\n"
        "print(json.dumps(check()))\n"
    )
    module = sys.modules[check.__module__]
    where = Path(module.__file__).parent
    return in_a_started_process(code, where, check.__module__, check.__name__, compiled=PRODUCTION)


def export_evaluated_as_started(recipe: Path, export: Path) -> dict:
    """The store's re-evaluation of ``export`` (``Strategy.evaluate_export``) for the recipe
    file ``recipe``, computed in a process started as the workers are (:func:`in_a_started_process`)."""
    code = (
        "import json, sys\n"
        "from minifield import recipe\n"
        "loaded = recipe.load(sys.argv[1])\n"
        "print(json.dumps(loaded.strategy.evaluate_export(loaded.data, sys.argv[2])))\n"
    )
    return in_a_started_process(code, recipe, export)


@pytest.fixture(autouse=True)
def _production_compile(request, monkeypatch):
    if request.node.get_closest_marker("production_compile"):
        for name, value in compiled_as(PRODUCTION).items():
            monkeypatch.setenv(name, value)


class UnmarkedSubprocess(RuntimeError):
    """A test outside the slow tier started a process."""


_fast_test: pytest.Item | None = None  # the item being run, while it is not marked slow
_original_popen_init = subprocess.Popen.__init__
# System probes that libraries run once per interpreter, whichever test comes first: the
# standard library's platform.processor() (the environment fingerprint) and matplotlib's font
# cache. They start nothing of ours and cost milliseconds.
_INCIDENTAL_PROBES = {"uname", "fc-list"}


def _program(args) -> str:
    """The started program's file name (a string is a shell line: its first word)."""
    if isinstance(args, str | bytes):
        words = os.fsdecode(args).split()
        return Path(words[0]).name if words else ""
    first = next(iter(args), "")
    return Path(os.fsdecode(first)).name if first else ""


def holds_the_chip() -> bool:
    """Whether this pytest process has started JAX on a TPU. It then holds the chip (libtpu
    lets one process hold it), so a process a test starts could not get it: such a test
    needs the host (docs/tpu.md). Never starts JAX itself."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is None or not bridge.backends_are_initialized():
        return False
    return bridge.get_backend().platform == "tpu"


def _guarded_popen_init(self, args, *rest, **options):
    if _program(args) not in _INCIDENTAL_PROBES:
        if _fast_test is not None:
            _fast_test.stash[_started_key] = args
            raise UnmarkedSubprocess(
                f"{_fast_test.nodeid} starts a process ({args!r}) but is not marked slow: "
                "add @pytest.mark.slow (or the module's pytestmark)"
            )
        if _running_test is not None and holds_the_chip():
            pytest.skip(f"needs_host: starts a process ({_program(args)}) while this pytest "
                        "process holds the TPU chip")  # fmt: skip
    _original_popen_init(self, args, *rest, **options)


_started_key = pytest.StashKey[object]()
subprocess.Popen.__init__ = _guarded_popen_init


_running_test: pytest.Item | None = None  # the item being run, slow or not


def _guard(item: pytest.Item):
    global _fast_test, _running_test
    _fast_test = None if item.get_closest_marker("slow") else item
    _running_test = item
    try:
        yield
    finally:
        _fast_test = _running_test = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _guard(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _guard(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Fail the set-up or call that started a process even where the test swallowed the
    exception."""
    outcome = yield
    report = outcome.get_result()
    started = item.stash.get(_started_key, None)
    if started is not None:
        del item.stash[_started_key]
        if report.passed:
            report.outcome = "failed"
            report.longrepr = (
                f"{item.nodeid} started a process ({started!r}) but is not marked slow"
            )


# -- one JAX compilation cache for the processes tests start --------------------------------------
# The suite starts hundreds of workers, Snakemake jobs and CLI processes that compile the same
# small programs (a recipe's step, evaluation and generation functions) again and again. JAX's
# persistent cache in the environment of every process the tests start, one directory per
# session under the session's temporary root (every session starts cold; nothing carries over
# from another run), lets each process after the first load those executables instead of
# compiling them. The pipeline's train stage and recovery proof pass this directory to their
# workers too (`attempt.options.computation_cache`: the cache the environment names wins over
# the work dir's), so a computation the suite ran before loads its programs; a worker the tests
# give their own `--compilation-cache` uses that one. A loaded executable computes what a
# compiled one does: every update's state hash, the final hash and the export's bytes are the
# same without the cache, cold and warm (docs/development.md). In this process the setting counts only where JAX is first imported
# after it (in a whole run, test modules import JAX while they are collected, before): its tests
# rarely compile one program twice, and writing out every small one cost more than it saved.
# Under pytest-xdist the directory is the session's, shared by its workers (each worker has a
# temporary root of its own below it): both run the same small recipes, and JAX's cache is
# already written and read by concurrent processes within one worker (Snakemake's parallel jobs).
@pytest.fixture(scope="session", autouse=True)
def session_compilation_cache(tmp_path_factory) -> Path:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        directory = tmp_path_factory.getbasetemp().parent / "jax-cache"
        directory.mkdir(exist_ok=True)
    else:
        directory = tmp_path_factory.mktemp("jax-cache")
    os.environ.update(  # every program, as the worker's `--compilation-cache` does
        JAX_COMPILATION_CACHE_DIR=str(directory),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    return directory


def linear_recipe(**overrides) -> dict:
    """A minimal valid linear-momentum recipe (built-in 64 examples, no pinned inputs)."""
    recipe = {
        "job_id": "linear-test",
        "product": {"name": "line-fit", "version": "1.0"},
        "strategy": {"name": "linear-momentum", "version": "1.0.0"},
    }
    for key, value in overrides.items():
        recipe[key] = value
    return recipe


def small_sft_inputs(root: Path, seed: int = 5, train: int = 96, held_out: int = 8) -> dict:
    """Write a small reversal dataset under ``root/in/sft``; returns its input root and pins."""
    import hashlib

    from minifield.data import encoding
    from minifield.strategies.packed_sft import demo_data

    data = root / "in" / "sft"
    data.mkdir(parents=True)
    sizes = {"train": train, "dev": held_out, "test": held_out}
    pins = {}
    for split, rows in demo_data.demo_examples(seed=seed, sizes=sizes).items():
        blob = encoding.to_jsonl(rows)
        (data / f"{split}.jsonl").write_bytes(blob)
        pins[split] = hashlib.sha256(blob).hexdigest()
    return {"input_root": root / "in", "pins": pins}


#: the tiny packed-sft model and run most packed-sft tests train (d_model 32, one layer)
TINY_SFT = {
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64},
    "training": {"seq_len": 32, "batch_size": 4, "warmup_steps": 2, "learning_rate": 0.01},
    "limits": {"max_steps": 6},
    "checkpoint": {"every_steps": 2, "keep": 3},
    "evaluation": {"eval_every": 0, "batch_size": 8, "max_generate_examples": 2},
}


def merged(sections: dict, **changes) -> dict:
    """``sections`` with each of ``changes`` merged into the section of its name (a dict's keys
    replace that section's; any other value replaces the section)."""
    out = copy.deepcopy(sections)
    for name, value in changes.items():
        out[name] = {**out.get(name, {}), **value} if isinstance(value, dict) else value
    return out


def packed_sft_recipe(pins: dict, job_id: str, /, inputs_dir: str = "sft", **sections) -> dict:
    """A packed-sft recipe over the three supervised files ``pins`` names (split → sha256,
    at ``inputs_dir/{split}.jsonl``); ``sections`` (model, training, …; a ``product`` or
    ``inputs`` given replaces the default) as given."""
    return {
        "job_id": job_id,
        "product": {"name": "reverser", "version": "0"},
        "strategy": {"name": "packed-sft", "version": "12.0.0"},
        "inputs": [
            {"name": s, "path": f"{inputs_dir}/{s}.jsonl".lstrip("/"), "sha256": pins[s]}
            for s in ("train", "dev", "test")
        ],
        **copy.deepcopy(sections),
    }


def small_sft_recipe(pins: dict, job_id: str, devices: int, **sections) -> dict:
    """A tiny packed-sft recipe (d_model 32, one layer, batch 8) over ``small_sft_inputs``;
    ``sections`` replace ``limits``, ``checkpoint`` or ``evaluation`` or add ``training``
    keys via ``training=...``."""
    training = {
        "batch_size": 8,
        "data_parallel": {"devices": devices, "shard_params": False},
        **sections.pop("training", {}),
    }
    return packed_sft_recipe(pins, job_id, **{**merged(TINY_SFT, training=training), **sections})


def copy_demo_heads(source: Path, target: Path, lines: dict[str, int]) -> None:
    """The first ``lines[split]`` lines of ``source/{split}.jsonl`` written to
    ``target/{split}.jsonl``: a demo dataset cut to what a pipeline test needs."""
    target.mkdir(parents=True, exist_ok=True)
    for split, count in lines.items():
        text = (source / f"{split}.jsonl").read_text()
        (target / f"{split}.jsonl").write_text("".join(text.splitlines(True)[:count]))


def write_recipe(path: Path, recipe: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(recipe, indent=2))
    return path


def write_project(workdir: Path, recipes_by_file: dict[str, dict]) -> None:
    """A Snakemake project in ``workdir`` running ``recipes_by_file`` (YAML under
    ``config/recipes/``) from inputs under ``in/``, the repo's config otherwise; the crash proof
    alone (``tests/test_proof.py`` covers both modes)."""
    import yaml

    (workdir / "config" / "recipes").mkdir(parents=True, exist_ok=True)
    for name, recipe in recipes_by_file.items():
        (workdir / "config" / "recipes" / name).write_text(yaml.safe_dump(recipe))
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["recipes"] = [f"config/recipes/{name}" for name in recipes_by_file]
    config["input_root"] = "in"
    config["qualification"] = {**config["qualification"], "mode": "crash"}
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(config))


def snakemake_jobs(output: str) -> dict[str, int]:
    """Rule → job count from Snakemake's "Job stats" table (its stdout and stderr)."""
    import re

    table = output.split("Job stats:", 1)[1].split("\n\n", 1)[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.MULTILINE)}


def worker_args(*flags, **options) -> list[str]:
    """The worker's arguments: ``flags`` as spelled (``"--validate-only"``), then one option per
    keyword in the order given: ``input_root=p`` is ``--input-root p``, ``True`` the bare flag
    (``record_state_hashes=True``), ``None`` or ``False`` leaves the option out."""
    args = [str(flag) for flag in flags]
    for name, value in options.items():
        if value is None or value is False:
            continue
        args.append("--" + name.replace("_", "-"))
        if value is not True:
            args.append(str(value))
    return args


def worker_command(*flags, **options) -> list[str]:
    """``minifield-worker`` with ``worker_args``, on this interpreter."""
    return [sys.executable, "-m", "minifield.worker", *worker_args(*flags, **options)]


def run_generate(model_dir: Path, prompt: str, max_new_tokens: int) -> subprocess.CompletedProcess:
    """``minifield generate --model MODEL_DIR --prompt PROMPT`` as a user runs it (a real
    process, output captured; the caller judges the exit code and the text)."""
    return subprocess.run(
        [sys.executable, "-m", "minifield.cli", "generate", "--model", str(model_dir)]
        + ["--prompt", prompt, "--max-new-tokens", str(max_new_tokens)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def minifield_in_process(*args) -> subprocess.CompletedProcess:
    """``minifield ARGS`` through :func:`minifield.cli.main` in this process: see
    :func:`main_in_process`."""
    from minifield import cli

    return main_in_process(cli.main, *args)


def main_in_process(main, *args) -> subprocess.CompletedProcess:
    """A command line's ``main(argv)`` run in this process (no interpreter start-up to pay):
    its exit code (argparse's ``SystemExit`` included), stdout and stderr as a finished process
    would give them. What the command puts in the environment (a delivery's client settings)
    is undone, as a process's end would undo it; a test that checks the process path itself
    still runs the real command."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    environment = dict(os.environ)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(map(str, args)))
            except SystemExit as stop:
                code = stop.code
    finally:
        os.environ.clear()
        os.environ.update(environment)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def run_worker(
    *flags, check_codes=None, timeout=300, env=None, **options
) -> subprocess.CompletedProcess:
    """Run ``minifield-worker`` as a real subprocess (arguments as ``worker_args`` takes them);
    ``check_codes`` fails the test on any other exit code, showing both streams' ends."""
    proc = subprocess.run(
        worker_command(*flags, **options),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )
    if check_codes is not None and proc.returncode not in check_codes:
        raise AssertionError(
            f"worker exited {proc.returncode}, expected {check_codes}\nstdout:\n{proc.stdout[-3000:]}\n"
            f"stderr:\n{proc.stderr[-3000:]}"
        )
    return proc


def run_attempt(
    recipe: Path, input_root: Path, output_root: Path, *extra, codes=(0,), cache=None, env=None
) -> subprocess.CompletedProcess:
    """One recorded attempt of ``recipe`` by the worker CLI (state hashes after every update),
    which must exit with one of ``codes``; ``extra`` flags as ``worker_args`` takes them."""
    return run_worker(
        *extra,
        job=recipe,
        input_root=input_root,
        output_root=output_root,
        compilation_cache=cache,
        record_state_hashes=True,
        check_codes=codes,
        env=env,
    )


def train_as_the_pipeline(raw: Path, root: Path, input_root: Path, prove: bool = True) -> Path:
    """validate → prepare → (a crash-mode recovery proof →) a real worker → evaluate, as the
    pipeline does, writing ``recipe.json``, ``validation.json``, ``examples/``, ``attempts/``,
    ``result.json``, ``metrics.json`` (and ``proof.json``) under ``root``; the attempt.

    Where the proof's length is the recipe's ``max_steps`` its uninterrupted reference is the
    whole computation (updates, export, result; tests/test_grpo_worker.py reads it so), and
    is the attempt returned: the train stage's run would be the same computation again, one
    worker process more."""
    from minifield.pipeline import evaluation, preparation
    from minifield.proof.prove import prove as prove_recovery

    preparation.validate(raw, root / "recipe.json", root / "validation.json")
    preparation.prepare(root / "recipe.json", input_root, root / "examples")
    attempt = None
    if prove:  # the qualification rule's proof: reference, crash, resume (real workers)
        proof = prove_recovery(
            root / "recipe.json", input_root, root / "work", root / "proof.json",
            examples_dir=root / "examples", mode="crash",  # test_proof.py covers both modes
        )  # fmt: skip
        assert proof["passed"], proof["diagnosis"]
        max_steps = json.loads((root / "recipe.json").read_text())["limits"]["max_steps"]
        if proof["settings"]["steps"] == max_steps:
            attempt = Path(proof["reference"]["attempt_dir"])
    if attempt is None:
        run_worker(
            job=root / "recipe.json", input_root=input_root, output_root=root / "attempts",
            check_codes=(0,),
        )  # fmt: skip
        (job,) = (root / "attempts").iterdir()
        (attempt,) = job.iterdir()
    result = json.loads((attempt / "result.json").read_text())
    assert result["status"] == "completed", result
    (root / "result.json").write_text(json.dumps({**result, "attempt_dir": str(attempt)}))
    evaluation.evaluate(
        root / "recipe.json", root / "result.json", root / "examples", root / "metrics.json"
    )
    return attempt


def attempts_of(output_root: Path, job_id: str) -> list[Path]:
    """The attempt directories of ``job_id`` under ``output_root``, oldest first."""
    return sorted((output_root / job_id).iterdir(), key=lambda p: p.stat().st_mtime)


def update_hashes(attempt_dirs) -> dict[int, str]:
    """Step → complete-state hash over a chain of attempts (later attempts win)."""
    found = {}
    for attempt in attempt_dirs:
        for event in read_events(attempt / "events.jsonl"):
            if event["type"] == "update":
                found[event["step"]] = event["state_hash"]
    return found


def read_events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def repo() -> Path:
    return REPO


# The SLURM executor plugin (a dependency) runs `scontrol show config` when Snakemake imports
# it, at every start. Where SLURM's client tools are installed but no controller answers (this
# machine outside the cluster tests; CI), scontrol retries for about 9 s before it fails, and
# every Snakemake run waits for it. Runs without a cluster point scontrol at a configuration
# with no controller, which fails at once; the cluster tests use the real one.
NO_CONTROLLER_SLURM_CONF = REPO / "tests" / "slurm" / "no-controller.conf"


def snakemake_command(workdir: Path, *args: str, cores: int | None = 2) -> list[str]:
    """``snakemake`` on the repository's Snakefile in ``workdir`` (a user's project directory);
    ``cores=None`` leaves the core count to a profile."""
    command = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"),
               "--directory", str(workdir)]  # fmt: skip
    if cores is not None:
        command += ["--cores", str(cores)]
    return [*command, *map(str, args)]


#: Only a worker opens the accelerator (minifield.supervision.accelerator): every Snakemake
#: run of the suite names an accelerator this machine lacks, so a process of the pipeline that
#: starts JAX other than on the CPU fails the test, and gives its workers the CPU.
ACCELERATOR_ABSENT = {"JAX_PLATFORMS": "tpu", "MINIFIELD_WORKER_JAX_PLATFORMS": "cpu"}


def run_snakemake(
    workdir: Path,
    *args: str,
    cores: int | None = 2,
    check: bool = False,
    timeout: int = 900,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    """Run the workflow in ``workdir`` as a real process, output captured; ``check`` fails the
    test on a non-zero exit, showing the ends of both streams."""
    proc = subprocess.run(
        snakemake_command(workdir, *args, cores=cores),
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "SLURM_CONF": str(NO_CONTROLLER_SLURM_CONF),
            **ACCELERATOR_ABSENT,
            **(env or {}),
        },
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"snakemake {' '.join(map(str, args))} exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-5000:]}"
        )
    return proc


@pytest.fixture(scope="session")
def linear_demo_run(tmp_path_factory) -> Path:
    """The linear demo through the whole default pipeline, run once per test session.

    A template: tests that change anything work on their own copy (``copy_run``).
    """
    import shutil

    import yaml

    workdir = tmp_path_factory.mktemp("linear-demo-run")
    shutil.copytree(REPO / "data" / "linear", workdir / "data" / "linear")
    (workdir / "config" / "recipes").mkdir(parents=True)
    shutil.copy(REPO / "config" / "recipes" / "linear-demo.yaml", workdir / "config" / "recipes")
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["recipes"] = ["config/recipes/linear-demo.yaml"]
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    run_snakemake(workdir, check=True)
    return workdir


def readme_first_command() -> list[list[str]]:
    """The README's first command (the main job), as the argument lists of its ``snakemake``
    steps: what follows ``uv run --locked`` in each ``&&`` part (the install steps before them
    are what the suite's own environment already did)."""
    line = next(
        line.strip()
        for line in (REPO / "README.md").read_text(encoding="utf-8").splitlines()
        if "uv run --locked snakemake --cores 2 &&" in line
    )
    prefix = "uv run --locked "
    return [part.strip()[len(prefix) :].split() for part in line.split("&&") if prefix in part]


#: test files that read the README's run (`readme_pipeline_run`) besides its own test file.
#: A session fixture is built once per xdist worker, so they are scheduled as one unit with
#: tests/test_readme_commands.py on one worker (`pytest_xdist_make_scheduler` below), and the
#: README's pipeline runs once per session.
READS_THE_README_RUN = (
    "tests/test_llama_demo.py",
    "tests/test_grpo_demo_pipeline.py",
    "tests/test_before_after.py",
)
#: test files that read the linear demo's run (`linear_demo_run`, about 25 CPU-s to build),
#: scheduled with tests/test_proof_verdict.py as one unit for the same reason.
READS_THE_LINEAR_DEMO_RUN = (
    "tests/test_accelerator.py",
    "tests/test_pipeline.py",
    "tests/test_proof.py",
    "tests/test_publish_pipeline.py",
    "tests/test_report_pipeline.py",
    "tests/test_tracking_server.py",
)


#: Most pytest-xdist workers ``-n auto`` starts (each holds JAX and a test's models: about 2 GB).
MAX_AUTO_WORKERS = 8


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject.toml): one worker per core, and one more that runs only the
    files whose tests mostly wait (``WAITING``; ``pytest_xdist_make_scheduler``). A third
    worker for every file on this 2-core machine cost more CPU than the idle time it filled:
    three JAX processes compiling and computing at once on two cores (back to back from one
    fresh clone, 2 workers 17 min 46 s and 1,884 CPU-s with 161 s idle, 3 workers 18 min 38 s
    and 2,132 CPU-s with 18 s idle; docs/performance.md). The waiting files sleep through
    most of their time (a SLURM cluster's status checks, stall and deadline timers, a full
    disk): on a worker of their own the others keep every core busy.
    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` still decides where it is set."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    computing = max(1, min(cores or 1, MAX_AUTO_WORKERS))
    # the fast tier starts no process (tests/test_fast_tier.py): nothing of it waits; and the
    # waiting worker is the last of three or more (one core keeps one worker)
    waiting = computing > 1 and (config.option.markexpr or "").strip() != FAST_TIER
    return computing + waiting


#: Files whose tests spend most of their time waiting, not computing (wall against CPU
#: seconds of one whole run, 2 workers: docs/performance.md): run on a worker of their own.
#: (tests/test_tracking_server.py waits too, 48 s for 23 CPU-s, but reads the linear demo's
#: run, which the worker of that unit builds.)
WAITING = (
    "tests/test_slurm_profile.py",  # 157 s, 16 CPU-s: the cluster's status checks
    "tests/test_io_failures.py",  # 38 s, 20 CPU-s: a worker stalled on a full disk
    "tests/test_supervise.py",  # 26 s, 2 CPU-s: stall and deadline timers
)


#: Units of work (a file, or the README run's files together) that took longest in a whole run
#: (seconds of one worker, 2 workers: docs/performance.md), longest first. xdist hands out
#: the files with the most tests first, which left these — one or a few long tests each,
#: mostly whole pipelines — for the end, where one ran alone while the other workers were
#: done; handed out first, the last minutes run the many short files instead.
LONGEST_FIRST = (
    "tests/test_readme_commands.py",  # with READS_THE_README_RUN: 255 s
    "tests/test_slurm_profile.py",  # 164 s, most of it waiting on the cluster
    "tests/test_multi_process.py",
    "tests/test_preference_demo_pipeline.py",
    "tests/test_two_stage_pipeline.py",
    "tests/test_proof_verdict.py",  # with READS_THE_LINEAR_DEMO_RUN: about 150 s
    "tests/test_grpo_worker.py",
    "tests/test_chains_pipeline.py",
    "tests/test_harness_pipeline.py",
    "tests/test_moe_lora.py",
    "tests/test_checkpoint_parts.py",
    "tests/test_preference_data_parallel.py",
    "tests/test_preference_worker.py",
    "tests/test_mixture_pipeline.py",
)


def work_unit(path: str) -> str:
    """The unit a test file is scheduled in: its own, or that of the session run it reads."""
    if path in READS_THE_README_RUN:
        return "tests/test_readme_commands.py"
    if path in READS_THE_LINEAR_DEMO_RUN:
        return "tests/test_proof_verdict.py"
    return path


def pytest_collection_modifyitems(config, items):
    """A SLURM cluster's tests need the host (``needs_host``: not on an accelerator's own
    machine, docs/tpu.md). Under xdist, the units in the order they are handed out:
    ``LONGEST_FIRST``, then by number of tests (xdist's own order); each file's tests keep
    their order."""
    for item in items:
        if item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.needs_host)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    counts: dict[str, int] = {}
    for item in items:
        unit = work_unit(item.nodeid.split("::")[0])
        counts[unit] = counts.get(unit, 0) + 1

    def rank(item) -> tuple:
        unit = work_unit(item.nodeid.split("::")[0])
        first = LONGEST_FIRST.index(unit) if unit in LONGEST_FIRST else len(LONGEST_FIRST)
        return (first, -counts[unit], unit)

    items.sort(key=rank)  # stable: within a unit, collection order


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (pyproject.toml), except that the files reading a session run go to
    one worker as one unit (``work_unit``), units are handed out in the collection's order
    (``pytest_collection_modifyitems`` above), and with three workers or more the last one
    runs the ``WAITING`` files alone while the others run the rest (``pytest_xdist_auto_num_workers``).
    A computing worker left without its kind of unit takes a waiting one rather than stand
    idle; the waiting worker, left without, ends (one computing worker per core is what the
    cores hold)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False

    class SharedRunFiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(super()._split_scope(nodeid))

        def _waits(self, node) -> bool:
            """Whether ``node`` is the worker of the waiting files."""
            return self.numnodes > 2 and node.gateway.id == f"gw{self.numnodes - 1}"

        def _assign_work_unit(self, node) -> None:
            waits = self._waits(node)
            mine = [scope for scope in self.workqueue if (scope in WAITING) == waits]
            if not mine and waits:
                node.shutdown()  # runs what it holds, then ends
                return
            scope = mine[0] if mine else next(iter(self.workqueue))
            self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return SharedRunFiles(config, log)


@pytest.fixture(scope="session")
def readme_pipeline_run(tmp_path_factory) -> Path:
    """The README's first command on a fresh copy of the repository's tracked files: the
    default demo recipes through the whole pipeline, report included, run once per session
    and read by the tests that only look at what it made (tests/test_readme_commands.py and
    ``READS_THE_README_RUN``, scheduled on one worker). Nothing may change it: a test that
    edits works on a copy (``copy_run``)."""
    import shutil

    tracked = (
        subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True)
        .stdout.decode()
        .split("\0")
    )
    workdir = tmp_path_factory.mktemp("readme-run") / "minifield"
    for name in filter(None, tracked):
        source, target = REPO / name, workdir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():  # e.g. workflow/schemas, as a clone checks it out
            target.symlink_to(os.readlink(source))
        elif source.is_file():
            shutil.copy2(source, target)
    for argv in readme_first_command():
        assert argv[0] == "snakemake", argv
        proc = subprocess.run(
            [sys.executable, "-m", *argv],
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=3600,
            check=False,
            env={
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                "SLURM_CONF": str(NO_CONTROLLER_SLURM_CONF),
                # the README's command as a user runs it: a session fixture is set up before
                # a test's own (``_production_compile``), so it sets both settings itself
                **compiled_as(PRODUCTION),
            },
        )
        assert proc.returncode == 0, (
            f"{' '.join(argv)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return workdir


def copy_run(template: Path, destination: Path) -> Path:
    """A private copy of a finished project directory (results, work dir, Snakemake metadata)."""
    import shutil

    shutil.copytree(template, destination, symlinks=True)
    return destination
