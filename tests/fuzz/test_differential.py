"""Differential fuzzer: random patterns, layouts, shapes, dtypes, strides and special values, on
every front (NumPy, torch autograd, jax.vjp, the cuattn tape), backend ('numpy', 'interp') and
path (sparse_attention, sparse_attention_varlen, merge_attention_states of two disjoint key
sets, KVCache + decode_attention, a context-parallel ring emulated in one process).

Every case either
* equals the float64 oracle (outputs, LSE and every gradient, the gradient through the LSE
  included) within twice the error a dense computation in the case's own precision makes
  (the yardstick, computed here for each case), with NaN/inf exactly where a dense float64
  computation puts them (docs/design.md §2), and leaves its inputs unchanged; or
* raises a ValueError/TypeError that names the argument, before any kernel launch, with every
  input unchanged, the same on every backend (docs/design.md §7).

Run:
    pytest tests/fuzz                                   CI mode: derandomized, < 2 min
    CUATTN_FUZZ_EXAMPLES=20000 pytest tests/fuzz -s     long mode: ~20000 cases, random seeds
    HYPOTHESIS_PROFILE=long pytest tests/fuzz -s        long mode with 20000 cases
    CUATTN_FUZZ_STRICT=1 ...                            known defects (KNOWN_DEFECTS) fail too
A summary of the cases run (by path, front, backend and outcome) is printed at the end.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

import cuattn
from cuattn.distributed import ring_plan, shard, unshard
from cuattn.layout.derived import restricted
from cuattn.tools.oracle import GRAD_FLOOR, REL_FLOOR
from tests.fuzz import strategies as fz
from tests.fuzz.strategies import KERNEL_BLOCKS, KERNEL_HEAD_DIMS, Case, Shape

jax.config.update("jax_enable_x64", True)  # process-wide, as the jax adapter tests run

# -- configuration --------------------------------------------------------------------------

# Examples per test in CI mode (tuned so the file runs in < 2 min on 2 cores, warm caches),
# and each test's share of a long run's CUATTN_FUZZ_EXAMPLES.
CI_EXAMPLES = {
    "layout": 300,
    "plain": 500,
    "varlen": 150,
    "merge": 120,
    "decode": 80,
    "cp": 80,
    "errors": 150,
}
LONG_SHARE = {
    "layout": 0.10,
    "plain": 0.50,
    "varlen": 0.12,
    "merge": 0.10,
    "decode": 0.06,
    "cp": 0.05,
    "errors": 0.07,
}
LONG_EXAMPLES = int(os.environ.get("CUATTN_FUZZ_EXAMPLES") or 0) or (
    20000 if os.environ.get("HYPOTHESIS_PROFILE") == "long" else 0
)


def fuzz_settings(test: str) -> settings:
    long = LONG_EXAMPLES > 0
    return settings(
        max_examples=max(1, round(LONG_EXAMPLES * LONG_SHARE[test])) if long else CI_EXAMPLES[test],
        deadline=None,
        derandomize=not long,
        database=None,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
    )


# -- known defects: being fixed; each tolerated only under its narrow condition --------------
# Delete an entry once its fix has landed (CUATTN_FUZZ_STRICT=1 ignores them all).
KNOWN_DEFECTS: dict[str, str] = {
    # None open. Found by this fuzzer and fixed (each stays a case it generates): lse-grad,
    # varlen-permuted, numpy-nan, empty-sizes, pattern-validation, merge-nan-grad,
    # end-aligned-index, dense-block-rows-before-keys, interp-dlse-assert,
    # interp-empty-row-grad, tape-grad-dtype. The narrow conditions that tolerated them are in
    # verdict() and check_layout_contract(), keyed by name: a new defect adds its entry here.
}
if os.environ.get("CUATTN_FUZZ_STRICT"):
    KNOWN_DEFECTS = {}

STATS: Counter = Counter()  # cases run, by path/front/backend/outcome (conftest prints it)
RATIOS: dict = {}  # (array, eps) -> largest error / max(yardstick error, eps) seen


# CUATTN_FUZZ_COLLECT=<file>: record failures there (one JSON line each) and go on, instead of
# stopping at the first (for long exploratory runs; the summary counts them by kind).
COLLECT = os.environ.get("CUATTN_FUZZ_COLLECT")


@contextlib.contextmanager
def collecting(case):
    if not COLLECT:
        yield
        return
    try:
        yield
    except Exception as err:  # noqa: BLE001  (every failure is recorded, none is lost)
        text = f"{type(err).__name__}: {err}"
        kind = re.findall(r"\[(\w[\w-]*)\]", text)[:1] or [type(err).__name__]
        key = f"FAIL/{case.path}/{case.backend}/{case.dtype}/{kind[0]}"
        STATS[key] += 1
        with open(COLLECT, "a") as f:
            f.write(json.dumps({"key": key, "error": text[:3000], "case": repr(case)}) + "\n")


def known(name: str) -> bool:
    return name in KNOWN_DEFECTS


# -- launch counting: "before any launch" -------------------------------------------------------


class Launches:
    """Counts kernel launches (interp) and NumPy-backend computations while installed."""

    def __init__(self) -> None:
        self.count = 0
        self._saved: list = []

    def _wrap(self, module, name):
        original = getattr(module, name)

        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        self._saved.append((module, name, original))
        setattr(module, name, counted)

    def install(self) -> None:
        from cuattn.backends import interp, numpy_ref

        self._wrap(interp, "launch")
        for name in ("attention_forward", "attention_backward", "merge_states"):
            self._wrap(numpy_ref, name)

    def remove(self) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()


LAUNCHES = Launches()


@pytest.fixture(scope="module", autouse=True)
def _count_launches():
    LAUNCHES.install()
    yield
    LAUNCHES.remove()


# -- inputs ---------------------------------------------------------------------------------

try:
    import ml_dtypes  # noqa: F401  (bfloat16 for NumPy: torch bf16 CPU tensors on the kernels)

    HAVE_ML_DTYPES = True
except ImportError:
    HAVE_ML_DTYPES = False

NP_DTYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16}
TORCH_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}
# Huge: far past where an unshifted exp overflows (~89 in float32), and inside the range where a
# float32 lse still pins a score: the kernels' backward recomputes P = exp2(s - lse) from the
# stored lse, so at |s| ~ 1e6 and beyond the lse's own rounding (|s| x 6e-8) is a whole unit of
# the exponent and P is garbage, in FlashAttention's scheme as in ours (docs/design.md §7).
HUGE = {"float64": 1e300, "float32": 1e4, "float16": 16000.0, "bfloat16": 1e4}
TINY = {"float64": 5e-324, "float32": 1.4e-45, "float16": 6e-8, "bfloat16": 9.2e-41}


def acc_name(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32"


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values exactly representable in dtype (round to nearest)."""
    if dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16).double().numpy()
    return x.astype(NP_DTYPES[dtype]).astype(np.float64)


def draw_values(case: Case, shapes: dict[str, tuple]) -> dict[str, np.ndarray]:
    """Seeded float64 values (already rounded to the case's dtype) for every named shape, with
    the case's special values written into its target array."""
    rng = np.random.default_rng(case.seed)
    values = {}
    for name, shape in shapes.items():
        x = rng.standard_normal(shape) * (case.amplitude if name in "qkv" else 1.0)
        values[name] = x
    sp = case.special
    if sp is not None and values[sp.target].size:
        x = values[sp.target].reshape(-1)
        where = rng.integers(0, x.size, sp.count)
        fill = {
            "nan": np.nan,
            "inf": np.inf,
            "-inf": -np.inf,
            "huge": HUGE[case.dtype] * rng.choice((-1.0, 1.0)),
            "denormal": TINY[case.dtype] * rng.integers(1, 4) * rng.choice((-1.0, 1.0)),
        }[sp.kind]
        x[where] = fill
        if sp.kind == "denormal":  # a whole row of subnormals, too
            values[sp.target].reshape(-1, values[sp.target].shape[-1])[0] = TINY[case.dtype]
    for name in values:
        if name != "dlse":
            values[name] = round_to(values[name], case.dtype)
        else:
            values[name] = round_to(values[name], acc_name(case.dtype))
    return values


# Memory arrangements of a 4-D [B, H, T, d] or a 3-D packed [T, H, d] input: a float64 base
# filled with NaN (so a read outside the view shows), the values written through the view.
def _perm(x, axes):
    return x.permute(*axes) if isinstance(x, torch.Tensor) else x.transpose(axes)


def _flat(x, offset, shape):
    n = math.prod(shape)
    flat = x.reshape(-1)[offset : offset + n]
    return flat.view(shape) if isinstance(x, torch.Tensor) else flat.reshape(shape)


def _broadcast(x, shape):
    return x.expand(*shape) if isinstance(x, torch.Tensor) else np.broadcast_to(x, shape)


