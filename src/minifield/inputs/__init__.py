"""Inputs of a computation: pinned files, remote ones fetched by origin, and prepared examples."""
