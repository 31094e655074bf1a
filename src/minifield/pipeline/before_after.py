"""Before and after preference tuning in a chain: the upstream export (the SFT result the
preference computation starts from) and the preference computation's export, measured on
the same DEV and TEST pairs (docs/preference.md "The pipeline", the report's "8. Preference").

Per export and split: **exact-match**, greedy generation from the rendered prompt equal to
the chosen answer (the SFT task's own measure), and **preference accuracy**, the share of
pairs whose chosen answer's tokens get the larger summed log-probability after the rendered
prompt (log-softmax in float64 over the model's FP32 logits). Both exports are read as HF
directories (``minifield.load_model``'s loader), so one measure serves both.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import numpy as np

from .. import atomic
from ..strategies.packed_sft import loaded


def _answer_logp(model, prompt_ids: list[int], answer: str) -> float:
    answer_ids = model.tokenizer._backend.encode(answer, add_special_tokens=False).ids
    ids = [*prompt_ids, *answer_ids]
    logits = np.asarray(model.logits(ids), np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    start = len(prompt_ids)
    return float(sum(logp[t - 1, ids[t]] for t in range(start, len(ids))))


def figures(export_dir: Path, pairs_path: Path) -> dict:
    """Exact-match and preference accuracy of one export on one pair file."""
    model = loaded.from_hf_directory(export_dir, "float32")
    rows = [json.loads(line) for line in Path(pairs_path).read_text().splitlines() if line]
    exact = preferred = 0
    for row in rows:
        prompt_ids = model.prompt_ids(row["prompt"])
        budget = len(row["chosen"]) + 4
        exact += model.generate(row["prompt"], budget, temperature=0.0) == row["chosen"]
        chosen = _answer_logp(model, prompt_ids, row["chosen"])
        preferred += chosen > _answer_logp(model, prompt_ids, row["rejected"])
    return {
        "pairs": len(rows),
        "exact_match": exact / len(rows),
        "preference_accuracy": preferred / len(rows),
    }


def compare(before: Path, after: Path, pairs: dict[str, Path], out_json: Path, out_html: Path):
    """Both exports on every split's pairs; writes the record and the report item."""
    record = {
        "before": {split: figures(before, path) for split, path in pairs.items()},
        "after": {split: figures(after, path) for split, path in pairs.items()},
        "exports": {"before": str(before), "after": str(after)},
    }
    dev = record["before"]["dev"]["exact_match"], record["after"]["dev"]["exact_match"]
    record["dev_exact_match_change"] = dev[1] - dev[0]
    atomic.write_json(out_json, record)
    rows = "".join(
        f"<tr><td>{label}</td>"
        + "".join(
            f"<td>{record[key][split][m]:.3f}</td>"
            for split in pairs
            for m in ("exact_match", "preference_accuracy")
        )
        + "</tr>"
        for key, label in (("before", "before (SFT export)"), ("after", "after (preference)"))
    )
    head = "".join(f"<th>{s} exact-match</th><th>{s} preference accuracy</th>" for s in pairs)
    body = (
        "<html><body><h3>Preference tuning: before and after</h3><table border='1'>"
        f"<tr><th>model</th>{head}</tr>{rows}</table><p>Greedy exact-match of the chosen "
        "answer and the share of pairs whose chosen answer has the larger log-probability, "
        f"on the same pairs. DEV exact-match change: {record['dev_exact_match_change']:+.3f}."
        f"</p><p>{html.escape(str(before))} → {html.escape(str(after))}</p></body></html>\n"
    )
    atomic.write_bytes(out_html, body.encode("utf-8"))
    return record
