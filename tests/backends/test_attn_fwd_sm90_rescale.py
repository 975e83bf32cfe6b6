"""The sm_90a forwards' rescale skip (attn_fwd_sm90<..., RESCALE_SKIP> and its persistent twin,
issue 53; asked for by CUATTN_SM90_RESCALE=skip) through the CPU interpreter against the float64
dense oracle, the persistent one bit for bit against attn_fwd_sm90 with the same skip; the
backends' choice of it; and its NVRTC build for sm_90a.

A consumer warp keeps the max its exponentials use while no row of its 16 has a tile max more
than 2^8 (exp2 units) above it, so O and l_i stay unscaled on such tiles and P may reach 2^8.
The inputs here steer the scores: a key's score carries an offset that follows its position
(q's first column and k's first column set it, the rest is noise), so a row's max grows by less
than the bound a tile (skipped), by more (rescaled), drifts past it over several tiles, jumps at
the last keys, or falls after the first tile; scores of magnitude 300 and 400 (the folded
exponent's bound lies between, in log2 units 512) with fp16 values near 2^8 x 1000 in P V. Layouts
with rows whose first key tile is fully masked and rows with nothing to attend (out 0, lse -inf)
come from the interpreter tests' square and window cases. Outputs are NaN-poisoned.
"""

from __future__ import annotations

import numpy as np
import pytest

from cuattn.backends import geometry, interp
from cuattn.backends.call import AttentionCall
from cuattn.layout.registry import make_layout
from tests.backends.test_attn_fwd_sm90 import (
    case_inputs,
    compile_for_sm90a,
    expression,
    random_inputs,
    run_forward,
    traits,
)
from tests.backends.test_attn_fwd_sm90_persistent import (
    check_against_both,
    persistent_expression,
    persistent_traits,
)
from tests.backends.test_interp_kernels import HEADS, check_forward
from tests.backends.test_sm90a_family import launched
from tests.helpers.oracle import dense_attention

pytest.importorskip("ml_dtypes")

SOURCE = "attn_fwd_sm90.cu"
SKIP = ", RESCALE_SKIP"
LOG2E = 1.0 / np.log(2.0)
BOUND_LOG2 = 8.0  # the kernel's RESCALE_SKIP_LOG2
# The offset q's and k's first columns put on a score: q's column holds OFFSET_Q, k's the
# offset / (OFFSET_Q x scale); the other columns are noise of this deviation (scores +- 0.25).
OFFSET_Q = 8.0
NOISE = 0.5
LSE_TOLERANCE = 1e-4  # relative, at least absolute


def skip_name(name: str) -> str:
    """An sm_90a forward's name expression with RESCALE_SKIP (the merge's unchanged)."""
    if name.startswith(("attn_fwd_sm90<", "attn_fwd_sm90_persistent<")):
        return name[:-1] + SKIP + ">"
    return name


class Skipping:
    """A library whose sm_90a forward launches (by the tests' helpers, which spell the default
    name expressions) run the RESCALE_SKIP instantiations."""

    def __init__(self, lib: interp.Library) -> None:
        self.lib = lib

    def traits(self, name: str):
        return self.lib.traits(skip_name(name))

    def launch(self, name: str, *args):
        return self.lib.launch(skip_name(name), *args)


def offsets(kind: str, n_k: int, tile_n: int) -> np.ndarray:
    """A score offset (natural units) for each key position."""
    tiles = np.arange(n_k) / tile_n
    per_tile = BOUND_LOG2 / LOG2E  # the bound, in natural units
    if kind == "slow growth":  # 0.45 of the bound a tile: skipped, then past it after 3 tiles
        return 0.45 * per_tile * tiles
    if kind == "fast growth":  # 1.5 bounds a tile: every tile rescales
        return 1.5 * per_tile * tiles
    if kind == "falling":  # the max in the first tile: never rescaled after it
        return -0.45 * per_tile * tiles
    if kind == "late spike":  # flat, then 30 (43 in log2 units) at the last 5 keys
        return np.where(np.arange(n_k) >= n_k - 5, 30.0, 0.0)
    if kind == "near the bound":  # 300 (433 in log2 units), 0.97 bounds a tile: P near 2^8
        return 300.0 + 0.97 * per_tile * tiles
    if kind == "past the fold":  # 400 (577 in log2 units): the unfolded exponent, growing slowly
        return 400.0 + 0.45 * per_tile * tiles
    raise ValueError(kind)


