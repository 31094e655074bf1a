"""``preference``: tuning a base model on preference pairs (DPO, IPO, SimPO, ORPO).

The parts: the losses over per-answer log-probabilities (:mod:`.losses`), the pair files as
packed rows (:mod:`.pairs`), the per-answer log-probabilities of one forward
(:mod:`.logprobs`) and the reference model's log-probabilities as a product of their own
(:mod:`.reference`). See docs/preference.md. Importing this package does not import JAX.
"""
