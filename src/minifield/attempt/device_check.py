"""Whether the devices JAX sees can run the recipe's computation, checked before any update.

The recipe may ask for a backend (``runtime.backend``) and a minimum device count
(``runtime.min_devices``); its strategy says how many devices the computation is defined
over (its data-parallel degree). A multi-process attempt must spread every batch over the
devices of all its processes. What was found is reported in a ``device`` event first, so a
refusal can be read next to it.
"""

from __future__ import annotations

from ..recipe import Recipe
from ..supervision import distributed
from .events import EventLog


def check(recipe: Recipe, env: dict, group: distributed.Group, events: EventLog) -> None:
    """Emit the ``device`` event; raise RuntimeError naming what does not fit."""
    import jax

    runtime = recipe.data.get("runtime", {})
    backend = runtime.get("backend", "any")
    devices = jax.devices()
    data_parallel = recipe.strategy.devices_required(recipe.data)
    events.emit(
        "device",
        backend=jax.default_backend(),
        device_kind=env["device_kind"],
        device_count=len(devices),
        process_count=jax.process_count(),
        data_parallel_devices=data_parallel,
    )
    if backend != "any" and jax.default_backend() != backend:
        raise RuntimeError(
            f"recipe runtime.backend={backend!r} but JAX runs on {jax.default_backend()!r} here "
            f"(devices: {[str(d) for d in devices]}); run on a {backend} host or set runtime.backend"
        )
    if len(devices) < runtime.get("min_devices", 1):
        raise RuntimeError(
            f"recipe runtime.min_devices={runtime['min_devices']} but only {len(devices)} "
            "device(s) visible"
        )
    if len(devices) < data_parallel:
        from ..training.data_parallel import missing_devices_message

        raise RuntimeError(missing_devices_message(data_parallel, len(devices)))
    if group.size > 1 and data_parallel != len(devices):
        raise RuntimeError(
            f"{group.size} processes hold {len(devices)} devices in all, but the recipe's "
            f"training.data_parallel.devices is {data_parallel} (strategy "
            f"{recipe.strategy.name}): a multi-process attempt spreads every batch over "
            f"the devices of all its processes. Set training.data_parallel.devices: "
            f"{len(devices)} (a strategy with data parallelism), or start one process"
        )
