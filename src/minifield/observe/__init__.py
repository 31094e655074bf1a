"""Measured signals of training jobs: the summary, capacity arithmetic and report figures."""
