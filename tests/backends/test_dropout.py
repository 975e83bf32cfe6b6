"""Attention dropout on the NumPy reference and the kernels' MODS_SCORE variants through the CPU
interpreter: the generator against Random123's known-answer vectors, the kernels' masks equal to
the reference's bit for bit, forward and every gradient against the float64 dense oracle given
the same mask (alone and with every other modifier), the kept fraction within binomial bounds,
and runs bit-identical for one seed.

Dropout is a runtime value of the score-modifier variant: these tests run the instantiations
tests/backends/test_score_mods.py builds.
"""

from __future__ import annotations

import numpy as np
import pytest

from cuattn.backends import NumpyBackend, dropout, geometry, interp
from cuattn.backends.call import AttentionCall, ScoreMods, ScoreOperands
from cuattn.layout import make_layout
from tests.backends.test_interp_kernels import HEADS, TOLERANCE, make_test_layout, n_ctx_for
from tests.backends.test_score_mods import HEAD_DIM, SOFTCAP, _inputs, mods_kernels  # noqa: F401
from tests.helpers.score_operands import check_operands

REF_RTOL = 1e-12
REFERENCE = NumpyBackend()
SEED = 2**40 + 17  # both key words in use
BINOMIAL_SIGMAS = 5

# Random123's known-answer vectors for philox4x32_10: (counter, key) -> the four words.
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize(("counter", "key", "words"), PHILOX_KAT)
def test_the_generator_gives_random123s_known_answers(counter, key, words):
    assert tuple(int(w) for w in dropout.philox4x32_10(counter, key)) == words


def test_the_kept_fraction_is_within_binomial_bounds():
    p, shape = 0.1, (2, 3, 256, 512)
    keep = dropout.keep_mask(p, SEED, *np.indices(shape, sparse=True))
    n = keep.size
    assert abs(keep.sum() - n * (1 - p)) <= BINOMIAL_SIGMAS * np.sqrt(n * p * (1 - p))
    again = dropout.keep_mask(p, SEED + 1, *np.indices(shape, sparse=True))
    assert (keep != again).mean() > 0.1  # another seed, another mask


@pytest.mark.parametrize("block", [16, 64, 128])
def test_the_kernels_drop_exactly_the_references_probabilities(mods_kernels, block):  # noqa: F811
    """q = k = 0 makes every score equal, so P = 1 / n_k; v one-hot per key reads P * Z back
    from out: the kernels' kept set must be the reference's, element by element, in every head
    and batch, for query and key tiles of every size."""
    n, p = 64, 0.3
    layout = make_layout("all", n, HEADS, block, causal=False)
    q = np.zeros((2, HEADS, n, n), np.float32)
    v = np.broadcast_to(np.eye(n, dtype=np.float32), q.shape).copy()
    mods = ScoreMods().with_dropout(p, SEED)
    out, _ = interp.forward(q, q, v, AttentionCall(layout, 1.0, mods=mods))
    kept = out * n * (1 - p)
    assert np.allclose(kept, np.round(kept), atol=1e-5)
    want = dropout.keep_mask(p, SEED, *np.indices(q.shape, sparse=True))
    np.testing.assert_array_equal(np.round(kept) == 1, want)


@pytest.mark.parametrize("rule", geometry.RULES)
def test_reference_dropout_matches_the_oracle(rule):
    n = n_ctx_for(16)
    layout = make_test_layout(rule, 16, n)
    q, k, v, dout = _inputs((2, HEADS, n, 8), np.float64, seed=1)
    check_operands(REFERENCE, q, k, v, dout, layout, REF_RTOL, dropout=(0.25, SEED))


KERNEL_CASES = [(16, dtype, "causal") for dtype in geometry.DTYPES]
KERNEL_CASES += [(16, "float32", rule) for rule in ("none", "bitmask")]
KERNEL_CASES += [(64, "float16", "causal"), (128, "bfloat16", "window")]


@pytest.mark.parametrize(("block", "dtype", "rule"), KERNEL_CASES)
def test_kernels_dropout_match_the_oracle(mods_kernels, block, dtype, rule):  # noqa: F811
    n = n_ctx_for(block) if block < 128 else 150
    layout = make_test_layout(rule, block, n)
    q, k, v, dout = _inputs((2, HEADS, n, HEAD_DIM), dtype, seed=block)
    check_operands(interp, q, k, v, dout, layout, TOLERANCE[dtype], dropout=(0.2, SEED))


def test_kernels_dropout_with_everything_else_bit_identical(mods_kernels):  # noqa: F811
    """Softcap, ALiBi, a key bias and a table beside dropout, GQA, fewer queries than keys, the
    lse's gradient; one seed gives the same bits twice, another seed other outputs."""
    n_k, n_q = 40, 24
    layout = make_layout("all", n_k, 4, 16, n_q=n_q)
    q, _, _, dout = _inputs((2, 4, n_q, HEAD_DIM), "float32", seed=8)
    _, k, v, _ = _inputs((2, 2, n_k, HEAD_DIM), "float32", seed=9)
    rng = np.random.default_rng(10)
    slopes = rng.uniform(0.05, 0.5, 4).astype(np.float32)
    key_bias = (rng.standard_normal((2, n_k)) * 2).astype(np.float32)
    table = rng.standard_normal((4, 7)).astype(np.float32)
    dlse = rng.standard_normal(q.shape[:3]).astype(np.float32)
    args = (interp, q, k, v, dout, layout, TOLERANCE["float32"], SOFTCAP, slopes, key_bias, dlse)
    first = check_operands(*args, rel_bias=table, dropout=(0.3, SEED))
    again = check_operands(*args, rel_bias=table, dropout=(0.3, SEED))
    for a, b in zip((first[0], first[1], *first[2]), (again[0], again[1], *again[2]), strict=True):
        np.testing.assert_array_equal(a, b)
    other = check_operands(*args, rel_bias=table, dropout=(0.3, SEED + 1))
    assert not np.array_equal(first[0], other[0])


