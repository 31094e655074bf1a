"""The pipeline stages as plain functions (each Snakemake script calls exactly one), and the
workflow's view of the configuration.

validate → fetch_inputs → hash_inputs → prepare (``preparation``) → qualify → train
(``training``) → evaluate (``evaluation``). Each reads the files the previous stage wrote and
writes its own outputs atomically; a stage that cannot go on raises ``errors.StageError``.
"""
