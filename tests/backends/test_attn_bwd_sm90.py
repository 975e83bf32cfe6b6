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
# and dK 4 each, dQ_part 8 over both halves of dS^T. The kernel holds dQ_part also over one half
# (4) on the computing path and on the skipping one: 4 + 4 more.
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


# Named patterns whose 64-block pairs often hold a query block in one column of the pair alone
# (the dQ GEMM then runs over that half of dS^T): (pattern, options, n_ctx, head dim, dtype, kv
# heads, batch). fixed at d = 128 (the consumers' registers are tightest there) and with GQA
# (2 query heads on 1 kv head, whose summary columns differ), strided (bitmask), bigbird
# (bidirectional, a ragged last block).
PATTERN_CASES = [
    ("fixed", {"local_attn_ctx": 128, "num_verts": 2, "vertsize": 1}, 384, 128, "bfloat16", 2, 1),
    ("fixed", {"local_attn_ctx": 128, "num_verts": 2, "vertsize": 1}, 384, 64, "float16", 1, 2),
    ("strided", {"local_attn_ctx": 16}, 384, 64, "bfloat16", 2, 1),
    ("bigbird", {"causal": False}, 350, 64, "float16", 2, 1),
]


def one_half_steps(layout) -> int:
    """Query blocks held by exactly one key block of a 64-block pair, over heads and pairs."""
    blocks = layout.blocks
    if blocks.shape[2] % 2:
        blocks = np.concatenate([blocks, np.zeros_like(blocks[:, :, :1])], axis=2)
    return int((blocks[:, :, 0::2] ^ blocks[:, :, 1::2]).sum())


@pytest.mark.parametrize(
    "pattern, options, n_ctx, head_dim, dtype, kv_heads, batch",
    PATTERN_CASES,
    ids=[f"{c[0]}-d{c[3]}-kv{c[5]}" for c in PATTERN_CASES],
)
def test_paired_blocks_with_a_missing_half_match_the_oracle_and_the_mma_backward(
    monkeypatch, pattern, options, n_ctx, head_dim, dtype, kv_heads, batch
):
    """Steps that one consumer of a 64-block pair computes and the other skips: dQ_part runs
    over the computing half of dS^T alone (both consumers), the skipping consumer stores
    nothing; steps neither computes reduce zeros. dQ, dK, dV against the float64 oracle and the
    mma.sync backward."""
    layout = make_layout(pattern, n_ctx, HEADS, 64, **options)
    assert one_half_steps(layout) > 0
    q, k, v, dout = inputs(layout, batch, kv_heads, head_dim, dtype, seed=3)
    scale = head_dim**-0.5
    call = AttentionCall(layout, scale)
    out, lse = interp.forward(q, k, v, call)
    monkeypatch.setenv(geometry.KERNELS_ENV, "sm90a")
    grads, names = launched(interp.backward, q, k, v, out, lse, dout, None, call)
    assert names == sm90_names(64, head_dim, dtype, layout.rule.kind)
    monkeypatch.setenv(geometry.KERNELS_ENV, "mma")
    mma = interp.backward(q, k, v, out, lse, dout, None, call)
    group = HEADS // kv_heads
    k_full, v_full = (np.repeat(x, group, axis=1) for x in (k, v))
    refs = dense_attention_grads(q, k_full, v_full, dout, layout.to_mask(), scale)
    refs = (refs[0], *(r.reshape(batch, kv_heads, group, *r.shape[2:]).sum(2) for r in refs[1:]))
    for name, grad, ref, other in zip("qkv", grads, refs, mma, strict=True):
        assert not np.isnan(grad.astype(np.float32)).any(), f"d{name} left poisoned"
        assert rel_err(grad, ref) <= TOLERANCE[dtype], f"d{name} against the oracle"
        assert rel_err(grad, other.astype(np.float64)) <= TOLERANCE[dtype], f"d{name} against mma"


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
    assert len(configs) == len({c.name_expression for c in configs}) == 68
    for config in configs:
        library = interp.library_for(config)
        assert library.traits(config.name_expression) == (config.threads, config.smem_bytes)
        assert config.arch == "sm_90a"
        assert config.smem_bytes <= geometry.SM90_SMEM_LIMIT


