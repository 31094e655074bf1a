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
the store read them. This module imports only the standard library, so any reader can use it
without the training stack.
"""

import datetime as dt
import secrets

ATTEMPT_JSON = "attempt.json"
EVENTS = "events.jsonl"
CHECKPOINTS = "checkpoints"
EXPORT = "export"
RESULT = "result.json"
RESERVE = ".reserve"


def new_attempt_id() -> str:
    """A new attempt directory's name: its UTC start time and six random hex digits."""
    return dt.datetime.now(dt.UTC).strftime("a%Y%m%dT%H%M%SZ-") + secrets.token_hex(3)
