"""Hypothesis strategies for the differential fuzzer (tests/fuzz/test_differential.py).

One strategy per dimension of a case: front, backend, dtype, shape, layout, memory (strides and
offsets), special values, options; the composite ``*_cases`` strategies combine them per path.
Array values are not drawn element by element: a case carries a seed and the harness draws its
arrays with NumPy, so a derandomized run is reproducible and cheap.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

import cuattn
from cuattn.backends import geometry

MODES = tuple(cuattn.layout.MODES)  # every registered named pattern
KERNEL_HEAD_DIMS = tuple(geometry.HEAD_DIMS)
KERNEL_BLOCKS = tuple(geometry.BLOCK_SIZES)
KERNEL_DTYPES = tuple(geometry.DTYPES)

# CI mode keeps the interpreter to the kernel instantiations that compile once into a small set
# of libraries (each (kernel file, dtype, head dim) is one g++ run of ~4 s on a cold cache);
# long mode (CUATTN_FUZZ_EXAMPLES / HYPOTHESIS_PROFILE=long) uses every head dim.
LONG = bool(os.environ.get("CUATTN_FUZZ_EXAMPLES")) or os.environ.get("HYPOTHESIS_PROFILE") == (
    "long"
)
INTERP_HEAD_DIMS = KERNEL_HEAD_DIMS if LONG else (16, 32)
INTERP_DTYPES = ("float32", "float16")

FRONTS = ("numpy", "torch", "jax", "tape")
GRAD_FRONTS = ("torch", "jax", "tape")


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    kv_heads: int
    n_q: int
    n_k: int
    head_dim: int


@dataclass(frozen=True)
class LayoutSpec:
    """A named pattern (``make_layout`` / ``Pattern``) or a custom ``Layout.from_blocks``."""

    kind: str  # "named" | "custom"
    blocksize: int
    mode: str | None = None
    options: tuple = ()  # sorted (name, value) pairs, make_layout's keyword arguments
    as_pattern: bool = False  # pass a cuattn.Pattern instead of a Layout
    density: float = 1.0  # custom: share of active blocks
    empty_rows: tuple = ()  # custom: query-block rows with no active block
    rule: str = "none"  # custom: the element rule (mask_fn), see CUSTOM_RULES
    seed: int = 0

    @property
    def opts(self) -> dict:
        return dict(self.options)


@dataclass(frozen=True)
class Special:
    """Special values written into one input array at a few seeded positions."""

    kind: str  # nan | inf | -inf | huge | denormal
    target: str  # q | k | v
    count: int


@dataclass(frozen=True)
class Case:
    path: str  # plain | varlen | merge | decode | cp
    front: str  # numpy | torch | jax | tape
    backend: str  # numpy | interp
    dtype: str  # float64 | float32 | float16 | bfloat16
    shape: Shape
    layout: LayoutSpec
    memory: tuple = ("contiguous", "contiguous", "contiguous")  # q, k, v
    dout_memory: str = "contiguous"
    special: Special | None = None
    scale: float | None = None
    return_lse: bool = False
    grad: bool = False
    dlse: bool = False  # the loss also reaches the lse (its gradient is checked)
    recompute: bool = False
    amplitude: float = 1.0
    seed: int = 0
    seqs: tuple = ()  # varlen: ((n_q, n_k), ...); decode: per-sequence lengths per append
    extra: tuple = ()  # path options as (name, value) pairs
    corruption: str | None = None  # errors: what was broken on purpose
    layouts_per_seq: tuple = field(default=())  # varlen: one LayoutSpec per sequence, or ()

    @property
    def opts(self) -> dict:
        return dict(self.extra)

    def short(self) -> str:
        return (
            f"{self.path}/{self.front}/{self.backend}/{self.dtype} {self.shape} "
            f"{self.layout.kind}:{self.layout.mode or self.layout.rule}"
        )


# -- one strategy per dimension ------------------------------------------------------------------


def fronts(grad_only: bool = False) -> st.SearchStrategy[str]:
    return st.sampled_from(GRAD_FRONTS if grad_only else FRONTS)


def backends(interp_share: int = 6) -> st.SearchStrategy[str]:
    """'numpy' mostly; the CPU kernel interpreter (slow: ~30 ms a launch) one case in
    ``interp_share``."""
    return st.integers(0, interp_share - 1).map(lambda i: "interp" if i == 0 else "numpy")


def dtypes(front: str, backend: str) -> st.SearchStrategy[str]:
    if backend == "interp":
        # float64 has no kernel (a named TypeError); bfloat16 on the CPU is refused (TypeError)
        choices = ["float32"] * 4 + ["float16"] * 3 + ["float64"]
        if front == "torch":
            choices.append("bfloat16")
        return st.sampled_from(choices)
    choices = ["float64"] * 4 + ["float32"] * 3 + ["float16"] * 2
    if front == "torch":
        choices.append("bfloat16")
    return st.sampled_from(choices)


def head_dims(backend: str) -> st.SearchStrategy[int]:
    if backend == "interp":
        # mostly kernel head dims; sometimes one without a kernel (a named ValueError)
        return st.one_of(
            st.sampled_from(INTERP_HEAD_DIMS),
            st.sampled_from(INTERP_HEAD_DIMS),
            st.sampled_from((8, 24, 33)),
        )
    return st.sampled_from((1, 2, 3, 5, 8, 16, 24, 32, 48, 64, 80, 96, 128))


def block_sizes(backend: str) -> st.SearchStrategy[int]:
    if backend == "interp":
        # kernel blocks, coarsened small blocks (8, 4, 2, 1), and ones with no kernel
        return st.sampled_from((16, 16, 32, 32, 64, 8, 4, 2, 1, 3, 12, 24))
    return st.sampled_from((1, 2, 3, 4, 5, 7, 8, 16, 32, 64))


def lengths(max_len: int) -> st.SearchStrategy[int]:
    """Sequence lengths: 1, tiny, ragged, up to max_len (0 separately, see ``shapes``)."""
    return st.one_of(
        st.just(1), st.integers(2, min(9, max_len)), st.integers(min(10, max_len), max_len)
    )


@st.composite
def shapes(draw, backend: str, max_len: int, allow_empty: bool = True) -> Shape:
    kv_heads = draw(st.integers(1, 3 if backend == "numpy" else 2))
    group = draw(st.sampled_from((1, 1, 2, 3, 4)))
    heads = kv_heads * group
    batch = draw(st.sampled_from((1, 1, 2, 3)))
    n_k = draw(lengths(max_len))
    n_q = draw(st.one_of(st.just(n_k), st.just(n_k), lengths(max_len)))
    if allow_empty and draw(st.integers(0, 19)) == 0:  # empty sizes: SDPA returns empty results
        which = draw(st.sampled_from(("batch", "n_q", "n_k", "both")))
        batch = 0 if which == "batch" else batch
        n_q = 0 if which in ("n_q", "both") else n_q
        n_k = 0 if which in ("n_k", "both") else n_k
    return Shape(batch, heads, kv_heads, n_q, n_k, draw(head_dims(backend)))


def memories(front: str) -> st.SearchStrategy[str]:
    """How an input array sits in memory (see test_differential.place)."""
    if front == "jax":
        return st.just("contiguous")  # jax arrays have no strides
    kinds = ["contiguous"] * 6 + [
        "transposed",  # a [B, T, H, d] projection viewed as [B, H, T, d]
        "fused",  # k or v as a view of one [B, T, 2, H, d] tensor
        "rows_strided",  # every other row of a longer buffer
        "padded",  # rows of a wider buffer, cut to head_dim
        "offset_aligned",  # a flat view at a 16-byte offset
        "offset",  # a flat view one element in (not 16-byte aligned)
        "last_axis",  # every other element along head_dim (kernels refuse)
        "broadcast",  # one batch entry repeated by a zero stride
    ]
    if front in ("numpy", "tape"):
        kinds.append("reversed")  # a negative stride along time (torch has none)
    return st.sampled_from(kinds)


def specials(dtype: str) -> st.SearchStrategy[Special | None]:
    special = st.builds(
        Special,
        kind=st.sampled_from(("nan", "inf", "-inf", "huge", "denormal")),
        target=st.sampled_from(("q", "k", "v")),
        count=st.integers(1, 3),
    )
    # in a subset of cases (one in six)
    return st.one_of(*([st.none()] * 5), special)


def scales() -> st.SearchStrategy[float | None]:
    return st.one_of(
        st.none(),
        st.none(),
        st.floats(0.05, 2.0),
        st.floats(-2.0, -0.05),  # negative scale: the softmax favours the smallest scores
        st.sampled_from((0.0, 8.0, -8.0)),
    )


def amplitudes() -> st.SearchStrategy[float]:
    return st.sampled_from((1.0, 1.0, 0.1, 3.0))


# -- layouts ----------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def named_options(draw, mode: str, n_k: int, heads: int, b: int) -> dict:
    """Valid make_layout arguments for ``mode`` at n_k keys (a pattern's own constraints)."""
    opts: dict = {"causal": draw(st.booleans())}
    nb = -(-n_k // b)
    if mode in ("local", "longformer"):
        opts["local_attn_ctx"] = draw(st.integers(1, n_k + 3))
    if mode == "longformer":
        opts["global_tokens"] = tuple(
            sorted(draw(st.sets(st.integers(0, n_k - 1), max_size=min(3, n_k))))
        )
    if mode == "strided":
        opts["local_attn_ctx"] = draw(st.integers(1, n_k + 2))
        opts["transpose"] = draw(st.sampled_from((None, None, False)))
    if mode == "fixed":
        g = draw(st.integers(1, 4))
        vertsize = draw(st.sampled_from(_divisors(g)))
        num_verts = draw(st.sampled_from([d for d in _divisors(heads) if d * vertsize <= g]))
        opts.update(local_attn_ctx=g * b, num_verts=num_verts, vertsize=vertsize)
    if mode == "bigbird":
        opts.update(
            num_global_blocks=draw(st.integers(0, 2)),
            num_window_blocks=draw(st.integers(0, 4)),
            num_random_blocks=draw(st.integers(0, 2)),
            seed=draw(st.integers(0, 3)),
        )
    if mode == "variable":
        opts["local_window_blocks"] = tuple(
            draw(st.lists(st.integers(1, nb), min_size=1, max_size=3))
        )
        opts["global_block_indices"] = tuple(
            sorted(draw(st.sets(st.integers(0, nb - 1), max_size=min(2, nb))))
        )
        opts["num_random_blocks"] = draw(st.integers(0, 1))
        opts["seed"] = draw(st.integers(0, 3))
        if not opts["causal"]:
            opts["horizontal_global_attention"] = draw(st.booleans())
    if mode == "document":
        cuts = sorted(draw(st.sets(st.integers(1, max(1, n_k - 1)), max_size=3)))
        cuts = [c for c in cuts if 0 < c < n_k]
        edges = [0, *cuts, n_k]
        opts["doc_lengths"] = tuple(int(e - s) for s, e in zip(edges, edges[1:], strict=False))
    return opts


CUSTOM_RULES = ("none", "none", "causal_end", "mod3", "even_keys", "hash", "band", "nothing")


@st.composite
def custom_specs(draw, b: int) -> LayoutSpec:
    return LayoutSpec(
        kind="custom",
        blocksize=b,
        density=draw(st.sampled_from((0.0, 0.15, 0.5, 0.85, 1.0))),
        empty_rows=tuple(draw(st.lists(st.integers(0, 7), max_size=2))),
        rule=draw(st.sampled_from(CUSTOM_RULES)),
        seed=draw(st.integers(0, 2**16)),
    )


@st.composite
def layout_specs(draw, shape: Shape, b: int, named_only: bool = False) -> LayoutSpec:
    """A named pattern (three in four) or a random block layout with a random element rule."""
    empty = min(shape.n_q, shape.n_k) == 0
    if not named_only and not empty and draw(st.integers(0, 3)) == 0:
        return draw(custom_specs(b))
    mode = draw(st.sampled_from(MODES))
    n_k = max(shape.n_k, 1)
    opts = draw(named_options(mode, n_k, shape.heads, b))
    # a Pattern builds its Layout for each call's lengths (the only way to name a 0 length)
    as_pattern = empty or draw(st.integers(0, 3)) == 0
    return LayoutSpec("named", b, mode, tuple(sorted(opts.items())), as_pattern=as_pattern)


@st.composite
def permuted_strided(draw, b: int, max_len: int = 48) -> tuple[int, LayoutSpec]:
    """(n, spec) of a strided layout built on the transposed order (n = s * b * m)."""
    s = draw(st.integers(1, 4))
    n = s * b * draw(st.integers(1, max(1, max_len // (s * b))))
    opts = {"causal": draw(st.booleans()), "local_attn_ctx": s, "transpose": None}
    as_pattern = draw(st.booleans())
    return n, LayoutSpec("named", b, "strided", tuple(sorted(opts.items())), as_pattern=as_pattern)


def build_layout(spec: LayoutSpec, heads: int, n_q: int, n_k: int):
    """The Layout (or Pattern) a spec describes, for heads and lengths."""
    if spec.kind == "named":
        opts = spec.opts
        if spec.as_pattern:
            return cuattn.Pattern(spec.mode, heads, spec.blocksize, **opts)
        return cuattn.make_layout(spec.mode, n_k, heads, spec.blocksize, n_q=n_q, **opts)
    b = spec.blocksize
    rng = np.random.default_rng(spec.seed)
    nbq, nb = -(-n_q // b), -(-n_k // b)
    blocks = rng.random((heads, nbq, nb)) < spec.density
    for row in spec.empty_rows:
        if row < nbq:
            blocks[:, row] = False
    return cuattn.Layout.from_blocks(
        blocks, b, mask_fn=custom_rule(spec, n_q, n_k), n_ctx=n_k, n_q=n_q
    )


def custom_rule(spec: LayoutSpec, n_q: int, n_k: int):
    """The vectorised mask_fn(h, q, k) of a custom spec (q is the query row, as from_blocks
    documents; its position is q + n_k - n_q)."""
    off, seed = n_k - n_q, spec.seed
    rules = {
        "none": None,
        "causal_end": lambda h, q, k: k <= q + off,
        "mod3": lambda h, q, k: (q + 2 * k + h) % 3 != 0,
        "even_keys": lambda h, q, k: (k + 0 * q) % 2 == 0,
        "hash": lambda h, q, k: ((q * 7919 + k * 104729 + h * 1299709 + seed) % 11) < 6,
        "band": lambda h, q, k: np.abs(q + off - k) < 3,
        "nothing": lambda h, q, k: np.zeros(np.broadcast(h, q, k).shape, dtype=bool),
    }
    return rules[spec.rule]


# -- options -------------------------------------------------------------------------------------


@st.composite
def options(draw, front: str) -> dict:
    grad = front in GRAD_FRONTS and draw(st.integers(0, 3)) > 0
    return_lse = draw(st.booleans())
    return {
        "scale": draw(scales()),
        "return_lse": return_lse,
        "grad": grad,
        "dlse": grad and return_lse and draw(st.booleans()),
        "recompute": grad and draw(st.integers(0, 3)) == 0,
        "dout_memory": draw(st.sampled_from(("contiguous", "contiguous", "transposed")))
        if front in ("torch", "tape")
        else "contiguous",
    }


# -- cases, per path ------------------------------------------------------------------------------


@st.composite
def plain_cases(
    draw, path: str = "plain", allow_empty: bool = True, allow_special: bool = True
) -> Case:
    """sparse_attention (path 'plain') or the merge of two disjoint key sets (path 'merge')."""
    front = draw(fronts())
    backend = draw(backends())
    dtype = draw(dtypes(front, backend))
    special = draw(specials(dtype)) if allow_special else None
    b = draw(block_sizes(backend))
    # special values go through the broadcast (NaN-aware) oracle: keep those cases small
    max_len = 24 if special is not None else (40 if backend == "interp" else 64)
    shape = draw(shapes(backend, max_len, allow_empty=allow_empty and path == "plain"))
    if special is not None and backend == "numpy":
        shape = Shape(
            shape.batch, shape.heads, shape.kv_heads, shape.n_q, shape.n_k, min(shape.head_dim, 32)
        )
    if path == "merge" and shape.n_k < 2:
        shape = Shape(shape.batch, shape.heads, shape.kv_heads, shape.n_q, 2, shape.head_dim)
    if path == "plain" and draw(st.integers(0, 9)) == 0:
        n, spec = draw(permuted_strided(b, max_len))
        shape = Shape(max(shape.batch, 1), shape.heads, shape.kv_heads, n, n, shape.head_dim)
    else:
        spec = draw(layout_specs(shape, b))
    opts = draw(options(front))
    extra = ()
    if path == "merge":
        extra = (("split", draw(st.sampled_from(("halves", "random", "interleaved")))),)
        opts["return_lse"] = True  # merging needs each side's lse
    return Case(
        path=path,
        front=front,
        backend=backend,
        dtype=dtype,
        shape=shape,
        layout=spec,
        memory=tuple(draw(memories(front)) for _ in range(3)),
        special=special,
        amplitude=draw(amplitudes()),
        seed=draw(st.integers(0, 2**32 - 1)),
        extra=extra,
        **opts,
    )


@st.composite
def factory_specs(draw, b: int, heads: int) -> LayoutSpec:
    """A spec whose options hold at every length: the callable (n_q, n_k) -> Layout of a
    packed batch."""
    if draw(st.integers(0, 3)) == 0:
        return draw(custom_specs(b))
    mode = draw(st.sampled_from(("all", "local", "strided", "fixed", "bigbird")))
    opts = draw(named_options(mode, 8, heads, b))
    opts.pop("transpose", None)
    return LayoutSpec("named", b, mode, tuple(sorted(opts.items())))


@st.composite
def varlen_cases(draw) -> Case:
    front = draw(fronts())
    backend = draw(backends())
    dtype = draw(dtypes(front, backend))
    special = draw(specials(dtype))
    b = draw(block_sizes(backend))
    base = draw(shapes(backend, 8, allow_empty=False))
    heads, kv_heads = base.heads, base.kv_heads
    seqs = []
    for _ in range(draw(st.integers(1, 4))):
        n_k = draw(lengths(24))
        n_q = draw(st.one_of(st.just(n_k), lengths(24)))
        if draw(st.integers(0, 14)) == 0:  # an empty sequence
            n_q, n_k = draw(st.sampled_from(((0, 0), (0, n_k), (n_q, 0))))
        seqs.append((n_q, n_k))
    spec = draw(factory_specs(b, heads))
    per_seq: tuple = ()
    if draw(st.integers(0, 4)) == 0:
        # a sequence whose strided layout is computed in the transposed (permuted) order
        s = draw(st.integers(1, 3))
        n = s * b * draw(st.integers(1, max(1, 24 // (s * b))))
        seqs[draw(st.integers(0, len(seqs) - 1))] = (n, n)
        opts = {"causal": draw(st.booleans()), "local_attn_ctx": s}
        spec = LayoutSpec("named", b, "strided", tuple(sorted(opts.items())))
    elif draw(st.booleans()):  # one layout per sequence, each drawn for its own lengths
        per_seq = tuple(
            draw(layout_specs(Shape(1, heads, kv_heads, q, k, 1), b)) if min(q, k) > 0 else spec
            for q, k in seqs
        )
        per_seq = tuple(LayoutSpec(**{**x.__dict__, "as_pattern": False}) for x in per_seq)
    total_q, total_k = sum(s[0] for s in seqs), sum(s[1] for s in seqs)
    opts = draw(options(front))
    return Case(
        path="varlen",
        front=front,
        backend=backend,
        dtype=dtype,
        shape=Shape(
            1,
            heads,
            kv_heads,
            total_q,
            total_k,
            min(base.head_dim, 32) if special and backend == "numpy" else base.head_dim,
        ),
        layout=spec,
        layouts_per_seq=per_seq,
        seqs=tuple(seqs),
        memory=tuple(draw(st.sampled_from(VARLEN_MEMORIES)) for _ in range(3)),
        special=special,
        amplitude=draw(amplitudes()),
        seed=draw(st.integers(0, 2**32 - 1)),
        **{**opts, "dout_memory": "contiguous"},
    )


# packed [total, heads, head_dim] arrays: as they are, a head slice of a fused qkv projection,
# one element in, or every other element of head_dim
VARLEN_MEMORIES = ("contiguous", "contiguous", "contiguous", "fused", "offset", "last_axis")


@st.composite
def decode_cases(draw) -> Case:
    backend = draw(backends(interp_share=3))
    dtype = draw(
        st.sampled_from(INTERP_DTYPES if backend == "interp" else ("float64", "float32", "float16"))
    )
    shape = draw(shapes(backend, 40, allow_empty=False))
    batch = max(shape.batch, 1)
    appends = draw(st.integers(1, 3))
    steps = []
    for _ in range(appends):
        t = draw(st.integers(1, 20))
        steps.append(tuple(draw(st.integers(0, t)) for _ in range(batch)) + (t,))
    totals = [sum(step[b] for step in steps) for b in range(batch)]
    if min(totals) == 0:  # every sequence needs a token before a query
        steps[0] = tuple(max(1, x) for x in steps[0][:-1]) + (steps[0][-1],)
        totals = [sum(step[b] for step in steps) for b in range(batch)]
    t_q = draw(st.integers(1, min(min(totals), 4)))
    return Case(
        path="decode",
        front="numpy",
        backend=backend,
        dtype=dtype,
        shape=Shape(batch, shape.heads, shape.kv_heads, t_q, max(totals), shape.head_dim),
        layout=LayoutSpec("named", 16, "all"),
        seqs=tuple(steps),
        scale=draw(scales()),
        return_lse=draw(st.booleans()),
        amplitude=draw(amplitudes()),
        seed=draw(st.integers(0, 2**32 - 1)),
        extra=(("page_size", draw(st.sampled_from((1, 2, 3, 4, 16)))),),
    )


@st.composite
def cp_cases(draw) -> Case:
    """Context parallelism emulated in one process: every rank's ring steps on its restricted
    layouts (ring_plan), merged by LSE, unsharded."""
    front = draw(st.sampled_from(("numpy", "torch", "torch")))
    backend = draw(backends(interp_share=8))
    dtype = draw(dtypes(front, backend).filter(lambda d: d != "bfloat16"))
    world = draw(st.integers(2, 4))
    balance = draw(st.sampled_from(("contiguous", "zigzag")))
    chunks = world * (2 if balance == "zigzag" else 1)
    b = draw(block_sizes(backend))
    n = chunks * draw(st.integers(1, max(1, 48 // chunks)))
    base = draw(shapes(backend, 8, allow_empty=False))
    shape = Shape(min(base.batch, 2), base.heads, base.kv_heads, n, n, base.head_dim)
    spec = draw(layout_specs(shape, b))
    spec = LayoutSpec(**{**spec.__dict__, "as_pattern": False})
    opts = draw(options(front))
    opts.update(return_lse=True, recompute=False)
    return Case(
        path="cp",
        front=front,
        backend=backend,
        dtype=dtype,
        shape=shape,
        layout=spec,
        amplitude=draw(amplitudes()),
        seed=draw(st.integers(0, 2**32 - 1)),
        extra=(("world", world), ("balance", balance)),
        **{**opts, "dout_memory": "contiguous"},
    )


CORRUPTIONS = (
    "kv_heads_not_dividing",
    "k_dtype",
    "v_shape",
    "layout_lengths",
    "layout_heads",
    "scale_nan",
    "scale_inf",
    "scale_bool",
    "rank",
    "layout_type",
    "blocksize_bad_pattern",
    "pattern_options",
)


@st.composite
def error_cases(draw) -> Case:
    """A valid plain case with one thing broken on purpose (see CORRUPTIONS)."""
    case = draw(plain_cases(allow_empty=False, allow_special=False))
    corruption = draw(st.sampled_from(CORRUPTIONS))
    layout = case.layout
    if corruption in ("pattern_options", "blocksize_bad_pattern"):
        layout = LayoutSpec("named", 16, "fixed", (("local_attn_ctx", 32),), as_pattern=True)
    if corruption in ("layout_lengths", "layout_heads") and layout.kind == "named":
        # a layout for other lengths or heads (options that hold at any length and heads)
        layout = LayoutSpec("named", layout.blocksize, "all", (("causal", True),))
    return Case(
        **{
            **case.__dict__,
            "layout": layout,
            "corruption": corruption,
            "grad": False,
            "dlse": False,
            "memory": ("contiguous",) * 3,
        }
    )


@st.composite
def layout_cases(draw) -> tuple[Shape, LayoutSpec]:
    """A layout and its lengths for the layout contract test (no arrays)."""
    b = draw(st.sampled_from((1, 2, 3, 4, 5, 8, 16)))
    if draw(st.integers(0, 5)) == 0:
        n, spec = draw(permuted_strided(b))
        spec = LayoutSpec(**{**spec.__dict__, "as_pattern": False})
        return Shape(1, draw(st.integers(1, 4)), 1, n, n, 1), spec
    heads = draw(st.integers(1, 4))
    n_k = draw(lengths(80))
    n_q = draw(st.one_of(st.just(n_k), lengths(80)))
    shape = Shape(1, heads, 1, n_q, n_k, 1)
    spec = draw(layout_specs(shape, b))
    return shape, LayoutSpec(**{**spec.__dict__, "as_pattern": draw(st.booleans())})
