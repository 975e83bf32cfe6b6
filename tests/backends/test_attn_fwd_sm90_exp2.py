"""The sm_90a forwards' exp2 partly on the FMA pipe (attn_fwd_sm90<..., EXP2_POLY> and its
persistent twin, issue 53; asked for by CUATTN_SM90_EXP2=poly): the polynomial itself
(kernels/common/exp2_poly.cuh) over a dense sweep of arguments against float64 exp2, then the
forwards through the CPU interpreter against the float64 dense oracle, the persistent one bit for
bit against attn_fwd_sm90 with the same flags, and against EXP2_MUFU on the same inputs; the
backends' choice of it; NVRTC's sm_90a build.

A quarter of each row's exp2 (the columns of every fourth n-tile) go through exp2_poly of T's
degree (3 for bf16, 4 for fp16): relative error at most 1.01e-4 and 2.91e-6, so l_i, and with
it lse, moves from EXP2_MUFU's by at most that much. The cases: causal and a sparse bitmask
rule, a window whose rows' first key block holds no key they may attend to (masked -inf scores
inside computed tiles), scores spread so wide (+-300 in log2 units) that most arguments fall far
below -127 in full tiles, and the rescale skip beside it (arguments up to +8). Outputs are
NaN-poisoned.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cuattn.backends import geometry, interp
from cuattn.backends.call import AttentionCall
from tests.backends.test_attn_fwd_sm90 import (
    case_inputs,
    compile_for_sm90a,
    expression,
    run_forward,
    traits,
)
from tests.backends.test_attn_fwd_sm90_persistent import (
    check_against_both,
    persistent_expression,
    persistent_traits,
)
from tests.backends.test_attn_fwd_sm90_rescale import case as skip_case
from tests.backends.test_attn_fwd_sm90_rescale import steer
from tests.backends.test_interp_hopper import sm90a_opcodes
from tests.backends.test_interp_kernels import check_forward
from tests.backends.test_sm90a_family import launched
from tests.helpers.interp_run import run
from tests.helpers.oracle import dense_attention

pytest.importorskip("ml_dtypes")

SOURCE = "attn_fwd_sm90.cu"
POLY_SOURCE = Path(__file__).parent / "kernels" / "exp2_poly.cu"
DEGREES = (3, 4)
# exp2_poly's relative error bound at each degree (measured 1.0136e-4 and 2.913e-6 over 2M
# reduced arguments in float32 Horner), and the degree each dtype's P takes.
POLY_ERROR = {3: 1.02e-4, 4: 2.95e-6}
DEGREE = {"bfloat16": 3, "float16": 4}
SMALLEST_NORMAL_LOG2 = -126
CLAMP = -127.0  # EXP2_POLY_MIN: at or below it, exactly +0
LSE_TOLERANCE = 1e-4  # against float64: relative, at least absolute (as the rescale skip's)
FLOAT_LSE_ROUNDING = 2.0**-21  # a few float32 roundings of lse, relative (log2, adds, LN2)
WIDE_Q = 60.0  # q's scale in the wide case: natural scores of deviation ~60, max ~+-300 log2


# ---- the polynomial ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def poly_lib() -> interp.Library:
    return interp.build_library(POLY_SOURCE, [f"test_exp2_poly<{d}>" for d in DEGREES])


def exp2_poly(lib, degree: int, x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, np.float32)
    y = np.full_like(x, np.nan)
    run(lib, f"test_exp2_poly<{degree}>", 4, 64, x, y, x.size)
    return y


def sweep() -> np.ndarray:
    """Arguments from below the clamp to past the rescale skip's bound: a dense grid, every
    float32 in a window about 0 and about a few integers (where the rounding to j changes)."""
    grid = np.linspace(-130.0, 10.0, 1 << 20, dtype=np.float32)
    near = []
    for centre in (0.0, 0.5, -0.5, 1.0, -1.0, -7.5, -126.5, -126.0):
        c = np.float32(centre)
        bits = c.view(np.int32) + np.arange(-2048, 2049, dtype=np.int32)
        near.append(bits.view(np.float32) if c != 0 else np.float32([-1e-30, 0.0, 1e-30]))
    tiny = np.float32(2.0) ** -np.arange(1, 140, dtype=np.float32)
    return np.concatenate([grid, *near, tiny, -tiny]).astype(np.float32)


@pytest.mark.parametrize("degree", DEGREES)
def test_exp2_poly_is_within_its_bound_and_exact_where_it_must_be(poly_lib, degree):
    x = sweep()
    y = exp2_poly(poly_lib, degree, x).astype(np.float64)
    assert np.isfinite(y).all() and (y >= 0).all()
    exact = np.exp2(x.astype(np.float64))
    normal = x >= SMALLEST_NORMAL_LOG2
    error = np.abs(y[normal] / exact[normal] - 1)
    assert error.max() <= POLY_ERROR[degree], (degree, error.max())
    assert error.max() > POLY_ERROR[degree] / 2  # the sweep reaches the error the bound claims
    # below the smallest normal: 0 or a subnormal under 2^-126 (MUFU.EX2.FTZ gives 0)
    assert (y[~normal] < 2.0**SMALLEST_NORMAL_LOG2).all()
    assert (y[x <= CLAMP] == 0).all()
    # integers give their power of two exactly, 0 gives 1 (a row's max element)
    n = np.arange(SMALLEST_NORMAL_LOG2, 9, dtype=np.float32)
    np.testing.assert_array_equal(exp2_poly(poly_lib, degree, n), np.exp2(n))


@pytest.mark.parametrize("degree", DEGREES)
def test_exp2_poly_of_masked_and_huge_negative_scores_is_exactly_zero(poly_lib, degree):
    x = np.float32([-np.inf, -1e38, -1e6, -1000.0, -128.0, -127.0, np.nan])
    y = exp2_poly(poly_lib, degree, x)
    assert (y.view(np.uint32) == 0).all(), y  # +0, bit for bit; a NaN clamps to it too


def test_exp2_poly_assembles_for_sm_90a_without_mufu_or_conversions():
    """On sm_90a the polynomial is FADD, FFMA, FMNMX and integer operations: no MUFU, and no
    F2I or FRND, which run at MUFU's rate."""
    names = [f"test_exp2_poly<{d}>" for d in DEGREES]
    opcodes, log = sm90a_opcodes(names, POLY_SOURCE)
    for name in names:
        ops = set(opcodes[name])
        assert {"FFMA", "FADD", "FMNMX"} <= ops, (name, sorted(ops))
        assert not ops & {"MUFU", "F2I", "FRND", "I2F"}, (name, sorted(ops))


