"""minifield.pipeline.host: a host whose /proc/<pid>/io psutil cannot parse (gVisor) gets
Snakemake's benchmark files without I/O instead of failed jobs."""

from __future__ import annotations

import psutil
import pytest

from minifield.pipeline import host


def _partial(self):  # what psutil raises on gVisor: the file lacks the field it parses first
    raise ValueError("b'rchar' field was not found in /proc/1586/io")


def test_a_readable_host_is_left_as_it_is(monkeypatch):
    original = psutil.Process.io_counters
    assert host.io_counters_readable()
    assert host.io_counters_as_missing_where_partial() is False
    assert psutil.Process.io_counters is original


def test_partial_counters_read_as_missing_as_snakemake_expects(monkeypatch):
    monkeypatch.setattr(psutil.Process, "io_counters", _partial)
    assert not host.io_counters_readable()
    assert host.io_counters_as_missing_where_partial() is True
    with pytest.raises(NotImplementedError, match="rchar"):
        psutil.Process().io_counters()
    assert host.io_counters_as_missing_where_partial() is False  # once
