"""Figures and tables for ``snakemake --report``: one function per report item.

Every function reads result files the pipeline already wrote (events, summary,
evaluation metrics, recovery proof, publication record, capacity table) and
writes one PNG (matplotlib, Agg backend) or one self-contained HTML table.
Nothing here computes a new measurement: numbers come from the files, so the
report shows exactly what the pipeline recorded.
"""
