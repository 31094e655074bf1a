"""Packing: first-fit decreasing checked by hand, the row arrays, overlong handling, efficiency."""

from __future__ import annotations

import numpy as np
import pytest

from minifield.data import encoding, packing
from minifield.data import tokenizer as tk
from minifield.data.encoding import Encoded
from minifield.strategies.packed_sft import demo_data

PAD = 99


def test_first_fit_decreasing_by_hand():
    # capacity 8, lengths by index: 0:5 1:4 2:3 3:3 4:2 5:1
    # longest first: 5 -> row0 (3 left); 4 -> row1 (4 left); 3 -> row0 (0 left);
    # 3 -> row1 (1 left); 2 -> new row2 (6 left); 1 -> row1 (0 left)
    assert packing.first_fit_decreasing([5, 4, 3, 3, 2, 1], 8) == [[0, 2], [1, 3, 5], [4]]
    # equal lengths keep input order
    assert packing.first_fit_decreasing([2, 2, 2], 4) == [[0, 1], [2]]
    with pytest.raises(ValueError, match="exceeds the capacity"):
        packing.first_fit_decreasing([9], 8)


def test_pack_rows_segments_positions_and_loss_mask_by_hand():
    a = Encoded(prompt=[1, 10], response=[11, 2])  # length 4
    b = Encoded(prompt=[1, 20, 21], response=[22, 23, 2])  # length 6
    c = Encoded(prompt=[1, 30], response=[2])  # length 3
    packed = packing.pack([a, b, c], seq_len=8, overlong="reject", pad_id=PAD)
    # FFD: b (6) -> row0, a (4) -> row1, c (3) -> row1 (4 left there; row0 has 2)
    arrays = packed.rows
    assert arrays.tokens.tolist() == [
        [1, 20, 21, 22, 23, 2, PAD, PAD],
        [1, 10, 11, 2, 1, 30, 2, PAD],
    ]
    assert arrays.segments.tolist() == [[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 2, 2, 2, 0]]
    assert arrays.positions.tolist() == [[0, 1, 2, 3, 4, 5, 0, 0], [0, 1, 2, 3, 0, 1, 2, 0]]
    # only the response tokens (and their <eos>) are trained on
    assert arrays.loss_mask.tolist() == [[0, 0, 0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0, 1, 0]]
    assert packed.stats["real_tokens"] == 13 and packed.stats["slots"] == 16
    assert packed.stats["efficiency"] == pytest.approx(13 / 16)
    assert packed.stats["loss_tokens"] == 6
    # stored as the prepared examples name them (docs/packed-sft.md), and read back
    stored = packed.rows.named("dev")
    assert sorted(stored) == ["dev_loss_mask", "dev_positions", "dev_segments", "dev_tokens"]
    assert stored["dev_segments"] is arrays.segments
    second = packing.Rows.of(stored, "dev").take([1])
    assert second.tokens.tolist() == [[1, 10, 11, 2, 1, 30, 2, PAD]]
    assert second.loss_mask.tolist() == [[0, 0, 1, 1, 0, 0, 1, 0]]


def test_overlong_examples_are_truncated_or_rejected_and_counted():
    short = Encoded([1, 5], [6, 2])  # 4
    long = Encoded([1, 5, 5], [6, 6, 6, 6, 2])  # 8 > 6: keeps prompt + 3 response tokens
    hopeless = Encoded([1, 5, 5, 5, 5, 5], [6, 2])  # the prompt alone fills the row
    truncated = packing.pack([short, long, hopeless], 6, "truncate", PAD)
    assert (truncated.stats["kept"], truncated.stats["truncated"], truncated.stats["rejected"]) == (
        1,
        1,
        1,
    )
    assert truncated.stats["packed"] == 2
    assert [1, 5, 5, 6, 6, 6] in truncated.rows.tokens.tolist()
    rejected = packing.pack([short, long, hopeless], 6, "reject", PAD)
    assert (rejected.stats["kept"], rejected.stats["truncated"], rejected.stats["rejected"]) == (
        1,
        0,
        2,
    )
    assert rejected.rows.tokens.tolist() == [[1, 5, 6, 2, PAD, PAD]]


def test_demo_packing_efficiency_is_at_least_095_and_masks_only_responses():
    tok = tk.byte_tokenizer()
    examples = [encoding.encode(e, tok) for e in demo_data.demo_examples()["train"]]
    packed = packing.pack(examples, 64, "truncate", tok.pad_id)
    arrays = packed.rows
    # recount from the arrays, independently of the reported statistics
    real = int(np.count_nonzero(arrays.segments))
    assert real == sum(len(e) for e in examples)  # nothing dropped or duplicated
    assert real / arrays.tokens.size >= 0.95
    assert packed.stats["efficiency"] == pytest.approx(real / arrays.tokens.size)
    # every example appears once: segment starts == examples
    starts = (arrays.positions == 0) & (arrays.segments > 0)
    assert int(starts.sum()) == len(examples)
    # the loss mask covers exactly response letters and <eos>, never <bos>/<sep>/pad/prompt
    masked = arrays.tokens[arrays.loss_mask == 1]
    assert masked.size == sum(len(e.response) for e in examples)
    assert not np.isin(masked, [tok.bos_id, tok.sep_id, tok.pad_id]).any()
    assert int((masked == tok.eos_id).sum()) == len(examples)
    # a response slot is always preceded, in its segment, by <sep> or another response slot
    rows, cols = np.nonzero(arrays.loss_mask)
    before = arrays.tokens[rows, cols - 1]
    assert np.all((before == tok.sep_id) | (arrays.loss_mask[rows, cols - 1] == 1))


@pytest.mark.slow  # compile-heavy for the fast tier (3 CPU-s there); the full suite runs it; test_model's packed = alone stays fast
def test_packed_loss_equals_sum_of_unpacked_example_losses():
    """No attention or loss leaks across segments: packing changes nothing per example."""
    import jax

    from minifield.models import model

    tok = tk.byte_tokenizer()
    examples = [encoding.encode(e, tok) for e in demo_data.demo_examples(sizes={"x": 12})["x"]]
    cfg = model.ModelConfig(
        vocab_size=tok.vocab_size,
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_ff=64,
        max_len=48,
        compute_dtype="float32",
    )
    params = model.init_params(cfg, jax.random.key(7))
    packed = packing.pack(examples, 48, "reject", tok.pad_id)
    assert packed.stats["rows"] < len(examples)  # several examples really share rows
    loss_fn = jax.jit(model.loss_fn, static_argnums=1)
    _, packed_aux = loss_fn(params, cfg, packed.rows)
    total, count = 0.0, 0.0
    for example in examples:
        alone = packing.pack([example], 48, "reject", tok.pad_id).rows
        _, aux = loss_fn(params, cfg, alone)
        total += float(aux["loss_sum"])
        count += float(aux["tokens"])
    assert float(packed_aux["tokens"]) == count == sum(len(e.response) for e in examples)
    assert float(packed_aux["loss_sum"]) == pytest.approx(total, rel=1e-5)
