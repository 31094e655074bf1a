"""Before and after preference tuning in a chain: the upstream export (the SFT result the
preference computation starts from) and the preference computation's export, measured on
the same DEV and TEST pairs (docs/preference.md "The pipeline", the report's "8. Preference").

Per export and split: **exact-match**, greedy generation from the rendered prompt equal to
the chosen answer (the SFT task's own measure), **preference accuracy**, the share of pairs
whose chosen answer gets the larger summed log-probability after the rendered prompt, and
the **mean margin** (chosen minus rejected, nats). An answer is scored as the preference
strategy trains it: the assistant turn the chat template renders after the prompt, through
its end-of-turn token (without it, a rejected answer that is a prefix of the chosen one
could never rank below it). Log-softmax in float64 over the model's FP32 logits. Both exports are read as HF
directories (``minifield.load_model``'s loader), so one measure serves both.

**The check**: with ``evaluation.max_dev_exact_match_drop`` (tolerance ``t``) in the
preference recipe, the after export's DEV exact-match must be at least the before export's
minus ``t``; the record and the report item say pass or fail, and the rule exits 1 on a fail
(:class:`DevExactMatchDrop`, one line naming both numbers). Absent: shown, not checked.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import numpy as np

from .. import atomic
from ..hf import loaded_model
from ..models.model import padded_length


def _answer_logp(model, prompt, prompt_ids: list[int], answer: str) -> float:
    """The summed log-probability of the assistant turn ``answer`` after ``prompt``."""
    if model.template is None:
        raise ValueError(f"{model.where}: no chat template to render the answers with")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = model.template.render([*messages, {"role": "assistant", "content": answer}])
    ids = model.tokenizer.backend.encode(text, add_special_tokens=False).ids
    if ids[: len(prompt_ids)] != prompt_ids:
        raise ValueError(f"{model.where}: the chat template renders the prompt differently alone")
    # right-padded as generation pads its buffer (the forward is causal: a slot's logits see
    # only the slots up to it), so a few compiled forwards serve every pair instead of one per
    # answer length
    width = padded_length(len(ids), model.cfg.max_len)
    padded = np.zeros(max(width, len(ids)), np.int32)
    padded[: len(ids)] = ids
    logits = np.asarray(model.logits(padded)[: len(ids)], np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    start = len(prompt_ids)
    return float(sum(logp[t - 1, ids[t]] for t in range(start, len(ids))))


def figures(export_dir: Path, pairs_path: Path) -> dict:
    """Exact-match, preference accuracy and mean margin of one export on one pair file."""
    model = loaded_model.from_hf_directory(export_dir, "float32")
    rows = [json.loads(line) for line in Path(pairs_path).read_text().splitlines() if line]
    exact, margins = 0, []
    for row in rows:
        prompt_ids = model.prompt_ids(row["prompt"])
        budget = len(row["chosen"]) + 4
        exact += model.generate(row["prompt"], budget, temperature=0.0) == row["chosen"]
        chosen, rejected = (
            _answer_logp(model, row["prompt"], prompt_ids, row[key])
            for key in ("chosen", "rejected")
        )
        margins.append(chosen - rejected)
    return {
        "pairs": len(rows),
        "exact_match": exact / len(rows),
        "preference_accuracy": sum(m > 0 for m in margins) / len(rows),
        "mean_margin": float(np.mean(margins)),
    }


KEY = "max_dev_exact_match_drop"


class DevExactMatchDrop(Exception):
    """The after export's DEV exact-match fell below the before export's minus the tolerance."""


def tolerance(recipe_path: Path) -> float | None:
    """The preference recipe's ``evaluation.max_dev_exact_match_drop`` (None: absent)."""
    return json.loads(Path(recipe_path).read_text())["evaluation"].get(KEY)


def check(record: dict, max_drop: float | None) -> dict | None:
    """``{max_dev_exact_match_drop, passed}`` of a record (None: no tolerance, no check)."""
    if max_drop is None:
        return None
    before, after = record["before"]["dev"]["exact_match"], record["after"]["dev"]["exact_match"]
    # exact-match is a count over the pairs: 1e-9 absorbs the float sum, nothing a pair moves
    return {KEY: max_drop, "passed": after >= before - max_drop - 1e-9}


def refusal(record: dict, recipe_path: Path) -> str | None:
    """The one-line message of a failed check (None when it passed or there is none)."""
    verdict = record["dev_exact_match_check"]
    if verdict is None or verdict["passed"]:
        return None
    before, after = record["before"]["dev"]["exact_match"], record["after"]["dev"]["exact_match"]
    return (
        f"preference tuning undid the upstream result on DEV: exact-match after {after:.4f} < "
        f"before {before:.4f} - {verdict[KEY]} (evaluation.{KEY} of {recipe_path})"
    )


def _verdict_text(verdict: dict | None) -> str:
    if verdict is None:
        return f"Not checked (the preference recipe has no evaluation.{KEY})."
    word = "PASS" if verdict["passed"] else "FAIL"
    return f"Check after &ge; before &minus; {verdict[KEY]}: <b>{word}</b>."


def compare(
    before: Path,
    after: Path,
    pairs: dict[str, Path],
    out_json: Path,
    out_html: Path,
    recipe: Path | None = None,
):
    """Both exports on every split's pairs; writes the record and the report item (with the
    check of the preference recipe ``recipe``'s tolerance, if it has one) and raises
    :class:`DevExactMatchDrop` after writing them when the check fails."""
    record = {
        "before": {split: figures(before, path) for split, path in pairs.items()},
        "after": {split: figures(after, path) for split, path in pairs.items()},
        "exports": {"before": str(before), "after": str(after)},
    }
    dev = record["before"]["dev"]["exact_match"], record["after"]["dev"]["exact_match"]
    record["dev_exact_match_change"] = dev[1] - dev[0]
    record["dev_exact_match_check"] = check(record, None if recipe is None else tolerance(recipe))
    atomic.write_json(out_json, record)
    rows = "".join(
        f"<tr><td>{label}</td>"
        + "".join(
            f"<td>{record[key][split][m]:.3f}</td>"
            for split in pairs
            for m in ("exact_match", "preference_accuracy", "mean_margin")
        )
        + "</tr>"
        for key, label in (("before", "before (SFT export)"), ("after", "after (preference)"))
    )
    head = "".join(
        f"<th>{s} exact-match</th><th>{s} preference accuracy</th><th>{s} mean margin</th>"
        for s in pairs
    )
    body = (
        "<html><body><h3>Preference tuning: before and after</h3><table border='1'>"
        f"<tr><th>model</th>{head}</tr>{rows}</table><p>Greedy exact-match of the chosen "
        "answer, the share of pairs whose chosen answer (through its end-of-turn token) has "
        "the larger log-probability and the mean log-probability margin (chosen minus "
        f"rejected, nats), on the same pairs. DEV exact-match change: {record['dev_exact_match_change']:+.3f}."
        f" {_verdict_text(record['dev_exact_match_check'])}</p><p>{html.escape(str(before))} → {html.escape(str(after))}</p></body></html>\n"
    )
    atomic.write_bytes(out_html, body.encode("utf-8"))
    message = refusal(record, recipe)
    if message is not None:
        raise DevExactMatchDrop(message)
    return record
