"""The publication store through its CLI, on exports of real worker runs.

Content ids, payload hashes and the held-out MSE are recomputed here with
hashlib, json and numpy, never with the store's own helpers.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import linear_recipe, train_as_the_pipeline, write_recipe

from minifield import cli
from minifield import store as stores

pytestmark = pytest.mark.slow  # every test uses real worker runs (module fixture)

HELDOUT_X = (-1.5, -0.37, 0.22, 1.5)


# -- real training runs (module scope: each is a real worker process) ---------------------------


def _train(root: Path, with_proof: bool = True, **overrides) -> dict:
    """validate → prepare → real worker → evaluate (→ recovery proof), as the pipeline does."""
    root.mkdir(parents=True)
    raw = write_recipe(root / "raw.json", linear_recipe(**overrides))
    attempt = train_as_the_pipeline(raw, root, root, with_proof)
    return {
        "root": root,
        "export": attempt / "export",
        "recipe": root / "recipe.json",
        "result": root / "result.json",
        "metrics": root / "metrics.json",
        "proof": root / "proof.json" if with_proof else None,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    # a and b checkpoint every (max_steps - 2) / 2 updates: their recovery proof's length,
    # min(max_steps, 2 * every_steps + 2), is then the whole computation, whose uninterrupted
    # reference is the trained run (train_as_the_pipeline); what the store checks of a run
    # (its export, result, metrics, proof) does not depend on the cadence
    return {
        "a": _train(base / "a", job_id="store-a", checkpoint={"every_steps": 3}),
        # more updates: a second, different and better model
        "b": _train(
            base / "b", job_id="store-b", limits={"max_steps": 12}, checkpoint={"every_steps": 5}
        ),
        # a threshold the model cannot meet: the declared validation fails (no proof needed)
        "strict": _train(
            base / "strict",
            with_proof=False,
            job_id="store-strict",
            evaluation={"max_heldout_mse": 1e-9},
        ),
    }


# -- helpers ----------------------------------------------------------------------------------


def store_cli(store: Path, *args, real: bool = False) -> subprocess.CompletedProcess:
    """``minifield store --store STORE ARGS``: the real CLI entry point, in this process by
    default (JAX is imported once), or as a separate process with ``real=True``."""
    argv = ["store", "--store", str(store), *map(str, args)]
    if real:
        return subprocess.run(
            [sys.executable, "-m", "minifield.cli", *argv],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exc:  # argparse usage errors
            code = exc.code
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def publish(store: Path, run: dict, *extra, export: Path | None = None, omit=()) -> str:
    """Publish ``run``'s export with every provenance source except those named in ``omit``."""
    args = ["publish", export or run["export"]]
    for flag, key in (
        ("--recipe", "recipe"),
        ("--train-result", "result"),
        ("--metrics", "metrics"),
        ("--proof", "proof"),
    ):
        if key not in omit:
            args += [flag, run[key]]
    proc = store_cli(store, *args, *extra)
    assert proc.returncode == 0, proc.stderr
    content_id = proc.stdout.strip()
    assert len(content_id) == 64
    return content_id


def activate_ok(store: Path, content_id: str) -> dict:
    proc = store_cli(store, "activate", content_id)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def pointer(store: Path) -> dict:
    return json.loads((store / "active.json").read_text())


def refused(store: Path, *args) -> str:
    """Run a command that must be refused; asserts active.json is byte-for-byte unchanged."""
    before = (store / "active.json").read_bytes()
    proc = store_cli(store, *args)
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert (store / "active.json").read_bytes() == before
    return proc.stderr


def heldout_mse(export_dir: Path) -> float:
    """The acceptance metric computed here from the .npy files: mean((w·x + b − (2x + 1))²)."""
    model = json.loads((export_dir / "model.json").read_text())
    weights = {
        e["name"]: np.load(export_dir / e["file"], allow_pickle=False) for e in model["weights"]
    }
    w, b = float(weights["w"][0]), float(weights["b"][0])
    return sum((w * x + b - (2 * x + 1)) ** 2 for x in HELDOUT_X) / len(HELDOUT_X)


@pytest.fixture
def active_store(tmp_path, runs) -> tuple[Path, str]:
    """A store with run ``a`` published and active."""
    store = tmp_path / "store"
    content_id = publish(store, runs["a"])
    activate_ok(store, content_id)
    return store, content_id