# ---- the forwards -------------------------------------------------------------------------------


def poly_name(name: str, skip: bool) -> str:
    """An sm_90a forward's name expression with EXP2_POLY (and the rescale asked for)."""
    if name.startswith(("attn_fwd_sm90<", "attn_fwd_sm90_persistent<")):
        rescale = "RESCALE_SKIP" if skip else "RESCALE_ALWAYS"
        return f"{name[:-1]}, {rescale}, EXP2_POLY>"
    return name


class Polynomial:
    """A library whose sm_90a forward launches (by the tests' helpers, which spell the default
    name expressions) run the EXP2_POLY instantiations."""

    def __init__(self, lib: interp.Library, skip: bool = False) -> None:
        self.lib = lib
        self.skip = skip

    def traits(self, name: str):
        return self.lib.traits(poly_name(name, self.skip))

    def launch(self, name: str, *args):
        return self.lib.launch(poly_name(name, self.skip), *args)


# (block, key tile, head dim, dtype, rule, layout case, score steering, rescale skip)
FP16_CAUSAL = (128, 128, 64, "float16", "causal", "square", None, False)
WIDE = (128, 128, 64, "bfloat16", "none", "long walk", "wide", False)
RUN_CASES = [
    (64, 64, 64, "bfloat16", "causal", "square", None, False),
    FP16_CAUSAL,
    (128, 128, 64, "bfloat16", "bitmask", "square", None, False),
    (64, 64, 64, "float16", "window", "first tile masked", None, False),
    WIDE,
    (64, 64, 64, "bfloat16", "causal", "long walk", "slow growth", True),
]
# also run with EXP2_MUFU: the polynomial is taken, and moves lse by at most its error
MUFU_CASES = [FP16_CAUSAL, WIDE]


@pytest.fixture(scope="module")
def lib() -> interp.Library:
    expressions, kernel_traits = [], []
    for case in sorted({(c[:5], c[7]) for c in RUN_CASES}):
        config, skip = case
        expressions += [poly_name(persistent_expression(*config), skip)]
        expressions += [poly_name(expression(*config), skip)]
        kernel_traits += [persistent_traits(*config[:4]), traits(*config[:4])]
    for config in sorted({c[:5] for c in MUFU_CASES}):
        expressions.append(expression(*config))
        kernel_traits.append(traits(*config[:4]))
    return interp.build_library(SOURCE, expressions, kernel_traits)


def inputs(case):
    block, tile_n, head_dim, dtype, rule, layout_case, steering, _ = case
    layout, q, k, v = skip_case(rule, block, layout_case, head_dim, dtype, block + head_dim)
    assert layout.rule.kind == rule
    scale = head_dim**-0.5
    if steering == "wide":
        q = (q.astype(np.float32) * WIDE_Q).astype(q.dtype)
    elif steering is not None:
        q, k, v = steer(q, k, v, steering, tile_n, scale)
    return layout, q, k, v, scale


@pytest.mark.parametrize("case", RUN_CASES, ids=str)
def test_the_polynomial_matches_the_oracle_in_both_kernels(lib, case):
    layout, q, k, v, scale = inputs(case)
    if case[6] == "wide":
        # most arguments of the full tiles fall below the clamp
        scores = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k.astype(np.float64))
        below = scores * scale / np.log(2) < scores.max(-1, keepdims=True) * scale / np.log(2) - 127
        assert below.mean() > 0.5
    out, lse = check_against_both(Polynomial(lib, case[7]), case[:5], layout, q, k, v)
    _, ref_lse = dense_attention(q, k, v, layout.to_mask(), scale)
    finite = np.isfinite(ref_lse)
    error = np.abs(lse[finite] - ref_lse[finite])
    assert (error <= LSE_TOLERANCE * np.maximum(1.0, np.abs(ref_lse[finite]))).all(), error.max()