def test_every_instantiation_compiles_for_sm_90a_without_spills_or_serialised_wgmma():
    """NVRTC compiles the whole backward family for sm_90a, the unordered dQ's instantiations
    too: no spills, ptxas neither injects waits between wgmma (C7519) nor serialises them
    (C7520, C7512), and each kernel holds the HGMMA of one step (the loop is not unrolled;
    dQ_part's over one half on both paths beside it), the TMA loads, the bulk reduce and
    setmaxnreg."""
    check_sm90a_build(geometry.sm90_backward_configs())


def check_sm90a_build(configs: list) -> None:
    """NVRTC's sm_90a build of the backward `configs` (one source file): no ptxas wait injected
    between wgmma or serialisation, no spills, and in each kernel one step's HGMMA, the TMA
    loads, the bulk reduce and setmaxnreg; skips where NVRTC or the SASS tools are missing."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from cuattn.backends.toolchain import common_options, kernel_program
    from dev import sass, sass_model
    from dev.ptxas import parse_ptxas_log

    problem = sass_model.missing_tools()
    if problem is not None:
        pytest.skip(f"no SASS tools: {problem}")
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
        if config.kernel in (geometry.SM90_BWD, geometry.SM90_BWD_PERSISTENT):
            assert opcodes.count("HGMMA") == HGMMA_PER_STEP[config.head_dim] + DQ_HGMMA, name
            assert {"UTMALDG", "UBLKRED", "USETMAXREG"} <= set(opcodes), name


@pytest.mark.parametrize("key_blocks", [1, 2])
def test_dq_ranks_order_each_query_block_s_ctas_as_they_are_claimed(key_blocks):
    """Each CSC entry's rank is the number of other CTAs (key tiles of key_blocks blocks) with a
    block in its row claimed before its own in its kv head's tile order, brute force on a random
    layout of 5 key blocks (an odd count: the last tile holds one block), 4 query heads on 2 kv
    heads; the order puts the tiles walking the fewest query blocks first, ties the higher."""
    from cuattn.backends.kernels import backward_tile_order, dq_ranks
    from cuattn.layout.layout import Layout

    blocks = np.random.default_rng(4).random((4, 4, 5)) < 0.5
    layout = Layout(blocks, 16, 5 * 16, n_q=4 * 16)
    kv_group, tiles = 2, -(-5 // key_blocks)
    order = backward_tile_order(layout.blocks, key_blocks, kv_group)
    assert order.shape == (2, tiles) and order.dtype == np.int32
    for kv_head in range(2):
        heads = blocks[kv_head * kv_group : (kv_head + 1) * kv_group]
        walked = [
            heads[:, :, t * key_blocks : (t + 1) * key_blocks].any(axis=2).sum()
            for t in range(tiles)
        ]
        assert sorted(range(tiles), key=lambda t: (walked[t], -t)) == list(order[kv_head])
    ranks = dq_ranks(layout.blocks, layout.col_ptr, layout.row_idx, key_blocks, order)
    for head in range(4):
        place = {int(t): n for n, t in enumerate(order[head // kv_group])}
        for column in range(5):
            first, last = layout.col_ptr[head, column], layout.col_ptr[head, column + 1]
            for entry in range(first, last):
                row = layout.row_idx[entry]
                claimed_before = {
                    j // key_blocks
                    for j in np.flatnonzero(blocks[head, row])
                    if place[j // key_blocks] < place[column // key_blocks]
                }
                assert ranks[entry] == len(claimed_before), (head, column, row)


def test_a_causal_layout_claims_its_shortest_columns_first():
    """Dense causal: the key tiles in descending order (the shortest column first), whatever
    the kv group."""
    from cuattn.backends.kernels import backward_tile_order

    layout = make_layout("all", 6 * 64, 4, 64, causal=True)
    for key_blocks, kv_group in ((1, 1), (2, 2), (2, 4)):
        order = backward_tile_order(layout.blocks, key_blocks, kv_group)
        tiles = 6 // key_blocks
        assert (order == np.arange(tiles)[::-1]).all(), (key_blocks, kv_group)


@pytest.mark.parametrize(
    "batch, kv_heads, n_q, groups",
    [(4, 16, 4096, 22), (2, 16, 8192, 32), (1, 16, 16384, 16), (2, 4, 1024, 1)],
)
def test_cta_groups_keep_a_group_s_query_side_within_the_l2_budget(batch, kv_heads, n_q, groups):
    """Q, dO, lse/delta and the fp32 dQ of a pair at d128: 1032 bytes a query, 4.03 MiB at
    T = 4096 (3 pairs a group of 16 MiB: 64 pairs in 22 groups); from 8192 one pair a group;
    everything in one group when it fits (8 pairs of 1.01 MiB)."""
    assert geometry.sm90_backward_cta_groups(batch, kv_heads, n_q, 128, "bfloat16", 1) == groups


ORDER_BLOCKS = 6  # key blocks of the claim-order tests: 3 paired CTAs a (kv head, batch)


def order_case(seed: int = 7):
    """A random 64-block layout of 4 query heads on 2 kv heads, 2 batches (4 pairs of 3 CTAs),
    whose columns differ in length (so tile_order is no plain reversal), bf16 at d = 64."""
    from cuattn.layout.layout import ElementRule, Layout

    rng = np.random.default_rng(seed)
    blocks = rng.random((4, ORDER_BLOCKS, ORDER_BLOCKS)) < 0.5
    blocks[:, np.arange(ORDER_BLOCKS), np.arange(ORDER_BLOCKS)] = True  # every row attends
    layout = Layout(blocks, 64, ORDER_BLOCKS * 64, ElementRule("none"))
    q, k, v, dout = inputs(layout, 2, 2, 64, "bfloat16", seed)
    out, lse = interp.forward(q, k, v, AttentionCall(layout, 0.125))
    return layout, q, k, v, dout, out, lse


def test_claim_order_groups_and_block_order_leave_the_gradients_bit_identical(sm90a, monkeypatch):
    """The pairs claimed in one group or four (one pair each), the CTAs run in three shuffled
    block orders: the same bits every time (the dQ adds follow the ranks, not the order the
    CTAs run in), and the float64 oracle's gradients."""
    from cuattn.backends import kernels

    layout, q, k, v, dout, out, lse = order_case()
    order = kernels.backward_tile_order(layout.blocks, 2, 2)
    assert not (order == np.arange(3)[::-1]).all(axis=1).all(), "no plain reversal"
    groups_seen, runs = [], []
    launch = interp.launch

    def spy(config, **values):
        if config.kernel == geometry.SM90_BWD:
            groups_seen.append(values["cta_groups"])
        return launch(config, **values)

    monkeypatch.setattr(interp, "launch", spy)
    for budget, seed in ((geometry.SM90_L2_GROUP_BYTES, "0"), (1, "3"), (1, "8")):
        monkeypatch.setattr(geometry, "SM90_L2_GROUP_BYTES", budget)
        monkeypatch.setenv("CUATTN_INTERP_BLOCK_SEED", seed)
        grads = interp.backward(q, k, v, out, lse, dout, None, AttentionCall(layout, 0.125))
        runs.append([g.view(np.uint16) for g in grads])
    assert groups_seen == [1, 4, 4]
    for name, first, *others in zip("qkv", *runs, strict=True):
        for other in others:
            np.testing.assert_array_equal(first, other, err_msg=f"d{name}")
    k_full, v_full = (np.repeat(x, 2, axis=1) for x in (k, v))
    refs = dense_attention_grads(q, k_full, v_full, dout, layout.to_mask(), 0.125)
    refs = (refs[0], *(r.reshape(2, 2, 2, *r.shape[2:]).sum(2) for r in refs[1:]))
    for name, grad, ref in zip("qkv", grads, refs, strict=True):
        assert rel_err(grad, ref) <= TOLERANCE["bfloat16"], f"d{name}"


