"""The reference policy of a grpo update (``rl.beta`` > 0): its per-token log-probabilities of
the update's rows, the k3 KL's other side.

With LoRA the reference is the frozen base itself, run with the adapters' contribution left
out (:func:`.update.make_reference`): no copy of the model. With full fine-tuning it is the
starting weights, held on the device (on the mesh: placed as the state's parameters are,
replicated or sharded) from the first update that needs them: one more copy of the model's
parameters in FP32.
"""

from __future__ import annotations

import numpy as np

from . import update


class ReferencePolicy:
    def __init__(self, cfg, temperature: float, lora_settings=None):
        self._fn = update.make_reference(cfg, temperature, lora_settings)
        self._lora = lora_settings is not None
        self._params = None  # full fine-tuning: the starting weights, placed at first use

    def logps(self, state, tokens, *, base, start_params, layout, data_parallel):
        """``[N, S]`` log-probabilities of ``tokens``, left on the device (on the mesh split
        as the rows) for the update that reads them (``base``: LoRA's frozen base;
        ``start_params``: full fine-tuning's starting weights, host arrays; ``layout`` and
        ``data_parallel``: the program's mesh, None on one device)."""
        import jax

        from ...training import data_parallel as placement

        if layout is not None:
            tokens = jax.device_put(tokens, layout.batch)
        if self._lora:
            return self._fn(base, state["params"], tokens)
        if self._params is None:
            if layout is None:
                self._params = jax.device_put(start_params)
            else:
                abstract = jax.tree_util.tree_map(
                    # shapes and dtypes only: a base converted slice by slice stays so
                    lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype),
                    start_params,
                )
                where = data_parallel.state_shardings(layout.mesh, {"params": abstract})
                self._params = placement.place_tree(start_params, where["params"])
        return self._fn(self._params, tokens)
