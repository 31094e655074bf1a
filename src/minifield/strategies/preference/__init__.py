"""``preference``: tuning a base model on preference pairs (DPO, IPO, SimPO, ORPO).

The strategy (:mod:`.strategy`) and its recipe settings (:mod:`.section`); the losses over
per-answer log-probabilities (:mod:`.losses`); the pair files as packed rows (:mod:`.pairs`,
:mod:`.prepared`); the per-answer log-probabilities of one forward (:mod:`.logprobs`); the
reference model's log-probabilities as a product of their own (:mod:`.reference`); each
update's pairs (:mod:`.batches`), the program on packed-sft's (:mod:`.program`) and the
evaluation (:mod:`.evaluator`). See docs/preference.md. Importing this package does not
import JAX.
"""

# the package's face: what the pipeline and the commands use (never a module below it)
from . import demo_data, reference, reference_link
from .strategy import Preference

__all__ = ["Preference", "demo_data", "reference", "reference_link"]
