"""The sm_90a forward (kernels/attn_fwd_sm90.cu, issue 27 step 3a) through the CPU interpreter
against the float64 dense oracle, with every Hopper hazard check on (the interpreter's
default), and compiled for sm_90a by NVRTC: every instantiation without spills, with HGMMA in
its SASS and no serialised wgmma.

Shapes are small on purpose (every wgmma is emulated thread by thread): a ragged last block,
layouts with a query row or a whole query block that attends to nothing, and a key block no
query attends to. Outputs are NaN-poisoned before launch. The launches here spell out the
kernel's signature themselves; tests/backends/test_sm90a_family.py runs it through the backends.
"""

from __future__ import annotations

import ctypes
import tempfile
from pathlib import Path

import numpy as np
import pytest

from cuattn.backends import interp
from cuattn.backends.geometry import SM90_FWD, KernelConfig, sm90_cta_groups
from cuattn.backends.kernels import panel_map
from cuattn.backends.toolchain import kernel_dir
from cuattn.layout.layout import ElementRule, Layout
from cuattn.layout.registry import make_layout
from tests.backends.test_interp_kernels import HEADS, check_forward, make_test_layout, n_ctx_for

ml_dtypes = pytest.importorskip("ml_dtypes")

SOURCE = "attn_fwd_sm90.cu"
NUMPY_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
CXX_TYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
RULES = {"none": "MASK_NONE", "causal": "MASK_CAUSAL", "window": "MASK_WINDOW"}
RULES["bitmask"] = "MASK_BITMASK"
TILE_M = 128  # query rows per CTA: two warpgroups of 64
STORE_ROWS = 64  # out is stored one warpgroup's rows at a time
# (block, key tile) per head dim: 128-blocks take 128-key tiles up to d = 128 (S and O then
# hold 64 + 64 accumulators a thread), 64-key tiles at d = 256 (128 for O alone); 64-blocks
# take 64-key tiles.
SHAPES = [(64, 64, d) for d in (64, 128, 256)] + [(128, 128, 64), (128, 128, 128), (128, 64, 256)]


def expression(block: int, tile_n: int, head_dim: int, dtype: str, rule: str) -> str:
    return f"attn_fwd_sm90<{block}, {tile_n}, {head_dim}, {CXX_TYPES[dtype]}, {RULES[rule]}>"


def traits(block: int, tile_n: int, head_dim: int, dtype: str) -> str:
    return f"attn_fwd_sm90_traits<{block}, {tile_n}, {head_dim}, {CXX_TYPES[dtype]}>"


# The interpreter runs, one per case: (block, key tile, head dim, dtype, rule, layout case).
# Each rule with each dtype and head dims 64 and 128 on 128-blocks; the paired 64-block CTAs
# with two rules; d = 256 once per block size; then GQA with strided inputs, queries != keys
# and a query count that leaves the second warpgroup of the last CTA without rows; then walks
# of 5 to 9 key tiles, so each K/V stage is filled again while the other is read (two-tile
# layouts never reuse one).
RUN_CASES = (
    [(128, 128, 64, "bfloat16", rule, "square") for rule in RULES]
    + [(128, 128, 128, "float16", rule, "square") for rule in RULES]
    + [
        (64, 64, 64, "float16", "causal", "square"),
        (64, 64, 128, "bfloat16", "bitmask", "square"),
        (64, 64, 256, "bfloat16", "none", "square"),
        (128, 64, 256, "float16", "causal", "square"),
        (128, 128, 64, "bfloat16", "causal", "gqa"),
        (128, 128, 128, "bfloat16", "causal", "fewer queries"),
        (64, 64, 64, "bfloat16", "window", "fewer queries"),
        (64, 64, 128, "float16", "causal", "one warpgroup of rows"),
        (128, 128, 128, "bfloat16", "none", "long walk"),
        (64, 64, 64, "float16", "none", "long walk"),
        (128, 64, 256, "bfloat16", "causal", "long walk"),
        (64, 64, 64, "bfloat16", "none", "alternating rows"),
    ]
)
ALTERNATING_BLOCKS = 8
ALTERNATING_SEEDS = range(3)  # warp orders: the case is about one consumer running ahead
LONG_WALK_BLOCKS = 4  # key blocks before the ragged fifth
# The gqa case's 8 (head, batch) pairs started in groups of 3, 3 and 2 (the backends choose one
# group at these sizes): every CTA of an uneven grouping runs once, on its own tile, head and batch
GQA_CTA_GROUPS = 3


