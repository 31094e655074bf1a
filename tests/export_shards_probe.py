"""One process of a sharded-export check (run by tests/test_export_shards.py).

Joins the processes named by ``MINIFIELD_COORDINATOR`` / ``MINIFIELD_NUM_PROCESSES`` /
``MINIFIELD_PROCESS_ID`` (none: one process), builds the same seeded host parameters in every
process — a tiny Phi-3 (fused ``qkv_proj`` and ``gate_up_proj``) and a tiny Mixtral with LoRA
adapters (the experts' adapters stacked) — places them on a 4-device mesh with
``shard_params`` (``DataParallel.state_shardings``), and writes the export together
(``export.write_whole`` with the group): the Phi-3 weights in BF16 in shards of at most
``--max-shard-size`` bytes, the Mixtral weights (replicated) in FP32 and its PEFT adapter. Prints process
0's JSON: the export's path, the topology, how many arrays were copied whole to a host
(``arrays.to_host``) and the sizes of everything ``process_allgather`` exchanged.
With ``--full-disk-in K`` the same processes then write the export again, into
``--full-disk-out``, process K's writes failing as on a full disk (two process starts fewer
than a run of its own); each process prints how each of its exports failed, if it did.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from family_reference import PHI3
from test_mixtral import MIXTRAL

from minifield.supervision import distributed

TARGETS = ("q_proj", "v_proj", "w1", "w2", "gate")


def host_params(hf: dict, seed: int):
    """``(cfg, FP32 host parameters)`` of the family ``hf`` describes, seeded."""
    from minifield.hf import config as hf_config

    cfg = hf_config.config_from_hf(hf, max_len=32)
    return cfg, random_params(cfg, seed)


def random_params(cfg, seed: int) -> dict:
    """Random FP32 parameters of ``cfg`` made with NumPy from the tensor table's shapes (no
    JAX initialisation: the values do not depend on how a process compiles)."""
    from minifield.hf import checkpoint as hf_checkpoint
    from minifield.models.expert_slots import put
    from minifield.models.families import param_shape

    rng = np.random.default_rng(seed)
    params: dict = {"blocks": {}}
    for internal, _, _ in hf_checkpoint.expected_tensors(cfg).values():
        for path in (internal,) if isinstance(internal, str) else internal:
            value = rng.standard_normal(param_shape(cfg, path)).astype(np.float32)
            put(params, path, value, cfg.n_experts)  # an expert's: into the stacked experts
    return params


def host_adapters(cfg, seed: int):
    """``(settings, FP32 host adapters)``: LoRA's own tree, every matrix seeded by NumPy (no
    JAX arithmetic, so the values do not depend on how a process compiles)."""
    import jax

    from minifield.training import lora

    settings = lora.LoraSettings(2, 6.0, TARGETS)
    adapters = lora.init_adapters(cfg, settings, jax.random.key(seed))
    rng = np.random.default_rng(seed)
    return settings, jax.tree_util.tree_map(
        lambda x: rng.normal(0, 0.3, x.shape).astype(np.float32), adapters
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-shard-size", type=int, required=True)
    parser.add_argument("--full-disk-in", type=int, help="then its writes fail (ENOSPC)")
    parser.add_argument("--full-disk-out", help="where the export on a full disk goes")
    args = parser.parse_args()
    topology = distributed.initialize()
    group = distributed.Group(topology)
    import jax
    from jax.experimental import multihost_utils

    from minifield.hf import checkpoint as hf_checkpoint
    from minifield.state import arrays, export
    from minifield.training import peft_adapter
    from minifield.training.data_parallel import DataParallel, place_tree

    gathered, exchanged = [], []
    to_host, allgather = arrays.to_host, multihost_utils.process_allgather

    def counting_to_host(leaf):
        gathered.append(tuple(leaf.shape))
        return to_host(leaf)

    def counting_allgather(value, *rest, **options):
        exchanged.append(int(np.size(value)))
        return allgather(value, *rest, **options)

    arrays.to_host = counting_to_host
    multihost_utils.process_allgather = counting_allgather

    mesh = DataParallel(4).mesh()

    def placed(tree, shard: bool = True):
        dp = DataParallel(4, shard)
        abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
        return place_tree(tree, dp.state_shardings(mesh, {"params": abstract})["params"])

    phi3_cfg, phi3 = host_params(PHI3, 1)
    mixtral_cfg, mixtral = host_params(MIXTRAL, 2)
    settings, adapters = host_adapters(mixtral_cfg, 3)
    # the Mixtral weights replicated (dealt out over the processes), the rest sharded
    phi3, mixtral, adapters = placed(phi3), placed(mixtral, False), placed(adapters)
    leaves = jax.tree_util.tree_leaves((phi3, mixtral, adapters))
    exchanged.clear()  # what the export exchanges, not the placement

    def write(directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        hf_checkpoint.write(
            directory / "phi3", phi3_cfg, phi3, "bfloat16", None, args.max_shard_size, group=group
        )
        hf_checkpoint.write(directory / "mixtral", mixtral_cfg, mixtral, group=group)
        adapter_dir = directory / "mixtral" / peft_adapter.ADAPTER_DIR
        peft_adapter.write_adapter(adapter_dir, settings, adapters, "base", mixtral_cfg, group)

    def export_into(out: Path) -> dict | None:
        """How writing the export into ``out/export`` failed (None: it was written)."""
        try:
            export.write_whole(out / "export", write, group)
            return None
        except export.ExportWriteError as exc:
            from minifield import atomic

            return {"message": str(exc), "io_failure": atomic.is_io_failure(exc)}

    final = Path(args.out) / "export"
    failure = export_into(Path(args.out))
    print(json.dumps({"process": topology.process_id, "failure": failure}))
    reported = {"gathered": list(gathered), "exchanged": list(exchanged)}  # the first export's
    if args.full_disk_in is not None:
        if args.full_disk_in == topology.process_id:
            import errno
            import os

            def full(*_):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            os.pwrite = full
        on_full_disk = export_into(Path(args.full_disk_out))
        print(json.dumps({"process": topology.process_id, "full_disk_failure": on_full_disk}))
    if topology.process_id == 0:
        report = {
            "export": str(final),
            "processes": jax.process_count(),
            "devices": jax.device_count(),
            "sharded_arrays": sum(not leaf.is_fully_replicated for leaf in leaves),
            "arrays": len(leaves),
            **reported,
            "failure": failure,
        }
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
