"""The shipped multiple-choice task's accuracy counted by hand: one ``loglikelihood`` request
per choice on an export, the argmax against the label read from the data file (the reference
the harness tests hold lm-eval's and the evaluate stage's ``acc`` to)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def mc_accuracy(export: Path, data: Path, limit: int) -> float:
    from lm_eval.api.instance import Instance

    from minifield.harness.model import MinifieldLM

    lm = MinifieldLM(path=str(export), batch_size=8)
    right = 0
    for line in data.read_text().splitlines()[:limit]:
        doc = json.loads(line)
        context = f"reverse: {doc['prompt']} ->"
        requests = [Instance("loglikelihood", {}, (context, f" {c}"), 0) for c in doc["choices"]]
        scores = [logp for logp, _ in lm.loglikelihood(requests)]
        right += int(np.argmax(scores)) == doc["label"]
    return right / limit
