"""The files of one attempt directory, ``OUT/<job_id>/<attempt_id>/``: every name in one place.

::

    attempt.json    identity, environment fingerprint, the attempt it resumed from (written first)
    events.jsonl    the event stream, one JSON object per line (see events.py)
    checkpoints/    committed checkpoints, one ``step-NNNNNNNN/`` each (see checkpoint.py)
    export/         loadable final weights and ``model.json`` (a completed attempt)
    result.json     status, checkpoint, final state hash, metrics (written last)
    .reserve        space held back while the attempt runs, so that a full disk still lets
                    it write how it ended (removed before result.json)

The worker writes these; resume, recovery proofs, evaluation, summaries, capacity figures and
the store read them. This module imports nothing, so any reader can use it without the
training stack.
"""

ATTEMPT_JSON = "attempt.json"
EVENTS = "events.jsonl"
CHECKPOINTS = "checkpoints"
EXPORT = "export"
RESULT = "result.json"
RESERVE = ".reserve"
