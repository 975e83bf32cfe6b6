"""cuattn under jax.jit on CUDA: each kernel launch an XLA custom call (backends/xla.py,
adapters/jax_xla.py).

Without a GPU the programs are lowered for CUDA (``lowering_for_cuda`` + ``lowering_platforms``)
and every custom call is decoded: target, kernel (NVRTC's lowered name of the right
instantiation, its PTX), grid, block, shared memory, parameters and output aliases against
cuattn.backends.geometry. The gpu-marked tests run the programs and compare with the eager
(DLPack) path and with the float64 NumPy reference.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import zlib
from collections import Counter
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cuattn
from cuattn import backends
from cuattn.adapters import jax_xla
from cuattn.backends import geometry, xla
from cuattn.backends.call import AttentionCall, ScoreMods, ScoreOperands
from cuattn.backends.geometry import KernelConfig
from cuattn.backends.kernels import kernel_layout


def _nvrtc_loads() -> bool:
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
        return True
    except Exception:  # no CuPy, or no libnvrtc: nothing to compile PTX with
        return False


def _jax_cuda() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


needs_nvrtc = pytest.mark.skipif(not _nvrtc_loads(), reason="needs NVRTC (CuPy) to write PTX")
needs_jax_cuda = pytest.mark.skipif(not _jax_cuda(), reason="needs a CUDA device visible to jax")

CC = 90
OUTPUTS = {
    "attn_fwd": ("out", "lse"),
    "attn_bwd_preprocess": ("delta",),
    "attn_bwd_dkdv": ("dk", "dv"),
    "attn_bwd_dq": ("dq",),
    "attn_bwd_sum_groups": ("summed",),
}
PTX_PARAM_TYPES = {"ptr": "u64", "i64": "u64", "i32": "u32", "f32": "f32"}
PARAM_KINDS = {"i32": "i32", "i64": "i64", "f32": "fp32"}


# ---- the protobuf encoder ---------------------------------------------------------------------


def test_varint_matches_protobuf_encoding():
    assert xla.varint(0) == b"\x00"
    assert xla.varint(1) == b"\x01"
    assert xla.varint(127) == b"\x7f"
    assert xla.varint(128) == b"\x80\x01"
    assert xla.varint(300) == b"\xac\x02"  # the protobuf documentation's example
    assert xla.varint(2**32 - 1) == b"\xff\xff\xff\xff\x0f"
    # negative int32/int64: ten bytes of 64-bit two's complement
    assert xla.varint(-1) == b"\xff" * 9 + b"\x01"
    assert xla.varint(-2) == b"\xfe" + b"\xff" * 8 + b"\x01"


def test_parameters_match_hand_encoded_bytes():
    # Parameter.array (field 1, length-delimited) holding Array.ptr_divisibility (field 2) = 16
    assert xla.create_array_parameter(0, 16) == b"\x0a\x02\x10\x10"
    assert xla.create_array_parameter(8, 0) == b"\x0a\x02\x08\x08"
    assert xla.create_array_parameter(0, 0) == b"\x0a\x00"  # a oneof member is always written
    assert xla.create_scalar_parameter(0, "i32") == b"\x18\x00"  # field 3, varint, even when 0
    assert xla.create_scalar_parameter(64, "i32") == b"\x18\x40"
    assert xla.create_scalar_parameter(-1, "i32") == b"\x18" + b"\xff" * 9 + b"\x01"
    assert xla.create_scalar_parameter(2**40, "i64") == b"\x28\x80\x80\x80\x80\x80\x20"
    assert xla.create_scalar_parameter(7, "u32") == b"\x20\x07"
    assert xla.create_scalar_parameter(True, "bool") == b"\x10\x01"
    assert xla.create_scalar_parameter(1.0, "fp32") == b"\x3d\x00\x00\x80\x3f"  # field 7, fixed32
    assert xla.create_scalar_parameter(1.0, "fp64") == b"\x41" + struct.pack("<d", 1.0)
    with pytest.raises(OverflowError):
        xla.create_scalar_parameter(2**31, "i32")
    with pytest.raises(OverflowError):
        xla.create_scalar_parameter(-1, "u64")


def test_messages_match_hand_encoded_bytes():
    kernel = xla.kernel_message(
        "k", num_warps=4, shared_mem_bytes=0, ptx=b"P", compute_capability=90
    )
    # name (1) "k"; num_warps (2) 4; shared memory 0 not written; ptx (4) "P"; cc (6) 90;
    # num_ctas (10, explicit presence) 1
    assert kernel == b"\x0a\x01k" + b"\x10\x04" + b"\x22\x01P" + b"\x30\x5a" + b"\x50\x01"
    call = xla.kernel_call_message(kernel, (3, 1, 2), [b"\x18\x00"])
    expected = b"\x0a" + bytes([len(kernel)]) + kernel + b"\x10\x03\x18\x01\x20\x02"
    assert call == expected + b"\x2a\x02\x18\x00"
    assert xla.any_kernel_call_message(call) == b"\x0a" + bytes([len(call)]) + call
    named = xla.any_kernel_call_message(call, "n", b"m")
    assert named.endswith(b"\x1a\x01m\x22\x01n")  # metadata (3), then name (4)


def test_decode_round_trip():
    params = [
        xla.create_array_parameter(),
        xla.create_scalar_parameter(-5, "i32"),
        xla.create_scalar_parameter(-(2**40), "i64"),
        xla.create_scalar_parameter(0.125, "fp32"),
        xla.create_scalar_parameter(2.5, "fp64"),
        xla.create_scalar_parameter(9, "u64"),
    ]
    ptx = b".version 8.0\n.target sm_90\n" * 100  # long enough for a two-byte length
    kernel = xla.kernel_message("_Z3fooPf", 8, 70000, ptx, 86)
    opaque = zlib.compress(
        xla.any_kernel_call_message(xla.kernel_call_message(kernel, (1000, 7, 65535), params), "x")
    )
    decoded = xla.decode_kernel_call(opaque)
    assert decoded == xla.DecodedKernelCall(
        name="x",
        kernel_name="_Z3fooPf",
        num_warps=8,
        num_ctas=1,
        shared_mem_bytes=70000,
        ptx=ptx,
        compute_capability=86,
        grid=(1000, 7, 65535),
        parameters=(
            ("array", (0, 16)),
            ("i32", -5),
            ("i64", -(2**40)),
            ("fp32", 0.125),
            ("fp64", 2.5),
            ("u64", 9),
        ),
    )
    with pytest.raises(ValueError):
        xla.parse_message(b"\x0a\x05ab")  # truncated length-delimited field


@needs_jax_cuda
@pytest.mark.gpu
def test_encoder_matches_jaxlib_to_proto():
    from jax._src.lib import gpu_triton

    ptx = b".version 8.0\n.target sm_90\n.entry f()\n{\nret;\n}\n"
    kernel = gpu_triton.TritonKernel("f", 4, 1, 1024, ptx.decode(), "", 90)
    params = [
        gpu_triton.create_array_parameter(0, 16),
        gpu_triton.create_scalar_parameter(-3, "i32"),
        gpu_triton.create_scalar_parameter(2**40, "i64"),
        gpu_triton.create_scalar_parameter(0.5, "fp32"),
    ]
    theirs = gpu_triton.TritonKernelCall(kernel, 5, 2, 1, params).to_proto("name", b"")
    ours = xla.any_kernel_call_message(
        xla.kernel_call_message(
            xla.kernel_message("f", 4, 1024, ptx, 90),
            (5, 2, 1),
            [
                xla.create_array_parameter(0, 16),
                xla.create_scalar_parameter(-3, "i32"),
                xla.create_scalar_parameter(2**40, "i64"),
                xla.create_scalar_parameter(0.5, "fp32"),
            ],
        ),
        "name",
    )
    assert ours == theirs


# ---- lowering for CUDA without a GPU ------------------------------------------------------------


@dataclass(frozen=True)
class _Call:
    """What a test reads of one stablehlo.custom_call, copied out while its module is alive
    (an MLIR op outliving its module reads freed memory)."""

    target: str
    opaque: bytes
    operands: int
    results: int
    aliases: tuple[int, ...]  # operand index of each result, in result order


def _custom_calls(lowered) -> list[_Call]:
    """Every stablehlo.custom_call of a lowered program (every function of the module)."""
    module = lowered.compiler_ir("stablehlo")
    calls = []

    def walk(operation) -> None:
        for region in operation.regions:
            for block in region.blocks:
                for op in block.operations:
                    if op.operation.name == "stablehlo.custom_call":
                        calls.append(_copy(op))
                    walk(op.operation)

    walk(module.operation)
    return calls


def _copy(op) -> _Call:
    attributes = op.attributes
    config = attributes["mhlo.backend_config"] if "mhlo.backend_config" in attributes else None
    aliases = ""
    if "output_operand_aliases" in attributes:
        aliases = str(attributes["output_operand_aliases"])
    return _Call(
        target=str(attributes["call_target_name"]).strip('"'),
        opaque=config["opaque"].value_bytes if config is not None and "opaque" in config else b"",
        operands=len(op.operands),
        results=len(op.results),
        aliases=tuple(int(i) for i in re.findall(r"operand_index = (\d+)", aliases)),
    )


def _decoded(call: _Call) -> xla.DecodedKernelCall:
    return xla.decode_kernel_call(call.opaque)


def _entry_param_types(ptx: str, lowered_name: str) -> list[str]:
    start = ptx.index(f".entry {lowered_name}(")
    signature = ptx[start : ptx.index(")", start)]
    return re.findall(r"\.param \.(\w+) ", signature)


def _check_call(op, config: KernelConfig, scalars: dict[str, float]) -> None:
    """One custom call launches ``config`` exactly as the CuPy backend would."""
    assert op.target == xla.CUSTOM_CALL_TARGET
    call = _decoded(op)
    compiled = xla.compile_ptx(config.source_file, config.name_expression, CC)
    assert call.kernel_name == compiled.lowered_name
    assert call.name == xla.CALL_NAME_PREFIX + config.name_expression
    assert call.grid == config.grid
    assert call.num_warps * 32 == config.threads and config.block_dims == (config.threads, 1, 1)
    assert call.shared_mem_bytes == config.smem_bytes
    assert call.compute_capability == CC and call.num_ctas == 1
    # the PTX holds that entry, for the virtual architecture of the device
    ptx = call.ptx.decode()
    assert f".entry {compiled.lowered_name}(" in ptx
    assert re.search(rf"^\.target sm_{CC}\b", ptx, re.MULTILINE)
    # parameters: one per kernel argument, kind by kind; every pointer an operand
    kinds = [kind for _, kind in config.args]
    assert _entry_param_types(ptx, compiled.lowered_name) == [PTX_PARAM_TYPES[k] for k in kinds]
    assert len(call.parameters) == len(config.args)
    for (name, kind), (got_kind, value) in zip(config.args, call.parameters, strict=True):
        if kind == "ptr":
            assert (got_kind, value) == ("array", (0, xla.PTR_DIVISIBILITY)), name
        else:
            assert got_kind == PARAM_KINDS[kind], name
            if name in scalars:
                assert value == pytest.approx(scalars[name], rel=1e-7), name
    pointers = [name for name, kind in config.args if kind == "ptr"]
    assert op.operands == len(pointers)
    outputs = OUTPUTS[config.kernel]
    assert op.aliases == tuple(pointers.index(name) for name in outputs)
    assert op.results == len(outputs)


def _rel(x, ref) -> float:
    x, ref = np.asarray(x, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.abs(x - ref).max() / np.abs(ref).max())


def _qkv(batch, heads, kv_heads, n, head_dim, dtype, vmapped=None):
    lead = () if vmapped is None else (vmapped,)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((*lead, batch, heads, n, head_dim))
    k, v = (rng.standard_normal((*lead, batch, kv_heads, n, head_dim)) for _ in range(2))
    return tuple(jnp.asarray(x, dtype=dtype) for x in (q, k, v))


def _lower_for_cuda(fun, *args):
    with jax_xla.lowering_for_cuda(CC):
        traced = jax.jit(fun).trace(*args)
    return traced.lower(lowering_platforms=("cuda",))


def _contiguous(name, batch, heads, n, head_dim):
    return {
        f"{name}_batch_stride": heads * n * head_dim if batch > 1 else 0,
        f"{name}_head_stride": n * head_dim if heads > 1 else 0,
        f"{name}_row_stride": head_dim,
    }


CASES = {
    # name: (batch, heads, kv_heads, n, head_dim, layout arguments)
    "mha": (2, 2, 2, 64, 64, ("local", {"blocksize": 64, "local_attn_ctx": 64})),
    "gqa": (
        2,
        4,
        2,
        128,
        64,
        ("fixed", {"blocksize": 32, "local_attn_ctx": 64, "num_verts": 1, "vertsize": 1}),
    ),
}


def _layout(case):
    batch, heads, kv_heads, n, head_dim, (mode, kwargs) = CASES[case]
    return cuattn.make_layout(mode, n, heads, **kwargs)


def _scalars(case, layout, names=("q", "k", "v", "dout")):
    batch, heads, kv_heads, n, head_dim, _ = CASES[case]
    kernel = kernel_layout(layout)
    scalars = {
        "n_q": n,
        "n_k": n,
        "q_offset": 0,
        "kv_group": heads // kv_heads,
        "scale": np.float32(head_dim**-0.5),
        "window_left": kernel.rule.window_left,
        "window_right": kernel.rule.window_right,
    }
    for name in names:
        scalars.update(_contiguous(name, batch, kv_heads if name in "kv" else heads, n, head_dim))
    return scalars


def _forward_config(case, dtype):
    batch, heads, _, n, head_dim, _ = CASES[case]
    layout = kernel_layout(_layout(case))
    name = geometry.kernel_dtype(dtype)
    return KernelConfig(
        "attn_fwd",
        head_dim,
        name,
        batch,
        heads,
        n,
        layout.blocksize,
        layout.rule.kind,
    )


def each_lowering_case(test):
    """``test(case, dtype)`` for every case of CASES in both 16-bit dtypes, where NVRTC is."""
    test = pytest.mark.parametrize("case", sorted(CASES))(test)
    return needs_nvrtc(pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])(test))


@each_lowering_case
def test_forward_lowers_to_one_launch(case, dtype):
    batch, heads, kv_heads, n, head_dim, _ = CASES[case]
    layout = _layout(case)
    q, k, v = _qkv(batch, heads, kv_heads, n, head_dim, dtype)
    lowered = _lower_for_cuda(lambda q, k, v: cuattn.sparse_attention(q, k, v, layout), q, k, v)
    (call,) = _custom_calls(lowered)
    scalars = _scalars(case, layout) | {"num_blocks": kernel_layout(layout).num_q_blocks}
    _check_call(call, _forward_config(case, dtype), scalars)
    assert "callback" not in lowered.as_text()


@each_lowering_case
def test_grad_lowers_to_forward_and_backward_launches(case, dtype):
    batch, heads, kv_heads, n, head_dim, _ = CASES[case]
    layout = _layout(case)
    kernel = kernel_layout(layout)
    q, k, v = _qkv(batch, heads, kv_heads, n, head_dim, dtype)

    def loss(q, k, v):
        return cuattn.sparse_attention(q, k, v, layout).astype(jnp.float32).sum()

    calls = _custom_calls(_lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, k, v))
    name = geometry.kernel_dtype(dtype)
    per_head = (head_dim, name, batch, heads)
    block, rule = kernel.blocksize, kernel.rule.kind
    scalars = _scalars(case, layout)
    expected = [
        (_forward_config(case, dtype), scalars | {"num_blocks": kernel.num_q_blocks}),
        (KernelConfig("attn_bwd_preprocess", *per_head, n), scalars),
        (
            KernelConfig("attn_bwd_dkdv", *per_head, n, block=block, rule=rule),
            scalars | {"num_blocks": kernel.num_blocks},
        ),
        (
            KernelConfig("attn_bwd_dq", *per_head, n, block=block, rule=rule),
            scalars | {"num_blocks": kernel.num_q_blocks},
        ),
    ]
    if kv_heads < heads:
        summed = KernelConfig("attn_bwd_sum_groups", head_dim, name, batch, kv_heads, n)
        expected += [(summed, {"n_k": n, "kv_group": heads // kv_heads})] * 2
    assert len(calls) == len(expected) == (6 if kv_heads < heads else 4)
    by_name = {
        xla.compile_ptx(c.source_file, c.name_expression, CC).lowered_name: (c, s)
        for c, s in expected
    }
    names = [_decoded(op).kernel_name for op in calls]
    assert Counter(names) == Counter(
        xla.compile_ptx(c.source_file, c.name_expression, CC).lowered_name for c, _ in expected
    )
    for op, kernel_name in zip(calls, names, strict=True):
        _check_call(op, *by_name[kernel_name])


@needs_nvrtc
def test_vmap_folds_the_mapped_axis_into_the_batch():
    batch, heads, kv_heads, n, head_dim, _ = CASES["mha"]
    layout = _layout("mha")
    q, k, v = _qkv(batch, heads, kv_heads, n, head_dim, jnp.bfloat16, vmapped=3)

    def f(q, k, v):
        return cuattn.sparse_attention(q, k, v, layout)

    # q mapped, k and v shared: broadcast, then one launch over batch 3 * 2
    (call,) = _custom_calls(_lower_for_cuda(jax.vmap(f, in_axes=(0, None, None)), q, k[0], v[0]))
    config = _forward_config("mha", jnp.bfloat16)
    folded = KernelConfig(
        config.kernel, head_dim, "bfloat16", 3 * batch, heads, n, config.block, config.rule
    )
    assert _decoded(call).grid == folded.grid
    _check_call(call, folded, {"q_batch_stride": heads * n * head_dim})

    def loss(q, k, v):
        return f(q, k, v).astype(jnp.float32).sum()

    # nested: both mapped axes fold into the batch
    nested = jax.vmap(jax.vmap(f, in_axes=(0, None, None)), in_axes=(0, None, None))
    (call,) = _custom_calls(_lower_for_cuda(nested, jnp.stack([q, q]), k[0], v[0]))
    assert _decoded(call).grid[2] == 2 * 3 * batch

    grads = _custom_calls(_lower_for_cuda(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))), q, k, v))
    assert len(grads) == 4
    for op in grads:
        grid = _decoded(op).grid
        assert grid[2] == 3 * batch


@needs_nvrtc
def test_permuted_and_bitmask_layouts_lower():
    """A layout in a computed token order (gathers around the launch) and one with per-block
    bitmasks (a non-empty mask_table operand)."""
    for kwargs in ({"local_attn_ctx": 16}, {"local_attn_ctx": 6}):
        layout = cuattn.make_layout("strided", 256, 2, blocksize=16, **kwargs)
        q, k, v = _qkv(1, 2, 2, 256, 64, jnp.float16)

        def f(q, k, v, layout=layout):
            return cuattn.sparse_attention(q, k, v, layout)

        lowered = _lower_for_cuda(f, q, k, v)
        (call,) = _custom_calls(lowered)
        config = KernelConfig("attn_fwd", 64, "float16", 1, 2, 256, 16, layout.rule.kind)
        _check_call(call, config, {"n_q": 256})
        assert ("gather" in lowered.as_text()) == (layout.perm is not None)


@needs_nvrtc
def test_recompute_runs_the_forward_again_in_the_backward():
    batch, heads, kv_heads, n, head_dim, _ = CASES["mha"]
    layout = _layout("mha")
    q, k, v = _qkv(batch, heads, kv_heads, n, head_dim, jnp.float16)

    def loss(q, k, v):
        out = cuattn.sparse_attention(q, k, v, layout, recompute=True)
        return out.astype(jnp.float32).sum()

    # value_and_grad: the primal forward is kept (jax.grad alone drops it as dead code)
    step = jax.value_and_grad(loss, argnums=(0, 1, 2))
    calls = _custom_calls(_lower_for_cuda(step, q, k, v))
    forward = xla.compile_ptx(
        "attn_fwd.cu", _forward_config("mha", jnp.float16).name_expression, CC
    )
    names = Counter(_decoded(op).kernel_name for op in calls)
    assert len(calls) == 5 and names[forward.lowered_name] == 2


@needs_nvrtc
def test_the_hlo_the_gpu_compiler_gets_carries_the_same_bytes():
    """XLA hands the FFI handler the custom call's backend_config as attribute text it parses
    back: the compressed protobuf survives that round trip byte for byte."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    layout = _layout("gqa")
    q, k, v = _qkv(*CASES["gqa"][:5], jnp.bfloat16)
    lowered = _lower_for_cuda(lambda q, k, v: cuattn.sparse_attention(q, k, v, layout), q, k, v)
    (call,) = _custom_calls(lowered)
    want = call.opaque
    hlo = lowered.as_text(dialect="hlo")
    (config,) = re.findall(
        rf'custom_call_target="{xla.CUSTOM_CALL_TARGET}".*api_version=API_VERSION_TYPED_FFI, '
        r"backend_config=(\{opaque = \".*\"\})",
        hlo,
    )
    with mlir.make_ir_context():
        opaque = ir.DictAttr(ir.Attribute.parse(config))["opaque"]
        assert ir.StringAttr(opaque).value_bytes == want