def case_layout(rule: str, block: int, case: str) -> tuple[Layout, int, int]:
    """(layout, batch, kv heads) of a run case."""
    if case == "square":
        return make_test_layout(rule, block, n_ctx_for(block)), 1, HEADS
    if case == "gqa":  # 4 query heads on 2 kv heads, two batches
        return make_layout("all", n_ctx_for(block), 4, block), 2, 2
    kwargs = {"local_attn_ctx": block // 2 + 3} if rule == "window" else {}
    mode = "local" if rule == "window" else "all"
    if case == "long walk":  # one CTA of queries (both warpgroups) over five key blocks
        n_k = LONG_WALK_BLOCKS * block + 9
        layout = make_layout("all", n_k, HEADS, block, causal=rule == "causal", n_q=TILE_M - 3)
        return layout, 1, HEADS
    if case == "alternating rows":
        # paired 64-blocks whose two rows share no key block (even query blocks read the even
        # key blocks, odd ones the odd): each consumer skips every other tile of the union and
        # must still wait for each before handing its stages back (StageRing)
        rows = np.arange(ALTERNATING_BLOCKS)
        blocks = (rows[:, None] % 2) == (rows[None, :] % 2)
        blocks = np.broadcast_to(blocks, (HEADS, *blocks.shape)).copy()
        n_ctx = ALTERNATING_BLOCKS * block
        return Layout(blocks, block, n_ctx, ElementRule("none")), 1, HEADS
    if case == "fewer queries":  # n_q < n_k, end-aligned: q_offset > 0
        return make_layout(mode, 2 * block + 9, HEADS, block, n_q=block + 5, **kwargs), 1, HEADS
    # 64-blocks: 70 queries, so the last CTA's second warpgroup has no block at all
    return make_layout(mode, 70, HEADS, block, **kwargs), 1, HEADS


def strided_view(x: np.ndarray) -> np.ndarray:
    """x [batch, heads, rows, d] as a view of a [batch, rows, heads, d] array (a projection's
    output seen head-major): non-contiguous batch, head and row strides."""
    stored = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    return stored.transpose(0, 2, 1, 3)


def random_inputs(layout: Layout, batch: int, kv_heads: int, head_dim: int, dtype: str, seed):
    """Fresh standard-normal q, k and v for `layout` ([batch, heads or kv heads, rows, d])."""
    rng = np.random.default_rng(seed)
    shape_q = (batch, layout.heads, layout.n_q, head_dim)
    shape_kv = (batch, kv_heads, layout.n_ctx, head_dim)
    return tuple(
        rng.standard_normal(s).astype(NUMPY_DTYPES[dtype]) for s in (shape_q, shape_kv, shape_kv)
    )


def case_inputs(rule: str, block: int, case: str, head_dim: int, dtype: str, seed) -> tuple:
    """(layout, q, k, v) of a run case: the gqa case's inputs as strided views."""
    layout, batch, kv_heads = case_layout(rule, block, case)
    assert layout.rule.kind == rule
    q, k, v = random_inputs(layout, batch, kv_heads, head_dim, dtype, seed)
    if case == "gqa":
        q, k, v = strided_view(q), strided_view(k), strided_view(v)
    return layout, q, k, v


@pytest.fixture(scope="module")
def lib() -> interp.Library:
    cases = sorted({(b, t, d, dtype, rule) for b, t, d, dtype, rule, _ in RUN_CASES})
    return interp.build_library(
        SOURCE, [expression(*c) for c in cases], [traits(*c[:4]) for c in cases]
    )


def forward_args(q, k, v, out, lse, layout: Layout, tile_n: int, scale: float) -> list:
    """The ctypes arguments every sm_90a forward kernel of the file opens with: the four tensor
    maps and their first columns, lse, the layout's CSR arrays and sizes, the scale and the
    window (then each kernel's own)."""
    index = interp.backend.index_arrays(layout)
    kv_rows = min(tile_n, layout.blocksize)  # a copy: the tile, or one block of a key pair
    operands = ((q, TILE_M), (k, kv_rows), (v, kv_rows), (out, STORE_ROWS))
    maps = [panel_map(x, x.ctypes.data, rows) for x, rows in operands]
    args: list = [m.interp_struct() for m, _ in maps] + [ctypes.c_int32(c) for _, c in maps]
    pointers = [lse, index.row_ptr, index.col_idx, index.row_mask, index.mask_table]
    args += [ctypes.c_void_p(a.ctypes.data) for a in pointers]
    kv_group = q.shape[1] // k.shape[1]
    ints = [layout.n_q, layout.n_ctx, layout.q_offset, kv_group, layout.num_q_blocks]
    args += [ctypes.c_int32(i) for i in ints]
    args.append(ctypes.c_float(scale))
    return args + [ctypes.c_int32(i) for i in (layout.rule.window_left, layout.rule.window_right)]


def compile_for_sm90a(expressions: list[str]) -> tuple[dict, object, dict]:
    """NVRTC's sm_90a build of `expressions` from the file: (lowered names, ptxas stats, SASS
    kernels), after checking that ptxas neither injects waits between wgmma (C7519) nor
    serialises them (C7520); skips where NVRTC or the SASS tools are missing."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from cuattn.backends.toolchain import common_options
    from dev import sass, sass_model
    from dev.ptxas import parse_ptxas_log

    problem = sass_model.missing_tools()
    if problem is not None:
        pytest.skip(f"no SASS tools: {problem}")
    source = (kernel_dir() / SOURCE).read_text()
    lowered, cubin, log = sass_model.compile_module(
        source, SOURCE, expressions, common_options(), "sm_90a"
    )
    assert "C7519" not in log and "C7520" not in log and "serialized" not in log, log
    with tempfile.TemporaryDirectory() as workdir:
        kernels = sass.parse(sass.disassemble(cubin, Path(workdir)))
    return lowered, parse_ptxas_log(log), kernels


def run_forward(lib, config, layout: Layout, q, k, v, scale: float, cta_groups: int = 0):
    """One launch of the kernel `config` (block, key tile, head dim, dtype, rule) on the
    interpreter, its (head, batch) pairs started in `cta_groups` groups (0: as the backends
    choose, geometry.sm90_cta_groups); returns (out, lse)."""
    batch, heads, n_q, head_dim = q.shape
    block, tile_n, _, dtype, rule_kind = config
    kv_group = heads // k.shape[1]
    if not cta_groups:
        cta_groups = sm90_cta_groups(batch, heads, layout.n_ctx, head_dim, dtype, kv_group)
    out = np.full((batch, heads, n_q, head_dim), np.nan, q.dtype)
    lse = np.full((batch, heads, n_q), np.nan, np.float32)
    name = expression(*config)
    threads, smem = lib.traits(name)
    args = forward_args(q, k, v, out, lse, layout, tile_n, scale) + [ctypes.c_int32(cta_groups)]
    geometry_config = KernelConfig(
        SM90_FWD, head_dim, dtype, batch, heads, n_q, block, rule_kind, key_pairs=tile_n > block
    )
    assert geometry_config.tile_n == tile_n and geometry_config.threads == threads, config
    grid = geometry_config.grid
    lib.launch(name, grid, (threads, 1, 1), smem, args)
    return out, lse


@pytest.mark.parametrize(
    "block, tile_n, head_dim, dtype, rule, case", RUN_CASES, ids=lambda x: str(x)
)
def test_the_sm90a_forward_matches_the_dense_oracle(
    lib, monkeypatch, block, tile_n, head_dim, dtype, rule, case
):
    layout, q, k, v = case_inputs(rule, block, case, head_dim, dtype, block + head_dim)
    scale = head_dim**-0.5
    for seed in ALTERNATING_SEEDS if case == "alternating rows" else [None]:
        if seed is not None:
            monkeypatch.setenv("CUATTN_INTERP_SEED", str(seed))
        config = (block, tile_n, head_dim, dtype, rule)
        groups = GQA_CTA_GROUPS if case == "gqa" else 0
        out, lse = run_forward(lib, config, layout, q, k, v, scale, groups)
        check_forward(out, lse, q, k, v, layout, scale, dtype)


def test_every_instantiation_compiles_for_sm_90a_to_hgmma_without_spills():
    """NVRTC compiles the whole family (every block and key tile, head dim, dtype and rule) for
    sm_90a: no spills, HGMMA, TMA and setmaxnreg in the SASS of each kernel, and ptxas neither
    injects waits between wgmma (C7519) nor serialises them (C7520)."""
    expressions = [
        expression(block, tile_n, head_dim, dtype, rule)
        for block, tile_n, head_dim in SHAPES
        for dtype in CXX_TYPES
        for rule in RULES
    ]
    lowered, stats, kernels = compile_for_sm90a(expressions)
    for name in expressions:
        assert not stats.get(lowered[name]).spills, (name, stats.get(lowered[name]))
        opcodes = {i.base for i in kernels[lowered[name]].instructions}
        # the wgmma, the TMA loads and stores, the setmaxnreg hand-over
        assert {"HGMMA", "UTMALDG", "UTMASTG", "USETMAXREG"} <= opcodes, (name, sorted(opcodes))
