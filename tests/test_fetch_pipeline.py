"""A recipe whose inputs are all remote runs through the real Snakemake pipeline, fetching
from a real https server on 127.0.0.1 that requires a bearer token; the token appears in
no file the pipeline wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import run_snakemake
from remote_server import AssetServer, make_certificate

from minifield import recipe as recipes
from minifield.digest import short
from minifield.inputs import fetch
from minifield.pipeline import preparation

TOKEN = "tok-" + secrets.token_hex(16)


def examples_jsonl() -> bytes:
    """48 points of y = 2x + 1 — not the 64 of the local demo file, so its use is visible."""
    xs = [round(-1.0 + 2.0 * i / 47, 6) for i in range(48)]
    return "".join(json.dumps({"x": x, "y": round(2 * x + 1, 6)}) + "\n" for x in xs).encode()


def files_under(*roots: Path):
    for root in roots:
        if root.exists():
            yield from (p for p in root.rglob("*") if p.is_file() and not p.is_symlink())


@pytest.mark.slow
def test_all_remote_recipe_runs_through_the_pipeline(tmp_path):
    data = examples_jsonl()
    sha = hashlib.sha256(data).hexdigest()
    cert, key = make_certificate(tmp_path)
    with AssetServer(token=TOKEN, tls=(cert, key)) as server:
        server.add("examples.jsonl", data)
        url = server.url("a", "examples.jsonl")
        (tmp_path / "config" / "recipes").mkdir(parents=True)
        (tmp_path / "data").mkdir()
        (tmp_path / "config" / "recipes" / "remote.yaml").write_text(
            yaml.safe_dump(
                {
                    "job_id": "remote-demo",
                    "product": {"name": "line-fit", "version": "1.0"},
                    "strategy": {"name": "linear-momentum", "version": "1.0.0"},
                    "inputs": [{"name": "examples", "url": url, "sha256": sha, "size": len(data)}],
                }
            )
        )
        creds = tmp_path / "credentials.json"
        creds.write_text(json.dumps({server.origin: {"bearer_token": TOKEN}}))
        os.chmod(creds, 0o600)
        config = {
            "recipes": ["config/recipes/remote.yaml"],
            "input_root": "data",
            "work_dir": "work",
            # the crash proof alone: preemption proofs are tested in test_proof.py
            "qualification": {"mode": "crash"},
            "remote_inputs": {
                "allowed_origins": ["https://assets.example"],  # plus the server's, below
                "credentials_file": str(creds),
                "ca_bundle": str(cert),
                "max_attempts": 2,
                "backoff_seconds": 0.05,
            },
        }
        config_path = tmp_path / "config" / "config.yaml"

        config["remote_inputs"]["allowed_origins"].append(server.origin)
        config_path.write_text(yaml.safe_dump(config))
        # Every stage that reads the fetched input root or the credentials (fetch, inputs,
        # prepare, qualify, train, evaluate) and the publication, not the capacity and report
        # stages (a process each): those read only files of the stages above, which the leak
        # check below reads too, and the config, which names the credentials file alone.
        loaded = recipes.load(tmp_path / "config" / "recipes" / "remote.yaml")
        base = f"results/computations/{short(loaded.computation_digest)}"
        proc = run_snakemake(tmp_path, f"{base}/eval/metrics.json", f"{base}/publication.json")
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert server.requests == [
            {"path": "/a/examples.jsonl", "authorization": f"Bearer {TOKEN}"}
        ]

    (computation,) = list((tmp_path / "results" / "computations").iterdir())
    cdigest = computation.name
    fetched_root = tmp_path / "results" / "fetched" / cdigest
    assert hashlib.sha256((fetched_root / "examples").read_bytes()).hexdigest() == sha
    assert (tmp_path / "work" / "cache" / "sha256" / sha).read_bytes() == data
    record = json.loads((computation / "inputs.json").read_text())
    assert record["input_root"] == f"results/fetched/{cdigest}"
    assert record["inputs"] == [
        {"name": "examples", "path": "examples", "sha256": sha, "size": len(data)}
    ]
    # The prepared examples are the 48 served points, not the 64 built-in/local ones.
    (examples_dir,) = list((tmp_path / "results" / "examples").iterdir())
    x = np.load(examples_dir / "x.npy")
    assert x.shape == (48,)
    assert np.allclose(x, [json.loads(line)["x"] for line in data.decode().splitlines()])
    result = json.loads((computation / "train" / "result.json").read_text())
    assert result["status"] == "completed" and result["steps_completed"] == 8
    assert result["inputs"][0]["sha256"] == sha
    metrics = json.loads((computation / "eval" / "metrics.json").read_text())
    assert metrics["acceptance"]["passed"] is True
    publication = json.loads((computation / "publication.json").read_text())
    assert (tmp_path / "results" / "store" / "artifacts" / publication["content_id"]).is_dir()

    # The token is in the credentials file only: no result, log, work file or Snakemake log.
    leaked = [
        str(p)
        for p in files_under(
            tmp_path / "results", tmp_path / "logs", tmp_path / "work", tmp_path / ".snakemake"
        )
        if TOKEN.encode() in p.read_bytes()
    ]
    assert leaked == []
    assert TOKEN not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_stage_refusal_leaves_no_input_root(tmp_path):
    """The rule's stage with the origin not allowed: a clear error, nothing placed or cached."""
    data = examples_jsonl()
    cert, key = make_certificate(tmp_path)
    with AssetServer(tls=(cert, key)) as server:
        server.add("examples.jsonl", data)
        url = server.url("a", "examples.jsonl")
        recipe = tmp_path / "recipe.json"
        recipe.write_text(
            json.dumps(
                {
                    "job_id": "remote-demo",
                    "product": {"name": "line-fit", "version": "1.0"},
                    "strategy": {"name": "linear-momentum", "version": "1.0.0"},
                    "inputs": [
                        {
                            "name": "examples",
                            "url": url,
                            "sha256": hashlib.sha256(data).hexdigest(),
                            "size": len(data),
                        }
                    ],
                }
            )
        )
        section = {"allowed_origins": ["https://assets.example"], "ca_bundle": str(cert)}
        root = tmp_path / "results" / "fetched" / "0123456789abcdef"
        with pytest.raises(fetch.FetchError, match=f"origin {server.origin} of {url} is not an"):
            preparation.fetch_inputs(
                recipe, section, tmp_path / "work", tmp_path / "data", root, tmp_path / "f.json"
            )
        assert server.requests == []
    assert list((tmp_path / "results" / "fetched").iterdir()) == []
    assert not (tmp_path / "f.json").exists()
    assert not (tmp_path / "work" / "cache" / "sha256").exists()


