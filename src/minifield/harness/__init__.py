"""lm-evaluation-harness tasks on minifield's own forward and generation (docs/harness.md).

``loading`` (the one adapter to the export loader), ``model`` (the harness model, registered as
``minifield`` in lm-eval's model registry when imported), ``tasks`` (pinned, offline task files:
checked and rewritten to their verified local data), ``thresholds`` (``task/metric >= value``
acceptance, read by the store without lm-eval), ``run`` (tasks evaluated on an export: what the
evaluate stage records), ``cli`` (``minifield-lm-eval``: lm-eval's command line with the
``minifield`` model registered). Only ``model``, ``run`` and ``cli`` import lm-eval (the
``harness`` extra) and JAX.
"""
