"""``grpo``: online reinforcement learning on verifiable rewards (GRPO and its variants).

The strategy (:mod:`.strategy`) and its recipe settings (:mod:`.section`); the prompt files
(:mod:`.prompts`); the program (:mod:`.program`) whose update samples, scores and trains
(:mod:`.update` on the device), the rollouts as a batch and as the file kept per update
(:mod:`.rollouts_file`); the rewards and the evaluation by greedy decoding
(:mod:`.evaluator`). The reinforcement-learning library underneath is
:mod:`minifield.rl`. See docs/grpo.md. Importing this package does not import JAX.
"""

# the package's face: what the pipeline and the commands use (never a module below it)
from pathlib import Path

from . import demo_data
from .section import python_reward_inputs
from .strategy import GRPO

__all__ = ["GRPO", "demo_data", "model_figures", "python_reward_inputs"]


def model_figures(recipe: dict, model_dir: Path, prompts_path: Path, files: dict[str, Path]):
    """Greedy reward figures of any HF directory with a chat template on a prompt file, as
    the grpo recipe renders and scores them (the chain's before/after record)."""
    from ...hf import loaded_model
    from .evaluator import model_metrics

    model = loaded_model.from_hf_directory(model_dir, "float32")
    return model_metrics(recipe, model, Path(prompts_path), files, prefix="split")
