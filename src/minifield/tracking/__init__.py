"""Delivery of runs and publications to an MLflow tracking server (docs/tracking.md).

The local files stay the source of truth (``events.jsonl``, ``results/``, the store);
MLflow is where they are delivered. Modules, one concept each:

- :mod:`.settings` — the ``tracking`` config section, checked;
- :mod:`.connection` — the MLflow client, its credentials and the retry policy;
- :mod:`.cursor` — the persisted per-attempt delivery cursor (exactly-once);
- :mod:`.attempt_events` — reading an attempt's events incrementally, events → metrics;
- :mod:`.runs` — runs (one per computation, one nested run per attempt) and what goes in;
- :mod:`.delivery` — an attempt's events delivered to its run, exactly once;
- :mod:`.live` — the follower process the supervisor starts beside a training worker;
- :mod:`.registry` — the model-registry mirror of the publication store.

Nothing here is imported unless ``tracking.enabled`` is true, so the pipeline runs without
the MLflow client installed.
"""
