"""The sm_90a kernels' schedules built on the device (kernels/layout_build.cu): the persistent
forward's work list and the backward's claim order and dQ ranks of a DeviceLayout, equal entry for
entry to what the host builds from a host layout (geometry.sm90_work_list, kernels.
backward_tile_order and kernels.dq_ranks), and the forward and backward through a DeviceLayout
bit for bit the host layout's. The build kernels run on the CPU interpreter."""

from __future__ import annotations

import contextlib
from unittest import mock

import numpy as np
import pytest

import cuattn
from cuattn import dynamic
from cuattn.backends import geometry, interp, kernels, layout_build
from cuattn.backends.call import AttentionCall
from cuattn.layout import registry
from cuattn.layout.device import INDEX_FIELDS, DeviceLayout
from cuattn.layout.layout import Layout
from tests.helpers.kernel_cases import PATTERNS, pattern_id, sweep_layout

# Every registered pattern, with the arguments it needs at 16 blocks of 64 (or 8 of 128).
REGISTRY_ARGS = {
    "all": {},
    "local": {"local_attn_ctx": 192},
    "strided": {"local_attn_ctx": 192},
    "fixed": {"local_attn_ctx": 256, "num_verts": 2, "vertsize": 1},
    "window": {"window_left": 130, "window_right": 70},
    "longformer": {"local_attn_ctx": 128, "global_tokens": (0, 700)},
    "bigbird": {"num_random_blocks": 1, "seed": 3},
    "variable": {"num_random_blocks": 1, "seed": 5},
    "document": {"doc_lengths": (300, 500, 261)},
}
# (batch, kv_group, head_dim, dtype): GQA, batch > 1, the wide key tile (two a 128-block)
SHAPES = [(1, 1, 64, "bfloat16"), (2, 2, 128, "float16"), (3, 4, 64, "float16")]


def as_device(layout: Layout) -> DeviceLayout:
    """The host layout's own arrays read as a DeviceLayout (as a torch op receives one)."""
    arrays = {"blocks": layout.blocks, "mask_table": layout.mask_table}
    arrays.update({field: getattr(layout, field) for field in INDEX_FIELDS})
    rule = layout.rule
    return DeviceLayout.from_arrays(
        arrays,
        layout.blocksize,
        layout.n_q,
        layout.n_ctx,
        rule.kind,
        (rule.window_left, rule.window_right),
    )


def assert_work_lists_equal(
    blocks,
    n_k,
    batch,
    kv_group,
    head_dim,
    dtype,
    block,
    key_pairs=False,
    sms=geometry.SM90_SMS,
    max_slots=None,
):
    """The device list (at the end of its bound, the counter at its first entry), its merges
    (then padding of no chunks) and threshold, against geometry.sm90_work_list (with
    ``key_pairs``, ``sms`` and ``max_slots`` on both sides). Returns the host list."""
    extra = {"key_pairs": key_pairs, "sms": sms, "max_slots": max_slots}
    host = geometry.sm90_work_list(blocks, batch, n_k, head_dim, dtype, kv_group, block, **extra)
    device = layout_build.sm90_work_list(
        interp.backend, blocks, batch, n_k, head_dim, dtype, kv_group, block, **extra
    )
    entries = len(host.items)
    first = device.num_items - entries
    assert first >= 0 and int(device.work_counter[0]) == first
    np.testing.assert_array_equal(device.items[first:], host.items)
    splits = len(host.merges)
    np.testing.assert_array_equal(device.merges[:splits], host.merges)
    assert not device.merges[splits:].any()  # the padding: entries of no chunks
    assert int(device.split_tiles[0]) == host.split_tiles
    assert host.slots <= device.slots and splits <= device.num_merges
    return host


def assert_backward_orders_equal(layout: Layout, kv_group: int) -> None:
    key_blocks = geometry.sm90_bwd_key_blocks(layout.blocksize)
    order = kernels.backward_tile_order(layout.blocks, key_blocks, kv_group)
    ranks = kernels.dq_ranks(layout.blocks, layout.col_ptr, layout.row_idx, key_blocks, order)
    device = layout if isinstance(layout, DeviceLayout) else as_device(layout)
    assert layout_build.backward_order_fits(device.num_blocks, key_blocks)
    device_order, device_ranks = layout_build.sm90_backward_order(
        interp.backend, device, device.kernel_arrays(), key_blocks, kv_group
    )
    np.testing.assert_array_equal(device_order, order)
    entries = int(np.asarray(layout.col_ptr)[-1, -1])
    np.testing.assert_array_equal(device_ranks[:entries], ranks[:entries])


def test_the_registry_table_names_every_pattern():
    assert set(REGISTRY_ARGS) == set(registry.modes())


