"""``grpo``: online reinforcement learning on verifiable rewards (GRPO and its variants).

The strategy (:mod:`.strategy`) and its recipe settings (:mod:`.section`); the prompt files
(:mod:`.prompts`); the program (:mod:`.program`) whose update samples, scores and trains
(:mod:`.update` on the device), the rollouts as a batch and as the file kept per update
(:mod:`.rollouts_file`); the rewards and the evaluation by greedy decoding
(:mod:`.evaluator`). The reinforcement-learning library underneath is
:mod:`minifield.rl`. See docs/grpo.md. Importing this package does not import JAX.
"""

# the package's face: what the pipeline and the commands use (never a module below it)
from . import demo_data
from .strategy import GRPO

__all__ = ["GRPO", "demo_data"]
