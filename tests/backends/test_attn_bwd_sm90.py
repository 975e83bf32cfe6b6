"""The sm_90a backward (kernels/attn_bwd_sm90.cu, issue 51) through the CPU interpreter, as the
backends run it with CUATTN_KERNELS=sm90a: dQ, dK and dV against the float64 oracle and against
the mma.sync backward for every element rule, GQA, ragged tails, queries != keys and a key block
nobody attends (dK = dV = 0); bit-identical gradients whatever order the CTAs run in (the dQ
reduces are ordered by semaphores); what it does not cover falls back to the mma.sync pair by
name. The GPU side that needs no GPU: NVRTC compiles every instantiation for sm_90a with no
spills, unserialised wgmma and the HGMMA count a step needs."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest

from cuattn.backends import geometry, interp
from cuattn.backends.call import AttentionCall
from cuattn.layout.registry import make_layout
from tests.backends.test_interp_kernels import HEADS, TOLERANCE, make_test_layout, n_ctx_for
from tests.backends.test_sm90a_family import inputs, launched
from tests.helpers.oracle import dense_attention_grads, rel_err

pytest.importorskip("ml_dtypes")

# HGMMA a consumer warp issues a step (bench/NOTES.md, change 35): S^T and dP^T d/16 each, dV
# and dK 4 each, dQ_part 8; the kernel holds dQ_part's 8 twice (the path of a consumer that
# computes the step and of one that skips it).
HGMMA_PER_STEP = {64: 24, 128: 32}
DQ_HGMMA = 8

# (block, rule, head dim, dtype, case): every rule, both head dims and dtypes, 128-blocks and
# paired 64-blocks; GQA (4 query heads on 2 kv heads, 2 batches); queries != keys; 64-blocks of
# an odd count (the last CTA's second block missing). The test layouts hold two key blocks, the
# second ragged, and "none"'s head 1 has a key block nobody attends (with 64-blocks: one
# consumer of the CTA skips every step).
CASES = [
    (128, "none", 64, "float16", "square"),
    (128, "causal", 64, "bfloat16", "square"),
    (128, "window", 128, "bfloat16", "square"),
    (128, "bitmask", 64, "float16", "square"),
    (128, "causal", 64, "bfloat16", "gqa"),
    (128, "causal", 128, "float16", "fewer queries"),
    (64, "none", 64, "float16", "square"),
    (64, "bitmask", 128, "float16", "odd blocks"),
    (64, "causal", 64, "bfloat16", "gqa"),
]
ODD_BLOCKS_N = 150  # three 64-blocks, the last ragged


@pytest.fixture
def sm90a(monkeypatch):
    monkeypatch.setenv(geometry.KERNELS_ENV, "sm90a")


def case_inputs(block: int, rule: str, head_dim: int, dtype: str, case: str, seed: int = 1):
    """(layout, q, k, v, dout, out, lse, scale, kv_group)."""
    if case == "square":
        layout, batch, kv_heads = make_test_layout(rule, block, n_ctx_for(block)), 1, HEADS
    elif case == "odd blocks":
        layout, batch, kv_heads = make_test_layout(rule, block, ODD_BLOCKS_N), 1, HEADS
    elif case == "gqa":
        layout, batch, kv_heads = make_layout("all", n_ctx_for(block), 4, block), 2, 2
    else:
        layout = make_layout("all", block + 9, HEADS, block, n_q=block // 2 + 5)
        batch, kv_heads = 1, HEADS
    q, k, v, dout = inputs(layout, batch, kv_heads, head_dim, dtype, seed)
    scale = head_dim**-0.5
    out, lse = interp.forward(q, k, v, AttentionCall(layout, scale))
    return layout, q, k, v, dout, out, lse, scale, layout.heads // kv_heads


def sm90_names(block: int, head_dim: int, dtype: str, rule: str) -> list[str]:
    cxx = geometry.CXX_TYPE[dtype]
    return [
        f"attn_bwd_preprocess<{head_dim}, {cxx}>",
        f"attn_bwd_sm90<{block}, {geometry.SM90_BWD_TILE_Q}, {head_dim}, {cxx}, "
        f"{geometry.CXX_RULE[rule]}>",
        f"attn_bwd_sm90_dq<{head_dim}, {cxx}>",
    ]


@pytest.mark.parametrize("block, rule, head_dim, dtype, case", CASES, ids=str)
def test_the_sm90a_backward_matches_the_oracle_and_the_mma_backward(
    monkeypatch, block, rule, head_dim, dtype, case
):
    layout, q, k, v, dout, out, lse, scale, group = case_inputs(block, rule, head_dim, dtype, case)
    monkeypatch.setenv(geometry.KERNELS_ENV, "sm90a")
    grads, names = launched(
        interp.backward, q, k, v, out, lse, dout, None, AttentionCall(layout, scale)
    )
    assert names == sm90_names(block, head_dim, dtype, rule)
    monkeypatch.setenv(geometry.KERNELS_ENV, "mma")
    mma, names = launched(
        interp.backward, q, k, v, out, lse, dout, None, AttentionCall(layout, scale)
    )
    assert any(name.startswith("attn_bwd_dkdv<") for name in names)
    k_full, v_full = (np.repeat(x, group, axis=1) for x in (k, v))
    refs = dense_attention_grads(q, k_full, v_full, dout, layout.to_mask(), scale)
    batch, kv_heads = k.shape[:2]
    refs = (refs[0], *(r.reshape(batch, kv_heads, group, *r.shape[2:]).sum(2) for r in refs[1:]))
    for name, grad, ref, other in zip("qkv", grads, refs, mma, strict=True):
        assert grad.shape == ref.shape and grad.dtype == q.dtype, f"d{name}"
        assert not np.isnan(grad.astype(np.float32)).any(), f"d{name} left poisoned"
        assert rel_err(grad, ref) <= TOLERANCE[dtype], f"d{name} against the oracle"
        assert rel_err(grad, other.astype(np.float64)) <= TOLERANCE[dtype], f"d{name} against mma"
    if rule == "none":  # head 1's key block 1 is attended by nobody
        assert not layout.blocks[1, :, 1].any()
        for grad in grads[1:]:
            assert (grad[:, 1, block:] == 0).all()


def test_gradients_are_bit_identical_whatever_order_the_ctas_run_in(sm90a, monkeypatch):
    """The dQ reduces into a tile happen in the layout's order, not the CTAs' (GQA causal: each
    query tile takes adds from several key tiles of several CTAs)."""
    layout, q, k, v, dout, out, lse, scale, _ = case_inputs(64, "causal", 64, "bfloat16", "gqa")
    runs = []
    for seed in ("0", "5"):
        monkeypatch.setenv("CUATTN_INTERP_BLOCK_SEED", seed)
        monkeypatch.setenv("CUATTN_INTERP_SEED", seed)
        grads, names = launched(
            interp.backward, q, k, v, out, lse, dout, None, AttentionCall(layout, scale)
        )
        assert "attn_bwd_sm90" in names[1]
        runs.append([g.view(np.uint16) for g in grads])
    for name, first, second in zip("qkv", *runs, strict=True):
        np.testing.assert_array_equal(first, second, err_msg=f"d{name}")


@pytest.mark.parametrize(
    "block, head_dim, dtype",
    [(32, 64, "bfloat16"), (128, 256, "bfloat16"), (128, 64, "float32")],
    ids=["32-blocks", "d256", "fp32"],
)
def test_what_it_does_not_cover_keeps_the_mma_backward(sm90a, block, head_dim, dtype):
    layout = make_test_layout("causal", block, n_ctx_for(block))
    q, k, v, dout = inputs(layout, 1, HEADS, head_dim, dtype, seed=2)
    assert not geometry.sm90_backward_supports(block, head_dim, dtype)
    out, lse = interp.forward(q, k, v, AttentionCall(layout, 0.125))
    _, names = launched(
        interp.backward, q, k, v, out, lse, dout, None, AttentionCall(layout, 0.125)
    )
    assert [name.split("<")[0] for name in names] == [
        "attn_bwd_preprocess",
        "attn_bwd_dkdv",
        "attn_bwd_dq",
    ]


def test_by_default_the_backward_stays_on_mma(monkeypatch):
    """It has never run on a GPU: opt-in only (CUATTN_KERNELS=sm90a)."""
    monkeypatch.delenv(geometry.KERNELS_ENV, raising=False)
    layout, q, k, v, dout, out, lse, scale, _ = case_inputs(128, "causal", 64, "bfloat16", "square")
    _, names = launched(
        interp.backward, q, k, v, out, lse, dout, None, AttentionCall(layout, scale)
    )
    assert not any("sm90" in name for name in names)


def test_geometry_matches_every_instantiation_s_traits():
    configs = geometry.sm90_backward_configs()
    assert len(configs) == len({c.name_expression for c in configs}) == 36
    for config in configs:
        library = interp.library_for(config)
        assert library.traits(config.name_expression) == (config.threads, config.smem_bytes)
        assert config.arch == "sm_90a"
        assert config.smem_bytes <= geometry.SM90_SMEM_LIMIT


def test_every_instantiation_compiles_for_sm_90a_without_spills_or_serialised_wgmma():
    """NVRTC compiles the whole backward family for sm_90a: no spills, ptxas neither injects
    waits between wgmma (C7519) nor serialises them (C7520, C7512), and each kernel holds the
    HGMMA of one step (the loop is not unrolled; dQ_part's on both paths), the TMA loads, the
    bulk reduce and setmaxnreg."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from cuattn.backends.toolchain import common_options, kernel_program
    from dev import sass, sass_model
    from dev.ptxas import parse_ptxas_log

    problem = sass_model.missing_tools()
    if problem is not None:
        pytest.skip(f"no SASS tools: {problem}")
    configs = geometry.sm90_backward_configs()
    expressions = [c.name_expression for c in configs]
    source_file = configs[0].source_file
    lowered, cubin, log = sass_model.compile_module(
        kernel_program(source_file), source_file, expressions, common_options(), "sm_90a"
    )
    for code in ("C7519", "C7520", "C7512", "serialized"):
        assert code not in log, log
    stats = parse_ptxas_log(log)
    with tempfile.TemporaryDirectory() as workdir:
        kernels = sass.parse(sass.disassemble(cubin, Path(workdir)))
    for config in configs:
        name = config.name_expression
        assert not stats.get(lowered[name]).spills, (name, stats.get(lowered[name]))
        opcodes = [i.base for i in kernels[lowered[name]].instructions]
        if config.kernel == geometry.SM90_BWD:
            assert opcodes.count("HGMMA") == HGMMA_PER_STEP[config.head_dim] + DQ_HGMMA, name
            assert {"UTMALDG", "UBLKRED", "USETMAXREG"} <= set(opcodes), name


@pytest.mark.parametrize("key_blocks", [1, 2])
def test_dq_ranks_order_each_query_block_s_ctas_from_the_highest_key_tile(key_blocks):
    """Each CSC entry's rank is the number of other CTAs (key tiles of key_blocks blocks) with a
    block in its row above its own: the order in which the CTAs claim their work, brute force
    on a random layout of 5 key blocks (an odd count: the last tile holds one block)."""
    from cuattn.backends.kernels import dq_ranks
    from cuattn.layout.layout import Layout

    blocks = np.random.default_rng(4).random((2, 4, 5)) < 0.5
    layout = Layout(blocks, 16, 5 * 16, n_q=4 * 16)
    ranks = dq_ranks(layout.blocks, layout.col_ptr, layout.row_idx, key_blocks)
    for head in range(2):
        for column in range(5):
            first, last = layout.col_ptr[head, column], layout.col_ptr[head, column + 1]
            for entry in range(first, last):
                row = layout.row_idx[entry]
                tiles_above = {
                    j // key_blocks
                    for j in np.flatnonzero(blocks[head, row])
                    if j // key_blocks > column // key_blocks
                }
                assert ranks[entry] == len(tiles_above), (head, column, row)
