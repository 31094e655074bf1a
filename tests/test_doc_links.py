"""Every relative Markdown link in README.md, docs/*.md and config/README.md points to a file
that exists, and every ``#anchor`` (in the same file or another) is the GitHub-style slug of a
heading in the target. Reads files only: no processes."""

import re
from pathlib import Path

import pytest
from conftest import REPO

DOCUMENTS = sorted(
    [REPO / "README.md", REPO / "config" / "README.md", *(REPO / "docs").glob("*.md")]
)

FENCE = re.compile(r"^ {0,3}(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target) or [text](target "title"); the text may hold one level of brackets.
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: links reduced to their text, lower case, every
    character but letters, digits, ``_``, ``-`` and spaces dropped, each space a ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings, repeated slugs numbered as GitHub does."""
    seen: dict[str, int] = {}
    result = set()
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link outside code, relative and absolute alike."""
    found = []
    numbered = list(enumerate(path.read_text(encoding="utf-8").splitlines(), start=1))
    fenced = False
    for number, line in numbered:
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        line = CODE_SPAN.sub("code", line)
        found.extend((number, match.group(1)) for match in LINK.finditer(line))
    return found


def _broken(path: Path) -> list[str]:
    broken = []
    for number, target in links(path):
        if SCHEME.match(target):
            continue  # an absolute URL: not checked here
        where = f"{path.relative_to(REPO)}:{number}: {target}"
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        if not destination.exists():
            broken.append(f"{where} (no such file)")
            continue
        if anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{where} (no heading with that anchor)")
    return broken


def test_the_slug_is_githubs():
    assert slug("Families (`families.py`)") == "families-familiespy"
    assert (
        slug("Execution options (GPU-shaped training)") == "execution-options-gpu-shaped-training"
    )
    assert slug("Using a model: `load_model` and `minifield generate`") == (
        "using-a-model-load_model-and-minifield-generate"
    )
    assert slug("Slow Snakemake start with SLURM tools but no controller") == (
        "slow-snakemake-start-with-slurm-tools-but-no-controller"
    )


def test_links_in_code_are_not_links(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("see [a](a.md) and `[b](b.md)`\n\n```\n[c](c.md)\n```\n", encoding="utf-8")
    assert [target for _, target in links(page)] == ["a.md"]


def test_repeated_headings_are_numbered(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Figures\n\n## Figures\n\n```\n# not a heading\n```\n", encoding="utf-8")
    assert anchors(page) == {"figures", "figures-1"}


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(path):
    broken = _broken(path)
    assert not broken, "broken links:\n" + "\n".join(broken)
