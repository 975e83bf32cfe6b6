"""The sm_90a forwards at 64-blocks on 128-key tiles of two adjacent key blocks
(attn_fwd_sm90<64, 128, ...> and attn_fwd_sm90_persistent<64, 128, ...>, issue 53; asked for by
CUATTN_SM90_TILE_N=128) through the CPU interpreter against the float64 dense oracle, the
persistent one bit for bit against attn_fwd_sm90 of the same key tile; the backends' choice of
it; and its NVRTC build for sm_90a.

Each half of a key tile keeps its own block's entry mask and element rule; a consumer whose row
holds one half computes that half alone (the N = 64 wgmma), and a half no row of the CTA holds
is never copied. The layouts here make every such case: rows that hold one half of every tile
(alternating rows, fixed, strided), tiles whose second block lies past the keys (an odd count
of key blocks, a ragged last block), tiles one consumer's row lacks entirely. Outputs are
NaN-poisoned before launch, and the interpreter's hazard checks are on (a consumer reading a
half that was not copied reads shared memory no copy wrote).
"""

from __future__ import annotations

import numpy as np
import pytest

from cuattn.backends import geometry, interp
from cuattn.backends.call import AttentionCall
from cuattn.layout.layout import ElementRule, Layout
from cuattn.layout.registry import make_layout
from tests.backends.test_attn_fwd_sm90 import (
    CXX_TYPES,
    RULES,
    case_inputs,
    compile_for_sm90a,
    expression,
    random_inputs,
    run_forward,
    strided_view,
    traits,
)
from tests.backends.test_attn_fwd_sm90_persistent import (
    RAGGED_ROWS,
    THIN_BLOCKS,
    check_against_both,
    check_split,
    merge_expression,
    persistent_expression,
    persistent_traits,
)
from tests.backends.test_interp_kernels import check_forward
from tests.backends.test_sm90a_family import launched

ml_dtypes = pytest.importorskip("ml_dtypes")

SOURCE = "attn_fwd_sm90.cu"
BLOCK = 64
TILE_N = 128
DTYPE = "bfloat16"

# (head dim, rule, case): every rule on test_attn_fwd_sm90's square layouts (a ragged last block;
# rows and blocks that attend to nothing), then queries != keys, GQA with strided inputs, a last
# CTA whose second consumer has no rows, a walk of five key blocks (an odd count: the last
# tile's second half lies past the keys) and two rows that share no key block.
RUN_CASES = [(64, rule, "square") for rule in RULES] + [
    (128, "causal", "square"),
    (128, "bitmask", "square"),
    (64, "window", "fewer queries"),
    (64, "causal", "gqa"),
    (128, "causal", "fewer queries"),
    (64, "causal", "one warpgroup of rows"),
    (64, "none", "long walk"),
    (128, "causal", "long walk"),
    (64, "none", "alternating rows"),
]
# Thin layouts of issue 53's table at a test's size, seven key blocks, the last ragged: each has
# rows that hold one block of a key pair.
THIN_MODES = ["fixed", "strided", "bigbird", "variable"]


def key_config(head_dim: int, rule: str) -> tuple:
    return (BLOCK, TILE_N, head_dim, DTYPE, rule)


def thin_layout(mode: str) -> Layout:
    n_ctx = THIN_BLOCKS * BLOCK + RAGGED_ROWS
    kwargs = {
        "strided": {"local_attn_ctx": 3 * BLOCK},
        "fixed": {"local_attn_ctx": 2 * BLOCK},
        "variable": {"local_window_blocks": (3,)},
    }.get(mode, {})
    return make_layout(mode, n_ctx, 2, BLOCK, causal=mode != "bigbird", **kwargs)


def half_tiles(layout: Layout) -> int:
    """Key tiles (pairs of blocks 2j, 2j + 1) of which a query row holds exactly one block."""
    blocks = layout.blocks
    if blocks.shape[2] % 2:
        blocks = np.pad(blocks, ((0, 0), (0, 0), (0, 1)))
    pairs = blocks.reshape(*blocks.shape[:2], -1, 2)
    return int((pairs.sum(axis=3) == 1).sum())


@pytest.fixture(scope="module")
def lib() -> interp.Library:
    configs = sorted({key_config(d, rule) for d, rule, _ in RUN_CASES})
    configs += sorted({key_config(64, thin_layout(m).rule.kind) for m in THIN_MODES} - set(configs))
    merges = sorted({c[2:4] for c in configs})
    expressions = [persistent_expression(*c) for c in configs] + [expression(*c) for c in configs]
    expressions += [merge_expression(*m) for m in merges]
    kernel_traits = [persistent_traits(*c[:4]) for c in configs] + [traits(*c[:4]) for c in configs]
    kernel_traits += [f"row_kernel_traits<{d}, {CXX_TYPES[t]}>" for d, t in merges]
    return interp.build_library(SOURCE, expressions, kernel_traits)