@pytest.mark.parametrize("mode", sorted(REGISTRY_ARGS))
@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_every_registered_pattern(mode, block, causal):
    """Every pattern at both block sizes, a ragged last block, a shorter query side for the
    causal ones: the forward's list for each of SHAPES and the backward's order and ranks."""
    n = 1024 + 37
    n_q = 700 if causal and mode not in ("strided", "fixed") else None
    options = dict(REGISTRY_ARGS[mode])
    if mode == "window" and causal:
        options["window_right"] = 0
    layout = cuattn.make_layout(mode, n, 8, block, causal=causal, n_q=n_q, **options)
    for batch, kv_group, head_dim, dtype in SHAPES:
        assert_work_lists_equal(
            layout.blocks, layout.n_ctx, batch, kv_group, head_dim, dtype, block
        )
        assert_backward_orders_equal(layout, kv_group)


@pytest.mark.parametrize("pattern", PATTERNS, ids=pattern_id)
def test_the_gpu_sweep_patterns(pattern):
    layout = sweep_layout(pattern, 64)
    host = assert_work_lists_equal(layout.blocks, layout.n_ctx, 2, 2, 128, "bfloat16", 64)
    assert len(host.items)
    assert_backward_orders_equal(layout, 2)


def random_blocks(rng, heads, nbq, nb, density, global_rows, empty):
    """Random blocks [heads, nbq, nb]: a density, some rows full (long rows the list splits),
    some rows and columns emptied."""
    blocks = rng.random((heads, nbq, nb)) < density
    for h in range(heads):
        blocks[h, rng.choice(nbq, size=min(global_rows, nbq), replace=False)] = True
        if empty:
            blocks[h, rng.choice(nbq, size=max(1, nbq // 4), replace=False)] = False
            blocks[h, :, rng.choice(nb, size=max(1, nb // 4), replace=False)] = False
    return blocks


@pytest.mark.parametrize("seed", range(24))
def test_random_layouts(seed):
    """Random shapes and densities, full rows (split) and none, empty rows and columns, GQA,
    batch > 1: the two sides equal; across the seeds both split and unsplit lists occur."""
    rng = np.random.default_rng(seed)
    block = (64, 128)[seed % 2]
    heads = int(rng.choice([1, 2, 4, 8]))
    kv_group = int(rng.choice([g for g in (1, 2, 4) if heads % g == 0]))
    nbq, nb = int(rng.integers(1, 24)), int(rng.integers(1, 48))
    density = float(rng.choice([0.02, 0.1, 0.3, 0.8]))
    blocks = random_blocks(rng, heads, nbq, nb, density, seed % 3, seed % 4 == 1)
    n_k = nb * block - int(rng.integers(0, block))
    batch = int(rng.integers(1, 4))
    head_dim = (64, 128)[seed // 2 % 2]
    for key_pairs in (False, True) if block == geometry.SM90_KEY_PAIR_BLOCK else (False,):
        host = assert_work_lists_equal(
            blocks, n_k, batch, kv_group, head_dim, "bfloat16", block, key_pairs
        )
        SPLITS.add(len(host.merges) > 0)
    layout = Layout(blocks, block, n_k, n_q=nbq * block, name="random")
    assert_backward_orders_equal(layout, kv_group)


SPLITS: set[bool] = set()


def test_random_layouts_had_split_rows_and_none():
    if len(SPLITS) < 2:  # run alone: the seeds again
        for seed in range(24):
            test_random_layouts(seed)
    assert SPLITS == {True, False}


def topk_layout(seed, n, heads, kv_heads, block, topk, causal=True):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((heads, n, 16))
    k = rng.standard_normal((kv_heads, n, 16))
    return dynamic.topk_blocks(q, k, block, topk, causal=causal, backend="interp")


@pytest.mark.parametrize(
    "seed, n, heads, kv_heads, block, topk, causal",
    [
        (1, 1500, 4, 2, 64, 3, True),
        (2, 2048, 4, 1, 64, [2, 3, 8, 30], False),
        (3, 3000, 2, 2, 128, 2, True),
        (4, 4096, 8, 2, 64, 4, True),
    ],
)
def test_dynamic_topk_layouts(seed, n, heads, kv_heads, block, topk, causal):
    """Layouts chosen on the device (top-k, a DeviceLayout): its schedules from its own
    arrays, equal to the host's from its host copy."""
    layout = topk_layout(seed, n, heads, kv_heads, block, topk, causal)
    assert isinstance(layout, DeviceLayout)
    kv_group = heads // kv_heads
    for batch in (1, 3):
        assert_work_lists_equal(layout.blocks, n, batch, kv_group, 128, "bfloat16", block)
    assert_backward_orders_equal(layout, kv_group)


@pytest.mark.parametrize("rule", ["mass", "vertical-slash"])
def test_the_other_dynamic_rules(rule):
    """Layouts chosen by softmax mass and by the vertical-slash rule (a bitmask DeviceLayout)."""
    rng = np.random.default_rng(21)
    q, k = rng.standard_normal((4, 2000, 16)), rng.standard_normal((2, 2000, 16))
    if rule == "mass":
        layout = dynamic.mass_threshold_blocks(q, k, 64, 0.6, backend="interp")
    else:
        layout = dynamic.vertical_slash_layout(
            q, np.repeat(k, 2, axis=0), 64, num_vertical=96, num_slash=64, backend="interp"
        )
    assert isinstance(layout, DeviceLayout)
    for batch, kv_group in ((1, 1), (2, 2)):
        assert_work_lists_equal(layout.blocks, 2000, batch, kv_group, 64, "float16", 64)
        assert_backward_orders_equal(layout, kv_group)


def test_empty_layout_and_one_item():
    """No block at all (every row empty), and a single item: nothing to split or merge."""
    for blocks in (np.zeros((2, 5, 7), bool), np.ones((1, 1, 1), bool)):
        assert_work_lists_equal(blocks, blocks.shape[2] * 64, 2, 1, 64, "bfloat16", 64)
        layout = Layout(blocks, 64, blocks.shape[2] * 64, n_q=blocks.shape[1] * 64)
        assert_backward_orders_equal(layout, 1)


@pytest.mark.parametrize("mode", ["all", "longformer", "bigbird", "strided", "window"])
@pytest.mark.parametrize("causal", [True, False])
def test_key_pair_lists(mode, causal):
    """128-key tiles of 64-blocks (CUATTN_SM90_TILE_N=128): rows counted in key pairs and cut
    between them on both sides, an odd key-block count (the last pair one block), a threshold
    low enough to split (sms 1000: few items, at least SM90_SPLIT_MIN_TILES, and rows of up to
    17 pairs, more than SM90_FEW_ITEMS_SPREAD_PERCENT of it); no cut inside a pair."""
    n = 2048 + 37
    options = dict(REGISTRY_ARGS[mode])
    if mode == "window" and causal:
        options["window_right"] = 0
    layout = cuattn.make_layout(mode, n, 4, 64, causal=causal, **options)
    assert layout.num_blocks % 2 == 1
    for batch, kv_group, head_dim, dtype in SHAPES:
        for sms in (geometry.SM90_SMS, 1000):
            host = assert_work_lists_equal(
                layout.blocks, n, batch, kv_group, head_dim, dtype, 64, True, sms
            )
            split = host.items[host.items[:, 3] != geometry.SM90_NO_SLOT]
            assert (split[:, 1] % 2 == 0).all()
            assert ((split[:, 2] % 2 == 0) | (split[:, 2] == layout.num_blocks)).all()
            KEY_PAIR_SPLITS.add(len(split) > 0)


KEY_PAIR_SPLITS: set[bool] = set()


def test_key_pair_lists_had_split_rows():
    if True not in KEY_PAIR_SPLITS:  # run alone
        test_key_pair_lists("longformer", False)
    assert True in KEY_PAIR_SPLITS


@pytest.mark.parametrize("key_pairs", [False, True], ids=["tile64", "pairs"])
@pytest.mark.parametrize(
    "heads, n, sms, threshold",
    [
        # (threshold with 64-key tiles, with key pairs): the mean's would be (132, 66)
        (1, 64 * 64, 132, (8, 8)),  # 32 items, 1056 tiles over 132 = 8, the minimum
        (2, 128 * 64, 132, (64, 32)),  # 128 items, 8320 tiles over 132 (key pairs 4224)
        (4, 128 * 64, 132, None),  # 256 items: as many as the SMs or more, the mean's (260)
        (2, 64 * 64, 16, None),  # 64 items on 16 SMs: the mean's
        (1, 96 * 64, 1000, (8, 8)),  # few items on many SMs: the minimum (the mean's 196)
    ],
)
def test_few_items_split_to_fill_the_sms(key_pairs, heads, n, sms, threshold):
    """Batch 1, few heads, causal rows: where the items are fewer than the SMs the threshold is
    the launch's key tiles over the SMs (at least SM90_SPLIT_MIN_TILES), equal on both sides;
    elsewhere the mean's."""
    layout = cuattn.make_layout("all", n, heads, 64, causal=True)
    host = assert_work_lists_equal(layout.blocks, n, 1, 1, 128, "bfloat16", 64, key_pairs, sms)
    units = heads * layout.num_blocks // 2
    walked = geometry.sm90_work_list(
        layout.blocks, 1, n, 128, "bfloat16", 1, 64, 0, key_pairs
    ).items
    tiles = 0  # the launch's key tiles, brute force over the items' unions
    for item, *_ in walked.tolist():
        head, tile = divmod(item, layout.num_blocks // 2)
        union = layout.blocks[head, 2 * tile : 2 * tile + 2].any(axis=0)
        tiles += len(set(np.flatnonzero(union) // (2 if key_pairs else 1)))
    mean = max(geometry.SM90_SPLIT_MIN_TILES, -(-geometry.SM90_SPLIT_FACTOR * tiles // units))
    if threshold is None:
        assert units >= sms and host.split_tiles == mean
    else:
        fill = max(geometry.SM90_SPLIT_MIN_TILES, -(-tiles // sms))
        assert host.split_tiles == min(mean, fill)
        assert host.split_tiles == threshold[key_pairs]
        assert len(host.items) > units  # rows were split


# Few items (12 on 13 SMs) where the spread decides: 11 rows of 16 key tiles and one of `longest`.
# (longest, threshold, chunks of the long row): 24 walks exactly 1.5 x the fill (200 tiles over
# 13: 16), so the mean's threshold (4 x 200 / 12) splits nothing; 25 walks past it, and the
# fill's threshold cuts it in two; 48 past 2 x the fill (224 / 13: 18) in three. Even rows of 24
# (288 / 13: 23) stay whole, where the unrefined rule would cut every one in two.
SPREAD_ITEMS, SPREAD_SMS, SPREAD_ROW = 12, 13, 16
SPREAD_CASES = [
    (24, 67, 1, False),
    (25, 16, 2, False),
    (48, 18, 3, False),
    (24, 96, 1, True),
]


@pytest.mark.parametrize("longest, threshold, chunks, even", SPREAD_CASES)
def test_few_items_split_only_where_the_rows_are_uneven(longest, threshold, chunks, even):
    """The few-items threshold applies only where the longest item walks more than
    SM90_FEW_ITEMS_SPREAD_PERCENT / 100 x the launch's key tiles over the SMs: on the host and
    on the device alike, at the boundary and on both sides of it."""
    blocks = np.zeros((1, 2 * SPREAD_ITEMS, 48), bool)
    for item in range(SPREAD_ITEMS):
        walked = longest if even or item == SPREAD_ITEMS // 2 else SPREAD_ROW
        blocks[0, 2 * item, :walked] = True
    host = assert_work_lists_equal(blocks, 48 * 64, 1, 1, 128, "bfloat16", 64, sms=SPREAD_SMS)
    assert host.split_tiles == threshold
    expected = [] if chunks == 1 else [[SPREAD_ITEMS // 2, 0, chunks]]
    np.testing.assert_array_equal(host.merges.reshape(-1, 3), np.array(expected).reshape(-1, 3))


H100_PCIE_SMS = 114
# Two heads of 120 causal 64-blocks: 120 items, fewer than an H200's 132 SMs, not fewer than an
# H100 PCIe's 114. Item i of a head walks 2i + 2 key tiles: 2 x 3660 = 7320 in all, a mean of 61.
FEW_ITEMS_HEADS, FEW_ITEMS_BLOCKS = 2, 120
FILL_132 = -(-7320 // 132)  # 56: the launch's tiles over 132 SMs
MEAN_THRESHOLD = 4 * 61  # 244: the mean's, past every row's 2 x 120 / 2 tiles (none split)


def few_items_layout():
    return cuattn.make_layout("all", FEW_ITEMS_BLOCKS * 64, FEW_ITEMS_HEADS, 64, causal=True)


def test_an_h100_pcie_s_sms_take_the_mean_s_threshold():
    """The few-items rule counts the SMs it is given: 120 items split to fill an H200's 132 SMs
    but not an H100 PCIe's 114 (as many items as SMs or more: the mean's threshold, no row
    split), on the host and on the device alike."""
    blocks = few_items_layout().blocks
    n = FEW_ITEMS_BLOCKS * 64
    h200 = geometry.sm90_work_list(blocks, 1, n, 128, "bfloat16", 1, 64)
    assert h200.split_tiles == FILL_132 and len(h200.items) > FEW_ITEMS_BLOCKS
    h100 = assert_work_lists_equal(blocks, n, 1, 1, 128, "bfloat16", 64, sms=H100_PCIE_SMS)
    assert h100.split_tiles == MEAN_THRESHOLD and len(h100.items) == FEW_ITEMS_BLOCKS
    assert not len(h100.merges)


class _WorkBuilt(Exception):
    """Stops a forward once its work list is built."""


@pytest.mark.parametrize("on_device", [False, True], ids=["host-layout", "device-layout"])
def test_the_backend_s_sm_count_sets_the_few_items_rule(monkeypatch, on_device):
    """The persistent forward builds its work list for its backend's SMs (multiprocessors: a
    GPU's own count, here an H100 PCIe's injected) on the host and on the device, not for
    geometry.SM90_SMS: the mean's threshold, where 132 would have split rows."""
    layout = few_items_layout()
    call_layout = as_device(layout) if on_device else layout
    q, k, v = random_inputs(layout, 1, FEW_ITEMS_HEADS, 64, "bfloat16", 3)
    monkeypatch.setattr(interp.backend, "multiprocessors", lambda x: H100_PCIE_SMS)
    build = kernels.KernelBackend._sm90_work
    built = []

    def spy(self, *args):
        built.append(build(self, *args))
        raise _WorkBuilt

    monkeypatch.setattr(kernels.KernelBackend, "_sm90_work", spy)
    monkeypatch.setenv(geometry.KERNELS_ENV, "sm90a-persistent")
    with pytest.raises(_WorkBuilt):
        interp.forward(q, k, v, AttentionCall(call_layout, 64**-0.5))
    (work,) = built
    assert int(np.asarray(work.split_tiles).ravel()[0]) == MEAN_THRESHOLD


def test_the_bounds_hold_where_the_split_is_largest():
    """Every unit but a few walking one key tile and the rest walking many: the most chunks and
    split rows the bounds allow for, within them (and used nearly up). The host's list is held
    to the bounds first: a device build past them writes out of bounds."""
    heads, nbq, nb = 1, 64, 64  # 32 units at 64-blocks
    blocks = np.zeros((heads, nbq, nb), bool)
    blocks[0, :, 0] = True
    blocks[0, :14, :] = True  # 7 units walking all 64 key blocks, 25 walking one
    # sms 1: the mean's threshold alone (4 x the mean, under units / 4 chunks beyond the first),
    # the cap out of reach (1 SM's is 8 slots: the shape's bound is what this checks)
    uncapped = {"sms": 1, "max_slots": NO_CAP}
    host = geometry.sm90_work_list(blocks, 1, nb * 64, 128, "bfloat16", 1, 64, **uncapped)
    entries, merges, slots = layout_build.work_list_bounds(32, 1, **uncapped)
    assert len(host.items) <= entries and len(host.merges) <= merges and host.slots <= slots
    assert len(host.merges) == 7
    assert_work_lists_equal(blocks, nb * 64, 1, 1, 128, "bfloat16", 64, **uncapped)
    # one item of 2000 key tiles, alone: the threshold ceil(2000 / 132) = 16 cuts it into 125
    # chunks, near the few-items bound of sms / batch chunks beyond the first
    blocks = np.ones((1, 1, 2000), bool)
    host = geometry.sm90_work_list(blocks, 1, 2000 * 64, 128, "bfloat16", 1, 64)
    entries, merges, slots = layout_build.work_list_bounds(1, 1)
    assert host.split_tiles == 16 and len(host.items) == 125
    assert len(host.items) <= entries and len(host.merges) <= merges and host.slots <= slots
    assert_work_lists_equal(blocks, 2000 * 64, 1, 1, 128, "bfloat16", 64)


NO_CAP = 2**30  # a max_slots no test's launch reaches
# Two heads of 16 query tiles at 64-blocks over 64 key blocks: 12 units walking every key
# block, the rest one (with key pairs: 32 tiles and 1).
CAP_HEADS, CAP_TILES, CAP_KEYS = 2, 16, 64


def capped_blocks():
    blocks = np.zeros((CAP_HEADS, 2 * CAP_TILES, CAP_KEYS), bool)
    blocks[:, :, 0] = True
    blocks[0, 4:16] = True  # head 0: 6 long units
    blocks[1, 20:32] = True  # head 1: 6 long units, the last tiles (ties across heads)
    return blocks


def brute_force_threshold(walked, batch, sms, max_slots):
    """The lowest threshold from sm90_split_tiles' uncapped one whose chunks fit, by trying
    every threshold in turn (the cap's bisection not used)."""
    base = geometry.sm90_split_tiles(walked, batch, sms, NO_CAP)
    for threshold in range(base, int(walked.max()) + 1):
        if batch * geometry.sm90_chunk_slots(walked, threshold) <= max_slots:
            return threshold
    raise AssertionError("the longest unit's tiles split nothing")


@pytest.mark.parametrize("key_pairs", [False, True], ids=["tile64", "pairs"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("max_slots", [NO_CAP, 96, 95, 40, 13, 3, 0])
def test_the_cap_raises_the_threshold_until_the_chunks_fit(key_pairs, batch, max_slots):
    """12 long units among 64 on 1000 SMs (few items: threshold 8, each long unit in 8 chunks
    of 64 tiles, 96 slots a batch): capped at ``max_slots`` for the launch, the threshold is
    the lowest whose chunks fit (brute force), the same on the device entry for entry, the
    slots within the cap and within the buffers' bound; from 96 a batch down to none split."""
    blocks = capped_blocks()
    n_k, sms = CAP_KEYS * 64, 1000
    host = assert_work_lists_equal(
        blocks, n_k, batch, 1, 128, "bfloat16", 64, key_pairs, sms, max_slots
    )
    span = 2 if key_pairs else 1  # key blocks a key tile: a pair's 128 keys or a 64-block's
    long_units = blocks.reshape(CAP_HEADS, CAP_TILES, 2, CAP_KEYS)[..., 1:].any(axis=(2, 3))
    walked = np.where(long_units, CAP_KEYS // span, 1)
    assert host.split_tiles == brute_force_threshold(walked, batch, sms, max_slots)
    assert host.slots <= max_slots
    entries, merges, slots = layout_build.work_list_bounds(
        CAP_HEADS * CAP_TILES, batch, sms, max_slots
    )
    assert len(host.items) <= entries and len(host.merges) <= merges and host.slots <= slots
    if max_slots >= batch * 96 // span:
        assert host.split_tiles == geometry.SM90_SPLIT_MIN_TILES
    else:  # the cap binds: the threshold raised, the long units split in fewer chunks, or none
        assert host.split_tiles > geometry.SM90_SPLIT_MIN_TILES
        assert len(host.merges) in (0, 12 * batch)
    CAP_SPLITS.add(len(host.merges) > 0)


CAP_SPLITS: set[bool] = set()


def test_the_cap_split_some_and_none():
    if len(CAP_SPLITS) < 2:  # run alone
        for max_slots in (40, 3):
            test_the_cap_raises_the_threshold_until_the_chunks_fit(False, 1, max_slots)
    assert CAP_SPLITS == {True, False}


@pytest.mark.parametrize("seed", range(6))
def test_random_layouts_under_a_binding_cap(seed):
    """Random layouts with full rows on many SMs (few items: low thresholds, many chunks),
    the cap at a random share of the uncapped slots: both sides equal."""
    rng = np.random.default_rng(100 + seed)
    block = (64, 128)[seed % 2]
    heads = int(rng.choice([1, 2, 4]))
    nbq, nb = int(rng.integers(4, 24)), int(rng.integers(16, 64))
    blocks = random_blocks(rng, heads, nbq, nb, 0.1, 3, seed % 3 == 1)
    batch = int(rng.integers(1, 4))
    uncapped = geometry.sm90_work_list(
        blocks, batch, nb * block, 64, "bfloat16", 1, block, sms=1000, max_slots=NO_CAP
    )
    cap = int(rng.integers(0, max(uncapped.slots, 1)))
    for key_pairs in (False, True) if block == geometry.SM90_KEY_PAIR_BLOCK else (False,):
        host = assert_work_lists_equal(
            blocks, nb * block, batch, 1, 64, "bfloat16", block, key_pairs, 1000, cap
        )
        assert host.slots <= cap


def test_the_workspace_bound_at_scale_is_the_cap():
    """T = 128k, 32 heads, batch 8, 64-blocks: 32768 units a batch, whose shape bound is 131072
    slots (8 GiB of float32 partials at d = 128), now the cap's 8 x 132 = 1056 (66 MiB); the
    merges and the entries beyond one an item bounded by it too."""
    units, batch = 32 * 1024, 8
    cap = geometry.sm90_split_slots(geometry.SM90_SMS)
    assert cap == 1056
    assert layout_build.work_list_bounds(units, batch, max_slots=NO_CAP) == (
        batch * units * 5 // 4,
        batch * units // 4,
        131072,
    )
    assert layout_build.work_list_bounds(units, batch) == (batch * units + cap, cap // 2, cap)
    assert cap * geometry.SM90_TILE_M * 128 * 4 == 69206016  # bytes of partial out at d = 128
    # and where the shape bounds it below the cap, the shape's bound stays
    assert layout_build.work_list_bounds(64, 1) == (64 + 132, 132, 264)


def test_the_forward_s_workspace_is_the_capped_bound(monkeypatch):
    """Through the backend, a cap of 2 slots (sm90_split_slots patched): Longformer's global row
    of 20 tiles, 3 chunks at the few-items threshold of 8, split in 2 (threshold 10); the
    persistent launch's partial out and lse hold 2 slots, through a DeviceLayout (its bound,
    min(the shape's 264, 2)) and the host layout (its list's exact slots); the result the
    oracle's, and the DeviceLayout's the host layout's bits."""
    from tests.backends.test_interp_kernels import check_forward

    host = cuattn.make_layout("longformer", 20 * 64, 1, 64, local_attn_ctx=64, causal=False)
    q, k, v = random_inputs(host, 1, 1, 64, "bfloat16", 19)
    monkeypatch.setattr(geometry, "sm90_split_slots", lambda sms: 2)
    monkeypatch.setenv(geometry.KERNELS_ENV, "sm90a-persistent")
    work = geometry.sm90_work_list(host.blocks, 1, host.n_ctx, 64, "bfloat16", 1, 64)
    assert (work.split_tiles, work.slots, len(work.merges)) == (10, 2, 1)
    parts = []
    launch = interp.backend.launch

    def spy(config, **values):
        if config.kernel == geometry.SM90_FWD_PERSISTENT:
            parts.append((values["part_out"].shape, values["part_lse"].shape))
        return launch(config, **values)

    monkeypatch.setattr(interp.backend, "launch", spy)
    scale = 64**-0.5
    out, lse = interp.forward(q, k, v, AttentionCall(as_device(host), scale))
    ref_out, ref_lse = interp.forward(q, k, v, AttentionCall(host, scale))
    assert parts == [((2, geometry.SM90_TILE_M, 64), (2, geometry.SM90_TILE_M))] * 2
    check_forward(out, lse, q, k, v, host, scale, "bfloat16")
    np.testing.assert_array_equal(out.view(np.uint16), ref_out.view(np.uint16))
    np.testing.assert_array_equal(lse, ref_lse)


# ---- through the backends -------------------------------------------------------------------


def launched(fn, *args):
    from tests.backends.test_sm90a_family import launched as spy

    return spy(fn, *args)


def no_host_schedule():
    """A context in which reading a device layout back to the host, or building a schedule
    from host blocks, fails the test (the interpreter's arrays are on the host, so such a
    build would otherwise pass unseen)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a device layout's schedule was built on the host")

    patches = [
        mock.patch.object(DeviceLayout, "host", refuse),
        mock.patch.object(kernels, "_layout_work_list", refuse),
        mock.patch.object(kernels, "_layout_backward_order", refuse),
        mock.patch.object(geometry, "sm90_work_list", refuse),
    ]
    stack = contextlib.ExitStack()
    for patch in patches:
        stack.enter_context(patch)
    return stack


def random_inputs(layout, batch, kv_heads, head_dim, dtype, seed):
    from tests.backends.test_attn_fwd_sm90_persistent import random_inputs as inputs

    return inputs(layout, batch, kv_heads, head_dim, dtype, seed)


@pytest.mark.parametrize(
    "make, batch, kv_heads, tile_n",
    [
        (
            lambda: cuattn.make_layout(
                "longformer", 40 * 64, 2, 64, local_attn_ctx=64, causal=False
            ),
            1,
            1,
            "64",
        ),
        (lambda: topk_layout(7, 5 * 64 + 9, 4, 2, 64, 2), 2, 2, "64"),
        (
            lambda: cuattn.make_layout(
                "longformer", 40 * 64 + 5, 2, 64, local_attn_ctx=64, causal=False
            ),
            1,
            1,
            "128",
        ),
    ],
    ids=["longformer-split", "topk-gqa", "longformer-split-key-pairs"],
)
def test_forward_through_a_device_layout_is_the_host_layouts(
    monkeypatch, make, batch, kv_heads, tile_n
):
    """CUATTN_KERNELS=sm90a-persistent: a DeviceLayout runs the persistent kernel (after the
    four list kernels, the merge where rows split) and its out and lse are the host layout's
    bits; with CUATTN_SM90_TILE_N=128 on 128-key tiles, its list counted and cut in key pairs
    (a batch of 1, two heads: fewer items than SMs, so the global rows split)."""
    monkeypatch.setenv(geometry.SM90_TILE_N_ENV, tile_n)
    layout = make()
    device = layout if isinstance(layout, DeviceLayout) else as_device(layout)
    host = device.host()
    q, k, v = random_inputs(host, batch, kv_heads, 64, "bfloat16", 11)
    monkeypatch.setenv(geometry.KERNELS_ENV, "sm90a-persistent")
    scale = 64**-0.5
    with no_host_schedule():
        (out, lse), names = launched(interp.forward, q, k, v, AttentionCall(device, scale))
    (ref_out, ref_lse), ref_names = launched(interp.forward, q, k, v, AttentionCall(host, scale))
    schedule = ["sm90_work_count", "sm90_work_scan", "sm90_work_fill", "sm90_work_order"]
    assert ref_names[0].startswith(f"attn_fwd_sm90_persistent<64, {tile_n}, ")
    # the merge runs wherever rows could split (its padding entries left alone where none did)
    merge = names[len(schedule) + 1 :]
    assert names[: len(schedule) + 1] == [*schedule, ref_names[0]], names
    assert merge == ref_names[1:] or (len(ref_names) == 1 and len(merge) == 1), names
    assert all(n.startswith("attn_fwd_sm90_merge<") for n in merge)
    np.testing.assert_array_equal(out.view(np.uint16), ref_out.view(np.uint16))
    np.testing.assert_array_equal(lse, ref_lse)


@pytest.mark.parametrize(
    "make, batch, kv_heads",
    [
        (lambda: cuattn.make_layout("bigbird", 6 * 64 + 5, 2, 64, causal=True), 2, 1),
        (lambda: topk_layout(9, 4 * 128, 4, 2, 128, 2), 1, 2),
    ],
    ids=["bigbird", "topk-gqa"],
)
def test_backward_through_a_device_layout_is_the_host_layouts(monkeypatch, make, batch, kv_heads):
    """CUATTN_KERNELS=sm90a: a DeviceLayout's backward runs attn_bwd_sm90 on the ranks built on
    the device (no longer the mma.sync pair), dQ, dK and dV the host layout's bits."""
    layout = make()
    device = layout if isinstance(layout, DeviceLayout) else as_device(layout)
    host = device.host()
    q, k, v = random_inputs(host, batch, kv_heads, 64, "bfloat16", 13)
    monkeypatch.setenv(geometry.KERNELS_ENV, "sm90a")
    scale = 64**-0.5
    out, lse = interp.forward(q, k, v, AttentionCall(host, scale))
    dout = np.random.default_rng(14).standard_normal(q.shape).astype(q.dtype)
    with no_host_schedule():
        grads, names = launched(
            interp.backward, q, k, v, out, lse, dout, None, AttentionCall(device, scale)
        )
    refs, ref_names = launched(
        interp.backward, q, k, v, out, lse, dout, None, AttentionCall(host, scale)
    )
    assert names == [ref_names[0], "sm90_claim_order", "sm90_dq_ranks", *ref_names[1:]], names
    assert any(n.startswith("attn_bwd_sm90<") for n in ref_names), ref_names
    for grad, ref in zip(grads, refs, strict=True):
        np.testing.assert_array_equal(grad.view(np.uint16), ref.view(np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sm90a-persistent", "sm90a"])
def test_on_the_gpu_a_device_layout_is_the_host_layouts(family, monkeypatch):
    """What a GPU run must pass before DeviceLayouts take the sm_90a schedules there: the
    longformer layout whose global rows split, its arrays on the GPU, through the cuda backend
    (the schedule kernels, then the persistent forward and its merge, or the sm_90a backward on
    device-built ranks), bit for bit what the same layout's host arrays give on the same GPU."""
    from cuattn.backends import cuda
    from cuattn.backends.cuda_runtime import cuda_available

    if not cuda_available():
        pytest.skip("needs a CUDA device")
    import cupy

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs an sm_90 GPU (H100, H200)")
    host = cuattn.make_layout("longformer", 40 * 64, 2, 64, local_attn_ctx=64, causal=False)
    arrays = {"blocks": host.blocks, "mask_table": host.mask_table}
    arrays.update({field: getattr(host, field) for field in INDEX_FIELDS})
    rule = host.rule
    device = DeviceLayout.from_arrays(
        {name: cupy.asarray(x) for name, x in arrays.items()},
        host.blocksize,
        host.n_q,
        host.n_ctx,
        rule.kind,
        (rule.window_left, rule.window_right),
    )
    inputs = random_inputs(host, 2, 1, 128, "bfloat16", 29)
    dout_host = np.random.default_rng(30).standard_normal(inputs[0].shape).astype(inputs[0].dtype)
    q, k, v, dout = (cupy.asarray(x) for x in (*inputs, dout_host))
    monkeypatch.setenv(geometry.KERNELS_ENV, family)
    names = []
    launch = cuda.CudaBackend.launch

    def spy(self, config, **values):
        names.append(config.kernel)
        return launch(self, config, **values)

    monkeypatch.setattr(cuda.CudaBackend, "launch", spy)
    backend, scale = cuda.CudaBackend(), 128**-0.5
    results = []
    for layout in (device, host):
        out, lse = backend.forward(q, k, v, AttentionCall(layout, scale))
        grads = backend.backward(q, k, v, out, lse, dout, None, AttentionCall(layout, scale))
        results.append([cupy.asnumpy(x) for x in (out, lse, *grads)])
    schedule = "sm90_work_count" if family == "sm90a-persistent" else "sm90_claim_order"
    assert schedule in names, names
    for got, want in zip(*results, strict=True):
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


# ---- NVRTC ----------------------------------------------------------------------------------


def test_the_schedule_kernels_compile_without_spills():
    """NVRTC for sm_80 and sm_90: every schedule kernel compiles, 0 spill bytes."""
    from dev import compile_check

    if compile_check.missing_toolchain():
        pytest.skip(compile_check.missing_toolchain())
    units = [
        u
        for u in compile_check.kernel_instantiations()
        if u.name_expression in geometry.SCHEDULE_KERNELS
    ]
    assert {u.name_expression for u in units} == set(geometry.SCHEDULE_KERNELS)
    sources = compile_check.load_sources(units)
    results = compile_check.run_check(
        units, ["sm_80", "sm_90"], sources, compile_check.common_options(), 1, progress=None
    )
    for result in results:
        assert result.error is None, (result.unit.name_expression, result.error)
        assert not result.spills, (result.unit.name_expression, result.arch, result.stats)
