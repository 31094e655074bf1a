"""``minifield generate`` refuses prompts that are not UTF-8 text: exit 2, one line naming
UTF-8 and where, before the model is read and before anything is printed."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _generate(tmp_path, *args: bytes | str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    # a model directory that does not exist: the prompts are judged first
    command = [sys.executable, "-m", "minifield.cli", "generate", "--model", tmp_path / "none"]
    return subprocess.run(
        [*command, *args], input=stdin, capture_output=True, timeout=120, check=False
    )


@pytest.mark.slow
def test_a_prompt_argument_that_is_not_utf8_is_refused(tmp_path):
    proc = _generate(tmp_path, "--prompt", "fine", "--prompt", b"ab\xffc")
    assert proc.returncode == 2 and proc.stdout == b""
    assert proc.stderr.decode() == (
        "minifield generate: --prompt (the second) is not valid UTF-8 text (an undecodable "
        "byte at character 2)\n"
    )


@pytest.mark.slow
def test_a_stdin_line_that_is_not_utf8_is_refused(tmp_path):
    # "\xc3(" : a two-byte sequence's lead byte followed by an ASCII byte
    proc = _generate(tmp_path, stdin="héllo\n".encode() + b"\xc3(\n")
    assert proc.returncode == 2 and proc.stdout == b""
    assert proc.stderr.decode() == (
        "minifield generate: standard input line 2 is not valid UTF-8 text (invalid "
        "continuation byte at byte 0)\n"
    )
    # valid UTF-8 lines get past the prompts to the model (here: a missing directory)
    proc = _generate(tmp_path, stdin="héllo\n".encode())
    assert proc.returncode == 2 and b"none: not a directory" in proc.stderr