@pytest.mark.parametrize("head_dim, rule, case", RUN_CASES, ids=str)
def test_key_pairs_match_the_oracle_in_both_kernels(lib, monkeypatch, head_dim, rule, case):
    layout, q, k, v = case_inputs(rule, BLOCK, case, head_dim, DTYPE, 7 + head_dim)
    if case == "alternating rows":
        # each consumer holds one half of every tile: the N = 64 path alone, both halves copied
        assert half_tiles(layout) == layout.blocks.shape[0] * layout.blocks.shape[1] * 4
        monkeypatch.setenv("CUATTN_INTERP_SEED", "1")
    if case == "long walk":
        assert layout.num_blocks % 2 == 1 and layout.n_ctx % TILE_N
    check_against_both(lib, key_config(head_dim, rule), layout, q, k, v)


@pytest.mark.parametrize("mode", THIN_MODES)
def test_thin_layouts_skip_the_half_a_row_lacks(lib, mode):
    layout = thin_layout(mode)
    assert half_tiles(layout) > 0 and layout.num_blocks % 2 == 1, mode
    q, k, v = random_inputs(layout, 2, layout.heads, 64, DTYPE, 3)
    check_against_both(lib, key_config(64, layout.rule.kind), layout, q, k, v)


def test_a_half_no_row_holds_past_the_keys_is_not_copied(lib):
    """Key blocks 0 and 2 of three, the third ragged: the second tile's second half would start
    past the keys, and no row holds the first tile's second half (a copy of it would be a
    wasted read; a consumer computing it would read shared memory no copy wrote)."""
    blocks = np.array([[[1, 0, 1], [1, 0, 1], [0, 0, 1]]], bool)
    layout = Layout(blocks, BLOCK, 3 * BLOCK - 5, ElementRule("none"))
    q, k, v = random_inputs(layout, 1, 1, 64, DTYPE, 4)
    check_against_both(lib, key_config(64, "none"), layout, q, k, v)


@pytest.mark.parametrize("mode", ["bigbird", "fixed"])
def test_split_rows_cut_inside_a_key_pair_merge_to_the_oracle(lib, mode):
    """A list counted in 64-blocks (not what the backends build with key pairs): chunks of one
    key block each, a chunk holding one half of a tile whose other half is the next chunk's, so
    each half is computed by exactly one chunk."""
    layout = thin_layout(mode)
    q, k, v = random_inputs(layout, 2, layout.heads, 64, DTYPE, 5)
    _, _, work = check_split(
        lib, key_config(64, layout.rule.kind), layout, q, k, v, key_pairs=False
    )
    assert (work.items[work.items[:, 3] >= 0, 1] % 2 == 1).any()  # a cut inside a pair