@needs_nvrtc
@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas on PATH")
def test_ptx_assembles_for_the_handlers_target(tmp_path):
    """jaxlib compiles the PTX with ptxas for sm_90a on a compute capability 9.0 device (the
    'a' variant from 9.x on): every kernel of a GQA forward and backward assembles for it, and
    the entry the handler looks up by name is in the cubin."""
    batch, heads, kv_heads, n, head_dim, _ = CASES["gqa"]
    layout = _layout("gqa")
    q, k, v = _qkv(batch, heads, kv_heads, n, head_dim, jnp.bfloat16)

    def loss(q, k, v):
        return cuattn.sparse_attention(q, k, v, layout).astype(jnp.float32).sum()

    calls = {_decoded(op) for op in _custom_calls(_lower_for_cuda(jax.grad(loss), q, k, v))}
    assert len({c.kernel_name for c in calls}) == 5
    for i, call in enumerate(calls):
        source = tmp_path / f"k{i}.ptx"
        source.write_bytes(call.ptx)
        result = subprocess.run(
            ["ptxas", "-arch=sm_90a", "-v", str(source), "-o", str(tmp_path / f"k{i}.cubin")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert f"Compiling entry function '{call.kernel_name}' for 'sm_90a'" in result.stderr


# The outputs KernelBackend asks as zeroed_output (a launch writes only part of them).
ZEROED_OUTPUTS = {"rel_bias_grad", "score_bias_grad", "work_counter", "dq_accum", "semaphores"}


class _Interpreted(jax_xla.XlaBackend):
    """The staged program run on the CPU: each launch, instead of the custom call, is a host
    callback that decodes the launch's protobuf and runs the kernel interpreter with the
    decoded scalars on the operands in order, outputs poisoned with NaN first (those the program
    zeroes checked to be 0 instead), and returns the
    aliased operands as the call's results: the staging (operand order, aliasing, the scalars
    baked into the protobuf, token order, vmap folding) checked by value without a GPU."""

    staged: list[str] = []  # kernel of every launch staged, in order

    def emit(self, config, operands, aliases, results, opaque):
        from cuattn.backends import interp

        call = xla.decode_kernel_call(opaque)
        assert call.grid == config.grid and call.num_warps == config.num_warps
        self.staged.append(config.kernel)
        written = sorted(aliases, key=aliases.get)  # the operand behind each result

        names = [name for name, kind in config.args if kind == "ptr"]

        def host(*arrays):
            arrays = [np.array(a) for a in arrays]
            for i in written:
                if names[i] in ZEROED_OUTPUTS:  # the launch writes part: the rest must be 0
                    assert not arrays[i].any(), names[i]
                else:
                    arrays[i][...] = np.nan
            pointers = iter(arrays)
            values = {
                name: next(pointers) if kind == "ptr" else value
                for (name, kind), (_, value) in zip(config.args, call.parameters, strict=True)
            }
            interp.launch(config, **values)
            return [arrays[i] for i in written]

        return jax.pure_callback(host, results, *operands)


@needs_nvrtc
@pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel interpreter needs g++")
@pytest.mark.parametrize(
    "mode, kwargs, softcap",
    [
        ("fixed", {"local_attn_ctx": 32, "num_verts": 1}, None),
        ("strided", {"local_attn_ctx": 4}, None),
        ("fixed", {"local_attn_ctx": 32, "num_verts": 1}, 1.5),
    ],
    ids=["fixed", "strided-permuted", "fixed-softcap"],
)
def test_staged_program_runs_on_the_kernel_interpreter(monkeypatch, mode, kwargs, softcap):
    backend = _Interpreted(CC)
    backend.staged = []
    monkeypatch.setattr(jax_xla, "backend_for", lambda cc: backend)
    # GQA, small enough for the interpreter (one host thread per CUDA thread)
    batch, heads, kv_heads, n, head_dim = 1, 2, 1, 64, 32
    layout = cuattn.make_layout(mode, n, heads, blocksize=16, **kwargs)
    assert (layout.perm is not None) == (mode == "strided")
    q, k, v = _qkv(batch, heads, kv_heads, n, head_dim, jnp.bfloat16, vmapped=2)
    rng = np.random.default_rng(3)
    weight = rng.standard_normal(q.shape[1:]).astype(np.float32)
    lse_weight = rng.standard_normal(q.shape[1:-1]).astype(np.float32)
    scale = head_dim**-0.5
    mods = ScoreMods(softcap or 0.0)

    def f(q, k, v):
        return cuattn.sparse_attention(q, k, v, layout, softcap=softcap)

    def loss(q, k, v):  # through both outputs: the lse's cotangent reaches the preprocess launch
        out, lse = cuattn.sparse_attention(q, k, v, layout, return_lse=True, softcap=softcap)
        return (out.astype(jnp.float32) * weight).sum() + (lse * lse_weight).sum()

    with jax_xla.lowering_for_cuda(CC):
        out = jax.jit(f)(q[0], k[0], v[0])
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q[0], k[0], v[0])
        mapped = jax.jit(jax.vmap(f))(q, k, v)
    backward = ["attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq", *["attn_bwd_sum_groups"] * 2]
    forward = "attn_fwd"
    # jit(f); jit(grad): forward, backward; vmap: the body traced unbatched by custom_vmap (then
    # dropped), and the rule's call on the folded batch
    assert backend.staged == [forward, forward, *backward, forward, forward]
    # the same kernels on the same inputs: bit for bit the eager interpreter backend's results
    host = [np.asarray(x) for x in (q[0], k[0], v[0])]
    call = AttentionCall(layout, scale, backend="interp", mods=mods)
    want_out, want_lse = backends.forward(*host, call)
    dout = weight.astype(want_out.dtype)
    want = backends.backward(*host, want_out, want_lse, dout, lse_weight, call)
    assert np.array_equal(np.asarray(out), want_out)
    for name, got, expected in zip("qkv", grads, want, strict=True):
        assert got.shape == expected.shape and np.array_equal(np.asarray(got), expected), name
    assert np.array_equal(np.asarray(mapped[0]), want_out)
    second_host = (np.asarray(x[1]) for x in (q, k, v))
    second = backends.forward(*second_host, call)
    assert np.array_equal(np.asarray(mapped[1]), second[0])
    # and within bf16 accuracy of the float64 reference
    reference, _ = backends.forward(
        *(x.astype(np.float64) for x in host), AttentionCall(layout, scale, mods=mods)
    )
    assert _rel(out, reference) <= 1e-2


def _interpreted_modifier_case(monkeypatch):
    """(the interpreting backend, installed; a layout; q, k, v mapped twice) of the modifier
    programs below: batch 2, 2 heads on 1 kv head, 64 tokens, head dim 32, bf16."""
    backend = _Interpreted(CC)
    backend.staged = []
    monkeypatch.setattr(jax_xla, "backend_for", lambda cc: backend)
    layout = cuattn.make_layout("fixed", 64, 2, blocksize=16, local_attn_ctx=32, num_verts=1)
    return backend, layout, _qkv(2, 2, 1, 64, 32, jnp.bfloat16, vmapped=2)


@needs_nvrtc
@pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel interpreter needs g++")
@pytest.mark.parametrize("per_batch", [False, True])
def test_staged_bias_program_runs_on_the_kernel_interpreter(monkeypatch, per_batch):
    """ALiBi's slopes and a key bias cross the staged program as operands (batch axis first:
    the slopes as [batch, heads], so a vmap folds them with the batch); the slopes' gradient
    comes back from the dQ launch's rows, the key bias's from dK/dV's: bit for bit the eager
    interpreter's, for one slope per head and one per (batch, head)."""
    backend, layout, (q, k, v) = _interpreted_modifier_case(monkeypatch)
    batch, heads, n, head_dim = 2, 2, 64, 32
    rng = np.random.default_rng(4)
    slopes = rng.uniform(0.05, 0.5, (batch, heads) if per_batch else (heads,)).astype(np.float32)
    key_bias = rng.standard_normal((batch, n)).astype(np.float32)
    key_bias[1, -7:] = -np.inf
    weight = rng.standard_normal(q.shape[1:]).astype(np.float32)
    scale, softcap = head_dim**-0.5, 1.5
    mods = ScoreMods(softcap, alibi=True, key_bias=True)

    def f(q, k, v, slopes, key_bias):
        kw = dict(softcap=softcap, alibi_slopes=slopes, key_bias=key_bias)
        return cuattn.sparse_attention(q, k, v, layout, **kw)

    def loss(q, k, v, slopes, key_bias):
        return (f(q, k, v, slopes, key_bias).astype(jnp.float32) * weight).sum()

    with jax_xla.lowering_for_cuda(CC):
        out = jax.jit(f)(q[0], k[0], v[0], slopes, key_bias)
        grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
        grads = jax.jit(grad)(q[0], k[0], v[0], slopes, key_bias)
        mapped = jax.jit(jax.vmap(f, in_axes=(0, 0, 0, None, None)))(q, k, v, slopes, key_bias)
    host = [np.asarray(x) for x in (q[0], k[0], v[0])]
    call = AttentionCall(layout, scale, backend="interp", mods=mods)
    call = call.with_operands(ScoreOperands(slopes, key_bias))
    want_out, want_lse = backends.forward(*host, call)
    dout = weight.astype(want_out.dtype)
    want = backends.backward(*host, want_out, want_lse, dout, None, call)
    assert np.array_equal(np.asarray(out), want_out)
    for name, got, expected in zip("qkv", grads[:3], want[:3], strict=True):
        assert got.shape == expected.shape and np.array_equal(np.asarray(got), expected), name
    # the slopes' rows summed in XLA's reduction order, not NumPy's
    assert grads[3].shape == slopes.shape
    np.testing.assert_allclose(np.asarray(grads[3]), want[3], rtol=1e-6, atol=0)
    assert grads[4].shape == key_bias.shape and np.array_equal(np.asarray(grads[4]), want[4])
    assert np.array_equal(np.asarray(mapped[0]), want_out)


@needs_nvrtc
@pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel interpreter needs g++")
@pytest.mark.parametrize(
    "shape, dtype",
    [((2, 64, 64), np.float32), ((2, 1, 1, 64), np.float32), ((64, 64), jnp.bfloat16)],
    ids=["per head", "by key per batch", "one plane bf16"],
)
def test_staged_score_bias_program_runs_on_the_kernel_interpreter(monkeypatch, shape, dtype):
    """A dense score bias crosses the staged program as an operand with its batch axis as q's
    (its other broadcast axes read at stride 0); its gradient comes back summed over what it
    broadcasts, shaped like it: bit for bit the eager interpreter's out and dq, dk, dv, the
    bias's gradient within float32 summation order; a vmap folds it with the batch. Without
    the opt-in it is refused by name, as on the eager CUDA path (it has not run on a GPU)."""
    backend, layout, (q, k, v) = _interpreted_modifier_case(monkeypatch)
    head_dim = 32
    rng = np.random.default_rng(6)
    bias = jnp.asarray(rng.standard_normal(shape), dtype)
    weight = rng.standard_normal(q.shape[1:]).astype(np.float32)
    scale = head_dim**-0.5

    def f(q, k, v, bias):
        return cuattn.sparse_attention(q, k, v, layout, score_bias=bias)

    def loss(q, k, v, bias):
        return (f(q, k, v, bias).astype(jnp.float32) * weight).sum()

    with jax_xla.lowering_for_cuda(CC):
        with pytest.raises(ValueError, match="score_bias: .* not run on a GPU"):
            jax.jit(f)(q[0], k[0], v[0], bias)
        monkeypatch.setenv(geometry.SCORE_BIAS_ENV, geometry.DECODE_FP8_KERNEL_FAMILY)
        out = jax.jit(f)(q[0], k[0], v[0], bias)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q[0], k[0], v[0], bias)
        mapped = jax.jit(jax.vmap(f, in_axes=(0, 0, 0, None)))(q, k, v, bias)
    host = [np.asarray(x) for x in (q[0], k[0], v[0])]
    call = AttentionCall(layout, scale, backend="interp")
    call = call.with_operands(ScoreOperands(score_bias=np.asarray(bias)))
    want_out, want_lse = backends.forward(*host, call)
    want = backends.backward(*host, want_out, want_lse, weight.astype(want_out.dtype), None, call)
    assert np.array_equal(np.asarray(out), want_out)
    for name, got, expected in zip("qkv", grads[:3], want[:3], strict=True):
        assert np.array_equal(np.asarray(got), expected), name
    assert grads[3].shape == bias.shape and grads[3].dtype == bias.dtype
    tol = 1e-6 if dtype == np.float32 else 1e-2
    np.testing.assert_allclose(
        np.asarray(grads[3], np.float32), np.asarray(want[3], np.float32), rtol=tol, atol=tol
    )
    assert np.array_equal(np.asarray(mapped[0]), want_out)
    second = backends.forward(*(np.asarray(x[1]) for x in (q, k, v)), call)
    assert np.array_equal(np.asarray(mapped[1]), second[0])


