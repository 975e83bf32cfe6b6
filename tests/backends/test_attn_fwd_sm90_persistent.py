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
import tempfile
from pathlib import Path

import numpy as np
import pytest

from cuattn.backends import geometry, interp
from cuattn.backends.call import AttentionCall
from cuattn.backends.kernels import panel_map
from cuattn.backends.toolchain import kernel_dir
from cuattn.layout.layout import Layout
from cuattn.layout.registry import make_layout
from tests.backends.test_attn_fwd_sm90 import (
    CXX_TYPES,
    NUMPY_DTYPES,
    RULES,
    SHAPES,
    STORE_ROWS,
    TILE_M,
    case_layout,
    expression,
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
# paired 64-blocks; d = 128 on both (d = 256 keeps attn_fwd_sm90); GQA with strided inputs;
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
    expressions = [persistent_expression(*c) for c in configs] + [expression(*c) for c in configs]
    kernel_traits = [persistent_traits(*c[:4]) for c in configs] + [traits(*c[:4]) for c in configs]
    return interp.build_library(SOURCE, expressions, kernel_traits)


def run_persistent(lib, config, layout: Layout, q, k, v, scale: float, ctas: int = GRID_CTAS):
    """One launch of attn_fwd_sm90_persistent `config` on `ctas` CTAs over the work list the
    backends build; returns (out, lse, counter after the launch)."""
    batch, heads, n_q, head_dim = q.shape
    block, tile_n, _, dtype, _ = config
    kv_group = heads // k.shape[1]
    work = geometry.sm90_work_list(
        layout.blocks, batch, layout.n_ctx, head_dim, dtype, kv_group, block
    )
    counter = np.zeros(1, np.int32)
    out = np.full((batch, heads, n_q, head_dim), np.nan, q.dtype)
    lse = np.full((batch, heads, n_q), np.nan, np.float32)
    index = interp.backend.index_arrays(layout)
    name = persistent_expression(*config)
    threads, smem = lib.traits(name)
    operands = ((q, TILE_M), (k, tile_n), (v, tile_n), (out, STORE_ROWS))
    maps = [panel_map(x, x.ctypes.data, rows) for x, rows in operands]
    args: list = [m.interp_struct() for m, _ in maps] + [ctypes.c_int32(c) for _, c in maps]
    pointers = [lse, index.row_ptr, index.col_idx, index.row_mask, index.mask_table]
    args += [ctypes.c_void_p(a.ctypes.data) for a in pointers]
    rule = layout.rule
    ints = [layout.n_q, layout.n_ctx, layout.q_offset, kv_group, layout.num_q_blocks]
    args += [ctypes.c_int32(i) for i in ints]
    args.append(ctypes.c_float(scale))
    args += [ctypes.c_int32(rule.window_left), ctypes.c_int32(rule.window_right)]
    args += [ctypes.c_void_p(work.ctypes.data), ctypes.c_int32(len(work)), ctypes.c_int32(heads)]
    args.append(ctypes.c_void_p(counter.ctypes.data))
    lib.launch(name, (ctas, 1, 1), (threads, 1, 1), smem, args)
    return out, lse, int(counter[0])


def random_inputs(layout: Layout, batch: int, kv_heads: int, head_dim: int, dtype: str, seed):
    rng = np.random.default_rng(seed)
    shape_q = (batch, layout.heads, layout.n_q, head_dim)
    shape_kv = (batch, kv_heads, layout.n_ctx, head_dim)
    return tuple(
        rng.standard_normal(s).astype(NUMPY_DTYPES[dtype]) for s in (shape_q, shape_kv, shape_kv)
    )


def check_against_both(lib, config, layout, q, k, v, ctas: int = GRID_CTAS):
    """The persistent forward against the float64 oracle, and bit-equal to attn_fwd_sm90; the
    counter shows every item claimed once and each CTA's one failed claim."""
    dtype, head_dim = config[3], config[2]
    scale = head_dim**-0.5
    out, lse, claims = run_persistent(lib, config, layout, q, k, v, scale, ctas)
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
    layout, batch, kv_heads = case_layout(rule, block, case)
    assert layout.rule.kind == rule
    q, k, v = random_inputs(layout, batch, kv_heads, head_dim, dtype, block + head_dim)
    if case == "gqa":
        q, k, v = strided_view(q), strided_view(k), strided_view(v)
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


def test_one_cta_runs_every_item_and_spare_ctas_find_the_list_out(lib):
    """One CTA for the whole list (Q's and the rings' phases wrap many times), then more CTAs
    than items: the result is the same bits."""
    layout = thin_layout("variable", 64)
    config = thin_config("variable", 64)
    q, k, v = random_inputs(layout, 2, layout.heads, 64, "bfloat16", 5)
    items = 2 * layout.heads * -(-layout.n_q // TILE_M)
    one, _ = check_against_both(lib, config, layout, q, k, v, ctas=1)
    many, _ = check_against_both(lib, config, layout, q, k, v, ctas=items + 2)
    np.testing.assert_array_equal(one.view(np.uint16), many.view(np.uint16))


@pytest.mark.parametrize("seed", BLOCK_SEEDS)
def test_any_cta_order_gives_the_same_bits(lib, monkeypatch, seed):
    monkeypatch.setenv("CUATTN_INTERP_BLOCK_SEED", str(seed))
    layout = thin_layout("bigbird", 64)
    q, k, v = random_inputs(layout, 2, layout.heads, 64, "bfloat16", 11)
    check_against_both(lib, thin_config("bigbird", 64), layout, q, k, v)


# ---- the work list ----------------------------------------------------------------------------


def test_the_work_list_is_every_item_once_longest_first_within_each_l2_group():
    layout = make_layout("bigbird", 40 * 64, 3, 64, causal=True)
    batch, head_dim = 2, 128
    tiles = -(-layout.num_q_blocks // 2)
    # K and V of a pair: 2 x n_k x 128 x 2 bytes, 1.3 MB at 2560 keys (the 6 pairs in one
    # group of the 16 MiB budget), 8 MiB at 16384 (groups of 2 pairs)
    for n_k, groups in ((layout.n_ctx, 1), (1 << 14, 3)):
        assert geometry.sm90_cta_groups(batch, 3, n_k, head_dim, "bfloat16", 1) == groups
        work = geometry.sm90_work_list(layout.blocks, batch, n_k, head_dim, "bfloat16", 1, 64)
        assert work.dtype == np.int32 and sorted(work.tolist()) == list(range(batch * 3 * tiles))
        pair, tile = np.divmod(work, tiles)
        union = layout.blocks.reshape(3, tiles, 2, -1).any(axis=2).sum(axis=2)
        walked = union[pair % 3, tile]
        size = batch * 3 // groups
        group = pair // size
        assert (np.diff(group) >= 0).all()  # the groups one after another
        for g in range(groups):
            assert (np.diff(walked[group == g]) <= 0).all()  # longest first within each


def test_the_work_list_numbers_items_in_31_bits():
    blocks = np.ones((1, 1, 1), bool)
    with pytest.raises(ValueError, match="31 bits"):
        geometry.sm90_work_list(blocks, 2**31, 128, 64, "bfloat16", 1, 128)


# ---- NVRTC ----------------------------------------------------------------------------------


def test_every_instantiation_compiles_for_sm_90a_without_spills():
    """The persistent family (every block and key tile, head dims 64 and 128, dtype and rule)
    for sm_90a: no spills (its producer keeps its claimed item in shared memory to stay within
    24 registers), HGMMA, TMA, setmaxnreg and the counter's atomic in the SASS, no serialised
    wgmma (C7520)."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from cuattn.backends.toolchain import common_options
    from dev import sass, sass_model
    from dev.ptxas import parse_ptxas_log

    problem = sass_model.missing_tools()
    if problem is not None:
        pytest.skip(f"no SASS tools: {problem}")
    expressions = [
        persistent_expression(block, tile_n, head_dim, dtype, rule)
        for block, tile_n, head_dim in SHAPES
        if head_dim in geometry.SM90_PERSISTENT_HEAD_DIMS
        for dtype in CXX_TYPES
        for rule in RULES
    ]
    source = (kernel_dir() / SOURCE).read_text()
    lowered, cubin, log = sass_model.compile_module(
        source, SOURCE, expressions, common_options(), "sm_90a"
    )
    assert "C7519" not in log and "C7520" not in log and "serialized" not in log, log
    stats = parse_ptxas_log(log)
    with tempfile.TemporaryDirectory() as workdir:
        kernels = sass.parse(sass.disassemble(cubin, Path(workdir)))
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
    assert config.smem_bytes == base.smem_bytes + geometry.SM90_PERSISTENT_SMEM_BYTES
    assert config.threads == base.threads


def test_head_dim_256_keeps_attn_fwd_sm90(monkeypatch):
    layout = make_layout("all", 2 * 64 + 9, 2, 64, causal=True)
    q, k, v = random_inputs(layout, 1, 2, 256, "bfloat16", 3)
    (out, lse), names = forward_launches(monkeypatch, "sm90a-persistent", q, k, v, layout, 0.1)
    assert names == ["attn_fwd_sm90<64, 64, 256, __nv_bfloat16, MASK_CAUSAL>"]
    check_forward(out, lse, q, k, v, layout, 0.1, "bfloat16")
