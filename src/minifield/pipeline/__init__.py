"""The pipeline stages the Snakemake rules call, and the workflow's view of the configuration."""
