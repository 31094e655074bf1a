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


def main(argv: list[str] | None = None) -> None:
    from lm_eval.__main__ import cli_evaluate

    from . import model  # noqa: F401 - registers the "minifield" model

    sys.argv = ["minifield-lm-eval", *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()


if __name__ == "__main__":
    main()
