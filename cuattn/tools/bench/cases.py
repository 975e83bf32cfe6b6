"""Benchmark cases: which patterns, sizes, dtypes and directions a sweep measures.

A case fixes one layout (pattern + T + block size) and one problem (batch, heads, head dim,
dtype, direction). The token budget per case is constant (batch * T = TOKENS), and heads * head_dim
is constant (MODEL_DIM), as in the FlashAttention papers' benchmarks, so every T costs the same
memory traffic for Q/K/V and the FLOPs grow linearly with T.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

TOKENS = 16 * 1024
MODEL_DIM = 2048
DRY_RUN_TOKENS = 512
DRY_RUN_MODEL_DIM = 64
# Pattern parameters in tokens, the same at every T, so density falls as T grows.
LOCAL_WINDOW = 512
# Transposed (block-diagonal) strided layouts need (T / STRIDE) % blocksize == 0: 16 keeps every
# swept T >= 1024 at b = 64 in that form.
STRIDE = 16
FIXED_GROUP = 128
WINDOW_LEFT, WINDOW_RIGHT = 4095, 512  # window pattern: keys q - 4095 .. q (+ 512 bidirectional)
LONGFORMER_WINDOW = 256
DOCUMENTS = 8  # documents packed per sequence in the document (varlen) pattern
GQA_GROUP = 4  # query heads per kv head in the GQA cases (32 query / 8 kv heads at d = 64)
DIRECTIONS = ("fwd", "fwd+bwd")


def document_lengths(n_ctx: int, count: int = DOCUMENTS) -> tuple[int, ...]:
    """``count`` uneven document lengths summing to n_ctx (1, 2, ..., count parts of it), so
    boundaries fall inside blocks, as packed variable-length batches do."""
    weights = list(range(1, count + 1))
    lengths = [n_ctx * w // sum(weights) for w in weights]
    lengths[-1] += n_ctx - sum(lengths)
    return tuple(lengths)


@dataclass(frozen=True)
class BenchPattern:
    """A named layout: cuattn.make_layout(mode, ..., causal=causal, **kwargs)."""

    label: str
    mode: str
    causal: bool
    kwargs: tuple[tuple[str, Any], ...] = field(default_factory=tuple)

    @property
    def dense(self) -> bool:
        return self.mode == "all"

    def make_layout(self, n_ctx: int, heads: int, blocksize: int) -> Any:
        from cuattn.layout import make_layout

        extra = {"doc_lengths": document_lengths(n_ctx)} if self.mode == "document" else {}
        return make_layout(
            self.mode,
            n_ctx=n_ctx,
            heads=heads,
            blocksize=blocksize,
            causal=self.causal,
            **dict(self.kwargs),
            **extra,
        )


def _pattern(label: str, mode: str, causal: bool, **kwargs: Any) -> BenchPattern:
    return BenchPattern(label, mode, causal, tuple(sorted(kwargs.items())))


DENSE_CAUSAL = _pattern("dense-causal", "all", True)
DENSE_FULL = _pattern("dense", "all", False)
SPARSE_PATTERNS = (
    _pattern("local", "local", True, local_attn_ctx=LOCAL_WINDOW),
    _pattern("local-bidir", "local", False, local_attn_ctx=LOCAL_WINDOW),
    _pattern("strided", "strided", True, local_attn_ctx=STRIDE),
    _pattern("strided-bidir", "strided", False, local_attn_ctx=STRIDE),
    _pattern("fixed", "fixed", True, local_attn_ctx=FIXED_GROUP, num_verts=2, vertsize=1),
    _pattern("fixed-bidir", "fixed", False, local_attn_ctx=FIXED_GROUP, num_verts=2, vertsize=1),
    # FlashAttention's window_size: Mistral's causal 4096-token window, and an asymmetric one
    _pattern("window-causal", "window", True, window_left=WINDOW_LEFT, window_right=0),
    _pattern("window", "window", False, window_left=WINDOW_LEFT, window_right=WINDOW_RIGHT),
    _pattern("longformer", "longformer", False, local_attn_ctx=LONGFORMER_WINDOW),
    _pattern("longformer-causal", "longformer", True, local_attn_ctx=LONGFORMER_WINDOW),
    _pattern("bigbird", "bigbird", False),
    _pattern("bigbird-causal", "bigbird", True),
    _pattern("variable", "variable", False),
    _pattern("variable-causal", "variable", True),
    _pattern("document", "document", True),  # the packed layout of a varlen batch
)
ALL_PATTERNS = (DENSE_CAUSAL, DENSE_FULL, *SPARSE_PATTERNS)


@dataclass(frozen=True)
class BenchCase:
    pattern: BenchPattern
    n_ctx: int
    head_dim: int
    dtype: str  # "float16" | "bfloat16" | "float32"
    blocksize: int
    direction: str  # "fwd" | "fwd+bwd"
    batch: int
    heads: int
    kv_heads: int = 0  # 0: as many as query heads; fewer: GQA/MQA

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def name(self) -> str:
        gqa = f" gqa {self.heads}/{self.kv}" if self.kv != self.heads else ""
        return (
            f"{self.pattern.label} T={self.n_ctx} d={self.head_dim} {self.dtype} "
            f"b={self.blocksize} {self.direction}{gqa}"
        )

    @property
    def problem_key(self) -> tuple[int, int, str, int, str, int]:
        """Cases sharing this key are compared with the same dense-causal baseline."""
        return (
            self.n_ctx,
            self.head_dim,
            self.dtype,
            self.blocksize,
            self.direction,
            self.kv_heads,
        )

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["pattern"] = {
            "label": self.pattern.label,
            "mode": self.pattern.mode,
            "causal": self.pattern.causal,
            "kwargs": dict(self.pattern.kwargs),
        }
        return d


@dataclass(frozen=True)
class Sweep:
    patterns: tuple[BenchPattern, ...]
    n_ctx: tuple[int, ...]
    head_dims: tuple[int, ...]
    dtypes: tuple[str, ...]
    blocksizes: tuple[int, ...]
    directions: tuple[str, ...] = DIRECTIONS
    tokens: int = TOKENS
    model_dim: int = MODEL_DIM
    # Extra dtypes measured for the dense patterns only (keeps the full sweep inside its budget).
    dense_only_dtypes: tuple[str, ...] = ()
    # Sparse patterns only at these sequence lengths / head dims (empty: at all of them).
    sparse_n_ctx: tuple[int, ...] = ()
    sparse_head_dims: tuple[int, ...] = ()
    # Dense causal also measured with this many query heads per kv head (GQA), where the sparse
    # patterns are; 1: not.
    gqa_group: int = 1

    def _measures(self, pattern: BenchPattern, dtype: str, head_dim: int, n_ctx: int) -> bool:
        if pattern.dense:
            return True
        return (
            dtype in self.dtypes
            and (not self.sparse_n_ctx or n_ctx in self.sparse_n_ctx)
            and (not self.sparse_head_dims or head_dim in self.sparse_head_dims)
        )

    def cases(self) -> Iterator[BenchCase]:
        """Grouped by problem size, dense causal first in each group so sparse cases find their
        baseline; a time budget that cuts the sweep short then loses whole sizes, not one
        direction of every size."""
        for dtype in (*self.dtypes, *self.dense_only_dtypes):
            for head_dim in self.head_dims:
                for blocksize in self.blocksizes:
                    for n_ctx in self.n_ctx:
                        for pattern in self.patterns:
                            if not self._measures(pattern, dtype, head_dim, n_ctx):
                                continue
                            heads = max(1, self.model_dim // head_dim)
                            groups = [1]
                            # GQA where the sparse patterns are measured (the sweep's budget)
                            gqa_here = self._measures(SPARSE_PATTERNS[0], dtype, head_dim, n_ctx)
                            if pattern == DENSE_CAUSAL and self.gqa_group > 1 and gqa_here:
                                groups.append(self.gqa_group)
                            for group, direction in itertools.product(groups, self.directions):
                                yield BenchCase(
                                    pattern,
                                    n_ctx,
                                    head_dim,
                                    dtype,
                                    blocksize,
                                    direction,
                                    batch=max(1, self.tokens // n_ctx),
                                    heads=heads,
                                    kv_heads=heads // group if group > 1 else 0,
                                )


# Quick: one size, and only patterns whose element rules (causal, none, window) FlexAttention
# compiles once per direction; each further rule kind costs it a compile of 10-30 s.
QUICK = Sweep(
    patterns=(
        DENSE_CAUSAL,
        DENSE_FULL,
        SPARSE_PATTERNS[0],
        SPARSE_PATTERNS[2],
        SPARSE_PATTERNS[4],
        SPARSE_PATTERNS[8],
    ),
    n_ctx=(4096,),
    head_dims=(128,),
    dtypes=("bfloat16",),
    blocksizes=(64,),
    gqa_group=GQA_GROUP,
)
# Full: what fits one 10-minute GPU call (~8 s a case on an H100, FlexAttention's compiles
# included): dense at three lengths and both head dims, every sparse pattern at one length.
# Head dim 128 first, so a run cut short by its budget loses d = 64, not the headline cases.
FULL = Sweep(
    patterns=ALL_PATTERNS,
    n_ctx=(2048, 8192, 16384),
    head_dims=(128, 64),
    dtypes=("bfloat16",),
    blocksizes=(64,),
    sparse_n_ctx=(8192,),
    sparse_head_dims=(128,),
    gqa_group=GQA_GROUP,
)
# CPU dry run: exercises every code path of the harness in seconds, on the NumPy backend, with
# pattern sizes scaled down so the layouts are really sparse at T = 128.
DRY_RUN = Sweep(
    patterns=(
        DENSE_CAUSAL,
        _pattern("local", "local", True, local_attn_ctx=32),
        _pattern("strided", "strided", True, local_attn_ctx=16),
        _pattern("bigbird", "bigbird", False),
        _pattern("document", "document", True),
    ),
    n_ctx=(256,),
    head_dims=(32,),
    dtypes=("float16",),
    blocksizes=(32,),
    tokens=DRY_RUN_TOKENS,
    model_dim=DRY_RUN_MODEL_DIM,
    gqa_group=2,
)
SWEEPS = {"quick": QUICK, "full": FULL, "dry-run": DRY_RUN}