def test_ranks_that_do_not_follow_the_claim_order_are_reported_not_hung(sm90a, monkeypatch):
    """Caught: CTAs claimed longest column first while the dQ ranks still put the shortest
    first: the first CTA waits on a rank no CTA claimed before it holds, and the interpreter
    (one CTA at a time: the least residency there is) reports the deadlock. Fixed: the ranks
    from the same longest-first order pass, within the oracle's tolerance."""
    from cuattn.backends import kernels

    dq_ranks = kernels.dq_ranks
    claim_longest_ranks_shortest(monkeypatch)
    layout, q, k, v, dout, out, lse = order_case()
    with pytest.raises(RuntimeError, match=r"waits for the semaphore at \d+ to hold \d+"):
        interp.backward(q, k, v, out, lse, dout, None, AttentionCall(layout, 0.125))
    monkeypatch.setattr(kernels, "dq_ranks", dq_ranks)
    layout, q, k, v, dout, out, lse = order_case()  # a new layout: no cached ranks
    grads = interp.backward(q, k, v, out, lse, dout, None, AttentionCall(layout, 0.125))
    k_full, v_full = (np.repeat(x, 2, axis=1) for x in (k, v))
    refs = dense_attention_grads(q, k_full, v_full, dout, layout.to_mask(), 0.125)
    refs = (refs[0], *(r.reshape(2, 2, 2, *r.shape[2:]).sum(2) for r in refs[1:]))
    for name, grad, ref in zip("qkv", grads, refs, strict=True):
        assert rel_err(grad, ref) <= TOLERANCE["bfloat16"], f"d{name}"