def steer(q, k, v, kind: str, tile_n: int, scale: float, v_scale: float = 1.0):
    """q, k, v with the offsets of `kind` on the scores, the noise rescaled, v times v_scale."""
    dtype = q.dtype
    q = q.astype(np.float32) * NOISE
    k = k.astype(np.float32) * NOISE
    q[..., 0] = OFFSET_Q
    k[..., 0] = offsets(kind, k.shape[2], tile_n) / (OFFSET_Q * scale)
    v = v.astype(np.float32) * v_scale
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


# (block, key tile, head dim, dtype, rule, layout case, score steering, v scale)
RUN_CASES = [
    (128, 128, 64, "bfloat16", rule, "square", "slow growth", 1.0) for rule in geometry.RULES
]
RUN_CASES += [
    (64, 64, 64, "float16", "causal", "square", "slow growth", 1.0),
    (64, 64, 64, "float16", "none", "long walk", "late spike", 1.0),
    (128, 128, 64, "float16", "none", "long walk", "fast growth", 1.0),
    (64, 64, 64, "bfloat16", "window", "first tile masked", "slow growth", 1.0),
    (64, 64, 64, "float16", "none", "long walk", "near the bound", 1000.0),
    (128, 128, 64, "float16", "causal", "square", "near the bound", 1000.0),
    (64, 64, 64, "bfloat16", "none", "long walk", "past the fold", 1.0),
    (128, 128, 128, "float16", "bitmask", "square", "slow growth", 1.0),
]
# bit-equal to RESCALE_ALWAYS where no row's max grows after its first tile; not where it grows
# within the bound (the skip was taken: P against an older max rounds differently)
ALWAYS_CONFIG = (64, 64, 64, "float16", "none")