# -- identity ---------------------------------------------------------------------------------


def test_content_id_and_payload_recomputed_independently(tmp_path, runs):
    # A Snakemake directory() output carries a .snakemake_timestamp: never part of the payload.
    export = tmp_path / "export"
    shutil.copytree(runs["a"]["export"], export)
    (export / ".snakemake_timestamp").write_text("")
    store = tmp_path / "store"
    content_id = publish(store, runs["a"], export=export)

    artifact = store / "artifacts" / content_id
    manifest = json.loads((artifact / "manifest.json").read_text())
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert hashlib.sha256(canonical.encode("utf-8")).hexdigest() == content_id

    expected_files = {
        p.relative_to(export).as_posix()
        for p in export.rglob("*")
        if p.is_file() and p.name != ".snakemake_timestamp"
    } | {"evidence/proof.json"}
    assert {item["path"] for item in manifest["payload"]} == expected_files
    assert not (artifact / ".snakemake_timestamp").exists()
    for item in manifest["payload"]:
        data = (artifact / item["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == item["sha256"]
        assert len(data) == item["size"]
        source = (
            runs["a"]["proof"] if item["path"] == "evidence/proof.json" else export / item["path"]
        )
        assert data == source.read_bytes()

    result = json.loads(runs["a"]["result"].read_text())
    provenance = manifest["provenance"]
    assert provenance["code_hash"] == result["environment"]["code_hash"]
    assert provenance["source_revision"] == result["environment"]["source_revision"]
    assert provenance["computation_digest"] == result["computation_digest"]
    assert provenance["examples_digest"] == result["examples_digest"]
    assert provenance["final_state_hash"] == result["final_state_hash"]
    proof_sha = hashlib.sha256(runs["a"]["proof"].read_bytes()).hexdigest()
    assert provenance["recovery_proof"]["sha256"] == proof_sha
    metrics = json.loads(runs["a"]["metrics"].read_text())
    assert manifest["validation"]["declared"] == metrics["acceptance"]
    assert manifest["recipe"] == json.loads(runs["a"]["recipe"].read_text())
    # Publishing never activates, and publishing the same content again gives the same id.
    assert not (store / "active.json").exists()
    assert publish(store, runs["a"], export=export) == content_id


# -- the happy path with rollback -------------------------------------------------------------


def test_publish_activate_publish_activate_rollback(tmp_path, runs):
    store = tmp_path / "store"
    a = publish(store, runs["a"])
    assert not (store / "active.json").exists()

    report = activate_ok(store, a)
    assert report["reevaluation"]["heldout_mse"] == pytest.approx(heldout_mse(runs["a"]["export"]))
    assert heldout_mse(runs["a"]["export"]) <= 1.0
    assert (pointer(store)["current"], pointer(store)["previous"]) == (a, None)

    before = (store / "active.json").read_bytes()
    b = publish(store, runs["b"])
    assert b != a
    assert (store / "active.json").read_bytes() == before  # publishing never moves the pointer

    activate_ok(store, b)
    assert (pointer(store)["current"], pointer(store)["previous"]) == (b, a)

    proc = store_cli(store, "rollback", real=True)
    assert proc.returncode == 0, proc.stderr
    state = pointer(store)
    assert (state["current"], state["previous"]) == (a, b)
    moves = [(m["action"], m["from"], m["to"]) for m in state["history"]]
    assert moves == [("activate", None, a), ("activate", a, b), ("rollback", b, a)]
    assert [m["seq"] for m in state["history"]] == [0, 1, 2]

    listing = json.loads(store_cli(store, "list").stdout)
    assert {row["content_id"]: row["active"] for row in listing} == {a: "current", b: "previous"}
    shown = json.loads(store_cli(store, "show").stdout)
    assert shown["current"] == a
    assert json.loads(store_cli(store, "show", b).stdout)["manifest"]["job_id"] == "store-b"
    assert store_cli(store, "verify", b).returncode == 0


# -- every refusal leaves active.json byte-for-byte unchanged ---------------------------------


def test_failed_gate_thresholds_not_met(active_store, runs):
    store, _ = active_store
    strict = publish(store, runs["strict"], "--no-proof", "thresholds test", omit=("proof",))
    message = refused(store, "activate", strict)
    assert "declared validation failed" in message
    # The store's own re-evaluation reaches the same verdict as the declared one.
    assert "acceptance re-evaluation failed" in message and "heldout_mse" in message
    assert heldout_mse(runs["strict"]["export"]) > 1e-9


def test_degraded_model_with_a_passing_declaration_is_caught_by_reevaluation(
    tmp_path, active_store, runs
):
    """A self-consistent export with bad weights and a *passing* declared validation."""
    store, _ = active_store
    degraded = tmp_path / "degraded"
    shutil.copytree(runs["a"]["export"], degraded)
    model = json.loads((degraded / "model.json").read_text())
    for entry in model["weights"]:
        buffer = io.BytesIO()
        np.save(
            buffer, np.zeros(entry["shape"], dtype=np.dtype(entry["dtype"])), allow_pickle=False
        )
        (degraded / entry["file"]).write_bytes(buffer.getvalue())
        entry["sha256"] = hashlib.sha256(buffer.getvalue()).hexdigest()
    (degraded / "model.json").write_text(json.dumps(model))
    # w = b = 0: MSE = mean((2x + 1)²) over the held-out x, far above 1.
    assert heldout_mse(degraded) == pytest.approx(sum((2 * x + 1) ** 2 for x in HELDOUT_X) / 4)
    content_id = publish(store, runs["a"], export=degraded)
    manifest = json.loads((store / "artifacts" / content_id / "manifest.json").read_text())
    assert manifest["validation"]["declared"]["passed"] is True  # the declaration lies
    message = refused(store, "activate", content_id)
    assert "acceptance re-evaluation failed on the published weights" in message
    assert "declared validation failed" not in message


def test_payload_weights_altered_after_publication(tmp_path, active_store, runs):
    store, _ = active_store
    b = publish(store, runs["b"])
    artifact = store / "artifacts" / b
    weight = sorted((artifact / "weights").iterdir())[0]
    buffer = io.BytesIO()
    np.save(buffer, np.asarray([5.0], dtype=np.float32), allow_pickle=False)
    weight.write_bytes(buffer.getvalue())
    message = refused(store, "activate", b)
    assert f"payload file corrupt: weights/{weight.name}" in message

    # Covering the tracks in the manifest too changes what the id hashes to.
    manifest = json.loads((artifact / "manifest.json").read_text())
    for item in manifest["payload"]:
        if item["path"] == f"weights/{weight.name}":
            item["sha256"] = hashlib.sha256(weight.read_bytes()).hexdigest()
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    message = refused(store, "activate", b)
    assert "content id mismatch" in message
    assert store_cli(store, "verify", b).returncode == 1


def test_missing_and_corrupt_payload_files(active_store, runs):
    store, _ = active_store
    b = publish(store, runs["b"])
    artifact = store / "artifacts" / b
    (artifact / "model.json").write_text("{not json")
    assert "payload file corrupt: model.json" in refused(store, "activate", b)
    for weight in (artifact / "weights").iterdir():
        weight.unlink()
    message = refused(store, "activate", b)
    assert "payload file missing: weights/00000.npy" in message
    assert "payload file missing: weights/00001.npy" in message


def test_missing_provenance(active_store, runs):
    store, _ = active_store
    bare = publish(store, runs["b"], omit=("result", "metrics"))  # only recipe + proof
    message = refused(store, "activate", bare)
    for named in (
        "code_hash",
        "source_revision",
        "final_state_hash",
        "missing declared validation",
    ):
        assert named in message

    unproven = publish(store, runs["b"], "--no-proof", "qualification not run", omit=("proof",))
    message = refused(store, "activate", unproven)
    assert "missing provenance: recovery_proof" in message
    assert "qualification not run" in message

    # No proof and no explicit waiver: publishing itself is refused.
    proc = store_cli(store, "publish", runs["b"]["export"], "--recipe", runs["b"]["recipe"])
    assert proc.returncode == 2 and "--no-proof" in proc.stderr


# -- the recovery proof must qualify this very computation ------------------------------------


def _bad_proofs(runs) -> dict[str, tuple[bytes, str]]:
    """Proofs that must not qualify run ``b``, each with what its refusal must name: the
    foreign computation's digest, or the number of the step that differs or is missing.

    Built from ``b``'s and ``a``'s genuine passing proofs by editing the JSON here;
    ``passed`` stays true in each, so only a verdict recomputed from the recorded
    hashes and digest can refuse them.
    """
    own = json.loads(runs["b"]["proof"].read_text())
    foreign = json.loads(runs["a"]["proof"].read_text())
    assert own["passed"] and foreign["passed"]
    assert foreign["computation_digest"] != own["computation_digest"]
    restored = own["resumed"]["restored"]["step"]
    last = own["settings"]["steps"]
    assert restored + 1 < last

    altered = copy.deepcopy(own)  # the resumed hash of the last step, in every place recorded
    for row in altered["resumed"]["state_hashes"] + altered["comparison"]:
        if row["step"] == last:
            key = "state_hash" if "state_hash" in row else "resumed"
            row[key] = hashlib.sha256(b"another state").hexdigest()

    missing = copy.deepcopy(own)  # no update after the restored checkpoint
    gone = restored + 1
    missing["resumed"]["state_hashes"] = [
        row for row in missing["resumed"]["state_hashes"] if row["step"] != gone
    ]
    missing["comparison"] = [row for row in missing["comparison"] if row["step"] != gone]
    missing["next_update"] = None

    def encoded(document: dict) -> bytes:
        return json.dumps(document, indent=2).encode()

    return {
        "foreign": (runs["a"]["proof"].read_bytes(), foreign["computation_digest"]),
        "altered": (encoded(altered), str(last)),
        "missing": (encoded(missing), str(gone)),
    }


def _proof_refusal_names(message: str, named: str) -> bool:
    """Whether a line of ``message`` refuses the proof and names ``named`` as a whole word
    (a step number, not a digit inside a hash)."""
    prefix = "recovery proof does not qualify this computation: "
    return any(
        re.search(rf"(?<![0-9a-f]){re.escape(named)}(?![0-9a-f])", line.split(prefix, 1)[1])
        for line in message.splitlines()
        if prefix in line
    )


@pytest.mark.parametrize("case", ["foreign", "altered", "missing"])
def test_publication_refuses_a_proof_that_does_not_qualify_the_computation(
    tmp_path, active_store, runs, case
):
    store, _ = active_store
    data, named = _bad_proofs(runs)[case]
    proof = tmp_path / "proof.json"
    proof.write_bytes(data)
    artifacts_before = sorted(p.name for p in (store / "artifacts").iterdir())
    args = ["publish", runs["b"]["export"], "--recipe", runs["b"]["recipe"]]
    args += ["--train-result", runs["b"]["result"], "--metrics", runs["b"]["metrics"]]
    message = refused(store, *args, "--proof", proof)  # exit 1, active.json byte-identical
    assert _proof_refusal_names(message, named)
    assert "nothing published" in message
    assert sorted(p.name for p in (store / "artifacts").iterdir()) == artifacts_before

    # The pipeline's publish rule (workflow/scripts/publish.py) refuses the same way.
    before = (store / "active.json").read_bytes()
    out = tmp_path / "publication.json"
    with pytest.raises(stores.Refused) as caught:
        stores.publish_computation(
            store, runs["b"]["export"], runs["b"]["recipe"], runs["b"]["result"],
            runs["b"]["metrics"], proof, out,
        )  # fmt: skip
    assert _proof_refusal_names("\n".join(caught.value.reasons), named)
    assert not out.exists()
    assert (store / "active.json").read_bytes() == before


def _artifact_with_proof(store: Path, content_id: str, proof: bytes) -> str:
    """A copy of artifact ``content_id`` holding ``proof`` as its evidence, with the manifest
    and the content id recomputed here (hashlib, json), so that every integrity check
    passes and only the proof itself can be refused: what a store written by an older
    gate, or by hand, may hold."""
    source = store / "artifacts" / content_id
    manifest = json.loads((source / "manifest.json").read_text())
    digest = hashlib.sha256(proof).hexdigest()
    for item in manifest["payload"]:
        if item["path"] == "evidence/proof.json":
            item.update(sha256=digest, size=len(proof))
    manifest["provenance"]["recovery_proof"]["sha256"] = digest
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    new_id = hashlib.sha256(canonical.encode("utf-8")).hexdigest()
    target = store / "artifacts" / new_id
    shutil.copytree(source, target)
    (target / "evidence" / "proof.json").write_bytes(proof)
    (target / "manifest.json").write_text(json.dumps(manifest))
    return new_id


def test_activation_refuses_a_proof_that_does_not_qualify_the_computation(active_store, runs):
    store, _ = active_store
    b = publish(store, runs["b"])
    # Control: the same construction with b's own proof (re-encoded) passes the whole gate.
    genuine = json.dumps(json.loads(runs["b"]["proof"].read_text())).encode()
    control = _artifact_with_proof(store, b, genuine)
    assert control != b
    assert store_cli(store, "verify", control).returncode == 0

    for case, (data, named) in _bad_proofs(runs).items():
        content_id = _artifact_with_proof(store, b, data)
        message = refused(store, "activate", content_id)  # exit 1, active.json byte-identical
        assert _proof_refusal_names(message, named), (case, message)
        for other in ("content id mismatch", "payload file", "declared validation failed"):
            assert other not in message, (case, message)
        assert store_cli(store, "verify", content_id).returncode == 1


def test_rollback_with_no_previous_and_unknown_id(active_store):
    store, _ = active_store
    assert "nothing to roll back to" in refused(store, "rollback")
    assert "not published" in refused(store, "activate", "0" * 64)
    proc = store_cli(store, "activate", "not-an-id")
    assert proc.returncode == 2


# -- single writer ----------------------------------------------------------------------------


def test_second_writer_times_out_clearly_while_the_lock_is_held(active_store, runs):
    store, _ = active_store
    b = publish(store, runs["b"])
    before = (store / "active.json").read_bytes()
    with open(store / ".lock", "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)  # another writer, from this test's process
        proc = store_cli(store, "--lock-timeout", "0.5", "activate", b, real=True)
    assert proc.returncode == 3
    assert "locked by another writer" in proc.stderr
    assert (store / "active.json").read_bytes() == before
    activate_ok(store, b)  # once the lock is free the same request goes through


def test_concurrent_activations_never_tear_the_pointer(tmp_path, runs):
    store = tmp_path / "store"
    a, b = publish(store, runs["a"]), publish(store, runs["b"])
    activate_ok(store, a)
    targets = [b, a, b]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "minifield.cli",
                "store",
                "--store",
                str(store),
                "--lock-timeout",
                "-1",
                "activate",
                target,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for target in targets
    ]
    # While they run, a reader only ever sees a complete pointer naming a published artifact.
    reads = 0
    while any(p.poll() is None for p in procs):
        seen = json.loads((store / "active.json").read_text())
        assert seen["current"] in (a, b)
        reads += 1
        time.sleep(0.01)
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), [o[1] for o in outputs]
    assert reads > 0

    state = pointer(store)  # parses: never torn
    history = state["history"]
    assert history[0]["to"] == a and history[0]["from"] is None
    # Every move starts where the previous one ended, and the pointer agrees with the last move.
    for earlier, later in zip(history, history[1:], strict=False):
        assert later["from"] == earlier["to"]
        assert later["seq"] == earlier["seq"] + 1
    assert (state["current"], state["previous"]) == (history[-1]["to"], history[-1]["from"])
    changed = sum(json.loads(out)["changed"] for out, _ in outputs)
    assert len(history) == 1 + changed
    assert {m["pid"] for m in history[1:]} <= {p.pid for p in procs}
    leftovers = [p.name for p in store.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_contradictory_sources_and_a_corrupt_pointer_are_refused(active_store, runs):
    store, _ = active_store
    # A train result of another computation than the recipe: refused at publication.
    proc = store_cli(
        store, "publish", runs["b"]["export"], "--recipe", runs["b"]["recipe"],
        "--train-result", runs["a"]["result"], "--proof", runs["b"]["proof"],
    )  # fmt: skip
    assert proc.returncode == 2 and "does not match the recipe" in proc.stderr
    # An unreadable pointer is never overwritten.
    b = publish(store, runs["b"])
    (store / "active.json").write_text('{"current": "trunc')
    proc = store_cli(store, "activate", b)
    assert proc.returncode == 2 and "refusing to overwrite" in proc.stderr
    assert (store / "active.json").read_text() == '{"current": "trunc'


def test_rollback_goes_through_the_same_gate(active_store, runs):
    store, a = active_store
    b = publish(store, runs["b"])
    activate_ok(store, b)
    assert (pointer(store)["current"], pointer(store)["previous"]) == (b, a)
    (store / "artifacts" / a / "evidence" / "proof.json").write_text('{"passed": true}')
    message = refused(store, "rollback")
    assert "payload file corrupt: evidence/proof.json" in message
    assert pointer(store)["current"] == b