@needs_nvrtc
@pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel interpreter needs g++")
def test_staged_dropout_program_takes_a_traced_seed(monkeypatch):
    """Dropout's seed crosses the staged program as an operand (two 32-bit words the kernels
    read): one trace serves every seed, each gives bit for bit the eager interpreter's result
    for its key, forward and backward; a vmap that maps the seed is refused (one seed per
    launch), an unmapped one serves the folded batch."""
    backend, layout, (q, k, v) = _interpreted_modifier_case(monkeypatch)
    head_dim = 32
    weight = np.random.default_rng(5).standard_normal(q.shape[1:]).astype(np.float32)
    scale, p = head_dim**-0.5, 0.25

    def f(q, k, v, seed):
        return cuattn.sparse_attention(q, k, v, layout, dropout_p=p, dropout_seed=seed)

    def loss(q, k, v, seed):
        return (f(q, k, v, seed).astype(jnp.float32) * weight).sum()

    host = [np.asarray(x) for x in (q[0], k[0], v[0])]
    with jax_xla.lowering_for_cuda(CC):
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        forward = jax.jit(f)
        for key in (2**40 + 17, 2**63 + 5):
            words = jnp.asarray([key & 0xFFFFFFFF, key >> 32], jnp.uint32)
            out = forward(q[0], k[0], v[0], words)
            _, grads = step(q[0], k[0], v[0], words)
            mods = ScoreMods().with_dropout(p, np.asarray(words))
            call = AttentionCall(layout, scale, backend="interp", mods=mods)
            call = call.with_operands(ScoreOperands(dropout_seed=np.asarray(words)))
            want_out, want_lse = backends.forward(*host, call)
            assert np.array_equal(np.asarray(out), want_out)
            dout = weight.astype(want_out.dtype)
            want = backends.backward(*host, want_out, want_lse, dout, None, call)
            for name, got, expected in zip("qkv", grads, want[:3], strict=True):
                assert np.array_equal(np.asarray(got), expected), name
        mapped = jax.jit(jax.vmap(f, in_axes=(0, 0, 0, None)))(q, k, v, words)
        assert np.array_equal(np.asarray(mapped[0]), want_out)
        with pytest.raises(ValueError, match="dropout_seed is mapped by this vmap"):
            jax.jit(jax.vmap(f))(q, k, v, jnp.stack([words, words]))
    backward = ["attn_bwd_preprocess", "attn_bwd_dkdv", "attn_bwd_dq", *["attn_bwd_sum_groups"] * 2]
    # one trace of each program for both seeds; each vmap's body traced unbatched (then folded,
    # or refused)
    staged = ["attn_fwd", "attn_fwd", *backward, "attn_fwd", "attn_fwd", "attn_fwd"]
    assert backend.staged == staged