def test_stage_links_local_inputs_at_their_path(tmp_path):
    """Local inputs of a recipe are placed in the computation's input root at their path."""
    data = examples_jsonl()
    (tmp_path / "data" / "linear").mkdir(parents=True)
    (tmp_path / "data" / "linear" / "examples.jsonl").write_bytes(data)
    recipe = tmp_path / "recipe.json"
    recipe.write_text(
        json.dumps(
            {
                "job_id": "local-demo",
                "product": {"name": "line-fit", "version": "1.0"},
                "strategy": {"name": "linear-momentum", "version": "1.0.0"},
                "inputs": [
                    {
                        "name": "examples",
                        "path": "linear/examples.jsonl",
                        "sha256": hashlib.sha256(data).hexdigest(),
                    }
                ],
            }
        )
    )
    root = tmp_path / "results" / "fetched" / "0123456789abcdef"
    record = preparation.fetch_inputs(
        recipe, {}, tmp_path / "work", tmp_path / "data", root, tmp_path / "fetched.json"
    )
    assert (root / "linear" / "examples.jsonl").read_bytes() == data
    assert record["local"] == [{"name": "examples", "path": "linear/examples.jsonl"}]
    assert record["remote"] == []
    assert json.loads((tmp_path / "fetched.json").read_text()) == record
