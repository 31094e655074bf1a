"""``minifield-lm-eval``: lm-eval's own command line with the ``minifield`` model registered.

lm-eval 0.4.13 finds models by import only (no entry-point group), so its ``lm_eval``
command cannot know ours; this one imports :mod:`.model` (which registers it) and hands every
argument to lm-eval unchanged::

    minifield-lm-eval --model minifield --model_args path=EXPORT_DIR --tasks TASK \\
        --include_path DIR_OF_TASK_YAML

Nothing here switches the hub off: a task that names a hub dataset would be fetched (or fail,
offline). The pipeline's evaluate stage reads pinned task files only (:mod:`.tasks`).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Run lm-eval's command line; a model path or argument it cannot use exits 2 with one
    line (lm-eval's own errors are its own)."""
    from lm_eval.__main__ import cli_evaluate

    from . import loading, model  # model registers "minifield"

    sys.argv = ["minifield-lm-eval", *(sys.argv[1:] if argv is None else argv)]
    try:
        cli_evaluate()
    except (loading.LoadError, model.HarnessModelError) as exc:
        print(f"minifield-lm-eval: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
