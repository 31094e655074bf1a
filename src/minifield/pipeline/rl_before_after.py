"""Before and after reinforcement learning in a chain: the upstream export (the SFT result the
grpo computation starts from) and the grpo computation's export, decoded greedily and scored
by the grpo recipe's own rewards on the same DEV and TEST prompts (docs/grpo.md "In a chain",
the report's "9. RL").

Per export and split: the **mean reward**, **pass@1** (the share of prompts whose total reaches
``evaluation.pass_reward``) and, with an ``exact_match`` reward, **exact-match**; each reward's
mean. Both exports are read as HF directories (``minifield.load_model``'s loader).

**The checks**: with ``evaluation.max_dev_reward_drop`` (and ``max_dev_exact_match_drop``) in
the grpo recipe, the after export's DEV mean reward (DEV exact-match) must be at least the
before export's minus the tolerance; the record and the report item say pass or fail, and the
rule exits 1 on a fail (:class:`RewardDrop`, one line naming the numbers). Absent: shown, not
checked.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from .. import atomic
from ..strategies import grpo

#: recipe key → the figure it bounds
CHECKS = {"max_dev_reward_drop": "reward", "max_dev_exact_match_drop": "exact_match"}
#: figures of a record, as ``model_figures`` names them (``split_`` prefixed)
FIGURES = ("reward", "pass_at_1", "exact_match")


class RewardDrop(Exception):
    """The after export's DEV figure fell below the before export's minus the tolerance."""


def figures(recipe: dict, export_dir: Path, prompts: Path, files: dict[str, Path]) -> dict:
    raw = grpo.model_figures(recipe, export_dir, prompts, files)
    return {key.removeprefix("split_"): value for key, value in raw.items()}


def checks(record: dict, evaluation: dict) -> list[dict]:
    """``{key, figure, before, after, max_drop, passed}`` of each tolerance the recipe gives."""
    out = []
    for key, figure in CHECKS.items():
        if key not in evaluation:
            continue
        before, after = record["before"]["dev"][figure], record["after"]["dev"][figure]
        # a mean over the DEV prompts: 1e-9 absorbs the float sum, nothing a prompt moves
        passed = after >= before - evaluation[key] - 1e-9
        out.append(
            {"key": key, "figure": figure, "before": before, "after": after,
             "max_drop": evaluation[key], "passed": passed}
        )  # fmt: skip
    return out


def refusal(record: dict, recipe_path: Path) -> str | None:
    failed = [c for c in record["checks"] if not c["passed"]]
    if not failed:
        return None
    return "; ".join(
        f"reinforcement learning undid the upstream result on DEV: {c['figure']} after "
        f"{c['after']:.4f} < before {c['before']:.4f} - {c['max_drop']} "
        f"(evaluation.{c['key']} of {recipe_path})"
        for c in failed
    )


def _html(record: dict, splits) -> str:
    shown = [f for f in FIGURES if f in record["before"]["dev"]]
    head = "".join(f"<th>{s} {f.replace('_', ' ')}</th>" for s in splits for f in shown)
    rows = "".join(
        f"<tr><td>{label}</td>"
        + "".join(f"<td>{record[key][s][f]:.3f}</td>" for s in splits for f in shown)
        + "</tr>"
        for key, label in (("before", "before (upstream export)"), ("after", "after (grpo)"))
    )
    verdicts = (
        " ".join(
            f"Check {c['figure']} after &ge; before &minus; {c['max_drop']}: "
            f"<b>{'PASS' if c['passed'] else 'FAIL'}</b>."
            for c in record["checks"]
        )
        or "Not checked (the grpo recipe has no evaluation.max_dev_reward_drop)."
    )
    exports = record["exports"]
    return (
        "<html><body><h3>Reinforcement learning: before and after</h3><table border='1'>"
        f"<tr><th>model</th>{head}</tr>{rows}</table><p>Greedy decoding of the same prompts, "
        "scored by the grpo recipe's rewards: mean total reward, pass@1 and exact-match. DEV "
        f"reward change: {record['dev_reward_change']:+.3f}. {verdicts}</p><p>"
        f"{html.escape(exports['before'])} → {html.escape(exports['after'])}</p></body></html>\n"
    )


def compare(
    before: Path,
    after: Path,
    prompts: dict[str, Path],
    files: dict[str, Path],
    recipe_path: Path,
    out_json: Path,
    out_html: Path,
) -> dict:
    """Both exports on every split's prompts (``files``: the Python rewards' pinned files by
    input name); writes the record and the report item, then raises :class:`RewardDrop` when
    a check fails."""
    recipe = json.loads(Path(recipe_path).read_text())
    record = {
        "before": {s: figures(recipe, before, p, files) for s, p in prompts.items()},
        "after": {s: figures(recipe, after, p, files) for s, p in prompts.items()},
        "exports": {"before": str(before), "after": str(after)},
    }
    record["dev_reward_change"] = (
        record["after"]["dev"]["reward"] - record["before"]["dev"]["reward"]
    )
    record["checks"] = checks(record, recipe["evaluation"])
    atomic.write_json(out_json, record)
    atomic.write_bytes(out_html, _html(record, list(prompts)).encode("utf-8"))
    message = refusal(record, recipe_path)
    if message is not None:
        raise RewardDrop(message)
    return record
