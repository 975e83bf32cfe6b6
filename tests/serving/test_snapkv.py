"""SnapKV and its head-adaptive form (Ada-KV) against a restatement of the selection rule.

The restatement works one sequence and one head at a time, over the prompt as a contiguous key
axis, in float64: the window's softmax over every key it may see, the votes for the older keys
summed over the window, a 'same'-padded pool (np.pad, then the windows of
sliding_window_view), the mean over the kv group's query heads, then the best by a lexsort.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuattn
from cuattn import policies as P

D = 16  # the smallest head dim the decode kernels have


def _votes(q_heads, keys, present, window, kernel_size, pooling):
    """float64 [older]: one kv group's pooled votes for the keys before the last ``window``;
    ``present`` [length] says which positions are candidates (the rest are no keys, and count
    as nothing in the pool: the pool's padding value)."""
    length = len(keys)
    older = length - window
    if older == 0:
        return np.zeros(0)
    nothing = -np.inf if pooling == "max" else 0.0
    pooled = []
    for q in q_heads:  # [length, D] each: one query head's queries
        rows = q[older:] @ keys.T / np.sqrt(D)
        seen = (np.arange(length)[None, :] <= np.arange(older, length)[:, None]) & present
        rows = np.where(seen, rows, -np.inf)
        probs = np.exp(rows - rows.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        vote = np.where(present[:older], probs[:, :older].sum(axis=0), nothing)
        padded = np.pad(vote, kernel_size // 2, constant_values=nothing)
        view = np.lib.stride_tricks.sliding_window_view(padded, kernel_size)
        pooled.append(view.max(axis=1) if pooling == "max" else view.sum(axis=1) / kernel_size)
    return np.mean(pooled, axis=0)


def _reference(q, k, lengths, budget, window, kernel_size, pooling, present=None):
    """The kept positions [batch][kv_head] (sorted lists) after an append with queries, the
    candidates being ``present[b][h]`` (bool [length]; default: every position)."""
    batch, kv_heads = k.shape[:2]
    group = q.shape[1] // kv_heads
    kept = []
    for b, length in enumerate(lengths):
        w = min(window, length)
        older = length - w
        here = [
            np.ones(length, bool) if present is None else present[b][h] for h in range(kv_heads)
        ]
        votes = [
            _votes(
                q[b, h * group : (h + 1) * group, :length],
                k[b, h, :length],
                here[h],
                w,
                kernel_size,
                pooling,
            )
            for h in range(kv_heads)
        ]
        older_of = [np.flatnonzero(here[h][:older]) for h in range(kv_heads)]
        newest = list(range(older, length))
        if isinstance(budget, P.HeadAdaptive):
            spare = budget.total - kv_heads * w
            flat = [(votes[h][p], p, h) for h in range(kv_heads) for p in older_of[h]]
            order = np.lexsort(
                ([h for *_, h in flat], [-p for _, p, _ in flat], [-v for v, *_ in flat])
            )
            chosen = [flat[i] for i in order[:spare]]
            kept.append(
                [sorted([p for _, p, g in chosen if g == h] + newest) for h in range(kv_heads)]
            )
            continue
        per_head = budget if isinstance(budget, list) else [budget] * kv_heads
        row = []
        for h in range(kv_heads):
            positions = older_of[h]
            order = np.lexsort((-positions, -votes[h][positions]))
            row.append(sorted([int(p) for p in positions[order[: per_head[h] - w]]] + newest))
        kept.append(row)
    return kept


def _attend(q, keys, values, k_pos, q_pos):
    """float64 causal attention of q [g, t_q, D] over keys at positions k_pos."""
    s = q @ keys.T / np.sqrt(D)
    s = np.where(k_pos[None, None, :] <= q_pos[None, :, None], s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ values


CASES = {
    # name: (budget, window, kernel_size, pooling, kv_heads, group, page_size, lengths, chunk)
    "max7": (20, 4, 7, "max", 2, 2, 4, [40, 33], 0),
    "max7_mqa": (11, 3, 7, "max", 1, 4, 16, [50, 47], 0),
    "avg7_gqa3": (15, 5, 7, "avg", 2, 3, 1, [37, 29], 0),
    "max1": (9, 2, 1, "max", 2, 2, 4, [30, 30], 0),
    "avg1": (9, 2, 1, "avg", 3, 1, 2, [25, 18], 0),
    "per_head": ([6, 14], 4, 7, "max", 2, 2, 4, [31, 24], 0),
    "over_prompt": (64, 4, 7, "max", 2, 2, 4, [40, 3], 0),
    "short_prompt": (12, 8, 7, "avg", 2, 2, 4, [30, 5], 0),
    "chunked": (18, 6, 7, "max", 2, 2, 4, [45, 38], 20),
    "adaptive": (P.head_adaptive(30), 4, 7, "max", 3, 2, 4, [40, 26], 0),
    "adaptive_avg1": (P.head_adaptive(25), 3, 1, "avg", 2, 2, 1, [33, 20], 0),
    "adaptive_chunked": (P.head_adaptive(40), 5, 7, "avg", 2, 1, 16, [60, 44], 25),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_kept_set_is_the_restatements(name):
    """Fresh random prompts (ragged, GQA, pool widths 1 and 7, max and average, budgets above
    and below the prompt, a chunked prefill whose older keys come from the pages): the cache
    keeps exactly the restatement's positions; then decode steps, which SnapKV leaves alone,
    attend exactly the kept tokens (NumPy reference, float64)."""
    budget, window, kernel_size, pooling, kv_heads, group, page, lengths, chunk = CASES[name]
    rng = np.random.default_rng(sorted(CASES).index(name))
    batch, heads, longest = len(lengths), kv_heads * group, max(lengths)
    k, v = (rng.standard_normal((batch, kv_heads, longest, D)) for _ in "kv")
    q = rng.standard_normal((batch, heads, longest, D))
    policy = P.SnapKV(budget, window, kernel_size=kernel_size, pooling=pooling)
    cache = cuattn.KVCache(batch, kv_heads, D, "float64", page_size=page, policy=policy)
    first = cache.num_pages
    if chunk:  # an earlier chunk without queries: kept whole, read back from the pages
        cache.append(k[:, :, :chunk], v[:, :, :chunk])
        assert (cache.positions() == np.arange(chunk)).all()
    rest = np.array(lengths) - chunk
    cache.append(k[:, :, chunk:], v[:, :, chunk:], lengths=rest, q=q[:, :, chunk:])
    want = _reference(q, k, lengths, budget, window, kernel_size, pooling)
    got = cache.positions()
    for b in range(batch):
        for h in range(kv_heads):
            assert [int(p) for p in got[b, h] if p >= 0] == want[b][h], (b, h)
    assert cache.num_pages == first  # the prefill fits the pool its budgets sized
    keys, values, kept = k, v, want
    for _ in range(3):
        x, y = (rng.standard_normal((batch, kv_heads, 1, D)) for _ in "kv")
        cache.append(x, y)
        keys, values = np.concatenate([keys, x], 2), np.concatenate([values, y], 2)
        kept = [[row + [int(cache.lengths[b]) - 1] for row in kept[b]] for b in range(batch)]
        step = rng.standard_normal((batch, heads, 1, D))
        out = cuattn.decode_attention(step, cache)
        for b in range(batch):
            for h in range(kv_heads):
                assert [int(p) for p in cache.positions()[b, h] if p >= 0] == kept[b][h]
                pos = np.array(kept[b][h])
                # sequence b's tokens sit at their positions in keys: the shorter one's
                # decode tokens follow its prompt, so index them by position
                at = np.where(pos < lengths[b], pos, pos - lengths[b] + longest)
                group_q = step[b, h * group : (h + 1) * group]
                want_out = _attend(group_q, keys[b, h, at], values[b, h, at], pos, pos[-1:])
                np.testing.assert_allclose(
                    out[b, h * group : (h + 1) * group], want_out, rtol=1e-12, atol=1e-14
                )


def test_decode_on_the_kernels_after_a_prefill():
    """The split-KV kernels on the interpreter (float32) read a SnapKV cache as the reference
    does."""
    rng = np.random.default_rng(7)
    cache = cuattn.KVCache(2, 2, D, "float32", page_size=4, policy=P.SnapKV(10, 3))
    k, v = (rng.standard_normal((2, 2, 27, D)).astype(np.float32) for _ in "kv")
    q = rng.standard_normal((2, 4, 27, D)).astype(np.float32)
    cache.append(k, v, lengths=[27, 19], q=q)
    for _ in range(2):
        x = rng.standard_normal((2, 2, 1, D)).astype(np.float32)
        cache.append(x, x)
        step = rng.standard_normal((2, 4, 1, D)).astype(np.float32)
        want = cuattn.decode_attention(step, cache, backend="numpy")
        got = cuattn.decode_attention(step, cache, backend="interp")
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_appending_with_queries_reads_nothing_back(monkeypatch):
    """The vote runs in whole-array operations on the cache's device, and so do the
    close-up after it, the growth as decoding adds tokens and the smaller pool a second vote
    leaves: a cache whose arrays refuse to reach the host keeps what a plain NumPy cache
    keeps, at every step."""
    from cuattn.serving import cache as cache_module
    from tests.serving.test_kv_cache import _DeviceModule

    rng = np.random.default_rng(8)
    k = rng.standard_normal((2, 2, 30, D)).astype(np.float32)
    q = rng.standard_normal((2, 4, 30, D)).astype(np.float32)
    plain = cuattn.KVCache(2, 2, D, "float32", page_size=4, policy=P.SnapKV(12, 3, 5, "avg"))
    monkeypatch.setattr(cache_module, "device_module", lambda device, name: _DeviceModule("device"))
    device = cuattn.KVCache(2, 2, D, "float32", page_size=4, policy=P.SnapKV(12, 3, 5, "avg"))
    for cache in (plain, device):
        cache.append(k[:, :, :10], k[:, :, :10])
        cache.append(k[:, :, 10:], k[:, :, 10:], lengths=[20, 15], q=q[:, :, 10:])
    np.testing.assert_array_equal(device.positions(), plain.positions())
    first = plain.num_pages
    for step in range(40):
        t = 5 if step == 30 else 1  # decoding grows the pool, a second vote shrinks it
        for cache in (plain, device):
            cache.append(k[:, :, :t], k[:, :, :t], q=q[:, :, :t] if t > 1 else None)
        np.testing.assert_array_equal(device.positions(), plain.positions())
        assert device.num_pages == plain.num_pages
        assert (plain.num_pages > first) == (step != 30)


def test_bad_arguments_are_refused_by_name():
    cases = [
        (lambda: P.SnapKV(8, 0), ValueError, "window must be an int >= 1, got 0"),
        (lambda: P.SnapKV(8, 2.0), TypeError, "window must be an int, got float"),
        (lambda: P.SnapKV(3, 4), ValueError, "budget must be >= window=4 .* got 3"),
        (lambda: P.SnapKV([8, 3], 4), ValueError, r"budget\[1\] must be >= window=4"),
        (lambda: P.SnapKV("8", 4), TypeError, "budget must be an int, a sequence of ints"),
        (lambda: P.SnapKV(8.0, 4), TypeError, "budget must be an int, got float"),
        (lambda: P.SnapKV(8, 4, kernel_size=6), ValueError, "kernel_size must be an odd int"),
        (lambda: P.SnapKV(8, 4, kernel_size=0), ValueError, "kernel_size must be an int >= 1"),
        (lambda: P.SnapKV(8, 4, kernel_size=7.0), TypeError, "kernel_size must be an int"),
        (lambda: P.SnapKV(8, 4, pooling="min"), ValueError, r"pooling must be one of \('max'"),
        (lambda: P.SnapKV(8, 4, pooling=max), TypeError, "pooling must be one of"),
    ]
    for make, error, message in cases:
        with pytest.raises(error, match=message):
            make()
    with pytest.raises(ValueError, match=r"head_adaptive\(7\) cannot keep window=4 .* 2 kv"):
        cuattn.KVCache(1, 2, D, "float64", policy=P.SnapKV(P.head_adaptive(7), 4))
    with pytest.raises(ValueError, match="one entry per kv head"):
        cuattn.KVCache(1, 2, D, "float64", policy=P.SnapKV([8, 8, 8], 4))
    rng = np.random.default_rng(9)
    k = rng.standard_normal((2, 2, 6, D))
    q = rng.standard_normal((2, 4, 6, D))
    cache = cuattn.KVCache(2, 2, D, "float64", page_size=4, policy=P.SnapKV(8, 4))
    cache.append(k, k)
    before = (cache.positions().copy(), cache.lengths.copy(), cache.slot_pos.copy())
    for args, kwargs, error, message in [
        ((k, k), {"q": q[:, :3]}, ValueError, r"q must be \[batch=2, heads \(a multiple"),
        ((k, k), {"q": q[:, :, :2]}, ValueError, "t=6, head_dim=16"),
        ((k, k), {"q": q.astype(np.float32)}, TypeError, "q has dtype float32"),
        ((k, k), {"q": [[1.0]]}, TypeError, "q must be an array, got list"),
        ((k, k, [6, 2]), {"q": q}, ValueError, "sequence 1 appends 2 of its 8 tokens"),
    ]:
        with pytest.raises(error, match=message):
            cache.append(*args, **kwargs)
        after = (cache.positions(), cache.lengths, cache.slot_pos)
        assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    plain = cuattn.KVCache(2, 2, D, "float64", policy=P.SlidingWindow(4))
    with pytest.raises(ValueError, match="q: only a policy that reads queries"):
        plain.append(k, k, q=q)


@pytest.mark.parametrize("budget", [14, P.head_adaptive(26)], ids=["per_head", "adaptive"])
@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_a_second_vote_pools_over_the_kept_positions(pooling, budget):
    """An append with queries after a compression (and decode steps) votes again over what is
    kept: a position no longer kept has no key and counts as nothing in the pool."""
    rng = np.random.default_rng(12 + (pooling == "avg"))
    batch, kv_heads, group, window = 2, 2, 2, 3
    lengths = np.array([36, 30])
    k = rng.standard_normal((batch, kv_heads, 60, D))
    q = rng.standard_normal((batch, kv_heads * group, 60, D))
    cache = cuattn.KVCache(
        batch, kv_heads, D, "float64", page_size=4, policy=P.SnapKV(budget, window, 5, pooling)
    )
    cache.append(k[:, :, :36], k[:, :, :36], lengths=lengths, q=q[:, :, :36])
    steps, more = 4, 12
    for i in range(steps):  # decode steps: kept whole
        x = np.stack([k[b, :, lengths[b] + i] for b in range(batch)])[:, :, None]
        cache.append(x, x)
    ends = lengths + steps
    present = [
        [np.isin(np.arange(e + more), cache.positions()[b, h]) for h in range(kv_heads)]
        for b, e in enumerate(ends)
    ]
    for b in range(batch):
        for h in range(kv_heads):
            present[b][h][ends[b] :] = True
    # k and q hold every sequence's tokens at their positions (each append took them so)
    x = np.stack([k[b, :, ends[b] : ends[b] + more] for b in range(batch)])
    qx = np.stack([q[b, :, ends[b] : ends[b] + more] for b in range(batch)])
    cache.append(x, x, q=qx)
    want = _reference(q, k, ends + more, budget, window, 5, pooling, present)
    got = cache.positions()
    for b in range(batch):
        for h in range(kv_heads):
            assert [int(p) for p in got[b, h] if p >= 0] == want[b][h], (b, h)


def test_the_pool_stays_one_partition_of_its_pages():
    """Votes, decode growth (ragged, sometimes nothing) and a second vote: every real page is
    in one table or on the free stack, none held empty, no pair above the host bound the pool
    is sized by, every kept slot holding its own token."""
    rng = np.random.default_rng(21)
    batch, kv_heads, page = 3, 2, 4
    cache = cuattn.KVCache(
        batch, kv_heads, D, "float32", page_size=page, policy=P.SnapKV(P.head_adaptive(20), 3)
    )
    tokens = {}

    def append(t, lengths, with_q):
        k = rng.standard_normal((batch, kv_heads, t, D)).astype(np.float32)
        q = rng.standard_normal((batch, 2 * kv_heads, t, D)).astype(np.float32)
        for b in range(batch):
            for i in range(lengths[b]):
                tokens[b, int(cache.lengths[b]) + i] = k[b, :, i]
        cache.append(k, k, lengths=lengths, q=q if with_q else None)

    append(30, [30, 17, 9], True)
    for step in range(12):
        append(2, rng.integers(0, 3, size=batch), False)
        if step == 7:
            append(4, [4, 4, 4], True)
        table, count = cache.page_tables()
        slot_pos = np.asarray(cache.slot_pos)
        free = list(cache.free_stack[: int(cache.free_top[0])])
        held = []
        for b in range(batch):
            for h in range(kv_heads):
                pages = list(table[b, h, : count[b, h]])
                assert len(pages) <= -(-cache._most[b, h] // page)
                assert all((slot_pos[p] >= 0).any() for p in pages)
                for p in pages:
                    for o in np.flatnonzero(slot_pos[p] >= 0):
                        np.testing.assert_array_equal(
                            cache.k_pages[p, o], tokens[b, int(slot_pos[p, o])][h]
                        )
                held += pages
        assert sorted(held + free) == list(range(1, cache.num_pages + 1))
        assert all((slot_pos[p] == -1).all() for p in free)
