"""The persistent sm_90a forward (kernels/attn_fwd_sm90.cu attn_fwd_sm90_persistent, issue 53)
through the CPU interpreter against the float64 dense oracle, and bit for bit against
attn_fwd_sm90 (the same tile code over the same items); its work list
(geometry.sm90_work_list); and its NVRTC build for sm_90a.

A grid of a few CTAs claims every (128 query rows, head, batch) item from a zeroed counter, so
one CTA runs many items back to back: Q, the rings' stages and phases, the turns and q_empty are
reused item after item. The interpreter runs a launch's blocks one after another, so the block
it runs first claims every item and the others find the list out; CUATTN_INTERP_BLOCK_SEED
changes which block that is. Outputs are NaN-poisoned before launch.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from cuattn.backends import geometry, interp
from cuattn.backends.call import AttentionCall
from cuattn.layout.layout import ElementRule, Layout
from cuattn.layout.registry import make_layout
from tests.backends.test_attn_fwd_sm90 import (
    CXX_TYPES,
    RULES,
    SHAPES,
    TILE_M,
    case_inputs,
    case_layout,
    compile_for_sm90a,
    expression,
    forward_args,
    random_inputs,
    run_forward,
    strided_view,
    traits,
)
from tests.backends.test_interp_kernels import check_forward

ml_dtypes = pytest.importorskip("ml_dtypes")

SOURCE = "attn_fwd_sm90.cu"
GRID_CTAS = 3  # a few persistent CTAs: the first to run takes every item
THIN_BLOCKS = 6  # key blocks of the thin layouts, before a ragged seventh
RAGGED_ROWS = 17
BLOCK_SEEDS = range(3)


def persistent_expression(block, tile_n, head_dim, dtype, rule) -> str:
    return expression(block, tile_n, head_dim, dtype, rule).replace(
        "attn_fwd_sm90<", "attn_fwd_sm90_persistent<", 1
    )


def merge_expression(head_dim, dtype) -> str:
    return f"attn_fwd_sm90_merge<{head_dim}, {CXX_TYPES[dtype]}>"


def persistent_traits(block, tile_n, head_dim, dtype) -> str:
    return traits(block, tile_n, head_dim, dtype).replace(
        "attn_fwd_sm90_traits<", "attn_fwd_sm90_persistent_traits<", 1
    )


def thin_layout(mode: str, block: int) -> Layout:
    """A layout of the issue's table at a test's size: a few key blocks of a row out of seven,
    the last block ragged; ``mode`` a registry pattern (with its bench arguments scaled down)."""
    n_ctx = THIN_BLOCKS * block + RAGGED_ROWS
    kwargs = {"strided": {"local_attn_ctx": 3 * block}}.get(mode, {})
    if mode == "variable":
        kwargs = {"local_window_blocks": (2,)}
    return make_layout(mode, n_ctx, 2, block, causal=mode != "bigbird", **kwargs)


# (block, key tile, head dim, dtype, rule, case): every rule on 128-blocks (d = 64) and the
# paired 64-blocks; d = 128 on both (d = 256: test_attn_fwd_sm90_persistent_d256.py); GQA with
# strided inputs;
# queries != keys; a query block with nothing to attend (the "none" square case: head 1's
# first block). The thin layouts of issue 53's table are THIN_CASES.
RUN_CASES = [(128, 128, 64, "bfloat16", rule, "square") for rule in RULES] + [
    (64, 64, 64, "float16", "causal", "square"),
    (64, 64, 64, "bfloat16", "bitmask", "square"),
    (64, 64, 128, "bfloat16", "none", "square"),
    (128, 128, 128, "float16", "causal", "square"),
    (128, 128, 64, "bfloat16", "causal", "gqa"),
    (64, 64, 64, "bfloat16", "window", "fewer queries"),
    (64, 64, 64, "float16", "causal", "one warpgroup of rows"),
    (128, 128, 64, "bfloat16", "none", "long walk"),
    (64, 64, 64, "bfloat16", "none", "alternating rows"),
]
THIN_CASES = [("variable", 64), ("bigbird", 64), ("strided", 64), ("bigbird", 128)]


def thin_config(mode: str, block: int) -> tuple:
    layout = thin_layout(mode, block)
    return (block, block, 64, "bfloat16", layout.rule.kind)


@pytest.fixture(scope="module")
def lib() -> interp.Library:
    configs = {c[:5] for c in RUN_CASES} | {thin_config(m, b) for m, b in THIN_CASES}
    configs = sorted(configs)
    merges = sorted({c[2:4] for c in configs})
    expressions = [persistent_expression(*c) for c in configs] + [expression(*c) for c in configs]
    expressions += [merge_expression(*m) for m in merges]
    kernel_traits = [persistent_traits(*c[:4]) for c in configs] + [traits(*c[:4]) for c in configs]
    kernel_traits += [f"row_kernel_traits<{d}, {CXX_TYPES[t]}>" for d, t in merges]
    return interp.build_library(SOURCE, expressions, kernel_traits)


def run_persistent(
    lib,
    config,
    layout: Layout,
    q,
    k,
    v,
    scale: float,
    ctas: int = GRID_CTAS,
    split_tiles=0,
    key_pairs=None,
    max_slots=None,
):
    """One launch of attn_fwd_sm90_persistent `config` on `ctas` CTAs over the work list the
    backends build (rows split above ``split_tiles`` key tiles: 0 none, None geometry's
    choice, its chunks within ``max_slots`` slots; counted and cut in key pairs where the
    config's key tile holds two blocks, unless ``key_pairs`` says otherwise), then
    attn_fwd_sm90_merge over the split rows as the backends run it; returns (out, lse, counter
    after the launch, the work list)."""
    batch, heads, n_q, head_dim = q.shape
    block, tile_n, _, dtype, _ = config
    kv_group = heads // k.shape[1]
    key_pairs = tile_n > block if key_pairs is None else key_pairs
    work = geometry.sm90_work_list(
        layout.blocks,
        batch,
        layout.n_ctx,
        head_dim,
        dtype,
        kv_group,
        block,
        split_tiles,
        key_pairs,
        max_slots=max_slots,
    )
    slots = max(work.slots, 1)
    part_out = np.full((slots, TILE_M, head_dim), np.nan, np.float32)
    part_lse = np.full((slots, TILE_M), np.nan, np.float32)
    counter = np.zeros(1, np.int32)
    out = np.full((batch, heads, n_q, head_dim), np.nan, q.dtype)
    lse = np.full((batch, heads, n_q), np.nan, np.float32)
    name = persistent_expression(*config)
    threads, smem = lib.traits(name)
    geometry_config = geometry.KernelConfig(
        geometry.SM90_FWD_PERSISTENT,
        head_dim,
        dtype,
        n_rows=ctas,
        block=block,
        rule=config[4],
        key_pairs=tile_n > block,
    )
    # the kernel's own traits (its two Q tiles included) are what the backends launch with
    assert (geometry_config.threads, geometry_config.smem_bytes) == (threads, smem), name
    args = forward_args(q, k, v, out, lse, layout, tile_n, scale)
    items = np.ascontiguousarray(work.items)
    args += [ctypes.c_void_p(items.ctypes.data), ctypes.c_int32(len(items)), ctypes.c_int32(heads)]
    args += [ctypes.c_void_p(a.ctypes.data) for a in (counter, part_out, part_lse)]
    lib.launch(name, (ctas, 1, 1), (threads, 1, 1), smem, args)
    if len(work.merges):
        merges = np.ascontiguousarray(work.merges)
        rows = len(merges) * TILE_M
        config = geometry.KernelConfig(geometry.SM90_FWD_MERGE, head_dim, dtype, n_rows=rows)
        name = merge_expression(head_dim, dtype)
        assert lib.traits(name) == (config.threads, config.smem_bytes)
        pointers = (part_out, part_lse, merges, out, lse)
        args = [ctypes.c_void_p(a.ctypes.data) for a in pointers]
        args += [ctypes.c_int32(n_q), ctypes.c_int32(rows)]
        lib.launch(name, config.grid, config.block_dims, config.smem_bytes, args)
    return out, lse, int(counter[0]), work


def check_against_both(lib, config, layout, q, k, v, ctas: int = GRID_CTAS):
    """The persistent forward against the float64 oracle, and bit-equal to attn_fwd_sm90; the
    counter shows every item claimed once and each CTA's one failed claim."""
    dtype, head_dim = config[3], config[2]
    scale = head_dim**-0.5
    out, lse, claims, _ = run_persistent(lib, config, layout, q, k, v, scale, ctas)
    check_forward(out, lse, q, k, v, layout, scale, dtype)
    ref_out, ref_lse = run_forward(lib, config, layout, q, k, v, scale)
    np.testing.assert_array_equal(out.view(np.uint16), ref_out.view(np.uint16))
    np.testing.assert_array_equal(lse, ref_lse)
    items = q.shape[0] * layout.heads * -(-layout.n_q // TILE_M)
    assert claims == items + ctas
    return out, lse


@pytest.mark.parametrize(
    "block, tile_n, head_dim, dtype, rule, case", RUN_CASES, ids=lambda x: str(x)
)
def test_the_persistent_forward_matches_the_oracle_and_attn_fwd_sm90(
    lib, monkeypatch, block, tile_n, head_dim, dtype, rule, case
):
    layout, q, k, v = case_inputs(rule, block, case, head_dim, dtype, block + head_dim)
    if case == "alternating rows":
        monkeypatch.setenv("CUATTN_INTERP_SEED", "1")
    check_against_both(lib, (block, tile_n, head_dim, dtype, rule), layout, q, k, v)


@pytest.mark.parametrize("mode, block", THIN_CASES, ids=str)
def test_thin_layouts_of_the_issue_s_table(lib, mode, block):
    layout = thin_layout(mode, block)
    config = thin_config(mode, block)
    # a thin layout: rows of very different lengths, as the issue's table has
    lengths = layout.blocks.sum(axis=2)
    assert lengths.max() > lengths.min() and layout.density < 0.75, (mode, lengths)
    q, k, v = random_inputs(layout, 2, layout.heads, 64, "bfloat16", block)
    check_against_both(lib, config, layout, q, k, v)


@pytest.mark.parametrize("items", [16, 9])
def test_one_cta_runs_every_item_and_spare_ctas_find_the_list_out(lib, items):
    """One CTA for the whole list (both Q tiles' and the rings' phases wrap many times), then
    more CTAs than items: the result is the same bits. An odd count of items leaves the end of
    the list to the second Q tile."""
    layout = thin_layout("variable", 64)
    batch = 2
    if items % 2:  # 3 heads x 3 query tiles, one batch
        layout = make_layout(
            "variable", 5 * 64 + RAGGED_ROWS, 3, 64, causal=True, local_window_blocks=(2,)
        )
        batch = 1
    config = thin_config("variable", 64)
    q, k, v = random_inputs(layout, batch, layout.heads, 64, "bfloat16", 5)
    assert items == batch * layout.heads * -(-layout.n_q // TILE_M)
    one, _ = check_against_both(lib, config, layout, q, k, v, ctas=1)
    many, _ = check_against_both(lib, config, layout, q, k, v, ctas=items + 2)
    np.testing.assert_array_equal(one.view(np.uint16), many.view(np.uint16))


@pytest.mark.parametrize("seed", BLOCK_SEEDS)
def test_any_cta_order_gives_the_same_bits(lib, monkeypatch, seed):
    monkeypatch.setenv("CUATTN_INTERP_BLOCK_SEED", str(seed))
    layout = thin_layout("bigbird", 64)
    q, k, v = random_inputs(layout, 2, layout.heads, 64, "bfloat16", 11)
    check_against_both(lib, thin_config("bigbird", 64), layout, q, k, v)


# ---- split rows -------------------------------------------------------------------------------

# Every row that walks more than SPLIT_TILES key tiles is split (into chunks of one tile): at
# these sizes geometry's own threshold (8 tiles at least) would split none.
SPLIT_TILES = 1
SPLIT_CASES = [c for c in RUN_CASES if c[-1] != "one warpgroup of rows"] + [
    (64, 64, 64, "bfloat16", "bitmask", "longformer"),
    (64, 64, 64, "bfloat16", "none", "empty rows in a split item"),
]


def split_case(block, case, rule):
    """(layout, batch, kv heads) of a split case: RUN_CASES' own, or a Longformer layout (a
    global row, a ragged last block)."""
    if case == "longformer":
        layout = make_layout(
            "longformer", THIN_BLOCKS * block + RAGGED_ROWS, 2, block, local_attn_ctx=block
        )
        return layout, 2, 2
    if case == "empty rows in a split item":
        # a paired item whose first block attends to nothing and whose second walks three key
        # blocks: every chunk leaves the first block's rows empty (out 0, lse -inf)
        blocks = np.array([[[0, 0, 0], [1, 1, 1], [1, 0, 1]]], bool)
        return Layout(blocks, block, 3 * block - 7, ElementRule("none")), 1, 1
    return case_layout(rule, block, case)


def split_rows(work, layout, batch):
    """bool [batch, heads, n_q]: the query rows of the items the work list split."""
    tiles = -(-layout.n_q // TILE_M)
    split = np.zeros((batch, layout.heads, tiles * TILE_M), bool)
    for item in work.merges[:, 0].tolist():
        pair, tile = divmod(item, tiles)
        split[pair // layout.heads, pair % layout.heads, tile * TILE_M : (tile + 1) * TILE_M] = True
    return split[:, :, : layout.n_q]


def check_split(
    lib,
    config,
    layout,
    q,
    k,
    v,
    ctas: int = GRID_CTAS,
    split_tiles=SPLIT_TILES,
    key_pairs=None,
    max_slots=None,
):
    """The persistent forward with rows split into chunks and merged (above ``split_tiles``,
    None: geometry's threshold; ``key_pairs``, ``max_slots`` as run_persistent): against the
    float64
    oracle; the rows it did not split bit-equal to attn_fwd_sm90, the split ones within the
    dtype's tolerance of it; every entry claimed once. Returns (out, lse, the work list)."""
    from tests.backends.test_interp_kernels import TOLERANCE
    from tests.helpers.oracle import rel_err

    dtype, head_dim = config[3], config[2]
    scale = head_dim**-0.5
    out, lse, claims, work = run_persistent(
        lib, config, layout, q, k, v, scale, ctas, split_tiles, key_pairs, max_slots
    )
    assert len(work.merges) and claims == len(work.items) + ctas
    check_forward(out, lse, q, k, v, layout, scale, dtype)
    ref_out, ref_lse = run_forward(lib, config, layout, q, k, v, scale)
    split = split_rows(work, layout, q.shape[0])
    np.testing.assert_array_equal(out[~split].view(np.uint16), ref_out[~split].view(np.uint16))
    np.testing.assert_array_equal(lse[~split], ref_lse[~split])
    assert rel_err(out[split], ref_out[split]) <= TOLERANCE[dtype]
    finite = split & np.isfinite(ref_lse)
    assert rel_err(lse[finite], ref_lse[finite]) <= TOLERANCE[dtype]
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    return out, lse, work


@pytest.mark.parametrize(
    "block, tile_n, head_dim, dtype, rule, case", SPLIT_CASES, ids=lambda x: str(x)
)
def test_split_rows_merge_to_the_oracle(lib, block, tile_n, head_dim, dtype, rule, case):
    layout, batch, kv_heads = split_case(block, case, rule)
    assert layout.rule.kind == rule
    q, k, v = random_inputs(layout, batch, kv_heads, head_dim, dtype, block + head_dim + 1)
    if case == "gqa":
        q, k, v = strided_view(q), strided_view(k), strided_view(v)
    check_split(lib, (block, tile_n, head_dim, dtype, rule), layout, q, k, v)


def test_few_items_are_split_by_geometry_s_own_threshold(lib):
    """Batch 1, one head, causal rows of up to 21 key tiles: 11 items, fewer than the SMs, so
    geometry's threshold is the launch's tiles over the SMs (at least 8) and the rows past 8
    tiles split, where the mean's (48) would split none; merged to the oracle, the rest
    attn_fwd_sm90's bits."""
    layout = make_layout("all", 20 * 64 + RAGGED_ROWS, 1, 64, causal=True)
    q, k, v = random_inputs(layout, 1, 1, 64, "float16", 23)
    config = (64, 64, 64, "float16", "causal")
    _, _, work = check_split(lib, config, layout, q, k, v, split_tiles=None)
    assert work.split_tiles == geometry.SM90_SPLIT_MIN_TILES and len(work.merges) == 7
    mean_only = geometry.sm90_work_list(layout.blocks, 1, layout.n_ctx, 64, "float16", 1, 64, sms=1)
    assert len(mean_only.merges) == 0


@pytest.mark.parametrize("key_blocks, split", [(12, False), (13, True)])
def test_few_items_of_even_rows_split_only_past_the_spread(lib, key_blocks, split):
    """Batch 1, one head of full rows: key_blocks / 2 items, fewer than the SMs, each walking
    key_blocks tiles, the launch's fill SM90_SPLIT_MIN_TILES (8). 12 tiles are 1.5 x the fill:
    the rule keeps every row whole (the unrefined rule cut each in two), the kernel's output
    attn_fwd_sm90's bits; 13 are past it: every row in two chunks, merged to the oracle."""
    config = (64, 64, 64, "bfloat16", "none")
    layout = make_layout("all", key_blocks * 64, 1, 64, causal=False)
    q, k, v = random_inputs(layout, 1, 1, 64, "bfloat16", key_blocks)
    if split:
        _, _, work = check_split(lib, config, layout, q, k, v, split_tiles=None)
        assert work.split_tiles == geometry.SM90_SPLIT_MIN_TILES
        assert work.merges[:, 2].tolist() == [2] * (key_blocks // 2 + 1)
        return
    scale = 64**-0.5
    out, lse, claims, work = run_persistent(lib, config, layout, q, k, v, scale, split_tiles=None)
    assert not len(work.merges) and claims == len(work.items) + GRID_CTAS
    check_forward(out, lse, q, k, v, layout, scale, "bfloat16")
    ref_out, ref_lse = run_forward(lib, config, layout, q, k, v, scale)
    np.testing.assert_array_equal(out.view(np.uint16), ref_out.view(np.uint16))
    np.testing.assert_array_equal(lse, ref_lse)


def test_a_binding_cap_merges_fewer_longer_chunks_to_the_oracle(lib):
    """Few items as above (7, rows of up to 13 key tiles: 3 rows past 8 split in 6 slots),
    the launch's slots capped at 4: the threshold raised from 8 to 10, the two longest rows
    still split; merged to the oracle, the unsplit rows attn_fwd_sm90's bits."""
    layout = make_layout("all", 12 * 64 + RAGGED_ROWS, 1, 64, causal=True)
    q, k, v = random_inputs(layout, 1, 1, 64, "float16", 29)
    config = (64, 64, 64, "float16", "causal")
    _, _, work = check_split(lib, config, layout, q, k, v, split_tiles=None, max_slots=4)
    uncapped = geometry.sm90_work_list(layout.blocks, 1, layout.n_ctx, 64, "float16", 1, 64)
    assert (uncapped.split_tiles, uncapped.slots, len(uncapped.merges)) == (8, 6, 3)
    assert (work.split_tiles, work.slots, len(work.merges)) == (10, 4, 2)


# (128-blocks: RUN_CASES' split cases)
@pytest.mark.parametrize("mode, block", [c for c in THIN_CASES if c[1] == 64], ids=str)
def test_split_thin_layouts(lib, mode, block):
    layout = thin_layout(mode, block)
    q, k, v = random_inputs(layout, 2, layout.heads, 64, "bfloat16", block + 1)
    check_split(lib, thin_config(mode, block), layout, q, k, v)


def test_split_rows_give_the_same_bits_whatever_the_claim_order(lib, monkeypatch):
    """One CTA taking every chunk, more CTAs than entries, and other blocks run first
    (CUATTN_INTERP_BLOCK_SEED): the merge reads the chunks in one order, so the bits agree."""
    layout = thin_layout("bigbird", 64)
    config = thin_config("bigbird", 64)
    q, k, v = random_inputs(layout, 2, layout.heads, 64, "bfloat16", 13)
    first, first_lse, _ = check_split(lib, config, layout, q, k, v, ctas=1)
    work = geometry.sm90_work_list(layout.blocks, 2, layout.n_ctx, 64, "bfloat16", 1, 64, 1)
    for seed, ctas in [(0, len(work.items) + 2), *((seed, GRID_CTAS) for seed in BLOCK_SEEDS)]:
        monkeypatch.setenv("CUATTN_INTERP_BLOCK_SEED", str(seed))
        out, lse, _, _ = run_persistent(lib, config, layout, q, k, v, 64**-0.5, ctas, SPLIT_TILES)
        np.testing.assert_array_equal(out.view(np.uint16), first.view(np.uint16))
        np.testing.assert_array_equal(lse, first_lse)


# ---- the work list ----------------------------------------------------------------------------


def test_the_work_list_is_every_item_once_longest_first_within_each_l2_group():
    layout = make_layout("bigbird", 40 * 64, 3, 64, causal=True)
    batch, head_dim = 2, 128
    tiles = -(-layout.num_q_blocks // 2)
    # K and V of a pair: 2 x n_k x 128 x 2 bytes, 1.3 MB at 2560 keys (the 6 pairs in one
    # group of the 16 MiB budget), 8 MiB at 16384 (groups of 2 pairs)
    for n_k, groups in ((layout.n_ctx, 1), (1 << 14, 3)):
        assert geometry.sm90_cta_groups(batch, 3, n_k, head_dim, "bfloat16", 1) == groups
        work = geometry.sm90_work_list(
            layout.blocks, batch, n_k, head_dim, "bfloat16", 1, 64, split_tiles=0
        )
        items = work.items
        assert items.dtype == np.int32 and items.shape[1] == geometry.SM90_WORK_FIELDS
        assert sorted(items[:, 0].tolist()) == list(range(batch * 3 * tiles))
        assert (items[:, 1:4] == [0, layout.num_blocks, geometry.SM90_NO_SLOT]).all()
        assert work.merges.shape == (0, geometry.SM90_MERGE_FIELDS) and work.slots == 0
        pair, tile = np.divmod(items[:, 0], tiles)
        union = layout.blocks.reshape(3, tiles, 2, -1).any(axis=2).sum(axis=2)
        walked = union[pair % 3, tile]
        size = batch * 3 // groups
        group = pair // size
        assert (np.diff(group) >= 0).all()  # the groups one after another
        for g in range(groups):
            assert (np.diff(walked[group == g]) <= 0).all()  # longest first within each


def split_layouts():
    """Layouts with rows far longer than the rest (global rows), a ragged last query tile (an
    odd count of 64-blocks), and a random one."""
    rng = np.random.default_rng(0)
    random_blocks = rng.random((2, 9, 11)) < 0.3
    random_blocks[0, 4] = True  # one full row
    longformer = make_layout("longformer", 23 * 64 + 5, 3, 64, local_attn_ctx=128)
    longformer_blocks = longformer.blocks
    return [
        ("bigbird", make_layout("bigbird", 29 * 64, 2, 64, causal=False).blocks, 64),
        ("longformer", longformer_blocks, 64),
        ("bigbird-128", make_layout("bigbird", 17 * 128, 2, 128, causal=False).blocks, 128),
        ("random", random_blocks, 64),
        # few items with long rows: the threshold from the SMs (16 at 132) sits between the
        # minimum and the mean's (132)
        ("causal", make_layout("all", 64 * 64, 2, 64, causal=True).blocks, 64),
    ]


@pytest.mark.parametrize(
    "split_tiles, sms", [(None, 132), (None, 1), (None, 40), (1, 132), (3, 132), (8, 132)]
)
@pytest.mark.parametrize("key_pairs", [False, True], ids=["tile64", "pairs"])
@pytest.mark.parametrize("label, blocks, block", split_layouts(), ids=lambda x: str(x)[:12])
def test_split_rows_are_chunks_that_cover_their_keys_against_a_brute_force(
    label, blocks, block, key_pairs, split_tiles, sms
):
    """Every (query tile, head, batch) item once unsplit, or, where it walks more than the
    threshold, as chunks of at most that many key tiles, none empty, whose key-block ranges
    cover [0, key blocks) in order with consecutive slots; the merge list names each split item
    with its first slot and chunk count; longest first within each L2 group. With key pairs a
    row's key tiles are the pairs (2j, 2j + 1) its union holds a block of, and no cut falls
    inside a pair (no tile is walked by two chunks). The threshold (None): 4 x the mean, at
    least 8; with fewer items than ``sms`` and the longest item past 1.5 x the launch's walked
    tiles over sms (at least 8: the fill), at most the fill."""
    if key_pairs and block != geometry.SM90_KEY_PAIR_BLOCK:
        pytest.skip("key pairs are 64-blocks")
    batch, head_dim, heads = 2, 128, blocks.shape[0]
    nb = blocks.shape[2]
    per_tile = 128 // block
    tiles = -(-blocks.shape[1] // per_tile)
    n_k = nb * block
    work = geometry.sm90_work_list(
        blocks, batch, n_k, head_dim, "bfloat16", 1, block, split_tiles, key_pairs, sms
    )
    threshold = work.split_tiles
    span = 2 if key_pairs else 1
    key_tiles = span * block // geometry.sm90_tile_n(block, head_dim, key_pairs)

    def walked(head, tile, first, end):  # the key tiles an item walks, brute force
        keys = set()
        for r in range(tile * per_tile, min((tile + 1) * per_tile, blocks.shape[1])):
            keys |= {c // span for c in range(first, end) if blocks[head, r, c]}
        return len(keys) * key_tiles

    if split_tiles is None:
        every = [walked(h, t, 0, nb) for h in range(heads) for t in range(tiles)]
        expected = max(geometry.SM90_SPLIT_MIN_TILES, int(np.ceil(4 * np.mean(every))))
        if batch * heads * tiles < sms:
            fill = max(geometry.SM90_SPLIT_MIN_TILES, -(-batch * sum(every) // sms))
            if max(every) > geometry.SM90_FEW_ITEMS_SPREAD_PERCENT / 100 * fill:
                expected = min(expected, fill)
        assert threshold == expected
    entries: dict[int, list[tuple[int, int, int]]] = {}
    for item, first, end, slot, *row_entries in work.items.tolist():
        entries.setdefault(item, []).append((first, end, slot))
        # the CSR entries each row's walk is cut to hold exactly its blocks in [first, end)
        head, tile = item // tiles % heads, item % tiles
        for r in range(2):
            row = tile * per_tile + r
            columns = (
                np.flatnonzero(blocks[head, row]) if r < per_tile and row < len(blocks[0]) else []
            )
            cut = row_entries[2 * r : 2 * r + 2]
            assert list(columns[cut[0] : cut[1]]) == [c for c in columns if first <= c < end]
    assert sorted(entries) == list(range(batch * heads * tiles))
    merges = {m[0]: (m[1], m[2]) for m in work.merges.tolist()}
    assert len(merges) == len(work.merges) and list(merges) == sorted(merges)
    slots = []
    for item, chunks in entries.items():
        head, tile = item // tiles % heads, item % tiles
        whole = walked(head, tile, 0, nb)
        if whole <= threshold:
            assert chunks == [(0, nb, geometry.SM90_NO_SLOT)] and item not in merges
            continue
        chunks.sort(key=lambda c: c[2])
        assert merges[item] == (chunks[0][2], len(chunks))
        assert len(chunks) == -(-whole // threshold)
        assert [c[2] for c in chunks] == list(range(chunks[0][2], chunks[0][2] + len(chunks)))
        bounds = [c[0] for c in chunks] + [chunks[-1][1]]
        assert bounds[0] == 0 and bounds[-1] == nb and bounds == sorted(bounds)
        assert all(b % span == 0 for b in bounds[:-1])  # no cut inside a key pair
        assert all(c[0] == d[1] for c, d in zip(chunks[1:], chunks, strict=False))
        for first, end, _ in chunks:
            assert 0 < walked(head, tile, first, end) <= threshold
        slots += [c[2] for c in chunks]
    assert sorted(slots) == list(range(work.slots))
    # longest first within each group (one group at these sizes)
    assert geometry.sm90_cta_groups(batch, heads, n_k, head_dim, "bfloat16", 1) == 1
    lengths = [
        walked(item // tiles % heads, item % tiles, first, end)
        for item, first, end, *_ in work.items.tolist()
    ]
    assert lengths == sorted(lengths, reverse=True)


def test_bench_shapes_split_only_the_global_rows():
    """At issue 53's bench shape only BigBird's and Longformer's global rows are split: dense
    causal and the other thin layouts keep every row whole."""
    from cuattn.tools.bench.cases import ALL_PATTERNS

    patterns = {p.label: p for p in ALL_PATTERNS}
    for label, split in (("dense-causal", 0), ("variable", 0), ("bigbird", 32), ("longformer", 32)):
        layout = patterns[label].make_layout(8192, 16, 64)
        work = geometry.sm90_work_list(layout.blocks, 2, 8192, 128, "bfloat16", 1, 64)
        assert len(work.merges) == split, label
        if split:  # the first query tile of every (head, batch): the global rows
            assert (work.merges[:, 0] % 32 == 0).all(), label


def test_the_work_list_numbers_items_in_31_bits():
    blocks = np.ones((1, 1, 1), bool)
    with pytest.raises(ValueError, match="31 bits"):
        geometry.sm90_work_list(blocks, 2**31, 128, 64, "bfloat16", 1, 128)


# ---- NVRTC ----------------------------------------------------------------------------------


def test_every_instantiation_compiles_for_sm_90a_without_spills():
    """The persistent family (every block and key tile, head dim, dtype and rule)
    and its merge for sm_90a: no spills (its producer keeps its claimed item and row entries in
    shared memory to stay within 24 registers), HGMMA, TMA, setmaxnreg and the counter's atomic
    in the SASS, no serialised wgmma (C7520)."""
    expressions = [
        persistent_expression(block, tile_n, head_dim, dtype, rule)
        for block, tile_n, head_dim in SHAPES
        if head_dim in geometry.SM90_PERSISTENT_HEAD_DIMS
        for dtype in CXX_TYPES
        for rule in RULES
    ]
    merges = [
        merge_expression(head_dim, dtype)
        for head_dim in geometry.SM90_PERSISTENT_HEAD_DIMS
        for dtype in CXX_TYPES
    ]
    lowered, stats, kernels = compile_for_sm90a(expressions + merges)
    for name in merges:
        assert not stats.get(lowered[name]).spills, (name, stats.get(lowered[name]))
    for name in expressions:
        assert not stats.get(lowered[name]).spills, (name, stats.get(lowered[name]))
        opcodes = {i.base for i in kernels[lowered[name]].instructions}
        assert {"HGMMA", "UTMALDG", "UTMASTG", "USETMAXREG"} <= opcodes, (name, sorted(opcodes))
        assert opcodes & {"ATOMG", "ATOM", "RED"}, (name, sorted(opcodes))


# ---- through the backends -------------------------------------------------------------------


def forward_launches(monkeypatch, family: str, q, k, v, layout, scale):
    """interp.forward under CUATTN_KERNELS=family: ((out, lse), launched name expressions)."""
    from tests.backends.test_sm90a_family import launched

    monkeypatch.setenv(geometry.KERNELS_ENV, family)
    return launched(interp.forward, q, k, v, AttentionCall(layout, scale))


@pytest.mark.parametrize(
    "mode, block, head_dim, dtype, kv_heads",
    [("bigbird", 64, 64, "bfloat16", 2), ("variable", 128, 64, "bfloat16", 1)],
    ids=str,
)
def test_cuattn_kernels_sm90a_persistent_chooses_it(
    monkeypatch, mode, block, head_dim, dtype, kv_heads
):
    """CUATTN_KERNELS=sm90a-persistent runs the persistent kernel (one launch, 132 CTAs at most)
    where attn_fwd_sm90 applies: the oracle's result and attn_fwd_sm90's bits; the backward
    keeps attn_bwd_dkdv + attn_bwd_dq."""
    from tests.backends.test_interp_kernels import TOLERANCE
    from tests.helpers.oracle import dense_attention_grads, rel_err

    layout = make_layout(
        mode, THIN_BLOCKS * block + RAGGED_ROWS, 4, block, causal=True, n_q=3 * block + 5
    )
    q, k, v = random_inputs(layout, 2, kv_heads, head_dim, dtype, 7)
    scale = head_dim**-0.5
    (out, lse), names = forward_launches(monkeypatch, "sm90a-persistent", q, k, v, layout, scale)
    tile_n = geometry.sm90_tile_n(block, head_dim)
    cxx = geometry.CXX_TYPE[dtype]
    rule = geometry.CXX_RULE[layout.rule.kind]
    assert names == [f"attn_fwd_sm90_persistent<{block}, {tile_n}, {head_dim}, {cxx}, {rule}>"]
    group = layout.heads // kv_heads
    k_full, v_full = (np.repeat(x, group, axis=1) for x in (k, v))
    check_forward(out, lse, q, k_full, v_full, layout, scale, dtype)
    (ref_out, ref_lse), _ = forward_launches(monkeypatch, "sm90a", q, k, v, layout, scale)
    np.testing.assert_array_equal(out.view(np.uint16), ref_out.view(np.uint16))
    np.testing.assert_array_equal(lse, ref_lse)

    monkeypatch.setenv(geometry.KERNELS_ENV, "sm90a-persistent")
    dout = np.random.default_rng(8).standard_normal(q.shape).astype(q.dtype)
    grads, names = launched_backward(q, k, v, out, lse, dout, layout, scale)
    assert not any(n.startswith("attn_bwd_sm90") for n in names), names
    refs = dense_attention_grads(q, k_full, v_full, dout, layout.to_mask(), scale)
    refs = (refs[0], *(r.reshape(2, kv_heads, group, *r.shape[2:]).sum(2) for r in refs[1:]))
    for name, grad, ref in zip("qkv", grads, refs, strict=True):
        assert rel_err(grad, ref) <= TOLERANCE[dtype], f"d{name}"


def test_the_backends_split_a_global_row_and_merge_it(monkeypatch):
    """Through the backends, geometry's own threshold: a Longformer layout whose global row
    walks 40 key tiles beside rows of about 4 (40 items, fewer than the SMs: threshold 8) is
    split, the persistent launch followed by the merge's; the oracle's result, the unsplit rows
    attn_fwd_sm90's bits."""
    from tests.backends.test_interp_kernels import TOLERANCE
    from tests.helpers.oracle import rel_err

    block, blocks, head_dim, dtype = 64, 40, 64, "bfloat16"
    layout = make_layout("longformer", blocks * block, 2, block, local_attn_ctx=block, causal=False)
    q, k, v = random_inputs(layout, 1, 1, head_dim, dtype, 17)
    work = geometry.sm90_work_list(layout.blocks, 1, layout.n_ctx, head_dim, dtype, 2, block)
    assert len(work.merges) == 2 and work.split_tiles < blocks  # each head's global row
    scale = head_dim**-0.5
    (out, lse), names = forward_launches(monkeypatch, "sm90a-persistent", q, k, v, layout, scale)
    rule = geometry.CXX_RULE[layout.rule.kind]
    assert names == [
        f"attn_fwd_sm90_persistent<64, 64, 64, __nv_bfloat16, {rule}>",
        "attn_fwd_sm90_merge<64, __nv_bfloat16>",
    ]
    k_full, v_full = (np.repeat(x, 2, axis=1) for x in (k, v))
    check_forward(out, lse, q, k_full, v_full, layout, scale, dtype)
    (ref_out, ref_lse), _ = forward_launches(monkeypatch, "sm90a", q, k, v, layout, scale)
    split = split_rows(work, layout, 1)
    np.testing.assert_array_equal(out[~split].view(np.uint16), ref_out[~split].view(np.uint16))
    np.testing.assert_array_equal(lse[~split], ref_lse[~split])
    assert rel_err(out[split], ref_out[split]) <= TOLERANCE[dtype]


def launched_backward(q, k, v, out, lse, dout, layout, scale):
    from tests.backends.test_sm90a_family import launched

    return launched(interp.backward, q, k, v, out, lse, dout, None, AttentionCall(layout, scale))


def test_its_grid_is_one_cta_an_sm_and_never_more_than_the_items():
    assert geometry.sm90_persistent_ctas(132, 10_000) == 132
    assert geometry.sm90_persistent_ctas(132, 7) == 7
    config = geometry.KernelConfig(
        geometry.SM90_FWD_PERSISTENT, 128, "bfloat16", n_rows=132, block=64, rule="causal"
    )
    base = geometry.KernelConfig(geometry.SM90_FWD, 128, "bfloat16", block=64, rule="causal")
    assert config.grid == (132, 1, 1)
    q_tile_bytes = geometry.SM90_TILE_M * 128 * 2  # 128 rows x d = 128 of bf16
    extra_q = (geometry.SM90_PERSISTENT_Q_BUFFERS - 1) * q_tile_bytes
    assert config.smem_bytes == base.smem_bytes + extra_q + geometry.SM90_PERSISTENT_SMEM_BYTES
    assert config.threads == base.threads


def test_head_dim_256_runs_the_persistent_forward_too(monkeypatch):
    layout = make_layout("all", 2 * 64 + 9, 2, 64, causal=True)
    q, k, v = random_inputs(layout, 1, 2, 256, "bfloat16", 3)
    (out, lse), names = forward_launches(monkeypatch, "sm90a-persistent", q, k, v, layout, 0.1)
    assert names == ["attn_fwd_sm90_persistent<64, 64, 256, __nv_bfloat16, MASK_CAUSAL>"]
    check_forward(out, lse, q, k, v, layout, 0.1, "bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["longformer", "bigbird"])
def test_on_the_gpu_split_rows_merge_to_the_oracle(mode, monkeypatch):
    """What a GPU run must pass before the persistent forward can be the sm_90 default: a
    layout whose global rows geometry's own threshold splits, through the cuda backend (the
    persistent launch, then the merge's), against the float64 oracle; the rows no chunk splits
    bit for bit attn_fwd_sm90's on the same GPU."""
    from cuattn.backends import cuda
    from cuattn.backends.cuda_runtime import cuda_available

    if not cuda_available():
        pytest.skip("needs a CUDA device")
    import cupy

    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("needs an sm_90 GPU (H100, H200)")
    block, blocks, head_dim, dtype = 64, 40, 128, "bfloat16"
    options = {"local_attn_ctx": block} if mode == "longformer" else {}
    layout = make_layout(mode, blocks * block, 2, block, causal=False, **options)
    q, k, v = random_inputs(layout, 2, 1, head_dim, dtype, 23)
    work = geometry.sm90_work_list(layout.blocks, 2, layout.n_ctx, head_dim, dtype, 2, block)
    assert work.merges, "the layout's global rows must be split"
    scale = head_dim**-0.5
    names = []
    launch = cuda.CudaBackend.launch

    def spy(self, config, **values):
        names.append(config.kernel)
        return launch(self, config, **values)

    monkeypatch.setattr(cuda.CudaBackend, "launch", spy)
    results = {}
    for family in ("sm90a-persistent", "sm90a"):
        monkeypatch.setenv(geometry.KERNELS_ENV, family)
        gpu = [cupy.asarray(x) for x in (q, k, v)]
        out, lse = cuda.CudaBackend().forward(*gpu, AttentionCall(layout, scale))
        results[family] = cupy.asnumpy(out), cupy.asnumpy(lse)
    assert names[:2] == [geometry.SM90_FWD_PERSISTENT, geometry.SM90_FWD_MERGE], names
    out, lse = results["sm90a-persistent"]
    k_full, v_full = (np.repeat(x, 2, axis=1) for x in (k, v))
    check_forward(out, lse, q, k_full, v_full, layout, scale, dtype)
    split = split_rows(work, layout, 2)
    ref_out, ref_lse = results["sm90a"]
    np.testing.assert_array_equal(out[~split].view(np.uint16), ref_out[~split].view(np.uint16))
    np.testing.assert_array_equal(lse[~split], ref_lse[~split])
