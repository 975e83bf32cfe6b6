"""`cuattn check`: every pattern x dtype x block size x shape against the float64 oracle.

Runs on the best backend present (the CUDA kernels on a GPU, else the kernels on the CPU
interpreter, else the NumPy backend) unless ``--backend`` says otherwise, prints one table row
per case (pattern, shape, dtype, backend, max relative error forward/backward, verdict) and
returns non-zero if any case fails. This is the project's main correctness job.
"""

from __future__ import annotations

import importlib.util
import math
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from cuattn import backends as _backend
from cuattn import dynamic
from cuattn._util import ceil_div, host_array
from cuattn.backends.call import AttentionCall
from cuattn.backends.cuda_runtime import why_no_cuda
from cuattn.backends.geometry import BLOCK_SIZES, HEAD_DIMS
from cuattn.backends.geometry import DTYPES as KERNEL_DTYPES
from cuattn.layout import make_layout
from cuattn.layout.layout import Layout
from cuattn.serving import KVCache, decode_attention, policies
from cuattn.tools.oracle import (
    GRAD_FLOOR,
    dense_attention,
    dense_attention_grads,
    kept_attention,
    rel_err,
)

# Relative error allowed per dtype (docs/design.md: fp32 ~1e-5, half types ~1e-2).
TOLERANCE = {"float64": 1e-10, "float32": 2e-5, "float16": 1e-2, "bfloat16": 2e-2}
DTYPES = {
    "numpy": ("float64", "float32", "float16"),
    "interp": KERNEL_DTYPES,
    "cuda": KERNEL_DTYPES,
}
HEADS = 2
BATCH = 1
SEED = 0
SIZES = ("quick", "standard", "full")
# The sweep a plain `cuattn check` runs: the interpreter runs a thread per CUDA thread, so it
# gets the quick sweep (under a minute on 2 CPU cores); the others are fast enough for more.
DEFAULT_SIZE = {"cuda": "standard", "interp": "quick", "numpy": "standard"}
# Ragged-length head dim per block size in the standard sweep: every head dim appears.
STANDARD_RAGGED_HEAD_DIM = {16: 32, 32: 96, 64: 128, 128: 96}
# Seconds per case measured on 2 CPU cores (the interpreter's first compile included) and a guess
# for a GPU: only for the "about" in the first line.
SECONDS_PER_CASE = {"cuda": 0.05, "interp": 1.4, "numpy": 0.05}
TOPK_PATTERN, TOPK_BLOCKS = "topk (chosen)", 2  # the data-chosen case: blocks kept per row
# The serving case: a paged KVCache (pages of `blocksize` tokens) kept by HeavyHitters, ragged
# prompts, then decode steps of t_q = n_q queries from HEADS query heads on one kv head; each
# step's attention (the split-KV kernels on interp/cuda) against the float64 oracle over
# exactly the tokens the cache keeps. There is no backward ("-").
DECODE_PATTERN, DECODE_STEPS = "decode (paged)", 3


@dataclass(frozen=True)
class Case:
    pattern: str
    mode: str
    kwargs: tuple
    blocksize: int
    n_ctx: int
    head_dim: int
    dtype: str
    n_q: int = 0  # queries (0: n_ctx); fewer or more than the keys are end-aligned
    kv_heads: int = HEADS  # fewer than HEADS: GQA/MQA
    batch: int = BATCH

    @property
    def queries(self) -> int:
        return self.n_q or self.n_ctx

    @property
    def shape(self) -> str:
        """[B,H,T,D]; [B,H/Hkv,Tq:Tk,D] for the LLM shapes."""
        heads = f"{HEADS}/{self.kv_heads}" if self.kv_heads != HEADS else str(HEADS)
        time = f"{self.queries}:{self.n_ctx}" if self.n_q else str(self.n_ctx)
        return f"[{self.batch},{heads},{time},{self.head_dim}]"

    def layout(self) -> Layout:
        """The case's layout (a top-k case's is chosen from its inputs, in run_case)."""
        if self.mode == "custom":
            return _custom_layout(self.n_ctx, self.blocksize)
        n_q = self.n_q or None
        return make_layout(
            self.mode, self.n_ctx, HEADS, self.blocksize, n_q=n_q, **dict(self.kwargs)
        )