def case(rule: str, block: int, layout_case: str, head_dim: int, dtype: str, seed: int):
    if layout_case == "first tile masked":
        # a window of block / 2 + 3 keys: the last rows of each query block see none of the
        # previous key block, which their block's row holds (its first rows reach into it)
        layout = make_layout("local", 3 * block + 9, HEADS, block, local_attn_ctx=block // 2 + 3)
        return layout, *random_inputs(layout, 1, HEADS, head_dim, dtype, seed)
    return case_inputs(rule, block, layout_case, head_dim, dtype, seed)


@pytest.fixture(scope="module")
def lib() -> interp.Library:
    configs = sorted({c[:5] for c in RUN_CASES})
    expressions = [skip_name(persistent_expression(*c)) for c in configs]
    expressions += [skip_name(expression(*c)) for c in configs]
    expressions.append(expression(*ALWAYS_CONFIG))
    kernel_traits = [persistent_traits(*c[:4]) for c in configs] + [traits(*c[:4]) for c in configs]
    kernel_traits.append(traits(*ALWAYS_CONFIG[:4]))
    return interp.build_library(SOURCE, expressions, kernel_traits)


@pytest.mark.parametrize(
    "block, tile_n, head_dim, dtype, rule, layout_case, kind, v_scale", RUN_CASES, ids=str
)
def test_the_rescale_skip_matches_the_oracle_in_both_kernels(
    lib, block, tile_n, head_dim, dtype, rule, layout_case, kind, v_scale
):
    layout, q, k, v = case(rule, block, layout_case, head_dim, dtype, block + head_dim)
    assert layout.rule.kind == rule
    scale = head_dim**-0.5
    q, k, v = steer(q, k, v, kind, tile_n, scale, v_scale)
    if layout_case == "first tile masked":
        # some row's first active key block holds no key it may attend to
        mask = layout.to_mask()[0]
        first_block = layout.blocks[0].argmax(axis=1)
        rows = np.arange(layout.n_q)
        starts = first_block[rows // block] * block
        firsts = [mask[r, s : s + block].any() for r, s in zip(rows, starts, strict=True)]
        assert not all(firsts) and mask.any(axis=1).all()
    out, lse = check_against_both(
        Skipping(lib), (block, tile_n, head_dim, dtype, rule), layout, q, k, v
    )
    # lse as exact as float32 scores allow, whatever max the exponentials used
    _, ref_lse = dense_attention(q, k, v, layout.to_mask(), scale)
    finite = np.isfinite(ref_lse)
    error = np.abs(lse[finite] - ref_lse[finite])
    assert (error <= LSE_TOLERANCE * np.maximum(1.0, np.abs(ref_lse[finite]))).all(), error.max()


@pytest.mark.parametrize("kind, equal", [("falling", True), ("slow growth", False)])
def test_the_skip_is_taken_where_the_max_grows_within_the_bound(lib, kind, equal):
    block, tile_n, head_dim, dtype, rule = ALWAYS_CONFIG
    layout, q, k, v = case(rule, block, "long walk", head_dim, dtype, 11)
    scale = head_dim**-0.5
    q, k, v = steer(q, k, v, kind, tile_n, scale)
    skipped = run_forward(Skipping(lib), ALWAYS_CONFIG, layout, q, k, v, scale)
    always = run_forward(lib, ALWAYS_CONFIG, layout, q, k, v, scale)
    check_forward(*skipped, q, k, v, layout, scale, dtype)
    same = np.array_equal(skipped[0].view(np.uint16), always[0].view(np.uint16))
    assert same == equal, kind


# ---- the backends' choice ---------------------------------------------------------------------


def test_the_rescale_skip_is_opt_in_and_checked(monkeypatch):
    monkeypatch.delenv(geometry.SM90_RESCALE_ENV, raising=False)
    assert not geometry.sm90_rescale_skip(64, False)
    monkeypatch.setenv(geometry.SM90_RESCALE_ENV, "always")
    assert not geometry.sm90_rescale_skip(128, False)
    monkeypatch.setenv(geometry.SM90_RESCALE_ENV, "skip")
    assert geometry.sm90_rescale_skip(64, False) and geometry.sm90_rescale_skip(128, False)
    # d = 256 and key pairs have no such instantiation
    assert not geometry.sm90_rescale_skip(256, False) and not geometry.sm90_rescale_skip(64, True)
    monkeypatch.setenv(geometry.SM90_RESCALE_ENV, "never")
    with pytest.raises(ValueError, match=geometry.SM90_RESCALE_ENV):
        geometry.sm90_rescale_skip(64, False)


def test_the_backend_runs_the_rescale_skip_when_asked(monkeypatch):
    monkeypatch.setenv(geometry.KERNELS_ENV, "sm90a")
    monkeypatch.setenv(geometry.SM90_RESCALE_ENV, "skip")
    dtype = "bfloat16"
    layout, q, k, v = case_inputs("causal", 128, "square", 64, dtype, 5)
    q, k, v = steer(q, k, v, "slow growth", 128, 0.125)
    (out, lse), names = launched(interp.forward, q, k, v, AttentionCall(layout, 0.125))
    check_forward(np.asarray(out), np.asarray(lse), q, k, v, layout, 0.125, dtype)
    assert f"attn_fwd_sm90<128, 128, 64, __nv_bfloat16, MASK_CAUSAL{SKIP}>" in names, names


# ---- NVRTC ------------------------------------------------------------------------------------


def test_rescale_skip_instantiations_compile_without_spills():
    """Four of geometry's 64 rescale-skip instantiations (each block, head dim and kernel at
    least once; the compile sweep builds all) for sm_90a: no spills, no injected or serialised
    wgmma (compile_for_sm90a), and the warp's vote in the SASS."""
    configs = [
        c
        for c in (*geometry.sm90_configs(), *geometry.sm90_persistent_configs())
        if c.rescale_skip and not c.exp2_poly
    ]
    assert len(configs) == 64
    chosen = [
        (geometry.SM90_FWD, 128, 128, "causal"),
        (geometry.SM90_FWD, 64, 64, "none"),
        (geometry.SM90_FWD_PERSISTENT, 64, 128, "bitmask"),
        (geometry.SM90_FWD_PERSISTENT, 128, 64, "window"),
    ]
    expressions = [
        c.name_expression
        for c in configs
        if (c.kernel, c.block, c.head_dim, c.rule) in chosen and c.dtype == "bfloat16"
    ]
    assert len(expressions) == len(chosen)
    lowered, stats, kernels = compile_for_sm90a(expressions)
    for name in expressions:
        assert not stats.get(lowered[name]).spills, (name, stats.get(lowered[name]))
        opcodes = {i.base for i in kernels[lowered[name]].instructions}
        assert "VOTE" in opcodes and "HGMMA" in opcodes, (name, sorted(opcodes))