def arrangement(memory: str, shape: tuple, dtype: str):
    """(base shape, view function) of a memory kind for an array of ``shape``."""
    item = ITEMSIZE[dtype]
    n = math.prod(shape)
    if len(shape) == 3:  # packed varlen [T, H, d]
        t, h, d = shape
        return {
            "contiguous": ((t, h, d), lambda x: x),
            "fused": ((t, 3, h, d), lambda x: x[:, 1]),
            "offset": ((n + 1,), lambda x: _flat(x, 1, shape)),
            "last_axis": ((t, h, 2 * d), lambda x: x[..., ::2]),
        }[memory]
    b, h, t, d = shape
    return {
        "contiguous": ((b, h, t, d), lambda x: x),
        "transposed": ((b, t, h, d), lambda x: _perm(x, (0, 2, 1, 3))),
        "fused": ((b, t, 2, h, d), lambda x: _perm(x[:, :, 1], (0, 2, 1, 3))),
        "rows_strided": ((b, h, 2 * t, d), lambda x: x[:, :, ::2]),
        "padded": ((b, h, t, d + 8), lambda x: x[..., :d]),
        "offset_aligned": ((n + 16 // item,), lambda x: _flat(x, 16 // item, shape)),
        "offset": ((n + 1,), lambda x: _flat(x, 1, shape)),
        "last_axis": ((b, h, t, 2 * d), lambda x: x[..., ::2]),
        "broadcast": ((min(b, 1), h, t, d), lambda x: _broadcast(x, shape)),
        "reversed": ((b, h, t, d), lambda x: x[:, :, ::-1]),
    }[memory]


@dataclass
class Placed:
    """An input as the front holds it, its backing base (checked unchanged after the call) and
    the float64 values the computation sees (read back through the view)."""

    x: object
    base: object
    values: np.ndarray
    leaf: object = None  # what gradients are taken against (torch: the view itself)


def to_f64(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).numpy()
    if isinstance(x, cuattn.Tensor):
        x = x.data
    return np.asarray(x).astype(np.float64)


def place(values: np.ndarray, dtype: str, memory: str, front: str, grad: bool) -> Placed:
    """The array ``values`` (float64, representable in dtype) on ``front`` in ``memory``."""
    if front == "jax":
        x = jnp.asarray(values.astype(NP_DTYPES[dtype]))
        return Placed(x, None, to_f64(x))
    base_shape, view = arrangement(memory, values.shape, dtype)
    base64 = np.full(base_shape, np.nan)
    if memory == "broadcast":
        base64[...] = values[: base_shape[0]]
    else:
        view(base64)[...] = values
    if front == "torch" or dtype == "bfloat16":
        base = torch.from_numpy(base64).to(TORCH_DTYPES[dtype])
        if front == "torch":
            if grad:
                base.requires_grad_(True)
            x = view(base)
            return Placed(x, base, to_f64(x), x)
        raise AssertionError("bfloat16 is drawn for the torch front only")
    base = base64.astype(NP_DTYPES[dtype])
    x = view(base)
    if front == "tape":
        t = cuattn.Tensor(x, requires_grad=grad)
        return Placed(t, base, to_f64(x), t)
    return Placed(x, base, to_f64(x))


def snapshot(p: Placed) -> bytes | None:
    if p.base is None:
        return None
    if isinstance(p.base, torch.Tensor):
        b = p.base.detach()
        return (b.view(torch.int16) if b.dtype == torch.bfloat16 else b).numpy().tobytes()
    return p.base.tobytes()


def kernel_readable(x) -> bool:
    """README 'What is supported today': the kernels read q, k, v, dout in place when the last
    axis is contiguous, every other stride (of an axis longer than 1) is a non-negative multiple
    of 16 bytes and the data starts on a 16-byte boundary."""
    if isinstance(x, cuattn.Tensor):
        x = x.data
    if isinstance(x, torch.Tensor):
        item = x.element_size()
        strides = [s * item for s in x.stride()]
        address = x.data_ptr()
    elif isinstance(x, np.ndarray):
        item, strides, address = x.itemsize, list(x.strides), x.ctypes.data
    else:
        return True  # jax: contiguous, and jax's own allocation
    outer = [s for s, n in zip(strides[:-1], x.shape[:-1], strict=True) if n > 1]
    last_ok = strides[-1] == item or x.shape[-1] == 1
    return last_ok and all(s >= 0 and s % 16 == 0 for s in outer) and address % 16 == 0


# -- the oracle and the yardstick --------------------------------------------------------------


@dataclass
class Result:
    """out [B, H, Q, d], lse [B, H, Q] and gradients (dq, dk, dv) as float64 arrays."""

    out: np.ndarray | None = None
    lse: np.ndarray | None = None
    grads: dict = field(default_factory=dict)


def dense(q, k, v, mask, scale, dout=None, dlse=None, acc=np.float64, drop_masked=False):
    """Dense masked attention and its gradients, computed in ``acc``.

    q [B, H, Q, d], k, v [B, Hkv, K, d] (GQA: head h reads kv head h // (H / Hkv)); mask
    [H, Q, K] or [B, H, Q, K]. A masked score is replaced by -inf, never multiplied (design §2).
    ``drop_masked``: masked keys contribute nothing at all (their k, v never enter a product:
    the strict NaN semantics); otherwise products with p = 0 are formed, as a dense GEMM does
    (0 * NaN = NaN: the loose semantics). A row with no allowed key gives out 0, lse -inf and
    zero gradients; a NaN or +inf score poisons its row (out, lse, gradients), as softmax does.
    The loss is sum(out * dout) + sum(lse * dlse).
    """
    bsz, heads, nq, d = q.shape
    nk = k.shape[2]
    q, k, v = (np.asarray(x, dtype=acc) for x in (q, k, v))
    group = heads // max(k.shape[1], 1)
    kr, vr = (np.repeat(x, group, axis=1) for x in (k, v))
    m = np.broadcast_to(mask, (bsz, heads, nq, nk))
    res = Result()
    if min(bsz, heads, nq) == 0 or nk == 0:
        return empty_result(q, k, v, dout)
    with np.errstate(all="ignore"):
        s = np.where(m, np.einsum("bhqd,bhkd->bhqk", q, kr) * acc(scale), -np.inf).astype(acc)
        mx = s.max(axis=-1, keepdims=True)
        shift = np.where(np.isneginf(mx), 0.0, mx)  # +inf or NaN: the row becomes NaN
        e = np.exp(s - shift)
        total = e.sum(axis=-1, keepdims=True)
        p = e / np.where(total > 0, total, 1.0)
        p = np.where(np.isnan(total), np.nan, p)

        def contract(a, b, pattern, over_k):
            """einsum, or with drop_masked the masked terms left out of the sum."""
            if not drop_masked:
                return np.einsum(pattern, a, b)
            if over_k:  # sum over keys: a [B,H,Q,K], b [B,H,K,d] -> [B,H,Q,d]
                terms = a[..., None] * b[:, :, None]
                return np.where(m[..., None], terms, 0.0).sum(axis=3)
            # sum over queries: a [B,H,Q,K], b [B,H,Q,d] -> [B,H,K,d]
            terms = a[..., None] * b[:, :, :, None]
            return np.where(m[..., None], terms, 0.0).sum(axis=2)

        out = contract(p, vr, "bhqk,bhkd->bhqd", True)
        log_total = np.log(np.where(total > 0, total, 1.0))[..., 0]
        lse = np.where(total[..., 0] > 0, shift[..., 0] + log_total, -np.inf)
        lse = np.where(np.isnan(total[..., 0]), np.nan, lse)
        res.out, res.lse = out, lse
        if dout is None:
            return res
        dout = np.asarray(dout, dtype=acc)
        dp = np.einsum("bhqd,bhkd->bhqk", dout, vr)
        if drop_masked:
            dp = np.where(m, dp, 0.0)
        delta = (dout * out).sum(axis=-1)
        if dlse is not None:
            delta = delta - np.asarray(dlse, dtype=acc)
        ds = p * (dp - delta[..., None])
        if drop_masked:
            ds = np.where(m, ds, 0.0)
        dq = contract(ds, kr, "bhqk,bhkd->bhqd", True) * acc(scale)
        dk = contract(ds, q, "bhqk,bhqd->bhkd", False) * acc(scale)
        dv = contract(p, dout, "bhqk,bhqd->bhkd", False)
    res.grads = {"dq": dq, **dict(zip(("dk", "dv"), sum_groups(k.shape[1], dk, dv), strict=True))}
    return res


def empty_result(q, k, v, dout) -> Result:
    res = Result(np.zeros(q.shape), np.full(q.shape[:3], -np.inf))
    if dout is not None:
        res.grads = {"dq": np.zeros(q.shape), "dk": np.zeros(k.shape), "dv": np.zeros(v.shape)}
    return res


def sum_groups(kv_heads: int, *grads):
    """Per-query-head dK/dV summed over each kv head's group of query heads."""
    return [g.reshape(g.shape[0], kv_heads, -1, *g.shape[2:]).sum(axis=2) for g in grads]


def flash(q, k, v, mask, scale, dout, dlse, acc, dtype: str, block: int = 16) -> Result:
    """The same as ``dense`` (loose semantics) computed the way the backends order it, in
    ``acc``: the scale folded into q, an online softmax over key blocks with exp2, the output
    rounded to ``dtype``; the backward recomputes P from the lse, forms delta from the rounded
    output, and accumulates dQ over key blocks and dK, dV over query blocks. A same-precision
    dense computation, too: the yardstick's second rounding pattern."""
    bsz, heads, nq, d = q.shape
    nk = k.shape[2]
    if min(bsz, heads, nq) == 0 or nk == 0:
        return empty_result(q, k, v, dout)
    q, k, v = (np.asarray(x, dtype=acc) for x in (q, k, v))
    group = heads // k.shape[1]

    def narrow(x):
        """P or dS as a tensor-core operand: in the inputs' 16-bit dtype (kept in acc for
        float32 and float64 inputs, which the kernels multiply as they are)."""
        if dtype not in ("float16", "bfloat16"):
            return x
        with np.errstate(all="ignore"):
            return round_to(x.astype(np.float64), dtype).astype(acc)

    kr, vr = (np.repeat(x, group, axis=1) for x in (k, v))
    m = np.broadcast_to(mask, (bsz, heads, nq, nk))
    log2e = acc(1.4426950408889634)
    qs = q * acc(scale * 1.4426950408889634)  # scores in log2 units
    keys = [slice(j, j + block) for j in range(0, nk, block)]
    rows = [slice(i, i + block) for i in range(0, nq, block)]
    with np.errstate(all="ignore"):
        mi = np.full((bsz, heads, nq), -np.inf, acc)
        li = np.zeros((bsz, heads, nq), acc)
        o = np.zeros((bsz, heads, nq, d), acc)
        for kb in keys:
            s2 = np.where(m[..., kb], np.einsum("bhqd,bhkd->bhqk", qs, kr[:, :, kb]), -np.inf)
            m_new = np.maximum(mi, s2.max(axis=-1))
            safe = np.where(np.isneginf(m_new), 0.0, m_new)
            pb = np.exp2(s2 - safe[..., None])
            alpha = np.exp2(mi - safe)
            li = li * alpha + pb.sum(axis=-1)
            o = o * alpha[..., None] + np.einsum("bhqk,bhkd->bhqd", narrow(pb), vr[:, :, kb])
            mi = m_new
        has = li > 0
        out = np.where(has[..., None], o / np.where(has, li, 1.0)[..., None], 0.0)
        out = np.where(np.isnan(li)[..., None], np.nan, out)
        lse2 = np.where(has, mi + np.log2(np.where(has, li, 1.0)), -np.inf)  # log2 units
        lse2 = np.where(np.isnan(li), np.nan, lse2)
        res = Result(round_to(out.astype(np.float64), dtype), (lse2 / log2e).astype(np.float64))
        if dout is None:
            return res
        dout = np.asarray(dout, acc)
        out_r = res.out.astype(acc)
        delta = (dout * out_r).sum(axis=-1)
        if dlse is not None:
            delta = delta - np.asarray(dlse, acc)
        finite = np.isfinite(lse2)

        def probs(rb, kb):
            s2 = np.einsum("bhqd,bhkd->bhqk", qs[:, :, rb], kr[:, :, kb])
            s2 = np.where(m[:, :, rb, kb], s2, -np.inf)
            lse_b = np.where(finite[:, :, rb], lse2[:, :, rb], 0.0)[..., None]
            p = np.where(finite[:, :, rb, None], np.exp2(s2 - lse_b), 0.0)
            p = np.where(np.isnan(lse2[:, :, rb])[..., None], np.nan, p)
            dp = np.einsum("bhqd,bhkd->bhqk", dout[:, :, rb], vr[:, :, kb])
            return p, p * (dp - delta[:, :, rb, None])

        dq = np.zeros(q.shape, acc)
        dk = np.zeros(kr.shape, acc)
        dv = np.zeros(vr.shape, acc)
        for kb in keys:  # dQ: each query row walks the key blocks
            dq += np.einsum("bhqk,bhkd->bhqd", narrow(probs(slice(None), kb)[1]), kr[:, :, kb])
        for rb in rows:  # dK, dV: each key walks the query blocks
            p, ds = (narrow(x) for x in probs(rb, slice(None)))
            dv += np.einsum("bhqk,bhqd->bhkd", p, dout[:, :, rb])
            dk += np.einsum("bhqk,bhqd->bhkd", ds, q[:, :, rb])
        if group > 1:  # per query head in dtype first, then summed: as the kernels (and a
            # same-precision dense GQA, whose repeated K and V sum their heads' gradients) do
            dk, dv = (
                round_to(g.astype(np.float64), dtype).astype(acc) for g in (dk * acc(scale), dv)
            )
            dk, dv = sum_groups(k.shape[1], dk, dv)
        else:
            dk = dk * acc(scale)
        res.grads = {
            n: round_to(g.astype(np.float64), dtype)
            for n, g in (("dq", dq * acc(scale)), ("dk", dk), ("dv", dv))
        }
    return res


def rounded(res: Result, dtype: str) -> Result:
    """A same-precision result: outputs and gradients rounded to the inputs' dtype (the lse
    stays in the accumulation type)."""
    return Result(
        round_to(np.asarray(res.out, np.float64), dtype),
        np.asarray(res.lse, np.float64),
        {n: round_to(np.asarray(g, np.float64), dtype) for n, g in res.grads.items()},
    )


@dataclass
class Expect:
    strict: Result  # float64, masked keys never enter a product
    loose: Result  # float64, products with p = 0 formed (0 * NaN = NaN)
    yard: Result  # the dense computation in the case's own precision
    yard2: Result  # the same computed as the backends order it (``flash``)
    noise: dict = field(default_factory=dict)  # array -> magnitude of its rounding noise


def noise_scales(q, k, v, mask, dout, scale) -> dict:
    """Absolute size of each output's rounding noise per unit roundoff of the accumulation.

    Two effects the yardstick can miss by luck (it may round the same way as the oracle):
    exp turns a score's absolute rounding (|S| eps, or sqrt(d) |scale| |q| |k| eps for the dot
    product) into a relative error of out, lse and every gradient, and dP - delta cancels to 0
    for a row with a single key (dq and dk keep
    noise of |dO| |V| sqrt(d)). Magnitudes are over the finite inputs."""

    def top(x):
        x = np.abs(np.asarray(x, np.float64))
        x = x[np.isfinite(x)]
        return float(x.max(initial=0.0))

    finite = [np.where(np.isfinite(x), x, 0.0) for x in (q, k)]
    group = q.shape[1] // max(k.shape[1], 1)
    kr = np.repeat(finite[1], group, axis=1)
    with np.errstate(all="ignore"):
        scores = np.abs(np.einsum("bhqd,bhkd->bhqk", finite[0], kr) * scale)
    s_max = float(np.where(np.broadcast_to(mask, scores.shape), scores, 0).max(initial=0.0))
    d = q.shape[-1]
    # a score's own rounding: up to sqrt(d) |scale| |q| |k| eps (a dot product of d terms)
    amp = 1.0 + max(s_max, abs(scale) * top(q) * top(k) * math.sqrt(d))
    ds = math.sqrt(d) * top(dout) * top(v) if dout is not None else 0.0  # |dP - delta|
    rows = math.sqrt(max(q.shape[2], 1))
    return {
        "out": top(v) * amp,
        "lse": amp,
        "dq": abs(scale) * top(k) * ds * amp,
        "dk": abs(scale) * top(q) * ds * rows * amp,
        "dv": top(dout) * rows * amp if dout is not None else 0.0,
    }


def expect(case: Case, q, k, v, mask, scale, dout, dlse) -> Expect:
    special = case.special is not None
    # float64 cases are measured against extended precision, so that the yardstick (a dense
    # float64 computation) has an error of its own
    exact = np.longdouble if case.dtype == "float64" else np.float64
    strict = dense(q, k, v, mask, scale, dout, dlse, acc=exact, drop_masked=special)
    loose = dense(q, k, v, mask, scale, dout, dlse, acc=exact) if special else strict
    acc = np.float64 if case.dtype == "float64" else np.float32
    # two dense computations in the case's precision, in two orders: the yardstick's error is
    # the larger of theirs (one sample of a rounding pattern is a noisy measure)
    b = case.layout.blocksize
    block = b if case.backend == "numpy" or b in KERNEL_BLOCKS else min(KERNEL_BLOCKS)
    yard = [
        rounded(dense(q, k, v, mask, scale, dout, dlse, acc=acc), case.dtype),
        flash(q, k, v, mask, scale, dout, dlse, acc, case.dtype, max(block, 8)),
    ]
    # The merge and context-parallel paths' partial outputs come back in the case's dtype before
    # they are merged: in half precision their rounding (the dtype's eps, not the
    # accumulation's) reaches every result through the merge and its gradient, a rounding no
    # single dense computation makes.
    noise_eps = EPS[acc_name(case.dtype)]
    if case.path in ("merge", "cp"):
        noise_eps = max(noise_eps, EPS[case.dtype])
    noise = noise_scales(q, k, v, mask, dout, scale) | {"eps": noise_eps}
    return Expect(strict, loose, yard[0], yard[1], noise=noise)


# -- comparison ---------------------------------------------------------------------------------


def compare(name: str, got, ex: Expect, pick, floor: float, eps: float) -> list[tuple[str, str]]:
    """Problems of one output array: (kind, message). ``pick`` selects the array of a Result.

    Tolerance: 2 x max(yardstick error, eps of the dtype, accumulation eps x noise scale)."""
    noise, noise_eps = ex.noise.get(name, 0.0), ex.noise.get("eps", eps)
    strict, loose, yard, yard2 = (
        np.asarray(pick(r), np.float64) for r in (ex.strict, ex.loose, ex.yard, ex.yard2)
    )
    got = np.asarray(got, np.float64)
    if got.shape != strict.shape:
        return [("shape", f"{name}: shape {got.shape}, expected {strict.shape}")]
    fin = np.isfinite
    problems = []
    spurious = ~fin(got) & fin(strict) & fin(loose) & fin(yard)
    if spurious.any():
        at = tuple(int(i) for i in np.argwhere(spurious)[0])
        problems.append(
            (
                "spurious",
                f"{name}: {got[at]} at {at} where the oracle has "
                f"{strict[at]} ({int(spurious.sum())} such elements)",
            )
        )
    swallowed = np.isnan(strict) & ~np.isnan(got) & ~(np.isinf(got) & ~fin(yard))
    if swallowed.any():
        at = tuple(int(i) for i in np.argwhere(swallowed)[0])
        problems.append(
            (
                "swallowed",
                f"{name}: {got[at]} at {at} where the oracle has NaN "
                f"({int(swallowed.sum())} such elements)",
            )
        )
    inf_wrong = np.isinf(strict) & (got != strict) & ~(np.isnan(got) & ~(fin(loose) & fin(yard)))
    if inf_wrong.any():
        at = tuple(int(i) for i in np.argwhere(inf_wrong)[0])
        problems.append(("inf", f"{name}: {got[at]} at {at} where the oracle has {strict[at]}"))
    both = fin(strict) & fin(yard)
    sel = both & fin(got)
    if sel.any():
        denom = max(float(np.abs(strict[both]).max()), floor)
        err = float(np.abs(got[sel] - strict[sel]).max()) / denom
        both2 = both & fin(yard2)
        yard_err = (
            max(
                float(np.abs(yard[both] - strict[both]).max()),
                float(np.abs(yard2[both2] - strict[both2]).max(initial=0.0)),
            )
            / denom
        )
        tol = 2 * max(yard_err, eps, noise_eps * noise / denom)
        ratio = err / (tol / 2)
        RATIOS[name[:3], eps] = max(RATIOS.get((name[:3], eps), 0.0), ratio)
        if os.environ.get("CUATTN_FUZZ_RATIO_LOG"):
            with open(os.environ["CUATTN_FUZZ_RATIO_LOG"], "a") as f:
                f.write(f"{name} {eps} {err} {yard_err} {noise_eps * noise / denom}\n")
        if not err <= tol:
            worst = np.argmax(np.abs(got[sel] - strict[sel]))
            at = tuple(int(i) for i in np.argwhere(sel)[worst])
            problems.append(
                (
                    "value",
                    f"{name}: error {err:.3g} > {tol:.3g} (2 x max(same-precision dense "
                    f"{yard_err:.3g}, eps {eps:.3g}, noise {noise_eps * noise / denom:.3g})); "
                    f"worst at {at}: {got[at]!r} vs {strict[at]!r}",
                )
            )
    return problems


def compare_all(case: Case, got: Result, ex: Expect) -> list:
    eps, lse_eps = EPS[case.dtype], EPS[acc_name(case.dtype)]
    problems = compare("out", got.out, ex, lambda r: r.out, REL_FLOOR, eps)
    if got.lse is not None:
        problems += compare("lse", got.lse, ex, lambda r: r.lse, REL_FLOOR, lse_eps)
    for g in got.grads:
        pick = lambda r, g=g: r.grads[g]  # noqa: E731
        problems += compare(g, got.grads[g], ex, pick, GRAD_FLOOR, eps)
    return problems


# -- running one case ----------------------------------------------------------------------------


@dataclass
class Outcome:
    result: Result | None = None
    error: BaseException | None = None
    launches: int = 0
    notes: list = field(default_factory=list)
    types: dict = field(default_factory=dict)  # name -> (type, dtype, shape) as the front gave


FRONT_TYPES = {
    "numpy": np.ndarray,
    "torch": torch.Tensor,
    "jax": jax.Array,
    "tape": cuattn.Tensor,
}


def describe(x) -> tuple:
    dtype = str(x.dtype).replace("torch.", "")
    return (type(x), dtype, tuple(int(d) for d in x.shape))


def as_tuple(r) -> tuple:
    return tuple(r) if isinstance(r, tuple) else (r,)


def differentiate(case: Case, f, inputs: list[Placed], dout: Placed | None, dlse) -> tuple:
    """Run f(q, k, v) -> (out,) or (out, lse) on the front; with gradients when asked, the loss
    being sum(out * dout) (+ sum(lse * dlse) when case.dlse). Returns (outputs, grads, notes)."""
    xs = [p.x for p in inputs]
    notes = []
    if not case.grad:
        return as_tuple(f(*xs)), {}, notes
    if case.front == "jax":
        outs, vjp = jax.vjp(lambda *a: as_tuple(f(*a)), *xs)
        cot = [jnp.asarray(dout.x)]
        if len(outs) > 1:
            lse_ct = dlse if case.dlse else np.zeros(outs[1].shape)
            cot.append(jnp.asarray(lse_ct, dtype=outs[1].dtype))
        grads = vjp(tuple(cot))
        return outs, dict(zip(("dq", "dk", "dv"), grads, strict=True)), notes
    outs = as_tuple(f(*xs))
    if case.front == "torch":
        targets, cots = [outs[0]], [dout.x]
        if case.dlse:
            if outs[1].requires_grad:
                targets.append(outs[1])
                cots.append(torch.as_tensor(dlse, dtype=outs[1].dtype))
            else:
                notes.append("lse-not-differentiable")
        live = [(t, c) for t, c in zip(targets, cots, strict=True) if t.requires_grad]
        grads = [None] * 3
        if live:  # (nothing is live when no key is ever attended: the gradients are 0)
            grads = torch.autograd.grad(
                [t for t, _ in live],
                [p.leaf for p in inputs],
                [c for _, c in live],
                allow_unused=True,
            )
        grads = [
            torch.zeros_like(p.leaf) if g is None else g for p, g in zip(inputs, grads, strict=True)
        ]
        return outs, dict(zip(("dq", "dk", "dv"), grads, strict=True)), notes
    # the tape
    if case.dlse:
        loss = (outs[0] * cuattn.Tensor(np.asarray(dout.values, outs[0].dtype))).sum()
        loss = loss + (outs[1] * cuattn.Tensor(np.asarray(dlse, outs[1].dtype))).sum()
        loss.backward()
    else:
        outs[0].backward(dout.x.data if isinstance(dout.x, cuattn.Tensor) else dout.x)
    grads = {}
    for name, p in zip(("dq", "dk", "dv"), inputs, strict=True):
        grads[name] = p.leaf.grad if p.leaf.grad is not None else np.zeros(p.leaf.shape)
    return outs, grads, notes


def invoke(case: Case, f, inputs, dout, dlse) -> Outcome:
    """Call f through differentiate; an exception becomes the outcome (with launches counted)."""
    before = LAUNCHES.count
    outcome = Outcome()
    try:
        outs, grads, outcome.notes = differentiate(case, f, inputs, dout, dlse)
    except (
        ValueError,
        TypeError,
        RuntimeError,
        NotImplementedError,
        AssertionError,
        IndexError,
    ) as err:
        outcome.error = err
        outcome.launches = LAUNCHES.count - before
        return outcome
    outcome.launches = LAUNCHES.count - before
    names = ["out", "lse"][: len(outs)]
    outcome.types = {n: describe(o) for n, o in zip(names, outs, strict=False)}
    outcome.types.update({n: describe(g) for n, g in grads.items()})
    outcome.result = Result(
        to_f64(outs[0]),
        to_f64(outs[1]) if len(outs) > 1 else None,
        {n: to_f64(g) for n, g in grads.items()},
    )
    return outcome


def layout_obj(case: Case, spec, n_q: int, n_k: int):
    return fz.build_layout(spec, case.shape.heads, n_q, n_k)


def mask_of(layout, heads: int, n_q: int, n_k: int) -> np.ndarray:
    """bool [heads, n_q, n_k] from ``layout.allowed`` (the contract), natural order."""
    if min(n_q, n_k) == 0:
        return np.zeros((heads, n_q, n_k), dtype=bool)
    if isinstance(layout, cuattn.Pattern):
        layout = layout.layout(n_q, n_k)
    h, q, k = np.ix_(np.arange(heads), np.arange(n_q), np.arange(n_k))
    try:
        return layout.allowed(h, q, k)
    except IndexError:
        if not (known("end-aligned-index") and layout.n_q > layout.n_ctx):
            raise
        STATS["mask/known:end-aligned-index"] += 1
        return layout.to_mask()


def scale_of(case: Case) -> float:
    return 1 / math.sqrt(case.shape.head_dim) if case.scale is None else case.scale


def expected_errors(case: Case, arrays: dict) -> list[tuple[type, str]]:
    """(exception type, argument the message names) of every documented refusal this case hits
    (README 'What is supported today' and 'Errors'); empty when it must succeed."""
    errors = []
    if case.dtype == "bfloat16" and (case.backend == "numpy" or not HAVE_ML_DTYPES):
        # NumPy has no bfloat16: the NumPy backend refuses it; torch's bfloat16 CPU tensors
        # reach the interpreter's kernels as ml_dtypes.bfloat16 (cuattn/adapters/dlpack.py)
        errors.append((TypeError, "q"))
    if case.backend == "interp":
        if case.dtype == "float64":
            errors.append((TypeError, "q"))
        if case.shape.head_dim not in KERNEL_HEAD_DIMS:
            errors.append((ValueError, "head_dim"))
        b = case.layout.blocksize
        if b not in KERNEL_BLOCKS and 16 % b:
            errors.append((ValueError, "blocksize"))
        # a permuted layout gathers its inputs into new arrays first: any strides will do
        if not permuted(case):
            errors += [(ValueError, n) for n, x in arrays.items() if not kernel_readable(x)]
    return errors


def more_queries(case: Case) -> bool:
    """A sequence with more queries than keys (end-aligned: rows before every key)."""
    seqs = case.seqs if case.path == "varlen" else [(case.shape.n_q, case.shape.n_k)]
    return any(a > b for a, b in seqs)


def permuted(case: Case) -> bool:
    """Whether the backend computes this case in a permuted token order: the inputs are then
    gathered into new arrays first, and any strides will do (README: the permutation is
    applied inside the call). A packed batch keeps its sequences' permutations when every
    sequence is self-attention (cu_seqlens_q == cu_seqlens_k)."""
    s = case.shape
    if case.path == "varlen":
        specs = case.layouts_per_seq or (case.layout,) * len(case.seqs)
        pairs = list(zip(specs, case.seqs, strict=True))
        if any(a != b for _, (a, b) in pairs):
            return False
        return any(a and has_perm(sp, s.heads, a, a) for sp, (a, _) in pairs)
    return min(s.n_q, s.n_k) > 0 and has_perm(case.layout, s.heads, s.n_q, s.n_k)


def has_perm(spec, heads: int, n_q: int, n_k: int) -> bool:
    if spec.kind != "named":
        return False
    try:
        return as_layout(fz.build_layout(spec, heads, n_q, n_k), n_q, n_k).perm is not None
    except (ValueError, TypeError):
        return False


NAME_PATTERNS = {"blocksize": r"block ?size", "head_dim": r"head_dim|head dim"}


def names(message: str, argument: str) -> bool:
    pattern = NAME_PATTERNS.get(argument, rf"(?<![A-Za-z_]){re.escape(argument)}(?![A-Za-z_])")
    return re.search(pattern, message) is not None


def is_empty(case: Case) -> bool:
    s = case.shape
    return min(s.batch, s.n_q, s.n_k) == 0 or any(
        min(x) == 0 for x in case.seqs if case.path == "varlen"
    )


def verdict(
    case: Case,
    outcome: Outcome,
    expected: list,
    ex: Expect | None,
    unchanged: bool,
    lse_shape: tuple,
) -> None:
    """Fail the case unless it met the contract (module docstring), or record the known defect
    it hit (narrow conditions, see KNOWN_DEFECTS)."""
    key = f"{case.path}/{case.front}/{case.backend}"
    assert unchanged, f"the call modified an input ({case.short()})"
    if outcome.error is not None:
        err = outcome.error
        msg = f"{type(err).__name__}: {err}"
        if known("end-aligned-index") and isinstance(err, IndexError) and more_queries(case):
            STATS[f"{key}/known:end-aligned-index"] += 1
            return
        if (
            known("interp-dlse-assert")
            and isinstance(err, AssertionError)
            and str(err) == "dlse"
            and case.backend == "interp"
            and permuted(case)
        ):
            STATS[f"{key}/known:interp-dlse-assert"] += 1
            return
        if (
            known("tape-grad-dtype")
            and isinstance(err, TypeError)
            and str(err).startswith("dout: dtype float32 differs")
            and (case.front, case.backend, case.dlse) == ("tape", "interp", True)
        ):
            STATS[f"{key}/known:tape-grad-dtype"] += 1
            return
        if not expected:
            raise AssertionError(f"unexpected error for a valid case: {msg}") from err
        ok = [(t, a) for t, a in expected if isinstance(err, t) and names(str(err), a)]
        assert ok, f"expected one of {expected} naming the argument, got {msg}"
        assert outcome.launches == 0, f"{outcome.launches} launches before the error: {msg}"
        STATS[f"{key}/refused"] += 1
        return
    # an empty call may return its empty result before any backend-specific check
    assert not expected or is_empty(case), f"expected a refusal {expected}, but it succeeded"
    problems = check_types(case, outcome, lse_shape) + compare_all(case, outcome.result, ex)
    tolerated = []
    if "lse-not-differentiable" in outcome.notes:
        problems.append(("lse-grad", "the lse of return_lse=True does not require grad"))
    if known("interp-empty-row-grad") and case.backend == "interp" and case.special:
        kept = [p for p in problems if not (p[0] == "spurious" and p[1].startswith(("dk", "dv")))]
        if len(kept) < len(problems):
            problems, tolerated = kept, tolerated + ["interp-empty-row-grad"]
    assert not problems, "\n".join(f"[{k}] {m}" for k, m in problems) + f"\n({case.short()})"
    for name in tolerated:
        STATS[f"{key}/known:{name}"] += 1
    STATS[f"{key}/ok"] += 1


def check_types(case: Case, outcome: Outcome, lse_shape: tuple) -> list[tuple[str, str]]:
    """The caller's own type, q's dtype (lse: float32, float64 for float64), lse's shape."""
    problems = []
    for name, (typ, dtype, shape) in outcome.types.items():
        # the tape's .grad holds arrays of the Tensor's array library (README: the tape)
        want_type = (
            np.ndarray if case.front == "tape" and name[0] == "d" else FRONT_TYPES[case.front]
        )
        if not issubclass(typ, want_type):
            problems.append(("type", f"{name}: {typ.__name__}, expected {want_type.__name__}"))
        want = acc_name(case.dtype) if name == "lse" else case.dtype
        if dtype != want:
            problems.append(("dtype", f"{name}: dtype {dtype}, expected {want}"))
        if name == "lse" and shape != lse_shape:
            problems.append(("shape", f"lse: shape {shape}, expected {lse_shape}"))
    return problems


def canonical_kv(case: Case) -> tuple:
    s = case.shape
    return (s.batch, s.heads, s.n_q, s.head_dim), (s.batch, s.kv_heads, s.n_k, s.head_dim)


def run_attention_case(case: Case) -> None:
    """plain / merge / cp: [B, H, T, d] inputs. Runs the case on its front and backend, then
    checks it (verdict)."""
    s = case.shape
    q_shape, kv_shape = canonical_kv(case)
    lse_shape = q_shape[:3]
    vals = draw_values(
        case, {"q": q_shape, "k": kv_shape, "v": kv_shape, "dout": q_shape, "dlse": lse_shape}
    )
    grad = case.grad
    q, k, v = (
        place(vals[n], case.dtype, m, case.front, grad)
        for n, m in zip("qkv", case.memory, strict=True)
    )
    dout = place(vals["dout"], case.dtype, case.dout_memory, case.front, False)
    dlse = vals["dlse"] if case.dlse else None
    scale = scale_of(case)
    spec = case.layout
    layout = None
    arrays = {"q": q.x, "k": k.x, "v": v.x}
    if case.path == "merge":  # the key sets x[:, :, idx] reach the kernels (numpy: any strides)
        halves = split_keys(case, s.n_k)
        arrays = {
            "q": q.x,
            **{
                n: take(p.x, idx)
                for n, p in (("k", k), ("v", v))
                for idx in halves
                if not kernel_readable(take(p.x, idx))
            },
        }
    elif case.path == "cp":  # the shards reach the kernels (zigzag's are copies)
        w, bal = case.opts["world"], case.opts["balance"]
        arrays = {n: [shard(x, r, w, bal) for r in range(w)] for n, x in arrays.items()}
        arrays = {
            n: next((y for y in ys if not kernel_readable(y)), ys[0]) for n, ys in arrays.items()
        }
    expected = expected_errors(case, arrays)
    if case.path == "cp" and all(
        sub is None
        for r in range(w)
        for sub in ring_plan(
            as_layout(fz.build_layout(spec, s.heads, s.n_q, s.n_k), s.n_q, s.n_k), r, w, bal
        ).steps
    ):
        expected = []  # no pair of shards has an active block: nothing reaches a backend
    kwargs = {"scale": case.scale, "backend": case.backend}
    want_lse = case.return_lse or case.dlse

    def build():
        return layout_obj(case, spec, s.n_q, s.n_k)

    if case.path == "plain":

        def f(q_, k_, v_):
            return cuattn.sparse_attention(
                q_, k_, v_, build(), recompute=case.recompute, return_lse=want_lse, **kwargs
            )
    elif case.path == "merge":
        keys = split_keys(case, s.n_k)

        def f(q_, k_, v_):
            lay = build()
            lay = lay.layout(s.n_q, s.n_k) if isinstance(lay, cuattn.Pattern) else lay
            parts = []
            for idx in keys:
                sub = restricted(lay, np.arange(s.n_q), idx)
                parts += list(
                    cuattn.sparse_attention(
                        take(q_, None),
                        take(k_, idx),
                        take(v_, idx),
                        sub,
                        return_lse=True,
                        recompute=case.recompute,
                        **kwargs,
                    )
                )
            out, lse = cuattn.merge_attention_states(*parts, backend=case.backend)
            return (out, lse) if want_lse else out
    else:  # cp
        world, balance = case.opts["world"], case.opts["balance"]

        def f(q_, k_, v_):
            return ring_emulated(build(), q_, k_, v_, world, balance, kwargs, case, want_lse)

    snaps = [snapshot(p) for p in (q, k, v, dout)]
    outcome = invoke(case, f, [q, k, v], dout, dlse)
    unchanged = snaps == [snapshot(p) for p in (q, k, v, dout)]
    ex = None
    if outcome.error is None:
        layout = build()
        mask = mask_of(layout, s.heads, s.n_q, s.n_k)
        ex = expect(
            case, q.values, k.values, v.values, mask, scale, dout.values if grad else None, dlse
        )
    verdict(case, outcome, expected, ex, unchanged, lse_shape)


def as_layout(layout, n_q: int, n_k: int):
    return layout.layout(n_q, n_k) if isinstance(layout, cuattn.Pattern) else layout


def take(x, idx):
    """x[:, :, idx] on any front (idx None: x itself)."""
    if idx is None:
        return x
    if isinstance(x, torch.Tensor):
        return x[:, :, torch.as_tensor(idx)]
    return x[:, :, idx]


def split_keys(case: Case, n_k: int) -> list[np.ndarray]:
    """Two disjoint, non-empty key sets covering every key."""
    rng = np.random.default_rng(case.seed + 1)
    kind = case.opts["split"]
    if kind == "halves":
        cut = int(rng.integers(1, n_k))
        return [np.arange(cut), np.arange(cut, n_k)]
    if kind == "interleaved":
        return [np.arange(0, n_k, 2), np.arange(1, n_k, 2)]
    side = rng.random(n_k) < 0.5
    side[0], side[-1] = True, False
    return [np.flatnonzero(side), np.flatnonzero(~side)]


def ring_emulated(layout, q, k, v, world, balance, kwargs, case, want_lse):
    """cuattn.distributed.ring_attention's computation, in one process: each rank's queries
    against every rank's keys on the ring plan's restricted layouts, merged by LSE."""
    if isinstance(layout, cuattn.Pattern):
        layout = layout.layout(case.shape.n_q, case.shape.n_k)
    outs, lses = [], []
    for rank in range(world):
        plan = ring_plan(layout, rank, world, balance)
        q_r = shard(q, rank, world, balance)
        out = lse = None
        for step, sub in enumerate(plan.steps):
            if sub is None:
                continue
            src = (rank - step) % world
            k_s, v_s = shard(k, src, world, balance), shard(v, src, world, balance)
            o, l_ = cuattn.sparse_attention(q_r, k_s, v_s, sub, return_lse=True, **kwargs)
            if out is None:
                out, lse = o, l_
            else:
                out, lse = cuattn.merge_attention_states(out, lse, o, l_, backend=kwargs["backend"])
        if out is None:  # no shard pair has an active block: 0 and -inf (gradients 0)
            acc = torch.float64 if case.dtype == "float64" else torch.float32
            if isinstance(q_r, torch.Tensor):
                out = q_r * 0
                lse = q_r.sum(-1).to(acc) * 0 + float("-inf")
            else:
                out = np.zeros_like(q_r)
                lse = np.full(q_r.shape[:3], -np.inf, dtype=acc_name(case.dtype))
        outs.append(out)
        lses.append(lse)
    out, lse = unshard(outs, balance), unshard(lses, balance)
    return (out, lse) if want_lse else out


def run_varlen_case(case: Case) -> None:
    s = case.shape
    heads, kv_heads, d = s.heads, s.kv_heads, s.head_dim
    cu_q = np.concatenate([[0], np.cumsum([x[0] for x in case.seqs])]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum([x[1] for x in case.seqs])]).astype(np.int32)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    vals = draw_values(
        case,
        {
            "q": (tq, heads, d),
            "k": (tk, kv_heads, d),
            "v": (tk, kv_heads, d),
            "dout": (tq, heads, d),
            "dlse": (heads, tq),
        },
    )
    q, k, v = (
        place(vals[n], case.dtype, m, case.front, case.grad)
        for n, m in zip("qkv", case.memory, strict=True)
    )
    dout = place(vals["dout"], case.dtype, "contiguous", case.front, False)
    dlse = vals["dlse"] if case.dlse else None
    specs = case.layouts_per_seq or (case.layout,) * len(case.seqs)
    want_lse = case.return_lse or case.dlse
    cu = {"torch": torch.from_numpy, "jax": jnp.asarray}.get(case.front, lambda x: x)
    kernel_views = {n: _packed_view(p.x) for n, p in zip("qkv", (q, k, v), strict=True)}
    expected = expected_errors(case, kernel_views)
    built: list = []

    def f(q_, k_, v_):
        if case.layouts_per_seq:
            layouts = [  # None for an empty sequence (it has no layout)
                layout_obj(case, sp, a, b) if a and b else None
                for sp, (a, b) in zip(specs, case.seqs, strict=True)
            ]
        else:

            def layouts(a, b):
                lay = layout_obj(case, case.layout, a, b)
                built.append(lay)
                return lay

        return cuattn.sparse_attention_varlen(
            q_,
            k_,
            v_,
            cu(cu_q),
            cu(cu_k),
            layouts,
            scale=case.scale,
            return_lse=want_lse,
            backend=case.backend,
        )

    snaps = [snapshot(p) for p in (q, k, v)]
    outcome = invoke(case, f, [q, k, v], dout, dlse)
    unchanged = snaps == [snapshot(p) for p in (q, k, v)]
    ex = None
    if outcome.error is None:
        mask = np.zeros((heads, tq, tk), dtype=bool)
        for i, (sp, (a, b)) in enumerate(zip(specs, case.seqs, strict=True)):
            if min(a, b) == 0:
                continue
            lay = layout_obj(case, sp, a, b)
            if lay.perm is not None:
                outcome.notes.append("permuted")
            mask[:, cu_q[i] : cu_q[i + 1], cu_k[i] : cu_k[i + 1]] = mask_of(lay, heads, a, b)
        to4 = lambda x: x.transpose(1, 0, 2)[None]  # noqa: E731  [T, H, d] -> [1, H, T, d]
        ex = expect(
            case,
            to4(q.values),
            to4(k.values),
            to4(v.values),
            mask,
            scale_of(case),
            to4(dout.values) if case.grad else None,
            None if dlse is None else dlse[None],
        )
        r = outcome.result
        outcome.result = Result(
            to4(r.out),
            None if r.lse is None else r.lse[None],
            {n: to4(g) for n, g in r.grads.items()},
        )
    verdict(case, outcome, expected, ex, unchanged, (heads, tq))


def _packed_view(x):
    """The [1, H, T, d] view of a packed [T, H, d] array that the backend reads."""
    if isinstance(x, cuattn.Tensor):
        x = x.data
    if isinstance(x, torch.Tensor):
        return x.unsqueeze(0).permute(0, 2, 1, 3)
    if isinstance(x, np.ndarray):
        return x[None].transpose(0, 2, 1, 3)
    return x


def run_decode_case(case: Case) -> None:
    s = case.shape
    page = case.opts["page_size"]
    batch, kv_heads, d = s.batch, s.kv_heads, s.head_dim
    steps = case.seqs
    shapes = {f"k{i}": (batch, kv_heads, st[-1], d) for i, st in enumerate(steps)}
    shapes.update({f"v{i}": (batch, kv_heads, st[-1], d) for i, st in enumerate(steps)})
    shapes["q"] = (batch, s.heads, s.n_q, d)
    vals = draw_values(case, shapes)
    dt = NP_DTYPES[case.dtype]
    expected = []
    if case.backend == "interp" and d not in KERNEL_HEAD_DIMS:
        expected.append((ValueError, "head_dim"))
    cache = None
    before = LAUNCHES.count
    outcome = Outcome()
    try:
        cache = cuattn.KVCache(batch, kv_heads, d, case.dtype, page_size=page)
        for i, st in enumerate(steps):
            cache.append(
                vals[f"k{i}"].astype(dt),
                vals[f"v{i}"].astype(dt),
                lengths=np.asarray(st[:-1], dtype=np.int64),
            )
        state = (cache.lengths.copy(), cache.positions().copy())
        r = cuattn.decode_attention(
            vals["q"].astype(dt),
            cache,
            scale=case.scale,
            return_lse=case.return_lse,
            backend=case.backend,
        )
        r = as_tuple(r)
        outcome.types = {n: describe(x) for n, x in zip(("out", "lse"), r, strict=False)}
        outcome.result = Result(to_f64(r[0]), to_f64(r[1]) if len(r) > 1 else None)
    except (ValueError, TypeError) as err:
        outcome.error = err
    outcome.launches = LAUNCHES.count - before
    unchanged = cache is None or (
        np.array_equal(state[0], cache.lengths) and np.array_equal(state[1], cache.positions())
    )
    ex = None
    if outcome.error is None:
        # the kept keys of sequence b: each append's first lengths[b] tokens, in order
        lengths = [sum(st[b] for st in steps) for b in range(batch)]
        kmax = max(lengths)
        keys, values = (np.zeros((batch, kv_heads, kmax, d)) for _ in range(2))
        mask = np.zeros((batch, s.heads, s.n_q, kmax), dtype=bool)
        for b in range(batch):
            ks = [vals[f"k{i}"][b, :, : st[b]] for i, st in enumerate(steps)]
            vs = [vals[f"v{i}"][b, :, : st[b]] for i, st in enumerate(steps)]
            keys[b, :, : lengths[b]] = np.concatenate(ks, axis=1)
            values[b, :, : lengths[b]] = np.concatenate(vs, axis=1)
            pos = np.arange(lengths[b] - s.n_q, lengths[b])
            mask[b, :, :, : lengths[b]] = np.arange(lengths[b])[None, :] <= pos[:, None]
        ex = expect(case, vals["q"], keys, values, mask, scale_of(case), None, None)
    # the decode path's lse: float32 from the kernels, the accumulation type from the reference
    if outcome.types.get("lse") and case.backend == "interp":
        typ, dtype, shape = outcome.types["lse"]
        outcome.types["lse"] = (typ, acc_name(case.dtype), shape)
    verdict(case, outcome, expected, ex, unchanged, (batch, s.heads, s.n_q))


# -- the tests ---------------------------------------------------------------------------------


@fuzz_settings("plain")
@given(fz.plain_cases())
def test_sparse_attention(case):
    with collecting(case):
        run_attention_case(case)


@fuzz_settings("varlen")
@given(fz.varlen_cases())
def test_varlen(case):
    with collecting(case):
        run_varlen_case(case)


@fuzz_settings("merge")
@given(fz.plain_cases(path="merge"))
def test_merge_of_disjoint_keys(case):
    if case.front == "tape":  # merge_attention_states takes arrays, not tape Tensors (README)
        case = Case(
            **{
                **case.__dict__,
                "front": "numpy",
                "grad": False,
                "dlse": False,
                "recompute": False,
                "dout_memory": "contiguous",
            }
        )
    if case.front == "jax" and case.grad:  # jax tracers are refused by merge (README)
        case = Case(**{**case.__dict__, "grad": False, "dlse": False})
    with collecting(case):
        run_attention_case(case)


@fuzz_settings("cp")
@given(fz.cp_cases())
def test_context_parallel_emulated(case):
    with collecting(case):
        run_attention_case(case)


@fuzz_settings("decode")
@given(fz.decode_cases())
def test_decode(case):
    with collecting(case):
        run_decode_case(case)


@fuzz_settings("errors")
@given(fz.error_cases())
def test_refusals(case):
    with collecting(case):
        run_error_case(case)


@fuzz_settings("layout")
@given(fz.layout_cases())
def test_layout_contract(shape_spec):
    check_layout_contract(*shape_spec)


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(fz.plain_cases(allow_empty=False, allow_special=False))
def test_oracle_is_cuattn_oracle(case):
    """The harness's oracle (NaN-aware, batched masks, dlse) is cuattn.tools.oracle on finite
    input: same out, lse, dq, dk, dv."""
    from cuattn.tools import oracle

    s = case.shape
    q_shape, kv_shape = canonical_kv(case)
    vals = draw_values(case, {"q": q_shape, "k": kv_shape, "v": kv_shape, "dout": q_shape})
    lay = fz.build_layout(case.layout, s.heads, s.n_q, s.n_k)
    mask = mask_of(lay, s.heads, s.n_q, s.n_k)
    q, k, v, dout = (vals[n] for n in ("q", "k", "v", "dout"))
    scale = scale_of(case)
    mine = dense(q, k, v, mask, scale, dout)
    strict = dense(q, k, v, mask, scale, dout, drop_masked=True)
    out, lse = oracle.dense_attention(q, k, v, mask, scale)
    grads = oracle.dense_attention_grads(q, k, v, dout, mask, scale)
    for ours in (mine, strict):
        np.testing.assert_allclose(ours.out, out, rtol=1e-10, atol=1e-12)
        np.testing.assert_array_equal(np.isfinite(ours.lse), np.isfinite(lse))
        np.testing.assert_allclose(ours.lse, lse, rtol=1e-10, atol=1e-12)
        for name, ref in zip(("dq", "dk", "dv"), grads, strict=True):
            np.testing.assert_allclose(ours.grads[name], ref, rtol=1e-9, atol=1e-10)


# -- refusals ---------------------------------------------------------------------------------

# corruption -> (exception type, the argument the message must name)
REFUSALS = {
    "kv_heads_not_dividing": (ValueError, "k"),
    "k_dtype": (TypeError, "k"),
    "v_shape": (ValueError, "v"),
    "layout_lengths": (ValueError, "layout"),
    "layout_heads": (ValueError, "layout"),
    "scale_nan": (ValueError, "scale"),
    "scale_inf": (ValueError, "scale"),
    "scale_bool": (TypeError, "scale"),
    "rank": (ValueError, "q"),
    "layout_type": (TypeError, "layout"),
    "blocksize_bad_pattern": (ValueError, "blocksize"),
    "pattern_options": (ValueError, "local_attn_ctx"),
}


def corrupted_call(case: Case, backend: str):
    """(inputs, call) for the case with its corruption: call() makes the layout (a Pattern's
    construction included) and calls sparse_attention."""
    s = case.shape
    q_shape, kv_shape = canonical_kv(case)
    c = case.corruption
    shapes = {"q": q_shape, "k": kv_shape, "v": kv_shape}
    if c == "kv_heads_not_dividing":
        shapes["k"] = shapes["v"] = (s.batch, s.heads + 1, s.n_k, s.head_dim)
    if c == "v_shape":
        shapes["v"] = (s.batch, s.kv_heads, s.n_k + 1, s.head_dim)
    if c == "rank":
        shapes["q"] = q_shape[1:]
    vals = draw_values(case, shapes)
    placed = {n: place(vals[n], case.dtype, "contiguous", case.front, False) for n in shapes}
    if c == "k_dtype":
        other = "float64" if case.dtype != "float64" else "float32"
        placed["k"] = place(round_to(vals["k"], other), other, "contiguous", case.front, False)
    n_q, n_k, heads = s.n_q, s.n_k, s.heads
    scale = {"scale_nan": math.nan, "scale_inf": -math.inf, "scale_bool": True}.get(c, case.scale)

    def call():
        if c == "blocksize_bad_pattern":
            layout = cuattn.Pattern("all", heads, blocksize=0)
        elif c == "pattern_options":
            layout = cuattn.Pattern("fixed", heads, 16, local_attn_ctx=24)
        elif c == "layout_type":
            layout = np.ones((heads, 1, 1), dtype=bool)
        else:
            lay_heads, lay_k = heads + (c == "layout_heads"), n_k + (c == "layout_lengths")
            layout = as_layout(fz.build_layout(case.layout, lay_heads, n_q, lay_k), n_q, lay_k)
        q, k, v = (placed[n].x for n in "qkv")
        return cuattn.sparse_attention(
            q, k, v, layout, scale=scale, backend=backend, return_lse=case.return_lse
        )

    return placed, call


def run_error_case(case: Case) -> None:
    """The same refusal, naming the argument, on both CPU backends, before any launch, with
    every input unchanged."""
    want_type, argument = REFUSALS[case.corruption]
    raised = {}
    for backend in ("numpy", "interp"):
        placed, call = corrupted_call(case, backend)
        snaps = {n: snapshot(p) for n, p in placed.items()}
        before = LAUNCHES.count
        try:
            call()
        except (ValueError, TypeError) as err:
            raised[backend] = err
        else:
            raise AssertionError(f"{case.corruption} on {backend}: the call succeeded")
        assert LAUNCHES.count == before, f"{case.corruption} on {backend}: launched first"
        assert snaps == {n: snapshot(p) for n, p in placed.items()}, "an input was modified"
        err = raised[backend]
        assert isinstance(err, want_type) and names(str(err), argument), (
            f"{case.corruption} on {backend}: expected {want_type.__name__} naming "
            f"{argument!r}, got {type(err).__name__}: {err}"
        )
    assert type(raised["numpy"]) is type(raised["interp"])
    if case.corruption in ("pattern_options", "blocksize_bad_pattern"):
        # a Pattern checks its arguments when it is built, not at its first call
        try:
            if case.corruption == "pattern_options":
                cuattn.Pattern("fixed", case.shape.heads, 16, local_attn_ctx=24)
            else:
                cuattn.Pattern("all", case.shape.heads, blocksize=0)
        except (ValueError, TypeError):
            pass
        else:
            raise AssertionError(f"{case.corruption}: Pattern(...) accepted its arguments")
    STATS[f"errors/{case.front}/refused"] += 1


# -- the layout contract ----------------------------------------------------------------------


def independent_mask(spec, heads: int, n_q: int, n_k: int) -> np.ndarray | None:
    """bool [heads, n_q, n_k] from the element rules as docs/design.md §2 and the README state
    them (tests/helpers/oracle.py), end-aligned (row i is position i + n_k - n_q)."""
    from tests.helpers import oracle as rules

    o, b = spec.opts, spec.blocksize
    pos = np.arange(n_q)[:, None] + (n_k - n_q)
    key = np.arange(n_k)[None, :]
    if spec.kind == "custom":
        blocks = np.random.default_rng(spec.seed).random((heads, -(-n_q // b), -(-n_k // b)))
        blocks = blocks < spec.density
        for row in spec.empty_rows:
            if row < blocks.shape[1]:
                blocks[:, row] = False
        rows = np.arange(n_q)
        m = blocks[:, rows[:, None] // b, key // b]
        fn = fz.custom_rule(spec, n_q, n_k)
        if fn is not None:
            h, q, k = np.ix_(np.arange(heads), rows, np.arange(n_k))
            m = m & np.broadcast_to(fn(h, q, k), m.shape)
        return m
    causal = o["causal"]
    mode = spec.mode
    if mode == "all":
        m = (key <= pos) if causal else np.ones((n_q, n_k), bool)
        return np.broadcast_to(m, (heads, n_q, n_k))
    if mode == "local":
        w = o["local_attn_ctx"]
        m = ((key <= pos) & (pos - key < w)) if causal else (np.abs(pos - key) < w)
        return np.broadcast_to(m, (heads, n_q, n_k))
    if mode == "strided":
        square = rules.rule_strided(n_k, heads, o["local_attn_ctx"], causal)
    elif mode == "fixed":
        square = rules.rule_fixed(
            n_k, heads, b, o["local_attn_ctx"], o["num_verts"], o["vertsize"], causal
        )
    elif mode == "longformer":
        square = rules.rule_longformer(n_k, heads, o["local_attn_ctx"], o["global_tokens"], causal)
    elif mode == "document":
        doc = np.repeat(np.arange(len(o["doc_lengths"])), o["doc_lengths"])
        g = np.arange(n_k)
        square = doc[g][:, None] == doc[g][None, :]
        if causal:
            square &= g[None, :] <= g[:, None]
        square = np.broadcast_to(square, (heads, n_k, n_k))
    elif mode in ("bigbird", "variable"):  # defined on (seeded) blocks: the square layout's
        lay = cuattn.make_layout(mode, n_k, heads, b, **o)
        square = rules.rule_blocks(lay.blocks, b, n_k, causal)
    else:
        return None
    out = np.zeros((heads, n_q, n_k), dtype=bool)
    rows = pos[:, 0] >= 0  # rows before every key see nothing on these patterns
    out[:, rows] = square[:, pos[rows, 0]]
    return out


def dense_block_rows_before_keys(spec, lay) -> bool:
    """The narrow condition of the known defect 'dense-block-rows-before-keys'."""
    return (
        known("dense-block-rows-before-keys")
        and spec.kind == "named"
        and spec.mode in ("fixed", "bigbird", "variable")
        and not spec.opts["causal"]
        and lay.n_q > lay.n_ctx
        and bool(lay.blocks.all())
    )


def first_difference(a: np.ndarray, b: np.ndarray) -> str:
    at = tuple(int(i) for i in np.argwhere(a != b)[0])
    return f"{int((a != b).sum())} elements differ, first (h, q, k) = {at}: {a[at]} vs {b[at]}"


def check_layout_contract(shape: Shape, spec) -> None:
    """allowed() == to_mask() == the documented element rule; CSR and CSC describe exactly the
    active blocks; every allowed element lies in an active block (computed order)."""
    heads, n_q, n_k = shape.heads, shape.n_q, shape.n_k
    lay = fz.build_layout(spec, heads, n_q, n_k)
    if isinstance(lay, cuattn.Pattern):
        lay = lay.layout(n_q, n_k)
    assert (lay.heads, lay.n_q, lay.n_ctx) == (heads, n_q, n_k)
    allowed = mask_of(lay, heads, n_q, n_k)
    to_mask = lay.to_mask()
    assert np.array_equal(allowed, to_mask), (
        f"allowed vs to_mask: {first_difference(allowed, to_mask)}"
    )
    rule = independent_mask(spec, heads, n_q, n_k)
    if rule is not None and dense_block_rows_before_keys(spec, lay):
        rows = slice(n_q - n_k)  # these rows see every key instead of none (known defect)
        if not np.array_equal(allowed[:, rows], rule[:, rows]):
            STATS["layout/known:dense-block-rows-before-keys"] += 1
            allowed, rule = allowed[:, n_q - n_k :], rule[:, n_q - n_k :]
    if rule is not None:
        assert np.array_equal(allowed, rule), (
            f"{spec.mode or spec.rule} {spec.opts} b={spec.blocksize} n_q={n_q} n_k={n_k}: "
            f"layout vs documented rule: {first_difference(allowed, rule)}"
        )
    b, nbq, nb = lay.blocksize, lay.num_q_blocks, lay.num_blocks
    for h in range(heads):
        rows = np.repeat(np.arange(nbq), np.diff(lay.row_ptr[h]))
        cols = lay.col_idx[lay.row_ptr[h, 0] : lay.row_ptr[h, -1]]
        csr = np.zeros((nbq, nb), bool)
        csr[rows, cols] = True
        assert np.array_equal(csr, lay.blocks[h]) and len(rows) == lay.nnz[h]
        kcols = np.repeat(np.arange(nb), np.diff(lay.col_ptr[h]))
        krows = lay.row_idx[lay.col_ptr[h, 0] : lay.col_ptr[h, -1]]
        csc = np.zeros((nbq, nb), bool)
        csc[krows, kcols] = True
        assert np.array_equal(csc, lay.blocks[h])
    hh, qq, kk = np.ix_(np.arange(heads), np.arange(n_q), np.arange(n_k))
    computed = lay.allowed(hh, qq, kk, natural=False)
    outside = computed & ~lay.blocks[hh, qq // b, kk // b]
    assert not outside.any(), "an allowed element outside every active block"
