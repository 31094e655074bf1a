"""What a run did, one line per computation: trained, the recovery proof, the acceptance (each
failing check with its value and threshold), published and activated.

An acceptance that fails leaves the model published but not activated, and Snakemake at exit 0:
the Snakefile's ``onsuccess`` handler prints :func:`closing_summary` as the run's last lines,
and the report's first item (``results/report/outcome.html``, :func:`outcome_page`) shows the
same lines. Everything is read from the files the stages wrote; a file that is not there is
said to be missing, never guessed.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

from . import page

#: the store's pointer file (:mod:`minifield.store.pointer`; observe does not import store)
ACTIVE_FILE = "active.json"
TITLE = "What the run did"
_IN_COMPUTATION = re.compile(r"(?:^|/)results/computations/([0-9a-f]{16})/")


def _read(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _trained(result: dict | None) -> str:
    if result is None:
        return "not trained (no train/result.json)"
    status = result.get("status")
    steps = result.get("steps_completed")
    if status == "completed":
        return f"trained ({steps} updates)"
    return f"training {status} after {steps} updates"


def _proof(proof: dict | None) -> str:
    if proof is None:
        return "no recovery proof"
    return "recovery proof passed" if proof.get("passed") else "recovery proof FAILED"


def _acceptance(metrics: dict | None) -> tuple[str, bool | None]:
    if metrics is None:
        return "not evaluated (no eval/metrics.json)", None
    acceptance = metrics.get("acceptance") or {}
    checks = acceptance.get("checks") or []
    if acceptance.get("passed"):
        return "acceptance passed", True
    failed = [c for c in checks if not c.get("passed")] or checks
    said = ", ".join(
        f"{c.get('name')} {page.fmt(c.get('value'))} (threshold {page.fmt(c.get('threshold'))})"
        for c in failed
    )
    return f"acceptance FAILED: {said or 'no check recorded'}", False


def _publication(publication: dict | None, active: dict | None, accepted: bool | None) -> str:
    if publication is None:
        return "not published"
    content_id = str(publication.get("content_id"))
    if active is not None and active.get("current") == content_id:
        return f"published {content_id[:16]}, activated (the store's current model)"
    why = " (activation refuses a model that fails acceptance)" if accepted is False else ""
    return f"published {content_id[:16]}, not activated{why}"


def outcome_line(cdir: Path, store_dir: Path) -> str:
    """One computation's line, read from its directory ``cdir`` (named by its short digest)
    and the store's pointer."""
    recipe = _read(cdir / "recipe.json") or {}
    acceptance, accepted = _acceptance(_read(cdir / "eval" / "metrics.json"))
    parts = [
        _trained(_read(cdir / "train" / "result.json")),
        _proof(_read(cdir / "qualification" / "proof.json")),
        acceptance,
        _publication(_read(cdir / "publication.json"), _read(store_dir / ACTIVE_FILE), accepted),
    ]
    return f"{recipe.get('job_id', '(no recipe.json)')} ({cdir.name}): " + "; ".join(parts)


def computations_in(paths: list[str]) -> list[str]:
    """The short digests of the computation directories ``paths`` lie in, in order, once."""
    found = (_IN_COMPUTATION.search(str(path)) for path in paths)
    return list(dict.fromkeys(match.group(1) for match in found if match))


def closing_summary(cdigests: list[str], results: Path, store_dir: Path) -> list[str]:
    """The lines of the computations ``cdigests`` (short digests) whose directory under
    ``results`` (``results/computations``) exists, in the order given, each once."""
    return [
        outcome_line(results / cdigest, store_dir)
        for cdigest in dict.fromkeys(cdigests)
        if (results / cdigest).is_dir()
    ]


def outcome_page(lines: list[str], out_html: Path) -> None:
    """The report's first item: the closing summary's lines."""
    items = "".join(f"<li>{html.escape(line)}</li>" for line in lines)
    body = (
        '<p class="note">Per computation: trained, the recovery proof, the acceptance (each '
        "failing check with its value and threshold), published and activated; the same lines "
        "the run printed at its end.</p>"
        + (f"<ul>{items}</ul>" if items else '<p class="note">No computation has results.</p>')
    )
    page.write_page(out_html, TITLE, body)
