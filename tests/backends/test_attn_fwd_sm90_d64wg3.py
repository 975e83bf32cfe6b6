"""attn_fwd_sm90 with three consumer warpgroups at d = 64 (attn_fwd_sm90<64, 64, 64, T, RULE,
RESCALE_ALWAYS, EXP2_MUFU, 3>, issue 53; asked for by CUATTN_SM90_D64_CONSUMERS=3) through the
CPU interpreter against the float64 dense oracle, and bit for bit against the two-consumer
kernel (a consumer's rows see the same key tiles in the same order either way); the backends'
choice of it; and its NVRTC build for sm_90a.

A CTA is 192 query rows, three adjacent 64-blocks, one a consumer, walking the union of the
three CSR rows (RowUnionTiles). The layouts here make: a last CTA whose third (or second and
third) consumer has no rows, a ragged last key block, queries != keys, GQA on strided inputs,
rows that hold one tile in three of the union (each consumer skips two of every three, under
several warp orders), a query block that attends to nothing in the middle of a CTA and a bitmask
row with no allowed key (out 0, lse -inf). Outputs are NaN-poisoned before launch.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from cuattn.backends import geometry, interp
from cuattn.backends.call import AttentionCall
from cuattn.backends.geometry import SM90_FWD, KernelConfig, sm90_cta_groups
from cuattn.backends.kernels import panel_map
from cuattn.layout.layout import ElementRule, Layout
from cuattn.layout.registry import make_layout
from tests.backends.test_attn_fwd_sm90 import (
    compile_for_sm90a,
    forward_args,
    random_inputs,
    strided_view,
)
from tests.backends.test_interp_kernels import bitmask_fn, check_forward
from tests.backends.test_sm90a_family import launched

pytest.importorskip("ml_dtypes")

SOURCE = "attn_fwd_sm90.cu"
BLOCK = 64
HEAD_DIM = 64
CONSUMERS = 3
TILE_M = CONSUMERS * 64
RAGGED = 9  # rows of the last, ragged block
N_CTX = 4 * BLOCK + RAGGED  # five blocks: CTA 0 holds three, CTA 1 two (its third has no rows)
THIRDS_BLOCKS = 6  # the rows-mod-3 layout: two whole CTAs
THIRDS_SEEDS = range(3)  # warp orders: one consumer running ahead of the others
SCALE = HEAD_DIM**-0.5


def config(dtype: str, rule: str, consumers: int = CONSUMERS, batch=1, heads=2, n_q=1):
    return KernelConfig(
        SM90_FWD, HEAD_DIM, dtype, batch, heads, n_q, BLOCK, rule, consumers=consumers
    )


class Libraries:
    """The interpreter's group library of each launch's config (interp.library_for: the one the
    backends and tests/backends/test_sm90a_family.py build, so the builds are shared)."""

    def traits(self, name: str):
        return interp.library_for(self.configs[name]).traits(name)

    def launch(self, name: str, *args):
        return interp.library_for(self.configs[name]).launch(name, *args)

    def __init__(self) -> None:
        self.configs: dict[str, KernelConfig] = {}


@pytest.fixture(scope="module")
def lib() -> Libraries:
    return Libraries()


def run(lib, layout: Layout, q, k, v, consumers: int = CONSUMERS):
    """(out, lse) of one launch on the interpreter, the geometry's config for this layout."""
    batch, heads, n_q, _ = q.shape
    dtype = "bfloat16" if q.dtype != np.float16 else "float16"
    kernel = config(dtype, layout.rule.kind, consumers, batch, heads, n_q)
    assert kernel.tile_m == consumers * 64 and kernel.threads == (1 + consumers) * 128
    out = np.full(q.shape, np.nan, q.dtype)
    lse = np.full(q.shape[:3], np.nan, np.float32)
    name = kernel.name_expression
    lib.configs[name] = kernel
    threads, smem = lib.traits(name)
    assert (threads, smem) == (kernel.threads, kernel.smem_bytes)
    args = forward_args(q, k, v, out, lse, layout, BLOCK, SCALE)
    q_map, q_col = panel_map(q, q.ctypes.data, kernel.tile_m)  # a Q box of the CTA's rows
    args[0], args[4] = q_map.interp_struct(), ctypes.c_int32(q_col)
    groups = sm90_cta_groups(batch, heads, layout.n_ctx, HEAD_DIM, dtype, heads // k.shape[1])
    lib.launch(name, kernel.grid, (threads, 1, 1), smem, args + [ctypes.c_int32(groups)])
    return out, lse


def thirds_layout() -> Layout:
    """Query block r reads key blocks j with j % 3 == r % 3: the three rows of a CTA share no
    key block, so each consumer computes one tile in three of the union and skips the rest."""
    rows = np.arange(THIRDS_BLOCKS)
    blocks = (rows[:, None] % 3) == (rows[None, :] % 3)
    return Layout(
        np.stack([blocks, blocks[::-1, ::-1]]),
        BLOCK,
        THIRDS_BLOCKS * BLOCK - 5,
        ElementRule("none"),
    )


def hole_layout() -> Layout:
    """Query block 1 (the middle consumer of CTA 0) attends to nothing; the rest is irregular."""
    rng = np.random.default_rng(11)
    blocks = rng.random((2, 5, 5)) < 0.6
    blocks[:, 1] = False
    blocks[:, [0, 2, 3, 4], 0] = True
    return Layout(blocks, BLOCK, N_CTX, ElementRule("none"))


CASES = {
    "causal, ragged, a last CTA of two blocks": lambda: make_layout(
        "all", N_CTX, 2, BLOCK, causal=True
    ),
    "window, fewer queries": lambda: make_layout(
        "local", N_CTX, 2, BLOCK, n_q=2 * BLOCK + 5, local_attn_ctx=BLOCK // 2 + 3
    ),
    "bitmask, a row with no key": lambda: Layout.from_blocks(
        np.ones((2, 5, 5), bool), BLOCK, bitmask_fn, n_ctx=N_CTX
    ),
    "a middle block with no key": hole_layout,
}


@pytest.mark.parametrize("case", CASES)
def test_three_consumers_match_the_oracle(lib, case):
    layout = CASES[case]()
    dtype = "float16" if layout.rule.kind == "bitmask" else "bfloat16"
    q, k, v = random_inputs(layout, 1, layout.heads, HEAD_DIM, dtype, len(case))
    out, lse = run(lib, layout, q, k, v)
    check_forward(out, lse, q, k, v, layout, SCALE, dtype)
    if layout.rule.kind in ("bitmask", "none"):
        assert np.isneginf(lse).any()  # the case has its row with nothing to attend


def test_gqa_strided_inputs(lib):
    layout = make_layout("all", N_CTX, 4, BLOCK, causal=True)
    q, k, v = random_inputs(layout, 2, 2, HEAD_DIM, "bfloat16", 5)
    q, k, v = strided_view(q), strided_view(k), strided_view(v)
    out, lse = run(lib, layout, q, k, v)
    check_forward(out, lse, q, k, v, layout, SCALE, "bfloat16")


@pytest.mark.parametrize("seed", THIRDS_SEEDS)
def test_rows_that_share_no_key_block_bit_for_bit_with_two_consumers(lib, monkeypatch, seed):
    monkeypatch.setenv("CUATTN_INTERP_SEED", str(seed))
    layout = thirds_layout()
    q, k, v = random_inputs(layout, 1, 2, HEAD_DIM, "bfloat16", 20 + seed)
    out, lse = run(lib, layout, q, k, v)
    check_forward(out, lse, q, k, v, layout, SCALE, "bfloat16")
    two_out, two_lse = run(lib, layout, q, k, v, consumers=2)
    np.testing.assert_array_equal(out.view(np.uint16), two_out.view(np.uint16))
    np.testing.assert_array_equal(lse, two_lse)


def test_causal_bit_for_bit_with_two_consumers(lib):
    layout = CASES["causal, ragged, a last CTA of two blocks"]()
    q, k, v = random_inputs(layout, 1, 2, HEAD_DIM, "bfloat16", 3)
    out, lse = run(lib, layout, q, k, v)
    two_out, two_lse = run(lib, layout, q, k, v, consumers=2)
    np.testing.assert_array_equal(out.view(np.uint16), two_out.view(np.uint16))
    np.testing.assert_array_equal(lse, two_lse)


# ---- the backends' choice ---------------------------------------------------------------------


def test_three_consumers_are_opt_in_and_checked(monkeypatch):
    monkeypatch.delenv(geometry.SM90_CONSUMERS_ENV, raising=False)
    assert geometry.sm90_consumers(64, 64, False, False, False) == 2
    monkeypatch.setenv(geometry.SM90_CONSUMERS_ENV, "2")
    assert geometry.sm90_consumers(64, 64, False, False, False) == 2
    monkeypatch.setenv(geometry.SM90_CONSUMERS_ENV, "3")
    assert geometry.sm90_consumers(64, 64, False, False, False) == 3
    # 128-blocks, d = 128, key pairs, the rescale skip and the exp2 polynomial keep two
    for args in (
        (128, 64, False, False, False),
        (64, 128, False, False, False),
        (64, 64, True, False, False),
        (64, 64, False, True, False),
        (64, 64, False, False, True),
    ):
        assert geometry.sm90_consumers(*args) == 2, args
    monkeypatch.setenv(geometry.SM90_CONSUMERS_ENV, "4")
    with pytest.raises(ValueError, match=geometry.SM90_CONSUMERS_ENV):
        geometry.sm90_consumers(64, 64, False, False, False)
    with pytest.raises(AssertionError):
        config("bfloat16", "causal").__class__(
            SM90_FWD, 128, "bfloat16", block=64, rule="causal", consumers=3
        )


def test_the_backend_runs_three_consumers_when_asked(monkeypatch):
    monkeypatch.setenv(geometry.KERNELS_ENV, "sm90a")
    layout = CASES["causal, ragged, a last CTA of two blocks"]()
    q, k, v = random_inputs(layout, 1, layout.heads, HEAD_DIM, "bfloat16", 8)
    three = config("bfloat16", "causal").name_expression
    monkeypatch.setenv(geometry.SM90_CONSUMERS_ENV, "3")
    (out, lse), names = launched(interp.forward, q, k, v, AttentionCall(layout, SCALE))
    check_forward(np.asarray(out), np.asarray(lse), q, k, v, layout, SCALE, "bfloat16")
    assert three in names, names


# ---- NVRTC ------------------------------------------------------------------------------------


def test_three_consumer_instantiations_compile_without_spills_or_local_memory():
    """Two of geometry's eight three-consumer instantiations for sm_90a: no spills and no
    local memory (the walk's per-row arrays stay in registers), no injected or serialised
    wgmma (compile_for_sm90a), the setmaxnreg hand-over, and the registers one CTA of 512
    threads leaves (128)."""
    configs = [c for c in geometry.sm90_configs() if c.consumers == CONSUMERS]
    assert len(configs) == 8 and all(c.threads == 512 for c in configs)
    chosen = [
        c.name_expression
        for c in configs
        if (c.dtype, c.rule) in (("bfloat16", "causal"), ("float16", "bitmask"))
    ]
    lowered, stats, kernels = compile_for_sm90a(chosen)
    for name in chosen:
        stat = stats.get(lowered[name])
        assert not stat.spills and stat.stack_bytes == 0 and stat.registers <= 128, (name, stat)
        opcodes = {i.base for i in kernels[lowered[name]].instructions}
        assert {"HGMMA", "UTMALDG", "UTMASTG", "USETMAXREG"} <= opcodes, (name, sorted(opcodes))
        assert not opcodes & {"LDL", "STL"}, name