def _custom_layout(n_ctx: int, blocksize: int) -> Layout:
    """A user layout with a data-defined element rule, and one block row left empty."""
    nb = ceil_div(n_ctx, blocksize)
    rng = np.random.default_rng(SEED)
    blocks = np.tril(rng.random((HEADS, nb, nb)) < 0.6)
    blocks[:, :, 0] = True
    blocks[:, 1] = False

    def rule(h: np.ndarray, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        return (k <= q) & ((q * 7 + k * 3 + h) % 5 != 0)

    return Layout.from_blocks(blocks, blocksize, mask_fn=rule, n_ctx=n_ctx)


def _patterns(blocksize: int) -> list[tuple[str, str, dict]]:
    b = blocksize
    return [
        ("all", "all", {}),
        ("all bidir", "all", {"causal": False}),
        ("local", "local", {"local_attn_ctx": 2 * b - 3}),
        ("local bidir", "local", {"local_attn_ctx": b + 5, "causal": False}),
        ("strided", "strided", {"local_attn_ctx": 4}),
        ("strided natural", "strided", {"local_attn_ctx": 5, "transpose": False}),
        ("fixed", "fixed", {"local_attn_ctx": 2 * b, "num_verts": 2, "vertsize": 1}),
        ("longformer", "longformer", {"local_attn_ctx": b // 2 + 1, "global_tokens": (0, 3)}),
        ("bigbird", "bigbird", {"num_random_blocks": 1}),
        ("variable", "variable", {"local_window_blocks": (1, 2)}),
        ("custom", "custom", {}),
    ]


def _shapes(blocksize: int, size: str) -> list[tuple[int, int]]:
    """(n_ctx, head_dim) pairs per block size: a whole number of blocks, then a ragged length."""
    if size == "quick":
        return [(4 * blocksize, 64)]
    if size == "full":
        return [(n, d) for n in (4 * blocksize, 4 * blocksize - 5) for d in HEAD_DIMS]
    return [(4 * blocksize, 64), (4 * blocksize - 5, STANDARD_RAGGED_HEAD_DIM[blocksize])]


def _llm_shape_cases(dtype: str) -> list[Case]:
    """MQA with fewer and with more queries than keys, a packed-documents layout on 8-blocks
    (run as 16-blocks with bitmasks on the kernels), a top-k layout chosen from the case's
    own q and k where they live (by the kernels of kernels/layout_build.cu on the interpreter
    and on a GPU: a DeviceLayout), and decode steps over a paged KV cache."""
    local = (("causal", False), ("local_attn_ctx", 40))
    return [
        Case("all mqa q<k", "all", (), 16, 64, 64, dtype, n_q=27, kv_heads=1),
        Case("local mqa q>k", "local", local, 64, 100, 64, dtype, n_q=150, kv_heads=1),
        Case("document b8", "document", (("doc_lengths", (9, 30, 1, 24)),), 8, 64, 64, dtype),
        Case(TOPK_PATTERN, "topk", (), 32, 4 * 32 - 5, 64, dtype, kv_heads=1),
        Case(DECODE_PATTERN, "decode", (), 16, 150, 64, dtype, n_q=2, kv_heads=1, batch=2),
    ]


def cases(backend: str, size: str = "standard") -> Iterator[Case]:
    """Every pattern x dtype x block size x a few shapes (``size``: quick, standard, full),
    then the LLM shapes (GQA/MQA, queries != keys, documents on 8-blocks) per dtype."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    dtypes = [d for d in DTYPES[backend] if d != "bfloat16" or _has_bfloat16()]
    blocksizes = (16, 64) if size == "quick" else BLOCK_SIZES
    for dtype in dtypes:
        for b in blocksizes:
            for name, mode, kw in _patterns(b):
                for n, d in _shapes(b, size):
                    yield Case(name, mode, tuple(sorted(kw.items())), b, n, d, dtype)
        yield from _llm_shape_cases(dtype)


def _has_bfloat16() -> bool:
    """NumPy and CuPy spell bfloat16 through ml_dtypes (installed with the cuda extras)."""
    return importlib.util.find_spec("ml_dtypes") is not None


def no_cuda_device() -> str | None:
    """Why the cuda backend cannot run here (None: a CUDA device is present)."""
    return why_no_cuda()


def best_backend() -> tuple[str, str]:
    """(backend, why it was picked)."""
    no_gpu = no_cuda_device()
    if no_gpu is None:
        return "cuda", "a CUDA device is present"
    if shutil.which("g++"):
        return "interp", f"{no_gpu}; g++ runs the kernels on the CPU interpreter"
    return "numpy", f"{no_gpu} and no g++: the NumPy reference backend"


def _to_backend(x: np.ndarray, backend: str, dtype: str) -> Any:
    if dtype == "bfloat16":
        import ml_dtypes

        x = x.astype(ml_dtypes.bfloat16)
    else:
        x = x.astype(dtype)
    return _backend.device_module("cuda", "x").asarray(x) if backend == "cuda" else x


def _to_host(x: Any) -> np.ndarray:
    return host_array(x).astype(np.float64)


def _run_decode(case: Case, backend: str) -> float:
    """The worst relative error of DECODE_STEPS decode steps over a paged KVCache on
    ``backend`` (a CuPy cache on cuda), each against float64 attention over exactly the kept
    tokens. HeavyHitters evicts by the scores the decodes add, so the kept set has holes."""
    rng = np.random.default_rng(SEED)
    like = _to_backend(np.zeros(1), backend, "float32") if backend == "cuda" else None
    cache = KVCache(
        case.batch,
        case.kv_heads,
        case.head_dim,
        case.dtype,
        page_size=case.blocksize,
        policy=policies.HeavyHitters(case.n_ctx * 3 // 4, case.queries),
        like=like,
    )
    kv_shape = (case.batch, case.kv_heads, case.n_ctx, case.head_dim)
    k, v = (_to_backend(rng.standard_normal(kv_shape), backend, case.dtype) for _ in "kv")
    cache.append(k, v, lengths=case.n_ctx - 13 * np.arange(case.batch))
    worst = 0.0
    for _ in range(DECODE_STEPS):
        step = (case.batch, case.kv_heads, case.queries, case.head_dim)
        k, v = (_to_backend(rng.standard_normal(step), backend, case.dtype) for _ in "kv")
        cache.append(k, v)
        q_shape = (case.batch, HEADS, case.queries, case.head_dim)
        q = _to_backend(rng.standard_normal(q_shape), backend, case.dtype)
        out = _to_host(decode_attention(q, cache, backend=backend))
        if np.isnan(out).any():
            return float("nan")
        worst = max(worst, rel_err(out, kept_attention(cache, q)))
    return worst


def run_case(case: Case, backend: str) -> tuple[float, float | None]:
    """(forward error, backward error or None) of one case, relative to the float64 oracle."""
    if case.mode == "decode":
        return _run_decode(case, backend), None
    rng = np.random.default_rng(SEED)
    q_shape = (BATCH, HEADS, case.queries, case.head_dim)
    kv_shape = (BATCH, case.kv_heads, case.n_ctx, case.head_dim)
    host = [rng.standard_normal(s) for s in (q_shape, kv_shape, kv_shape, q_shape)]
    q, k, v, dout = (_to_backend(x, backend, case.dtype) for x in host)
    # The oracle sees exactly the values the backend sees (after rounding to the dtype).
    q64, k64, v64, do64 = (_to_host(x) for x in (q, k, v, dout))
    scale = 1.0 / np.sqrt(case.head_dim)
    if case.mode == "topk":
        layout = dynamic.topk_blocks(q[0], k[0], case.blocksize, TOPK_BLOCKS, backend=backend)
    else:
        layout = case.layout()
    call = AttentionCall(layout, scale, backend=backend)
    out, lse = _backend.forward(q, k, v, call)
    grads = _backend.backward(q, k, v, out, lse, dout, None, call)
    mask = layout.to_mask()
    ref_out, _ = dense_attention(q64, k64, v64, mask, scale)
    ref_grads = dense_attention_grads(q64, k64, v64, do64, mask, scale)
    out_h = _to_host(out)
    if np.isnan(out_h).any() or any(np.isnan(_to_host(g)).any() for g in grads):
        return float("nan"), float("nan")
    fwd = rel_err(out_h, ref_out)
    bwd = max(rel_err(_to_host(g), r, GRAD_FLOOR) for g, r in zip(grads, ref_grads, strict=True))
    return fwd, bwd


# Exit status of a check that could not start (the backend asked for is not on this machine).
EXIT_NO_DEVICE = 2


def main(backend: str | None = None, size: str | None = None, out=sys.stdout) -> int:
    if backend is None:
        backend, why = best_backend()
    else:
        why = "chosen with --backend"
    missing = no_cuda_device() if backend == "cuda" else None
    if missing is not None:  # before any estimate or case: nothing could run
        fallback, _ = best_backend()
        print(
            f"cuattn check: --backend cuda needs a CUDA device, but {missing} here; run "
            f"`cuattn check` (picks {fallback} on this machine) or --backend interp/numpy",
            file=sys.stderr,
        )
        return EXIT_NO_DEVICE
    size = size or DEFAULT_SIZE[backend]
    todo = list(cases(backend, size))
    estimate = len(todo) * SECONDS_PER_CASE[backend]
    print(
        f"cuattn check: backend {backend} ({why}); {size} sweep, {len(todo)} cases, "
        f"about {estimate:.0f} s",
        file=out,
    )
    if "bfloat16" in DTYPES[backend] and not _has_bfloat16():
        print(
            "bfloat16 cases skipped: pip install ml_dtypes (or the cuda extras) for them", file=out
        )
    width = len(str(len(todo)))
    header = f"{'':<{2 * width + 3}} {'pattern':<16} {'shape [B,H,T,D]':<20} {'block':>5} "
    header += f"{'dtype':<9} {'fwd rel err':>11} {'bwd rel err':>11}  verdict"
    print(header, file=out)
    print("-" * len(header), file=out)
    failures = 0
    worst: dict[str, float] = {}
    start = time.perf_counter()
    for i, case in enumerate(todo, 1):
        fwd, bwd = run_case(case, backend)
        errors = [fwd] if bwd is None else [fwd, bwd]
        tol = TOLERANCE[case.dtype]
        ok = all(e <= tol for e in errors)  # NaN compares false: a NaN fails
        failures += not ok
        # NaN counts as infinitely wrong in the summary (it has failed the case already).
        error = max(math.inf if e != e else e for e in errors)
        worst[case.dtype] = max(worst.get(case.dtype, 0.0), error)
        bwd_text = "-" if bwd is None else f"{bwd:.2e}"
        print(
            f"[{i:>{width}}/{len(todo)}] {case.pattern:<16} {case.shape:<20} {case.blocksize:>5} "
            f"{case.dtype:<9} {fwd:>11.2e} {bwd_text:>11}  {'ok' if ok else 'FAIL'}",
            file=out,
            flush=True,
        )
    elapsed = time.perf_counter() - start
    print(f"\nbackend {backend}, {size} sweep: {len(todo)} cases in {elapsed:.1f} s", file=out)
    for dtype, error in worst.items():
        tolerance = TOLERANCE[dtype]
        print(
            f"  {dtype:<9} worst relative error {error:.2e} (tolerance {tolerance:.0e})", file=out
        )
    verdict = "PASS" if not failures else "FAIL"
    print(f"{verdict}: {len(todo) - failures} passed, {failures} failed", file=out)
    return 1 if failures else 0
