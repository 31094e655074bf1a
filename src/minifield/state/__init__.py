"""The complete training state: named arrays and their hash, checkpoints of it (the format),
and exported weights."""
