"""What a pipeline stage raises: Snakemake shows the message and fails the job."""


class StageError(Exception):
    pass