@pytest.mark.parametrize("case", MUFU_CASES, ids=str)
def test_the_polynomial_is_taken_and_moves_lse_by_its_error_alone(lib, case):
    layout, q, k, v, scale = inputs(case)
    config, dtype = case[:5], case[3]
    poly_out, poly_lse = run_forward(Polynomial(lib), config, layout, q, k, v, scale)
    mufu_out, mufu_lse = run_forward(lib, config, layout, q, k, v, scale)
    assert not np.array_equal(poly_lse, mufu_lse)
    assert not np.array_equal(poly_out.view(np.uint16), mufu_out.view(np.uint16))
    np.testing.assert_array_equal(np.isneginf(poly_lse), np.isneginf(mufu_lse))
    finite = np.isfinite(mufu_lse)
    moved = np.abs(poly_lse[finite] - mufu_lse[finite])
    bound = POLY_ERROR[DEGREE[dtype]] + FLOAT_LSE_ROUNDING * np.maximum(
        1.0, np.abs(mufu_lse[finite])
    )
    assert (moved <= bound).all(), (moved.max(), dtype)


# ---- the backends' choice ---------------------------------------------------------------------


def test_the_polynomial_is_opt_in_and_checked(monkeypatch):
    monkeypatch.delenv(geometry.SM90_EXP2_ENV, raising=False)
    assert not geometry.sm90_exp2_poly(64, False)
    monkeypatch.setenv(geometry.SM90_EXP2_ENV, "mufu")
    assert not geometry.sm90_exp2_poly(128, False)
    monkeypatch.setenv(geometry.SM90_EXP2_ENV, "poly")
    assert geometry.sm90_exp2_poly(64, False)
    # d = 128 and 256 and key pairs have no such instantiation
    assert not geometry.sm90_exp2_poly(128, False) and not geometry.sm90_exp2_poly(256, False)
    assert not geometry.sm90_exp2_poly(64, True)
    monkeypatch.setenv(geometry.SM90_EXP2_ENV, "fma")
    with pytest.raises(ValueError, match=geometry.SM90_EXP2_ENV):
        geometry.sm90_exp2_poly(64, False)


def test_the_backend_runs_the_polynomial_when_asked(monkeypatch):
    """Both switches reach the name: the polynomial beside the rescale skip (the instantiations
    with RESCALE_ALWAYS are named by geometry the same way, test_polynomial_instantiations_...)."""
    monkeypatch.setenv(geometry.KERNELS_ENV, "sm90a")
    monkeypatch.setenv(geometry.SM90_EXP2_ENV, "poly")
    monkeypatch.setenv(geometry.SM90_RESCALE_ENV, "skip")
    dtype = "bfloat16"
    layout, q, k, v = case_inputs("causal", 128, "square", 64, dtype, 5)
    (out, lse), names = launched(interp.forward, q, k, v, AttentionCall(layout, 0.125))
    check_forward(np.asarray(out), np.asarray(lse), q, k, v, layout, 0.125, dtype)
    flags = "RESCALE_SKIP, EXP2_POLY"
    assert f"attn_fwd_sm90<128, 128, 64, __nv_bfloat16, MASK_CAUSAL, {flags}>" in names, names


# ---- NVRTC ------------------------------------------------------------------------------------


def test_polynomial_instantiations_compile_without_spills():
    """Two of geometry's 64 exp2-polynomial instantiations (each kernel, dtype, block size and
    rescale once; the compile sweep builds all) for sm_90a: no spills, no injected or
    serialised wgmma (compile_for_sm90a), and the polynomial's clamp in the SASS."""
    configs = [
        c for c in (*geometry.sm90_configs(), *geometry.sm90_persistent_configs()) if c.exp2_poly
    ]
    assert len(configs) == 64
    chosen = [
        (geometry.SM90_FWD, 64, 64, "float16", False),
        (geometry.SM90_FWD_PERSISTENT, 128, 64, "bfloat16", True),
    ]
    expressions = [
        c.name_expression
        for c in configs
        if (c.kernel, c.block, c.head_dim, c.dtype, c.rescale_skip) in chosen and c.rule == "causal"
    ]
    assert len(expressions) == len(chosen)
    lowered, stats, kernels = compile_for_sm90a(expressions)
    for name in expressions:
        assert not stats.get(lowered[name]).spills, (name, stats.get(lowered[name]))
        instructions = kernels[lowered[name]].instructions
        opcodes = {i.base for i in instructions}
        assert "HGMMA" in opcodes and "MUFU" in opcodes, (name, sorted(opcodes))
        clamps = [i for i in instructions if i.base == "FMNMX" and "-127" in str(i.operands)]
        assert clamps, name