def chunk_pairs(work, layout):
    """Each split chunk's key pairs (2j, 2j + 1) that its item's rows hold a block of, per item."""
    tiles = -(-layout.n_q // 128)
    pairs: dict[int, list[set]] = {}
    for item, first, end, slot, *_ in work.items.tolist():
        if slot == geometry.SM90_NO_SLOT:
            continue
        head, tile = item // tiles % layout.heads, item % tiles
        union = layout.blocks[head, 2 * tile : 2 * tile + 2].any(axis=0)
        pairs.setdefault(item, []).append({j // 2 for j in range(first, end) if union[j]})
    return pairs


@pytest.mark.parametrize("mode", ["bigbird", "fixed", "strided", "variable"])
def test_split_rows_cut_between_key_pairs_merge_to_the_oracle(lib, mode):
    """The list the backends build with key pairs, one tile a chunk: every cut at an even key
    block, so no tile is walked by two chunks (each chunk holds one pair), merged to the oracle,
    the unsplit rows attn_fwd_sm90's bits."""
    layout = thin_layout(mode)
    q, k, v = random_inputs(layout, 2, layout.heads, 64, DTYPE, 9)
    _, _, work = check_split(lib, key_config(64, layout.rule.kind), layout, q, k, v)
    split = work.items[work.items[:, 3] >= 0]
    assert (split[:, 1] % 2 == 0).all()
    assert ((split[:, 2] % 2 == 0) | (split[:, 2] == layout.num_blocks)).all()
    for item, chunks in chunk_pairs(work, layout).items():
        assert all(len(c) == 1 for c in chunks), item
        assert len(set().union(*chunks)) == len(chunks), item  # each pair in one chunk


def test_few_items_with_key_pairs_split_by_geometry_s_own_threshold(lib):
    """Batch 1, one head, causal rows of up to 13 key pairs: fewer items than the SMs, so
    geometry's threshold falls to 8 tiles (pairs) and the longer rows split between pairs."""
    layout = make_layout("all", 24 * BLOCK + 17, 1, BLOCK, causal=True)
    q, k, v = random_inputs(layout, 1, 1, 128, DTYPE, 10)
    _, _, work = check_split(lib, key_config(128, "causal"), layout, q, k, v, split_tiles=None)
    assert work.split_tiles == geometry.SM90_SPLIT_MIN_TILES and len(work.merges) == 5
    for chunks in chunk_pairs(work, layout).values():
        assert sum(len(c) for c in chunks) == len(set().union(*chunks))


def test_gqa_strided_inputs_with_a_thin_layout(lib):
    layout = make_layout("strided", THIN_BLOCKS * BLOCK + RAGGED_ROWS, 4, BLOCK, 3 * BLOCK)
    q, k, v = random_inputs(layout, 2, 2, 64, DTYPE, 6)
    q, k, v = strided_view(q), strided_view(k), strided_view(v)
    out, lse = run_forward(lib, key_config(64, layout.rule.kind), layout, q, k, v, 0.125)
    check_forward(out, lse, q, k, v, layout, 0.125, DTYPE)


# ---- the backends' choice ---------------------------------------------------------------------


def test_the_key_tile_is_opt_in_and_checked(monkeypatch):
    monkeypatch.delenv(geometry.SM90_TILE_N_ENV, raising=False)
    assert not geometry.sm90_key_pairs(64, 128, DTYPE)
    monkeypatch.setenv(geometry.SM90_TILE_N_ENV, "64")
    assert not geometry.sm90_key_pairs(64, 128, DTYPE)
    monkeypatch.setenv(geometry.SM90_TILE_N_ENV, "128")
    assert geometry.sm90_key_pairs(64, 128, DTYPE) and geometry.sm90_key_pairs(64, 64, DTYPE)
    # 128-blocks have their own tiles; d = 256 and fp16 have no such instantiation
    for block, head_dim, dtype in ((128, 128, DTYPE), (64, 256, DTYPE), (64, 128, "float16")):
        assert not geometry.sm90_key_pairs(block, head_dim, dtype)
    monkeypatch.setenv(geometry.SM90_TILE_N_ENV, "96")
    with pytest.raises(ValueError, match=geometry.SM90_TILE_N_ENV):
        geometry.sm90_key_pairs(64, 128, DTYPE)


@pytest.mark.parametrize("family", ["sm90a", "sm90a-persistent"])
def test_the_backend_runs_key_pairs_when_asked(monkeypatch, family):
    monkeypatch.setenv(geometry.KERNELS_ENV, family)
    layout = thin_layout("fixed")
    q, k, v = random_inputs(layout, 1, layout.heads, 64, DTYPE, 8)
    kernel = geometry.SM90_FWD if family == "sm90a" else geometry.SM90_FWD_PERSISTENT
    for asked, tile_n in (("", BLOCK), ("128", TILE_N)):
        monkeypatch.setenv(geometry.SM90_TILE_N_ENV, asked)
        (out, lse), names = launched(interp.forward, q, k, v, AttentionCall(layout, 0.125))
        check_forward(np.asarray(out), np.asarray(lse), q, k, v, layout, 0.125, DTYPE)
        assert f"{kernel}<{BLOCK}, {tile_n}, 64, __nv_bfloat16, MASK_CAUSAL>" in names, names


# ---- NVRTC ------------------------------------------------------------------------------------


def test_key_pair_instantiations_compile_without_spills_with_both_wgmma_widths():
    """Four of geometry's 16 key-pair instantiations (each head dim, rule and kernel at least
    once; the compile sweep, dev/compile_check.py, builds all 16) for sm_90a: no spills, no
    injected or serialised wgmma (compile_for_sm90a), and the QK^T wgmma at N = 128 (both halves)
    and at N = 64 (one half) in each."""
    configs = [
        c for c in (*geometry.sm90_configs(), *geometry.sm90_persistent_configs()) if c.key_pairs
    ]
    assert len(configs) == 16
    chosen = [
        (geometry.SM90_FWD, 128, "causal"),
        (geometry.SM90_FWD, 64, "window"),
        (geometry.SM90_FWD_PERSISTENT, 128, "bitmask"),
        (geometry.SM90_FWD_PERSISTENT, 64, "none"),
    ]
    expressions = [c.name_expression for c in configs if (c.kernel, c.head_dim, c.rule) in chosen]
    assert len(expressions) == len(chosen)
    lowered, stats, kernels = compile_for_sm90a(expressions)
    for name in expressions:
        assert not stats.get(lowered[name]).spills, (name, stats.get(lowered[name]))
        shapes = {i.opcode for i in kernels[lowered[name]].instructions if i.base == "HGMMA"}
        assert any("64x128x16" in s for s in shapes), (name, shapes)
        assert any("64x64x16" in s for s in shapes), (name, shapes)
