"""``minifield generate`` refuses prompts that are not UTF-8 text (exit 2, one line naming
UTF-8 and where, before the model is read and before anything is printed) and prompts that
leave no position for a new token in the model's context (exit 2, one line: the prompt's
length in tokens against the context, before anything is printed)."""

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


#: the shipped demo base model (an HF directory): a character tokenizer (one token a letter),
#: 64 positions, a chat template that lays a user turn out as <bos> content <sep>
CONTEXT = (
    "the model's context is 64 positions: shorten the prompt (the context holds the prompt "
    "and at least one new token) or use a model with a longer context\n"
)


@pytest.mark.slow
def test_a_prompt_longer_than_the_context_is_refused_with_its_length_in_tokens(repo):
    model = repo / "data" / "llama-base"
    command = [sys.executable, "-m", "minifield.cli", "generate", "--model", model]

    def generate(*args, stdin=b""):
        return subprocess.run(
            [*command, *args], input=stdin, capture_output=True, timeout=300, check=False
        )

    # 1 MiB of prompt (from stdin: one argument may hold 128 KiB at most), which the chat
    # template sandbox's bound (2^20 characters a render) met first, naming the template
    proc = generate(stdin=b"ab" * (1 << 19) + b"\n")
    assert (proc.returncode, proc.stdout) == (2, b"")
    assert proc.stderr.decode() == f"minifield generate: the prompt is 1,048,576 tokens, {CONTEXT}"
    # judged before anything is generated: the first prompt's text is not printed
    proc = generate("--prompt", "abc", "--prompt", "ab" * 50_000)
    assert (proc.returncode, proc.stdout) == (2, b"")
    assert proc.stderr.decode() == f"minifield generate: prompt 2 of 2 is 100,000 tokens, {CONTEXT}"
    # 62 tokens of its own fit; with the template's <bos> and <sep> no position is left
    proc = generate("--prompt", "a" * 62)
    assert (proc.returncode, proc.stdout) == (2, b"")
    assert proc.stderr.decode() == (
        f"minifield generate: the prompt is 64 tokens with its chat template (62 of its own), "
        f"{CONTEXT}"
    )
    # 61 leave one: one new token is printed
    proc = generate("--prompt", "a" * 61, "--max-new-tokens", "5")
    assert proc.returncode == 0 and proc.stderr == b"", proc.stderr[-2000:]
    assert len(proc.stdout.decode().rstrip("\n")) <= 1
