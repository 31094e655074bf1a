"""The listing ``benchmarks/llama_step.py`` compares between our step and the minimal loop:
the vocabulary-sized work of a compiled program, read from its optimised HLO.

Checked on small programs whose vocabulary work is known by construction: an extra pass over
the logits (an argmax for an accuracy metric) must change the listing, a reduction whose result
has no vocabulary axis must still be counted (by the array it reads), and the same program
compiled twice must list the same. A listing that missed any of these could not tell the two
loops apart.
"""

from __future__ import annotations

import sys

import pytest
from conftest import REPO

V = 977  # a vocabulary no other axis here has


@pytest.fixture(scope="module")
def vocab_ops():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import llama_step
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return llama_step.vocab_ops


def _hlo(fn, *shapes):
    import jax
    import jax.numpy as jnp

    args = [jnp.ones(s, jnp.float32) for s in shapes]
    return jax.jit(fn).lower(*args).compile().as_text()


def _loss(h, w):
    import jax
    import jax.numpy as jnp

    return -jnp.sum(jax.nn.log_softmax(h @ w, axis=-1)[:, 0])


def _loss_and_accuracy(h, w):
    import jax.numpy as jnp

    return _loss(h, w), jnp.mean(jnp.argmax(h @ w, axis=-1) == 0)


def test_listing_sees_an_extra_pass_over_the_logits(vocab_ops):
    plain = vocab_ops(_hlo(_loss, (8, 16), (16, V)), V)
    again = vocab_ops(_hlo(_loss, (8, 16), (16, V)), V)
    extra = vocab_ops(_hlo(_loss_and_accuracy, (8, 16), (16, V)), V)
    assert plain and plain == again
    assert extra != plain
    assert sum(extra.values()) > sum(plain.values())


def test_listing_counts_a_reduction_over_the_vocabulary_by_what_it_reads(vocab_ops):
    import jax.numpy as jnp

    ops = vocab_ops(_hlo(lambda x: jnp.sum(jnp.exp(x)), (4, V)), V)
    # exp makes a [4, V] array; the reduction reading it makes none (XLA:CPU may reduce in
    # two stages, the second reading only the first's partial sums, which is not counted)
    assert any(f"{V}" in result for _, result in ops)
    assert any(f"{V}" not in result for _, result in ops)
    assert vocab_ops(_hlo(lambda x: jnp.sum(jnp.exp(x)), (4, 5)), V) == {}
