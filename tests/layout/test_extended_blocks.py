"""The block builders of cuattn.layout.extended: the parameters that choose between cuattn's rule
and DeepSpeed's (``causal_columns``, ``random_blocks``)."""

import numpy as np
import pytest

from cuattn.layout import extended

NB = 6


def _on(blocks: np.ndarray) -> set[tuple[int, int]]:
    return {(int(r), int(c)) for r, c in zip(*np.nonzero(blocks), strict=True)}


def test_causal_columns_start_at_the_diagonal_or_at_the_group_start():
    # one global group, blocks [2, 4)
    diagonal = extended.global_blocks(NB, [2], [4], causal=True, causal_columns="diagonal")
    start = extended.global_blocks(NB, [2], [4], causal=True, causal_columns="start")
    assert _on(diagonal) == {(r, c) for c in (2, 3) for r in range(c, NB)}
    assert _on(start) == {(r, c) for c in (2, 3) for r in range(2, NB)}  # (2, 3) above
    both = extended.global_blocks(NB, [2], [4])
    assert _on(both) == {(r, c) for c in (2, 3) for r in range(NB)}
    for how in ("diagonal", "start"):
        assert _on(extended.global_blocks(NB, [2], [4], causal_columns=how)) == _on(both)


def test_causal_columns_start_keeps_global_rows_whole():
    rows = extended.global_blocks(NB, [2], horizontal=True, causal=True, causal_columns="start")
    assert rows[2].all() and rows[2:, 2].all() and not rows[:2, 2].any()
    cut = extended.global_blocks(NB, [2], horizontal=True, causal=True)
    assert _on(cut) == {(2, 0), (2, 1)} | {(r, 2) for r in range(2, NB)}


def test_causal_columns_must_be_named():
    with pytest.raises(ValueError, match=r"causal_columns must be one of \('diagonal', 'start'\)"):
        extended.global_blocks(NB, [0], causal=True, causal_columns="first")


def test_variable_blocks_pass_causal_columns_on():
    kw = dict(global_starts=[1], global_ends=[3], causal=True)
    diagonal = extended.variable_blocks(NB, [NB], **kw)
    start = extended.variable_blocks(NB, [1], **kw, causal_columns="start")
    assert not np.triu(diagonal, 1).any()
    assert _on(np.triu(start, 1)) == {(1, 2)}


@pytest.mark.parametrize("causal", [False, True])
def test_random_blocks_given_are_added_as_drawn(causal):
    drawn = np.zeros((NB, NB), dtype=bool)
    drawn[0, 5] = drawn[3, 3] = True  # above the diagonal, and on a window block
    base = extended.bigbird_blocks(NB, 3, [0], [1], causal)
    got = extended.bigbird_blocks(NB, 3, [0], [1], causal, random_blocks=drawn)
    np.testing.assert_array_equal(got, base | drawn)
    variable = extended.variable_blocks(NB, [2], [0], causal=causal, random_blocks=drawn)
    assert variable[0, 5]


@pytest.mark.parametrize("causal", [False, True])
def test_random_blocks_generator_draws_among_the_free_blocks(causal):
    base = extended.bigbird_blocks(NB, 1, [0], [1], causal)
    allowed = np.tril(np.ones((NB, NB), bool)) if causal else np.ones((NB, NB), bool)
    free = allowed & ~base
    rng = np.random.default_rng(3)
    heads = [
        extended.bigbird_blocks(NB, 1, [0], [1], causal, random_blocks=rng, num_random_blocks=2)
        for _ in range(4)
    ]
    for got in heads:
        extra = got & ~base
        assert (got >= base).all() and not (extra & ~free).any()
        np.testing.assert_array_equal(extra.sum(axis=1), np.minimum(2, free.sum(axis=1)))
    assert len({h.tobytes() for h in heads}) > 1  # one generator, drawn on per call
    again = extended.bigbird_blocks(
        NB, 1, [0], [1], causal, random_blocks=np.random.default_rng(3), num_random_blocks=2
    )
    np.testing.assert_array_equal(again, heads[0])
