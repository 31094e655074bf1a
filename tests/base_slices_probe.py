"""One process of a check that a base's FP32 masters are converted slice by slice where they
are placed (run by tests/test_base_slices.py).

Joins the processes named by ``MINIFIELD_COORDINATOR`` / ``MINIFIELD_NUM_PROCESSES`` /
``MINIFIELD_PROCESS_ID`` (none: one process); each reads the same BF16 base written under
``--base`` (prepared arrays as the prepare stage stores them), places its FP32 masters on a
4-device mesh with ``shard_params`` from :class:`FP32Slices` leaves, and prints its JSON: the
elements it converted (every slice asked for, and whether any leaf was converted whole), the
whole model's elements, and the version-3 state hash of the placed parameters next to that of
the eagerly converted ones placed alike.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from minifield.supervision import distributed


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True)
    args = parser.parse_args()
    distributed.initialize()
    import jax

    from minifield.hf import checkpoint as hf_checkpoint
    from minifield.hf import stored_base
    from minifield.state import arrays
    from minifield.training.data_parallel import DataParallel, place_tree

    cfg, stored, layout = hf_checkpoint.load_stored(args.base, compute_dtype="float32")
    prepared = stored_base.to_arrays(stored, layout)
    converted, whole = [], []
    getitem, as_array = stored_base.FP32Slices.__getitem__, stored_base.FP32Slices.__array__

    def counting_getitem(self, index):
        value = getitem(self, index)
        converted.append(int(value.size))
        return value

    def counting_array(self, dtype=None, copy=None):
        whole.append(self.shape)
        return as_array(self, dtype, copy)

    stored_base.FP32Slices.__getitem__ = counting_getitem
    stored_base.FP32Slices.__array__ = counting_array
    by_slices = stored_base.host_fp32(prepared, by_slices=True)
    eager = stored_base.host_fp32(prepared)
    dp = DataParallel(4, True)
    mesh = dp.mesh()
    abstract = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(tuple(a.shape), np.float32), eager
    )
    shardings = dp.state_shardings(mesh, {"params": abstract})["params"]
    placed = place_tree(by_slices, shardings)
    converted_elements = sum(converted)
    reference = place_tree(eager, shardings)
    leaves = jax.tree_util.tree_leaves(by_slices)
    print(
        json.dumps(
            {
                "process": jax.process_index(),
                "processes": jax.process_count(),
                "lazy_leaves": sum(isinstance(v, stored_base.FP32Slices) for v in leaves),
                "lazy_elements": sum(
                    int(np.prod(v.shape)) for v in leaves if isinstance(v, stored_base.FP32Slices)
                ),
                "converted": converted_elements,
                "converted_whole": len(whole),
                "hash": arrays.state_hash({"params": placed}),
                "reference_hash": arrays.state_hash({"params": reference}),
                "architecture": cfg.architecture,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