def test_cpu_jit_keeps_the_host_callback():
    layout = _layout("mha")
    q, k, v = _qkv(1, 2, 2, 64, 64, jnp.float32)
    text = (
        jax.jit(lambda q, k, v: cuattn.sparse_attention(q, k, v, layout)).lower(q, k, v).as_text()
    )
    assert xla.CUSTOM_CALL_TARGET not in text and "callback" in text


def test_cpu_backend_names_are_refused_on_cuda():
    layout = _layout("mha")
    q, k, v = _qkv(1, 2, 2, 64, 64, jnp.float16)
    with pytest.raises(ValueError, match="backend='numpy'"):
        _lower_for_cuda(
            lambda q, k, v: cuattn.sparse_attention(q, k, v, layout, backend="numpy"), q, k, v
        )


@needs_nvrtc
def test_kernel_argument_checks_still_run_under_jit():
    layout = cuattn.make_layout("local", 64, 2, blocksize=64, local_attn_ctx=64)
    q = jnp.zeros((1, 2, 64, 24), jnp.float16)  # head_dim 24 has no kernel
    with pytest.raises(ValueError, match="head_dim 24"):
        _lower_for_cuda(lambda q: cuattn.sparse_attention(q, q, q, layout), q)


# ---- on a GPU ---------------------------------------------------------------------------------