def test_the_unordered_dq_matches_the_oracle_and_leaves_dk_dv_bit_identical(sm90a, monkeypatch):
    """CUATTN_BWD_DQ=unordered runs the instantiation without the semaphore waits: dQ within
    the dtype's tolerance of the float64 oracle and of the ordered run, dK and dV the same bits
    (only dQ is added across CTAs), on 64-block pairs with a missing half (bigbird) and GQA
    causal."""
    cases = [
        (make_layout("bigbird", 350, HEADS, 64, causal=False), 1, HEADS, 64, "float16"),
        (make_layout("all", 3 * 64, 4, 64), 2, 2, 64, "bfloat16"),
    ]
    for layout, batch, kv_heads, head_dim, dtype in cases:
        q, k, v, dout = inputs(layout, batch, kv_heads, head_dim, dtype, seed=5)
        call = AttentionCall(layout, head_dim**-0.5)
        out, lse = interp.forward(q, k, v, call)
        monkeypatch.setenv(geometry.BWD_DQ_ENV, "ordered")
        ordered = interp.backward(q, k, v, out, lse, dout, None, call)
        monkeypatch.setenv(geometry.BWD_DQ_ENV, "unordered")
        grads, names = launched(interp.backward, q, k, v, out, lse, dout, None, call)
        assert names[1].endswith(", DQ_UNORDERED>"), names
        group = layout.heads // kv_heads
        k_full, v_full = (np.repeat(x, group, axis=1) for x in (k, v))
        refs = dense_attention_grads(q, k_full, v_full, dout, layout.to_mask(), head_dim**-0.5)
        assert rel_err(grads[0], refs[0]) <= TOLERANCE[dtype]
        assert rel_err(grads[0], ordered[0].astype(np.float64)) <= TOLERANCE[dtype]
        for name, grad, other in zip("kv", grads[1:], ordered[1:], strict=True):
            np.testing.assert_array_equal(grad.view(np.uint16), other.view(np.uint16), f"d{name}")


