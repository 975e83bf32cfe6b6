"""The sm_90a forward as a kernel family of the backends (issue 27): CUATTN_KERNELS=sm90a
chooses kernels/attn_fwd_sm90.cu for every forward it supports, on the interpreter as on an
sm_90 GPU, and the mma.sync forward for the rest; the backward runs on its out and lse
(kernels/attn_bwd_sm90.cu where that supports the case, tests/backends/test_attn_bwd_sm90.py).

On the interpreter (its wgmma, swizzle and async-proxy checks on), against the float64 oracle
with NaN-poisoned outputs, and against the mma.sync forward of the same call. The GPU side
that needs no GPU: the cubin NVRTC builds for sm_90a, cached on disk and handed to CuPy.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import numpy as np
import pytest

from cuattn.backends import cuda_runtime, geometry, interp
from cuattn.backends.call import AttentionCall
from cuattn.backends.kernels import panel_map
from cuattn.layout.layout import Layout
from cuattn.layout.registry import make_layout
from tests.backends.test_interp_kernels import (
    HEADS,
    NUMPY_DTYPES,
    TOLERANCE,
    check_forward,
    make_test_layout,
    n_ctx_for,
)
from tests.helpers.oracle import dense_attention_grads, rel_err
from tests.helpers.ptx_layouts import aligned_array

pytest.importorskip("ml_dtypes")


@pytest.fixture
def sm90a(monkeypatch):
    monkeypatch.setenv(geometry.KERNELS_ENV, "sm90a")


def launched(fn, *args):
    """(fn's result, the name expressions of every kernel it launched)."""
    names = []
    launch = interp.launch

    def spy(config, **values):
        names.append(config.name_expression)
        return launch(config, **values)

    with mock.patch.object(interp, "launch", spy):
        return fn(*args), names


def inputs(layout: Layout, batch: int, kv_heads: int, head_dim: int, dtype: str, seed: int):
    rng = np.random.default_rng(seed)
    shape_q = (batch, layout.heads, layout.n_q, head_dim)
    shape_kv = (batch, kv_heads, layout.n_ctx, head_dim)
    return [
        rng.standard_normal(shape).astype(NUMPY_DTYPES[dtype])
        for shape in (shape_q, shape_kv, shape_kv, shape_q)
    ]


# (block, head dim, dtype, rule, case): each rule, both block sizes and dtypes, every head dim;
# GQA with strided inputs, and queries != keys
CASES = [
    (64, 64, "bfloat16", "causal", "square"),
    (64, 128, "float16", "bitmask", "square"),
    (128, 64, "float16", "none", "square"),
    (128, 128, "bfloat16", "window", "square"),
    (128, 256, "bfloat16", "causal", "square"),
    (64, 64, "float16", "causal", "gqa"),
    (128, 128, "bfloat16", "causal", "fewer queries"),
]


def case_layout(block: int, rule: str, case: str) -> tuple[Layout, int, int]:
    """(layout, batch, kv heads)."""
    if case == "square":
        return make_test_layout(rule, block, n_ctx_for(block)), 1, HEADS
    if case == "gqa":  # 4 query heads on 2 kv heads, two batches
        return make_layout("all", n_ctx_for(block), 4, block), 2, 2
    return make_layout("all", 2 * block + 9, HEADS, block, n_q=block + 5), 1, HEADS


@pytest.mark.parametrize("block, head_dim, dtype, rule, case", CASES, ids=str)
def test_the_family_runs_forward_and_backward_against_the_oracle(
    sm90a, block, head_dim, dtype, rule, case
):
    layout, batch, kv_heads = case_layout(block, rule, case)
    q, k, v, dout = inputs(layout, batch, kv_heads, head_dim, dtype, seed=block + head_dim)
    if case == "gqa":  # a projection's output seen head-major: strided batch, head and row
        q, k, v = (
            np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for x in (q, k, v)
        )
    scale = head_dim**-0.5
    (out, lse), names = launched(interp.forward, q, k, v, AttentionCall(layout, scale))
    tile_n = geometry.sm90_tile_n(block, head_dim)
    cxx = geometry.CXX_TYPE[dtype]
    rule_cxx = geometry.CXX_RULE[rule]
    assert names == [f"attn_fwd_sm90<{block}, {tile_n}, {head_dim}, {cxx}, {rule_cxx}>"]
    group = layout.heads // kv_heads
    k_full, v_full = (np.repeat(x, group, axis=1) for x in (k, v))
    check_forward(out, lse, q, k_full, v_full, layout, scale, dtype)

    grads = interp.backward(q, k, v, out, lse, dout, None, AttentionCall(layout, scale))
    refs = dense_attention_grads(q, k_full, v_full, dout, layout.to_mask(), scale)
    refs = (refs[0], *(r.reshape(batch, kv_heads, group, *r.shape[2:]).sum(2) for r in refs[1:]))
    for name, grad, ref in zip("qkv", grads, refs, strict=True):
        assert not np.isnan(grad.astype(np.float32)).any(), f"d{name} left poisoned"
        assert rel_err(grad, ref) <= TOLERANCE[dtype], f"d{name}"


def test_it_agrees_with_the_mma_forward(monkeypatch):
    layout = make_test_layout("causal", 64, n_ctx_for(64))
    q, k, v, _ = inputs(layout, 1, HEADS, 128, "bfloat16", seed=3)
    monkeypatch.setenv(geometry.KERNELS_ENV, "mma")
    (mma, _), names = launched(interp.forward, q, k, v, AttentionCall(layout, 0.1))
    assert names[0].startswith("attn_fwd<")
    monkeypatch.setenv(geometry.KERNELS_ENV, "sm90a")
    (wgmma, _), names = launched(interp.forward, q, k, v, AttentionCall(layout, 0.1))
    assert names[0].startswith("attn_fwd_sm90<")
    # fp32 accumulation of the same products in the same key order: at most bf16 rounding apart
    assert rel_err(wgmma, mma.astype(np.float64)) <= TOLERANCE["bfloat16"]


@pytest.mark.parametrize(
    "dtype, head_dim, block, softcap",
    [("float32", 64, 64, 0.0), ("bfloat16", 32, 64, 0.0), ("float16", 64, 32, 0.0)]
    + [("bfloat16", 64, 64, 20.0)],
    ids=["fp32", "d32", "block32", "softcap"],
)
def test_what_it_does_not_support_keeps_the_mma_forward(sm90a, dtype, head_dim, block, softcap):
    from cuattn.backends.call import ScoreMods

    layout = make_test_layout("causal", block, n_ctx_for(block))
    q, k, v, _ = inputs(layout, 1, HEADS, head_dim, dtype, seed=5)
    mods = ScoreMods(softcap=softcap)
    (out, lse), names = launched(
        interp.forward, q, k, v, AttentionCall(layout, head_dim**-0.5, mods=mods)
    )
    assert names and names[0].startswith("attn_fwd<")
    if not softcap:
        check_forward(out, lse, q, k, v, layout, head_dim**-0.5, dtype)


def test_an_unknown_family_is_refused_by_name_before_any_launch(monkeypatch):
    layout = make_test_layout("causal", 64, n_ctx_for(64))
    q, k, v, _ = inputs(layout, 1, HEADS, 64, "float16", seed=7)
    monkeypatch.setenv(geometry.KERNELS_ENV, "wgmma")
    with pytest.raises(ValueError, match="CUATTN_KERNELS='wgmma'.*accepted: auto, mma, sm90a"):
        launched(interp.forward, q, k, v, AttentionCall(layout, 0.1))
    monkeypatch.delenv(geometry.KERNELS_ENV)
    assert geometry.kernel_family() == "auto"


class _GpuLikeBackend(interp.InterpBackend):
    """The interpreter deciding as a GPU backend on an sm_90 device does."""

    sm90a_by_default = True


@pytest.mark.parametrize(
    "family, by_default, expected",
    [
        ("", False, "attn_fwd<"),  # the interpreter, unset: attn_fwd
        ("auto", False, "attn_fwd<"),
        ("", True, "attn_fwd_sm90<"),  # an sm_90 GPU, unset: the wgmma forward
        ("auto", True, "attn_fwd_sm90<"),
        ("mma", True, "attn_fwd<"),  # asked for attn_fwd: everywhere
        ("sm90a", False, "attn_fwd_sm90<"),  # asked for the wgmma forward: the interpreter too
    ],
)
def test_the_default_family_is_the_backend_s_choice(monkeypatch, family, by_default, expected):
    layout = make_test_layout("causal", 64, n_ctx_for(64))
    q, k, v, _ = inputs(layout, 1, HEADS, 64, "bfloat16", seed=11)
    monkeypatch.setenv(geometry.KERNELS_ENV, family)
    backend = _GpuLikeBackend() if by_default else interp.InterpBackend()
    (out, lse), names = launched(backend.forward, q, k, v, AttentionCall(layout, 0.125))
    assert names[0].startswith(expected)
    check_forward(out, lse, q, k, v, layout, 0.125, "bfloat16")


def test_the_cuda_backend_runs_the_wgmma_forward_by_default_on_sm_90_alone():
    from types import SimpleNamespace

    from cuattn.backends.cuda import CudaBackend

    assert CudaBackend.sm90a_by_default and not interp.InterpBackend.sm90a_by_default
    on = SimpleNamespace
    backend = CudaBackend()
    assert backend.runs_sm90a(on(device=on(compute_capability="90")))
    for capability in ("80", "86", "89", "100", "120"):  # A100 .. Blackwell: no sm_90a code
        assert not backend.runs_sm90a(on(device=on(compute_capability=capability)))


def _is_variant(config) -> bool:
    """An opt-in variant's instantiation (the rescale skip, the exp2 polynomial, three
    consumers): each is its own interpreter library, which only this test would build."""
    return config.rescale_skip or config.exp2_poly or config.consumers != 2


@pytest.mark.parametrize(
    "variants",
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["default", "opt-in variants"],
)
def test_geometry_matches_every_instantiation_s_traits(variants):
    """geometry's threads and shared memory equal the kernel's traits, instantiation by
    instantiation: the default ones in the suite, the opt-in variants' libraries (two minutes
    of g++ from a cold cache) in the slow step."""
    configs = geometry.sm90_configs()
    assert len(configs) == len(set(c.name_expression for c in configs)) == 128
    assert not {c.name_expression for c in configs} & {
        getattr(c, "name_expression", None) for c in geometry.all_configs()
    }
    chosen = [c for c in configs if _is_variant(c) == variants]
    assert chosen
    for config in chosen:
        library = interp.library_for(config)
        assert library.traits(config.name_expression) == (config.threads, config.smem_bytes)
        assert config.arch == "sm_90a"


@pytest.mark.parametrize(
    "batch, heads, n_k, head_dim, kv_group, groups",
    [
        (4, 16, 4096, 128, 1, 8),  # the profiled d128 shape: 2 MiB of K and V a head, 8 a group
        (4, 32, 4096, 64, 1, 8),  # d64: 1 MiB a head, 16 a group
        (4, 32, 4096, 128, 4, 4),  # GQA: 4 query heads share a kv head, 32 of them a group
        (1, 8, 65536, 128, 1, 8),  # a head's K and V past the budget: one pair a group
        (1, 2, 70, 64, 1, 1),  # the interpreter's sizes: one group
        (3, 12, 4096, 128, 1, 5),  # 36 pairs of 8 at most: 5 groups (of 8, 7, 7, 7, 7)
    ],
)
def test_cta_groups_keep_a_group_s_k_and_v_within_the_l2_budget(
    batch, heads, n_k, head_dim, kv_group, groups
):
    assert geometry.sm90_cta_groups(batch, heads, n_k, head_dim, "bfloat16", kv_group) == groups
    pairs_per_group = -(-batch * heads // groups)
    kv_heads_per_group = -(-pairs_per_group // kv_group)
    group_bytes = kv_heads_per_group * 2 * n_k * head_dim * 2
    assert pairs_per_group == 1 or group_bytes <= geometry.SM90_L2_GROUP_BYTES


def test_the_cuda_runtime_builds_an_sm90a_cubin_and_loads_it_from_disk(monkeypatch, tmp_path):
    """No GPU here: CuPy's module loader is a stand-in; NVRTC's cubin and its cache are real."""
    from dev.sass import disassemble

    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    cache = tmp_path / "cubins"
    monkeypatch.setenv(cuda_runtime.CUBIN_CACHE_ENV, str(cache))
    loaded = []

    class FakeCupy:
        @staticmethod
        def RawModule(path):  # noqa: N802 (CuPy's name)
            loaded.append(path)
            return path

    monkeypatch.setattr(cuda_runtime, "cupy_module", lambda: FakeCupy)
    config = geometry.KernelConfig("attn_fwd_sm90", 64, "bfloat16", block=64, rule="causal")
    options = cuda_runtime.common_options()
    path, lowered = cuda_runtime.cubin_module(
        config.source_file, config.name_expression, options, config.arch
    )
    assert lowered.startswith("_Z") and "attn_fwd_sm90" in lowered
    cubin = Path(path).read_bytes()
    try:
        text = disassemble(cubin, tmp_path)
    except FileNotFoundError:
        pytest.skip("nvdisasm is not installed")
    assert "HGMMA" in text
    stamp = [p.stat().st_mtime_ns for p in sorted(cache.glob("*.cubin"))]
    again, lowered_again = cuda_runtime.cubin_module(
        config.source_file, config.name_expression, options, config.arch
    )
    assert (again, lowered_again) == (path, lowered) and loaded == [path, path]
    assert [p.stat().st_mtime_ns for p in sorted(cache.glob("*.cubin"))] == stamp  # no rebuild


def test_jax_s_xla_path_keeps_the_mma_forward():
    """Its custom calls carry PTX for the device's plain architecture, which has no wgmma."""
    pytest.importorskip("jax")
    from cuattn.adapters.jax_xla import XlaBackend

    assert not XlaBackend(90).runs_sm90a(None)
    assert interp.backend.runs_sm90a(None)


def test_a_packed_varlen_call_runs_on_it(sm90a):
    """sparse_attention_varlen packs its sequences into one block-diagonal bitmask layout: the
    family runs it like any other (64-blocks, bf16), each sequence equal to its own oracle."""
    import cuattn
    from tests.helpers.oracle import dense_attention

    lengths = [70, 100]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    rng = np.random.default_rng(11)
    dtype = NUMPY_DTYPES["bfloat16"]
    q, k, v = (rng.standard_normal((int(cu[-1]), HEADS, 64)).astype(dtype) for _ in range(3))
    layouts = [make_layout("all", n, HEADS, 64) for n in lengths]
    (out, lse), names = launched(
        lambda: cuattn.sparse_attention_varlen(
            q, k, v, cu, cu, layouts, return_lse=True, backend="interp"
        )
    )
    assert any(name.startswith("attn_fwd_sm90<64, 64, 64,") for name in names)
    for s, layout in enumerate(layouts):
        rows = slice(int(cu[s]), int(cu[s + 1]))
        one = [x[rows].transpose(1, 0, 2)[None] for x in (q, k, v)]
        ref_out, ref_lse = dense_attention(*one, layout.to_mask(), 64**-0.5)
        assert rel_err(out[rows], ref_out[0].transpose(1, 0, 2)) <= TOLERANCE["bfloat16"]
        assert rel_err(lse[:, rows], ref_lse[0]) <= TOLERANCE["bfloat16"]


def offset_views(arrays, offset_bytes: int, pitch: int) -> list[np.ndarray]:
    """Copies of `arrays` [batch, heads, rows, d] in rows `pitch` elements apart, starting
    `offset_bytes` past a 128-byte boundary (16-byte aligned, as the backends require)."""
    views = []
    for x in arrays:
        padded = (*x.shape[:-1], pitch)
        nbytes = int(np.prod(padded)) * x.itemsize
        buffer = aligned_array((1, nbytes + 128), np.uint8)
        flat = buffer[0, offset_bytes : offset_bytes + nbytes].view(x.dtype)
        view = flat.reshape(padded)[..., : x.shape[-1]]
        view[...] = x
        views.append(view)
    return views


@pytest.mark.parametrize("pitch", [64, 128])
@pytest.mark.parametrize("offset_bytes", [16, 48, 112])
def test_inputs_off_the_128_byte_boundary_run_on_it(sm90a, offset_bytes, pitch):
    """A swizzled tensor map's base must be 128-byte aligned; q, k and v need only be 16-byte
    aligned. Each map then starts at the boundary before the data, its columns further in
    (kernels.panel_map), and reads exactly the inputs' elements, with rows as far apart as their
    width (pitch 64) or further (128)."""
    layout = make_test_layout("causal", 64, n_ctx_for(64))
    fresh = inputs(layout, 1, HEADS, 64, "bfloat16", seed=offset_bytes)
    q, k, v = offset_views(fresh[:3], offset_bytes, pitch)
    map_, col = panel_map(q, q.ctypes.data, geometry.SM90_TILE_M)
    assert col * q.itemsize == offset_bytes % 128 and map_.global_address % 128 == 0
    (out, lse), names = launched(interp.forward, q, k, v, AttentionCall(layout, 0.125))
    assert names == [f"attn_fwd_sm90<64, 64, 64, __nv_bfloat16, {geometry.CXX_RULE['causal']}>"]
    check_forward(out, lse, q, k, v, layout, 0.125, "bfloat16")


def test_a_map_the_device_refuses_keeps_the_mma_forward(sm90a, monkeypatch):
    """Should a device refuse a tensor map (the CUDA backend asks the driver before the
    launch), the forward runs on attn_fwd: the same numbers, nothing launched half-way."""
    layout = make_test_layout("causal", 64, n_ctx_for(64))
    q, k, v, _ = inputs(layout, 1, HEADS, 64, "bfloat16", seed=4)
    monkeypatch.setattr(interp.backend, "encodes", lambda map_: False)
    (out, lse), names = launched(interp.forward, q, k, v, AttentionCall(layout, 0.125))
    assert names[0].startswith("attn_fwd<")
    check_forward(out, lse, q, k, v, layout, 0.125, "bfloat16")


def test_a_broadcast_kv_head_keeps_the_mma_forward(sm90a):
    """k and v expanded from one head (stride 0 over heads): a tensor map's strides cannot say
    that, so attn_fwd reads them, exactly."""
    layout = make_test_layout("causal", 64, n_ctx_for(64))
    q, k, v, _ = inputs(layout, 1, 1, 64, "bfloat16", seed=9)
    k, v = (np.broadcast_to(x, (1, HEADS, *x.shape[2:])) for x in (k, v))
    (out, lse), names = launched(interp.forward, q, k, v, AttentionCall(layout, 0.125))
    assert names[0].startswith("attn_fwd<")
    check_forward(
        out, lse, q, np.ascontiguousarray(k), np.ascontiguousarray(v), layout, 0.125, "bfloat16"
    )