# Seeds held in arrays (a traced jax seed, one torch drew on the device): the same key as an int
# seed gives the same mask; above 2^63 too (the whole 64-bit key, which an int seed cannot be).
SEED_ARRAYS = [
    np.array(SEED, np.int64),
    np.array([SEED], np.uint64),
    np.array([SEED & 0xFFFFFFFF, SEED >> 32], np.uint32),
    np.array([0x89ABCDEF, 0xF1234567], np.uint32),  # a key of 2^63 and more
]


@pytest.mark.parametrize("words", SEED_ARRAYS, ids=["int64", "uint64[1]", "uint32[2]", "high"])
def test_a_seed_array_gives_the_mask_of_the_key_it_holds(mods_kernels, words):  # noqa: F811
    """The kernels read the seed's two words from memory: their kept set is the reference's for
    the key the array holds, element by element (the one-hot read-back above), and the whole
    forward and backward match the oracle on both backends."""
    n, p = 48, 0.3
    layout = make_layout("all", n, HEADS, 16, causal=False)
    q = np.zeros((2, HEADS, n, n), np.float32)
    v = np.broadcast_to(np.eye(n, dtype=np.float32), q.shape).copy()
    mods = ScoreMods().with_dropout(p, words)
    assert mods.seed_words and mods.with_operands(ScoreOperands(dropout_seed=words)) == mods
    out, _ = interp.forward(
        q,
        q,
        v,
        AttentionCall(layout, 1.0, mods=mods).with_operands(ScoreOperands(dropout_seed=words)),
    )
    kept = np.round(out * n * (1 - p)) == 1
    key = dropout.seed_of(words)
    want = dropout.keep_mask(p, key, *np.indices(q.shape, sparse=True))
    np.testing.assert_array_equal(kept, want)
    layout = make_test_layout("causal", 16, n_ctx_for(16))
    q, k, v, dout = _inputs((2, HEADS, layout.n_q, HEAD_DIM), "float32", seed=3)
    # float32 inputs: the reference accumulates in float32 too (its dK here is ~6e-6 off the
    # float64 oracle with numpy 2.4), so both are held to float32's tolerance
    for backend in (REFERENCE, interp):
        tolerance = TOLERANCE["float32"]
        check_operands(backend, q, k, v, dout, layout, tolerance, dropout=(0.2, words))


def test_a_seed_array_equals_its_int_bit_for_bit():
    layout = make_test_layout("causal", 16, n_ctx_for(16))
    q, k, v, _ = _inputs((2, HEADS, layout.n_q, HEAD_DIM), "float32", seed=4)
    by_value = interp.forward(
        q, k, v, AttentionCall(layout, 0.5, mods=ScoreMods().with_dropout(0.2, SEED))
    )
    words = SEED_ARRAYS[2]
    mods = ScoreMods().with_dropout(0.2, words)
    by_array = interp.forward(
        q,
        k,
        v,
        AttentionCall(layout, 0.5, mods=mods).with_operands(ScoreOperands(dropout_seed=words)),
    )
    for a, b in zip(by_value, by_array, strict=True):
        np.testing.assert_array_equal(a, b)


def test_no_dropout_is_the_plain_kernels():
    """dropout_p = 0 adds no modifier: the call runs the plain kernels (ScoreMods.any)."""
    assert not ScoreMods().with_dropout(0.0, SEED).any
    assert ScoreMods().with_dropout(0.1, SEED).any


@pytest.mark.parametrize(
    ("p", "seed", "error", "message"),
    [
        (1.0, 0, ValueError, r"dropout_p must be in \[0, 1\)"),
        (-0.1, 0, ValueError, r"dropout_p must be in \[0, 1\)"),
        ("0.1", 0, TypeError, "dropout_p must be a float"),
        (0.1, -1, ValueError, r"dropout_seed must be in \[0, 2\^63\)"),
        (0.1, 2**63, ValueError, r"dropout_seed must be in \[0, 2\^63\)"),
        (0.1, 1.5, TypeError, "dropout_seed must be an int"),
        (0.1, np.zeros(2, np.float32), TypeError, "must be int64 or uint64 .* or uint32"),
        (0.1, np.zeros(2, np.int64), ValueError, r"int64 array must have shape \(\) or \(1,\)"),
        (0.1, np.zeros((1, 2), np.uint32), ValueError, r"must have shape \(2,\)"),
    ],
)
def test_bad_dropout_arguments_are_refused(p, seed, error, message):
    with pytest.raises(error, match=message):
        ScoreMods().with_dropout(p, seed)


@pytest.mark.parametrize(("block", "dtype"), [(16, "float32"), (64, "bfloat16")])
def test_head_dim_256_in_passes_matches_the_oracle(block, dtype):
    """At head dim 256 the variant's dQ (every dtype) and its fp32 forward compute their output
    columns in two passes over the row (registers): every modifier at once, exact as elsewhere,
    the operands' gradients from the first pass only."""
    n = 40
    layout = make_test_layout("causal", block, n)
    q, k, v, dout = _inputs((1, HEADS, n, 256), dtype, seed=20)
    rng = np.random.default_rng(21)
    slopes = rng.uniform(0.05, 0.5, HEADS).astype(np.float32)
    table = rng.standard_normal((HEADS, 9)).astype(np.float32)
    check_operands(
        interp,
        q,
        k,
        v,
        dout,
        layout,
        TOLERANCE[dtype],
        SOFTCAP,
        slopes,
        rel_bias=table,
        dropout=(0.2, SEED),
    )