GPU_TOL = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3}  # jit vs eager: the same kernel, another ptxas


def _gpu_case(case, dtype, vmapped=None):
    batch, heads, kv_heads, n, head_dim, _ = CASES[case]
    arrays = _qkv(batch, heads, kv_heads, n, head_dim, dtype, vmapped)
    device = jax.devices("cuda")[0]
    return _layout(case), tuple(jax.device_put(x, device) for x in arrays)


@needs_jax_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_jit_forward_equals_eager(case, dtype):
    layout, (q, k, v) = _gpu_case(case, dtype)

    def f(q, k, v):
        return cuattn.sparse_attention(q, k, v, layout, return_lse=True)

    out, lse = jax.jit(f)(q, k, v)
    ref_out, ref_lse = f(q, k, v)  # eager: DLPack to the CuPy kernels
    assert out.dtype == dtype and lse.dtype == jnp.float32
    assert _rel(out, ref_out) <= GPU_TOL[dtype]
    assert _rel(lse, ref_lse) <= 1e-5
    assert "triton_kernel_call_ffi" in jax.jit(f).lower(q, k, v).as_text()


@needs_jax_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_jit_grad_equals_eager(case, recompute):
    dtype = jnp.float16
    layout, (q, k, v) = _gpu_case(case, dtype)
    weight = jax.device_put(
        jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), dtype), q.devices().pop()
    )

    def loss(q, k, v):
        out = cuattn.sparse_attention(q, k, v, layout, recompute=recompute)
        return (out.astype(jnp.float32) * weight.astype(jnp.float32)).sum()

    grads = jax.grad(jax.jit(loss), argnums=(0, 1, 2))(q, k, v)
    eager = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    jitted_outside = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for name, got, again, want in zip("qkv", grads, jitted_outside, eager, strict=True):
        assert got.shape == want.shape and got.dtype == dtype, name
        assert _rel(got, want) <= GPU_TOL[dtype], name
        assert np.array_equal(np.asarray(got), np.asarray(again)), name


