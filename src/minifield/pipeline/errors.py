"""What a pipeline stage raises, and how a rule's script ends on a refusal of bad input.

A refusal (a bad recipe, input file, row, reward or proof) ends the script with one line on
its log, which Snakemake shows under the failed job, and exit :data:`EXIT_REFUSED`: no
traceback. The line starts with :data:`REFUSED`, so the Snakefile's ``onerror`` handler can
repeat it as the run's last line (:func:`refusal_lines`). Any other exception is a bug and
keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: the exit status of a stage that refused its input (the worker's and the CLI's too)
EXIT_REFUSED = 2
#: how a refusal's line starts
REFUSED = "minifield refused"


class StageError(Exception):
    pass


def _refusal_types() -> tuple[type[BaseException], ...]:
    # imported when a stage fails, not when it starts: most stages never need them
    from ..data.chat_template import ChatTemplateError
    from ..data.tokenizer import TokenizerError
    from ..harness.tasks import HarnessTaskError
    from ..inputs.credentials import CredentialsError
    from ..inputs.examples import ExamplesError
    from ..inputs.fetch import FetchError
    from ..inputs.origins import OriginError
    from ..inputs.pinned import InputError
    from ..recipe import RecipeError
    from ..rl.python_reward import RewardError
    from ..store.errors import StoreError

    return (
        StageError,
        RecipeError,
        InputError,
        ExamplesError,
        FetchError,
        OriginError,
        CredentialsError,
        ChatTemplateError,
        TokenizerError,
        HarnessTaskError,
        RewardError,
        StoreError,
    )


def one_line(stage: str, message: str) -> str:
    """The refusal's line: the stage, then the message with its line breaks joined by "; "."""
    parts = [part.strip() for part in str(message).splitlines() if part.strip()]
    return f"{REFUSED} ({stage}): {'; '.join(parts) or 'no message'}"


@contextmanager
def refusals(stage: str) -> Iterator[None]:
    """Around a rule script's call: a refusal prints :func:`one_line` on stderr (the rule's
    log) and exits :data:`EXIT_REFUSED`; anything else propagates with its traceback."""
    try:
        yield
    except Exception as exc:
        if not isinstance(exc, _refusal_types()):
            raise
        print(one_line(stage, str(exc)), file=sys.stderr, flush=True)
        raise SystemExit(EXIT_REFUSED) from None


def refusal_lines(run_logs: list | str | Path | None) -> list[str]:
    """The refusals the Snakemake run's log files hold (Snakemake copies a failed job's log
    into them), each once, in order."""
    if isinstance(run_logs, (str, Path)):
        run_logs = [run_logs]
    seen: dict[str, None] = {}
    for run_log in run_logs or []:
        try:
            text = Path(run_log).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith(REFUSED):
                seen.setdefault(line.strip())
    return list(seen)