def test_the_unordered_dq_never_waits_on_a_rank(sm90a, monkeypatch):
    """Caught by the ordered kernel, passed by the unordered one: CTAs claimed longest column
    first with the dQ ranks still shortest first deadlock the ordered reduces (the interpreter
    runs one CTA at a time); the unordered instantiation reads no rank, so the same launch
    completes, under three shuffled CTA orders, within the oracle's tolerance."""
    claim_longest_ranks_shortest(monkeypatch)
    layout, q, k, v, dout, out, lse = order_case()
    call = AttentionCall(layout, 0.125)
    with pytest.raises(RuntimeError, match=r"waits for the semaphore at \d+ to hold \d+"):
        interp.backward(q, k, v, out, lse, dout, None, call)
    monkeypatch.setenv(geometry.BWD_DQ_ENV, "unordered")
    k_full, v_full = (np.repeat(x, 2, axis=1) for x in (k, v))
    refs = dense_attention_grads(q, k_full, v_full, dout, layout.to_mask(), 0.125)
    refs = (refs[0], *(r.reshape(2, 2, 2, *r.shape[2:]).sum(2) for r in refs[1:]))
    for seed in ("0", "3", "8"):
        monkeypatch.setenv("CUATTN_INTERP_BLOCK_SEED", seed)
        grads = interp.backward(q, k, v, out, lse, dout, None, call)
        for name, grad, ref in zip("qkv", grads, refs, strict=True):
            assert rel_err(grad, ref) <= TOLERANCE["bfloat16"], f"d{name}, block seed {seed}"


def test_a_dq_order_that_is_none_is_refused_before_any_launch(sm90a, monkeypatch):
    layout, q, k, v, dout, out, lse, scale, _ = case_inputs(128, "causal", 64, "bfloat16", "square")
    monkeypatch.setenv(geometry.BWD_DQ_ENV, "fast")
    launches = []
    monkeypatch.setattr(interp, "launch", lambda config, **values: launches.append(config))
    with pytest.raises(ValueError, match="CUATTN_BWD_DQ='fast'.*ordered, unordered"):
        interp.backward(q, k, v, out, lse, dout, None, AttentionCall(layout, scale))
    assert launches == []


def test_the_order_model_prices_the_ordered_waits():
    """dev/bwd_order_model.py, the prediction the GPU run compares with: at the built claim
    order the ordered reduces cost nothing over unordered ones in a causal layout (every CTA
    reaches a query block after those ranked before it), and bigbird's global blocks make them
    wait; unordered is never slower."""
    from dev import bwd_order_model as model

    def makespans(pattern: str) -> tuple[float, float]:
        columns, tile_order = model.layout_case(pattern, 1024, 64)
        order = [(p, j) for j in tile_order for p in range(8)]
        return tuple(
            model.makespan(order, 1024, 1.0, ordered=o, columns=columns) for o in (True, False)
        )

    causal = makespans("dense-causal")
    assert causal[0] == causal[1]
    bigbird = makespans("bigbird")
    assert bigbird[0] > 1.05 * bigbird[1]


def claim_longest_ranks_shortest(monkeypatch) -> None:
    """Patch the backends so that CTAs claim key tiles longest column first while the dQ ranks
    keep the shortest-first order: a mismatch that deadlocks the ordered reduce."""
    from cuattn.backends import kernels

    shortest_first = kernels.backward_tile_order
    dq_ranks = kernels.dq_ranks

    def longest_first(blocks, key_blocks, kv_group):
        return np.ascontiguousarray(shortest_first(blocks, key_blocks, kv_group)[:, ::-1])

    def ranks_shortest_first(blocks, col_ptr, row_idx, key_blocks, tile_order):
        order = shortest_first(blocks, key_blocks, len(blocks) // len(tile_order))
        return dq_ranks(blocks, col_ptr, row_idx, key_blocks, order)

    monkeypatch.setattr(kernels, "backward_tile_order", longest_first)
    monkeypatch.setattr(kernels, "dq_ranks", ranks_shortest_first)