@needs_jax_cuda
@pytest.mark.gpu
def test_gpu_vmap_equals_a_loop():
    layout, (q, k, v) = _gpu_case("gqa", jnp.bfloat16, vmapped=3)

    def f(q, k, v):
        return cuattn.sparse_attention(q, k, v, layout)

    def loss(q, k, v):
        return f(q, k, v).astype(jnp.float32).sum()

    mapped = jax.jit(jax.vmap(f))(q, k, v)
    looped = jnp.stack([jax.jit(f)(q[i], k[i], v[i]) for i in range(3)])
    # one CTA never reads another batch's rows: folding the axis into the batch changes nothing
    assert np.array_equal(np.asarray(mapped), np.asarray(looped))
    shared = jax.jit(jax.vmap(f, in_axes=(0, None, None)))(q, k[0], v[0])
    assert np.array_equal(
        np.asarray(shared), np.asarray(jnp.stack([jax.jit(f)(q[i], k[0], v[0]) for i in range(3)]))
    )
    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v)
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    looped = [step(q[i], k[i], v[i]) for i in range(3)]
    for j, got in enumerate(grads):
        assert np.array_equal(np.asarray(got), np.asarray(jnp.stack([g[j] for g in looped])))


@needs_jax_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_bf16_against_float64_numpy(case):
    layout, (q, k, v) = _gpu_case(case, jnp.bfloat16)
    host = [np.asarray(x, dtype=np.float64) for x in (q, k, v)]
    weight = np.random.default_rng(2).standard_normal(host[0].shape)
    scale = host[0].shape[-1] ** -0.5
    call = AttentionCall(layout, scale, backend="numpy")
    ref_out, ref_lse = backends.forward(*host, call)
    ref_grads = backends.backward(*host, ref_out, ref_lse, weight, None, call)

    def loss(q, k, v):
        out = cuattn.sparse_attention(q, k, v, layout)
        return (out.astype(jnp.float32) * jnp.asarray(weight, jnp.float32)).sum()

    out = jax.jit(lambda q, k, v: cuattn.sparse_attention(q, k, v, layout))(q, k, v)
    assert _rel(out, ref_out) <= 1e-2
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        assert _rel(got, want) <= 1e-2, name
