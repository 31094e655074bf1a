"""The environment fingerprint: what it records and compares, and how it reads the revision."""

from __future__ import annotations

import subprocess

import pytest
from conftest import REPO

from minifield.attempt import environment


def test_fingerprint_covers_what_determines_bits():
    fp = environment.fingerprint()
    for field in (
        "jax",
        "jaxlib",
        "optax",
        "backend",
        "device_kind",
        "device_count",
        "xla_flags",
        "threads",
        "prng_impl",
        "threefry_partitionable",
        "matmul_precision",
    ):
        assert field in fp and field in environment.BIT_DEFINING, field
    assert fp["device_count"] >= 1 and fp["prng_impl"]


def test_differences_name_each_changed_field():
    before = environment.fingerprint()
    after = {**before, "xla_flags": "--xla_foo", "threads": {"OMP_NUM_THREADS": "3"}}
    diff = environment.differences(before, after)
    assert set(diff) == {"xla_flags", "threads"}
    assert diff["xla_flags"] == {"recorded": before["xla_flags"], "current": "--xla_foo"}
    # provenance-only fields never block a resume
    assert environment.differences(before, {**before, "code_hash": "x", "platform": "y"}) == {}


@pytest.mark.slow  # runs git for the reference revision
def test_source_revision_is_read_without_running_git(monkeypatch):
    monkeypatch.delenv("MINIFIELD_SOURCE_REVISION", raising=False)
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    if not head:
        return  # not a git checkout: nothing to compare with
    assert environment.source_revision() == head
