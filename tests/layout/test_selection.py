"""cuattn.dynamic's block selection rules against a restatement of their definitions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cuattn
from cuattn import dynamic

B = 16


def restated_scores(q, k, b, pool):
    """score[h][i][j] by explicit loops over heads and blocks."""
    heads, n, _ = q.shape
    group = heads // k.shape[0]
    nb = -(-n // b)
    reduce = np.mean if pool == "mean" else (lambda x, axis: np.max(x, axis=axis))
    pq = [[reduce(q[h, i * b : (i + 1) * b], axis=0) for i in range(nb)] for h in range(heads)]
    pk = [[reduce(k[g, j * b : (j + 1) * b], axis=0) for j in range(nb)] for g in range(len(k))]
    return [
        [[float(pq[h][i] @ pk[h // group][j]) for j in range(nb)] for i in range(nb)]
        for h in range(heads)
    ]


def restated_topk(scores, topk, causal, keep_diagonal, keep_first):
    out = set()
    for h, rows in enumerate(scores):
        for i, row in enumerate(rows):
            allowed = [j for j in range(len(row)) if j <= i or not causal]
            forced = {j for j in allowed if (keep_diagonal and j == i) or j < keep_first}
            others = sorted((j for j in allowed if j not in forced), key=lambda j: (-row[j], j))
            budget = topk[h] if isinstance(topk, list) else topk
            out |= {(h, i, j) for j in forced | set(others[: budget - len(forced)])}
    return out


def restated_mass(scores, tau, causal, keep_diagonal, max_blocks, scale):
    out = set()
    for h, rows in enumerate(scores):
        for i, row in enumerate(rows):
            allowed = [j for j in range(len(row)) if j <= i or not causal]
            top = max(row[j] * scale for j in allowed)
            weight = {j: np.exp(row[j] * scale - top) for j in allowed}
            total = sum(weight.values())
            ordered = sorted(allowed, key=lambda j: (not (keep_diagonal and j == i), -weight[j], j))
            taken, mass = [], 0.0
            for j in ordered:
                if mass >= tau - 1e-9 or (max_blocks and len(taken) == max_blocks):
                    break
                taken.append(j)
                mass += weight[j] / total
            out |= {(h, i, j) for j in taken}
    return out


def _active(layout):
    return {tuple(int(x) for x in idx) for idx in zip(*np.nonzero(layout.blocks), strict=True)}


def _qk(seed, n=100, heads=4, kv_heads=2, d=16):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((heads, n, d)), rng.standard_normal((kv_heads, n, d))


# numpy: the choice made on the host; interp: made by kernels/layout_build.cu (a DeviceLayout)
BACKENDS = ["numpy", "interp"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pool", ["mean", "max"])
@pytest.mark.parametrize(
    "topk, causal, keep_diagonal, keep_first",
    [(3, True, True, 1), (2, True, False, 0), (4, False, True, 2), ([1, 2, 3, 5], True, True, 0)],
)
def test_topk_blocks_equal_the_definition(topk, causal, keep_diagonal, keep_first, pool, backend):
    q, k = _qk(1)  # n = 100: a ragged last block of 4 rows; GQA 4 query / 2 kv heads
    layout = dynamic.topk_blocks(
        q, k, B, topk, pool, causal, keep_diagonal, keep_first, backend=backend
    )
    scores = restated_scores(q, k, B, pool)
    assert _active(layout) == restated_topk(scores, topk, causal, keep_diagonal, keep_first)
    budget = np.broadcast_to(np.asarray(topk), (4,))
    assert (layout.blocks.sum(axis=-1) <= budget[:, None]).all()  # never over budget
    assert layout.nnz.tolist() == layout.blocks.sum(axis=(1, 2)).tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_go_to_the_lower_block(backend):
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 64, 16))
    k = np.tile(rng.standard_normal((1, 16, 16)), (1, 4, 1))  # four identical key blocks
    layout = dynamic.topk_blocks(
        q, k, B, 2, causal=False, keep_diagonal=False, keep_first=0, backend=backend
    )
    assert _active(layout) == {(0, i, j) for i in range(4) for j in (0, 1)}


@pytest.mark.parametrize(
    "tau, causal, keep_diagonal, max_blocks",
    [
        (0.5, True, True, None),
        (0.9, True, False, None),
        (1.0, False, True, 3),
        (0.3, False, False, None),
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_mass_threshold_blocks_equal_the_definition(
    tau, causal, keep_diagonal, max_blocks, backend
):
    q, k = _qk(3)
    q *= 4  # sharper block scores: heads differ in how many blocks they need
    layout = dynamic.mass_threshold_blocks(
        q,
        k,
        B,
        tau,
        causal=causal,
        keep_diagonal=keep_diagonal,
        max_blocks=max_blocks,
        backend=backend,
    )
    scores = restated_scores(q, k, B, "mean")
    want = restated_mass(scores, tau, causal, keep_diagonal, max_blocks, 16**-0.5)
    assert _active(layout) == want
    if max_blocks:
        assert layout.blocks.sum(axis=-1).max() <= max_blocks


def test_attention_and_gradients_on_a_chosen_layout_equal_the_dense_oracle():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 4, 100, 16)) for _ in range(3))
    layout = dynamic.topk_blocks(q, k, B, 3)
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    out = cuattn.sparse_attention(*leaves, layout)
    (out * out).sum().backward()
    dense = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    s = dense[0] @ dense[1].transpose(-1, -2) / 4.0
    s = s.masked_fill(~torch.from_numpy(layout.to_mask())[None], float("-inf"))
    want = torch.softmax(s, -1) @ dense[2]
    (want * want).sum().backward()
    assert torch.allclose(out, want, rtol=1e-12, atol=1e-12)
    for got, ref in zip(leaves, dense, strict=True):
        assert torch.allclose(got.grad, ref.grad, rtol=1e-10, atol=1e-12)


def test_framework_arrays_and_bad_arguments():
    q, k = _qk(5, kv_heads=4)
    from_torch = dynamic.topk_blocks(torch.from_numpy(q), torch.from_numpy(k), B, 3)
    assert np.array_equal(from_torch.blocks, dynamic.topk_blocks(q, k, B, 3).blocks)
    with pytest.raises(ValueError, match="leave room for the forced blocks"):
        dynamic.topk_blocks(q, k, B, 1, keep_first=1)
    with pytest.raises(ValueError, match="one per head"):
        dynamic.topk_blocks(q, k, B, [1, 2])
    with pytest.raises(ValueError, match="tau must be in"):
        dynamic.mass_threshold_blocks(q, k, B, 1.5)
    with pytest.raises(ValueError, match="a layout is for one sequence"):
        dynamic.topk_blocks(np.stack([q, q]), np.stack([k, k]), B, 3)
    with pytest.raises(ValueError, match="pool must be one of"):
        dynamic.topk_blocks(q, k, B, 3, pool="median")
    with pytest.raises(ValueError, match="as many keys as queries"):
        dynamic.topk_blocks(q, k[:, :50], B, 3)
