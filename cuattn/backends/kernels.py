"""The attention kernels' launch sequences, shared by the CUDA and the interpreter backends.

Forward:  attn_fwd over CSR rows -> (out, lse).
Backward: attn_bwd_preprocess (delta = rowsum(dO * O)); attn_bwd_dkdv over CSC columns;
          attn_bwd_dq over CSR rows. No atomics, so every backward is bit-identical run to run.
Inputs q, k, v and dout are read in place at any strides with contiguous 16-byte aligned rows (a
[B, T, H, d] tensor viewed as [B, H, T, d] needs no copy); other strides are refused with a
ValueError before any launch. Outputs are contiguous.
Shapes: q, out, dout [batch, heads, n_q, d]; k, v [batch, kv_heads, n_k, d] (GQA/MQA when
kv_heads < heads: the kernels index the shared kv head, nothing is repeated in memory; dK and dV
come out per query head and attn_bwd_sum_groups sums each group in float, in head order). A
layout of block size 8 runs on the 16-block kernels through its coarsened form
(layout.derived.coarsened).
Geometry and argument order of every launch come from cuattn.backends.geometry. A subclass of
:class:`KernelBackend` says only where arrays live and how a launch runs, so the two kernel
backends cannot drift apart in what they launch.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from cuattn.backends import dropout, geometry, layout_build
from cuattn.backends.call import AttentionCall, ScoreMods, ScoreOperands, rel_max_distance
from cuattn.backends.geometry import KernelConfig
from cuattn.backends.tensor_map import Swizzle, TensorMap
from cuattn.layout.derived import coarsened
from cuattn.layout.device import DeviceLayout
from cuattn.layout.layout import Layout

# The layout's index arrays every kernel backend places where its kernels read them.
LAYOUT_FIELDS = ("row_ptr", "col_idx", "row_mask", "col_ptr", "row_idx", "col_mask", "mask_table")
# cp.async and ldmatrix move 16-byte chunks: every q/k/v/out/dout row must start 16-byte aligned.
COPY_ALIGNMENT = 16
ROW_STRIDE_LIMIT = 2**31  # the kernels step between rows with a 32-bit element stride
_COARSENED: weakref.WeakKeyDictionary[Layout, Layout] = weakref.WeakKeyDictionary()
# A paired forward CTA (geometry.FWD_PAIRED_BLOCK) takes one step per tile of the union of its two
# query blocks' rows, the warps of a block without that tile idle: pairs are used when the union
# has at most this many more steps than the two rows hold on average (dense causal: 0.8 % at
# 128 blocks, 6 % at 16; strided and BigBird layouts: up to 100 %).
PAIRED_MAX_EXTRA_STEPS = 0.10
_PAIRED: weakref.WeakKeyDictionary[Layout, bool] = weakref.WeakKeyDictionary()
# The sm_90a backward's claim order and dQ ranks of a layout, by (key blocks a CTA, kv group).
_BACKWARD_ORDER: weakref.WeakKeyDictionary[
    Layout, dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]
] = weakref.WeakKeyDictionary()
# attn_fwd_sm90_persistent's work lists of host layouts (_layout_work_list)
_WORK_LISTS: weakref.WeakKeyDictionary[Layout, dict[tuple, geometry.Sm90WorkList]] = (
    weakref.WeakKeyDictionary()
)
# The dense score bias's element strides, in the order of its axes [batch, heads, n_q, n_k].
_SCORE_BIAS_STRIDES = tuple(f"score_bias_{axis}_stride" for axis in ("batch", "head", "q", "k"))


def _dropout_values(mods: ScoreMods, seed_words: Any, xp: Any) -> dict[str, Any]:
    """The block kernels' dropout arguments (kernels/common/philox.cuh): the threshold (0: off),
    the seed (below 2^63: a signed 64-bit parameter as it is), or the array ``seed_words`` that
    holds it (8 bytes, read by the kernels, never by the host), and the kept probabilities'
    scale. A one-element stand-in takes the array's place when the seed is a value."""
    words = {"dropout_seed_words": xp.zeros(1, xp.uint32), "use_seed_words": 0}
    if seed_words is not None:
        words = {"dropout_seed_words": _seed_words(seed_words, xp), "use_seed_words": 1}
    if not mods.dropout_p:
        return {"dropout_threshold": 0, "dropout_seed": 0, "dropout_scale": 1.0, **words}
    return {
        "dropout_threshold": dropout.threshold(mods.dropout_p),
        "dropout_seed": mods.dropout_seed,
        "dropout_scale": 1.0 / (1.0 - mods.dropout_p),
        **words,
    }


# log2(e) in float32, as the kernels' LOG2E (kernels/common/score_tile.cuh)
_LOG2E = np.float32(1.4426950408889634)


def panel_map(x: Any, address: int, rows: int) -> tuple[TensorMap, int]:
    """The rank-4 tensor map attn_fwd_sm90 reads x [batch, heads, n, d] through (its data at
    `address`), with a box of one 64-column panel of `rows` rows and the 128-byte swizzle
    (geometry.SM90_*), and the column where x's rows start in it. A swizzled map's base must be
    128-byte aligned; x's need only be 16-byte aligned (KernelBackend._check_alignment), so the
    map starts at the 128-byte boundary at or before x's first element and its columns that many
    elements further in: every element it reads is x's (the boxes start at that column, and the
    map ends where x's rows end)."""
    itemsize = x.dtype.itemsize
    col = address % geometry.SM90_MAP_ALIGNMENT // itemsize
    batch, heads, n, d = x.shape
    batch_stride, head_stride, row_stride = x.strides[:3]
    # the stride of a length-1 axis is never used: any valid one will do (the rows': a row's
    # width in whole 16-byte units)
    row_bytes = -(-(d + col) * itemsize // 16) * 16
    row_stride = row_stride if n > 1 else row_bytes
    head_stride = head_stride if heads > 1 else row_stride * n
    batch_stride = batch_stride if batch > 1 else head_stride * heads
    map_ = TensorMap(
        global_address=address - col * itemsize,
        dims=(d + col, n, heads, batch),
        strides=(row_stride, head_stride, batch_stride),
        box=(geometry.SM90_PANEL_BYTES // itemsize, rows, 1, 1),
        element_bytes=itemsize,
        swizzle=Swizzle.B128,
    )
    return map_, col


def _tma_describes(x: Any) -> bool:
    """Whether a TMA tensor map can describe x [batch, heads, rows, d] (its strides checked by
    KernelBackend._check_strides): not when an axis of length > 1 has stride 0 (a broadcast
    view, e.g. one kv head expanded), which a tensor map's strides do not express; attn_fwd
    reads those."""
    return all(stride > 0 for stride, size in zip(x.strides, x.shape, strict=True) if size > 1)


def _seed_words(seed: Any, xp: Any) -> Any:
    """A seed array (call.check_seed_words: 8 bytes) as the two 32-bit words the kernels read,
    low first: a view of the same memory."""
    seed = xp.ascontiguousarray(seed).reshape(-1)
    return seed if seed.dtype.itemsize == 4 else seed.view(xp.uint32)


def _score_bias_by_key(bias: Any) -> bool:
    """Whether a score bias is broadcast over the queries ([..., 1, n_k] or [..., 1, 1]): its
    gradient is then the sum over queries of dS, which attn_bwd_dkdv makes for the key bias,
    and no [batch, heads, n_q, n_k] buffer is needed."""
    return bias.shape[-2] == 1


def _refuse_decode_score_bias(call: AttentionCall) -> None:
    """The decode kernels take every score operand but a dense score bias: refused by name."""
    if call.operands.score_bias is not None:
        raise ValueError(
            "score_bias: the decode kernels take no dense score bias (a KV cache's keys have "
            "no fixed [time_q, time_k] plane); pass a per-key bias as key_bias"
        )


def modifier_variant(mods: ScoreMods, scale: float) -> bool:
    """Whether a block-kernel call runs the score-modifier variant (MODS_SCORE): with a
    modifier, and for a scale that is not positive, since the plain kernels fold their scale
    into the softmax's exp2 FMA, which a positive scale allows (kernels/common/score_tile.cuh)."""
    return mods.any or not scale > 0


def kernel_layout(layout: Layout) -> Layout:
    """The layout the kernels walk: ``layout`` itself, or for a block size below the smallest
    kernel block (8) the same elements on the smallest kernel block, built once per layout."""
    if layout.blocksize in geometry.BLOCK_SIZES:
        return layout
    smallest = geometry.BLOCK_SIZES[0]
    if smallest % layout.blocksize:
        raise ValueError(
            f"layout: blocksize {layout.blocksize} has no kernel; supported: "
            f"{geometry.BLOCK_SIZES} and divisors of {smallest} (run coarsened to {smallest})"
        )
    if layout not in _COARSENED:
        _COARSENED[layout] = coarsened(layout, smallest)
    return _COARSENED[layout]


def layout_pairs_rows(layout: Layout) -> bool:
    """Whether the forward runs ``layout`` in paired CTAs (where geometry has them): decided
    once per layout from its blocks. Device layouts are never paired: their rows are not read
    on the host (and the walk needs each row's blocks in ascending order, which host layouts
    guarantee)."""
    paired = _PAIRED.get(layout)
    if paired is None:
        paired = False
        if not isinstance(layout, DeviceLayout) and layout.num_q_blocks > 1:
            blocks = layout.blocks
            if blocks.shape[1] % 2:
                blocks = np.concatenate([blocks, np.zeros_like(blocks[:, :1])], axis=1)
            pairs = blocks.reshape(blocks.shape[0], -1, 2, blocks.shape[2])
            union = int(pairs.any(axis=2).sum())
            paired = union <= (1 + PAIRED_MAX_EXTRA_STEPS) * int(blocks.sum()) / 2
        _PAIRED[layout] = paired
    return paired


def _tiles_held(blocks: np.ndarray, key_blocks: int) -> np.ndarray:
    """[heads, query blocks, key tiles]: whether a key tile (key_blocks key blocks: the sm_90a
    backward's CTA) holds a block of the query block's row."""
    heads, num_q_blocks, num_blocks = blocks.shape
    tiles = -(-num_blocks // key_blocks)
    padded = np.zeros((heads, num_q_blocks, tiles * key_blocks), bool)
    padded[:, :, :num_blocks] = blocks
    return padded.reshape(heads, num_q_blocks, tiles, key_blocks).any(axis=3)


def backward_tile_order(blocks: np.ndarray, key_blocks: int, kv_group: int) -> np.ndarray:
    """The order in which the sm_90a backward's CTAs of one (kv head, batch) claim their key
    tiles: fewest query blocks walked first (the union of the tile's columns, summed over the
    kv head's query heads), ties the higher tile first. The dQ adds into a query block follow
    it (dq_ranks), and a column that walks fewer blocks reaches each of its blocks sooner down
    the column, so in a causal layout no CTA waits for one claimed before it. int32 [kv heads,
    key tiles]; ``blocks`` [heads, query blocks, key blocks], heads = kv heads x kv_group."""
    held = _tiles_held(blocks, key_blocks)
    heads, _, tiles = held.shape
    walked = held.sum(axis=1).reshape(heads // kv_group, kv_group, tiles).sum(axis=1)
    # fewest first, then the higher tile: sort on (walked, -tile)
    order = np.lexsort((-np.arange(tiles)[None, :].repeat(len(walked), 0), walked), axis=1)
    return order.astype(np.int32)


def dq_ranks(
    blocks: np.ndarray,
    col_ptr: np.ndarray,
    row_idx: np.ndarray,
    key_blocks: int,
    tile_order: np.ndarray,
) -> np.ndarray:
    """The sm_90a backward's order of the dQ adds: for each CSC entry (query block i, key block
    j) of each head, the rank of j's CTA (key tile j // key_blocks) among the CTAs that add
    into query block i, in the order they claim their work (``tile_order``, that of
    backward_tile_order, [kv heads, key tiles]): the number of other CTAs with a block in row i
    claimed before j's. ``blocks`` [heads, query blocks, key blocks] and the CSC arrays as the
    layout holds them; int32, one per entry."""
    held = _tiles_held(blocks, key_blocks)
    heads, _, tiles = held.shape
    kv_group = heads // len(tile_order)
    ranks = np.empty(len(row_idx), np.int32)
    for head in range(heads):
        order = tile_order[head // kv_group]
        # CTAs of the row before each one in claim order: a cumulative count along the order
        claimed = held[head][:, order]
        before = np.empty_like(claimed, dtype=np.int64)
        before[:, order] = np.cumsum(claimed, axis=1) - claimed
        first, last = int(col_ptr[head, 0]), int(col_ptr[head, -1])
        columns = np.repeat(np.arange(blocks.shape[2]), np.diff(col_ptr[head]))
        ranks[first:last] = before[row_idx[first:last], columns // key_blocks]
    return ranks


def _layout_backward_order(
    layout: Layout, key_blocks: int, kv_group: int
) -> tuple[np.ndarray, np.ndarray]:
    """(backward_tile_order, dq_ranks) of a host layout, built once per layout, CTA width and
    kv group."""
    cached = _BACKWARD_ORDER.setdefault(layout, {})
    key = (key_blocks, kv_group)
    if key not in cached:
        order = backward_tile_order(layout.blocks, key_blocks, kv_group)
        ranks = dq_ranks(layout.blocks, layout.col_ptr, layout.row_idx, key_blocks, order)
        cached[key] = (order, ranks)
    return cached[key]


def _layout_work_list(
    layout: Layout, key: tuple[int, int, str, int, int, bool, int]
) -> geometry.Sm90WorkList:
    """geometry.sm90_work_list of a host layout, built once per layout and (batch, keys, dtype,
    kv_group, head dim, key pairs, SMs)."""
    cached = _WORK_LISTS.setdefault(layout, {})
    if key not in cached:
        batch, n_k, dtype, kv_group, head_dim, key_pairs, sms = key
        cached[key] = geometry.sm90_work_list(
            layout.blocks,
            batch,
            n_k,
            head_dim,
            dtype,
            kv_group,
            layout.blocksize,
            key_pairs=key_pairs,
            sms=sms,
        )
    return cached[key]


# Poison of Quest's choice before quest_select writes it (it writes 0 or 1 everywhere)
QUEST_UNWRITTEN = 255
# The serving cache's bookkeeping arrays the decode kernels read, by name, in their order
DECODE_BOOK = ("slot_pos", "page_table", "page_count", "lengths")


class KernelBackend:
    """forward/backward like cuattn/backends/numpy_ref.py, through the .cu kernels.

    Subclasses provide: ``name``, ``array_kind`` (for messages), ``is_array``, ``device_of``,
    ``xp`` (NumPy or CuPy), ``output`` (an output buffer), ``index_arrays`` (the layout's index
    arrays where the kernels read them) and ``launch``.
    """

    name = "kernels"
    array_kind = "arrays"
    on_gpu = False

    # -- what a subclass provides -------------------------------------------------------------

    @property
    def xp(self) -> Any:
        raise NotImplementedError

    def is_array(self, x: Any) -> bool:
        raise NotImplementedError

    def device_of(self, x: Any) -> int:
        return 0

    def data_address(self, x: Any) -> int:
        """Address of x's first element where the kernels read it."""
        raise NotImplementedError

    def output(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A buffer every element of which the kernels write."""
        raise NotImplementedError

    def zeroed_output(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A buffer the kernels write in part: zeros where they do not."""
        return self.xp.zeros(shape, dtype)

    def index_arrays(self, layout: Layout) -> Any:
        """Object with row_ptr, col_idx, row_mask, col_ptr, row_idx, col_mask, mask_table."""
        raise NotImplementedError

    def launch(self, config: KernelConfig, **values: Any) -> None:
        raise NotImplementedError

    def multiprocessors(self, x: Any) -> int:
        """SMs of the device of x: the persistent forward's grid (geometry.sm90_persistent_ctas)
        and the SMs its work list's few-items rule fills (geometry.sm90_split_tiles). By default
        an H100 SXM's/H200's count, geometry.SM90_SMS (the interpreter runs blocks one after
        another, so the count only sets how many CTAs find the work list out and which rows the
        few-items rule splits)."""
        return geometry.SM90_SMS

    def runs_sm90a(self, x: Any) -> bool:
        """Whether this backend runs sm_90a code (wgmma) on the device of x: not by default
        (jax's XLA path hands jaxlib PTX for the device's plain architecture)."""
        return False

    # Whether CUATTN_KERNELS=auto (the default) runs attn_fwd_sm90 where runs_sm90a: a GPU
    # backend does (it is the faster forward there); the interpreter, which emulates both
    # families, keeps attn_fwd unless CUATTN_KERNELS=sm90a asks.
    sm90a_by_default = False

    @contextlib.contextmanager
    def on_device_of(self, x: Any) -> Iterator[None]:
        yield

    # -- the shared part ----------------------------------------------------------------------

    def _check_inputs(self, arrays: dict[str, Any], layout: Layout) -> tuple[str, tuple]:
        """Validate before any launch (docs/design.md §7): type, device, shape, dtype, layout.

        ``arrays`` holds q and k (and v, out, dout where given); returns (dtype name,
        (batch, heads, n_q, head_dim, kv_heads, n_k))."""
        q, k = arrays["q"], arrays["k"]
        self._check_placement(arrays)
        for name, array in arrays.items():
            like = k if name == "v" else q
            if name != "k" and array.shape != like.shape:
                raise ValueError(
                    f"{name}: shape {array.shape} differs from {'k' if name == 'v' else 'q'}'s "
                    f"{like.shape}"
                )
            if array.dtype != q.dtype:
                raise TypeError(f"{name}: dtype {array.dtype} differs from q's {q.dtype}")
        for name, array in (("q", q), ("k", k)):
            if array.ndim != 4:
                raise ValueError(
                    f"{name}: expected [batch, heads, time, head_dim], got shape {array.shape}"
                )
        if np.dtype(q.dtype).name not in geometry.DTYPES:
            raise TypeError(
                f"q: dtype {q.dtype} has no kernel; the kernels accept {', '.join(geometry.DTYPES)}"
            )
        batch, heads, n_q, head_dim = q.shape
        kv_batch, kv_heads, n_k, kv_dim = k.shape
        if (kv_batch, kv_dim) != (batch, head_dim) or heads % kv_heads:
            raise ValueError(
                f"k: shape {k.shape} does not fit q {q.shape}: expected [batch={batch}, kv_heads "
                f"dividing heads={heads}, n_k, head_dim={head_dim}]"
            )
        if head_dim not in geometry.HEAD_DIMS:
            raise ValueError(
                f"q: head_dim {head_dim} has no kernel; supported: {geometry.HEAD_DIMS}"
            )
        limit = geometry.GRID_YZ_LIMIT
        for name, size in (("heads", heads), ("batch", batch)):
            if size > limit:
                raise ValueError(
                    f"q: {name} = {size} exceeds the kernels' grid limit of {limit}; "
                    f"split the call into chunks of at most {limit} {name}"
                )
        rows = batch * heads * max(n_q, n_k)
        if rows >= geometry.CTA_COUNT_LIMIT:
            raise ValueError(
                f"q: batch x heads x max(n_q, n_k) = {batch} x {heads} x {max(n_q, n_k)} reaches "
                f"the kernels' limit of {geometry.CTA_COUNT_LIMIT}; split the call along batch "
                "or heads"
            )
        if (layout.heads, layout.n_q, layout.n_ctx) != (heads, n_q, n_k):
            raise ValueError(
                f"layout: built for heads={layout.heads}, n_q={layout.n_q}, n_ctx={layout.n_ctx}; "
                f"q has heads={heads}, n_q={n_q} and k has n_k={n_k}"
            )
        kernel_layout(layout)  # a block size with no kernel fails here, before any launch
        return geometry.kernel_dtype(q.dtype), (batch, heads, n_q, head_dim, kv_heads, n_k)

    def _check_placement(self, arrays: dict[str, Any]) -> None:
        """Every array of this backend's kind and on the device of the first one."""
        first, reference = next(iter(arrays.items()))
        for name, array in arrays.items():
            if not self.is_array(array):
                raise TypeError(
                    f"{name}: the {self.name} backend takes {self.array_kind}, "
                    f"got {type(array).__name__}"
                )
            if self.device_of(array) != self.device_of(reference):
                raise ValueError(
                    f"{name}: on device {self.device_of(array)}, {first} on "
                    f"{self.device_of(reference)}"
                )

    def _check_alignment(self, arrays: dict[str, Any]) -> None:
        """A contiguous view at an element offset (``flat[1:].reshape(...)``) passes every
        shape check but faults a GPU's 16-byte copies; refuse it before any launch."""
        for name, array in arrays.items():
            address = self.data_address(array)
            if address % COPY_ALIGNMENT:
                raise ValueError(
                    f"{name}: data starts at an address {address % COPY_ALIGNMENT} bytes past a "
                    f"{COPY_ALIGNMENT}-byte boundary (a view at an element offset?); the kernels "
                    f"copy {COPY_ALIGNMENT}-byte chunks. Pass a copy: x.clone() (torch), "
                    "np.array(x) or cupy.array(x) (ascontiguousarray returns such a view "
                    "unchanged)"
                )

    @staticmethod
    def _check_contiguous(arrays: dict[str, Any]) -> None:
        """Arrays a kernel reads as flat buffers (no strides passed) must be C-contiguous: a
        strided view would be read as if it were not, silently."""
        for name, x in arrays.items():
            if not x.flags.c_contiguous:
                raise ValueError(
                    f"{name}: the kernel reads it as a contiguous buffer, got strides "
                    f"{tuple(x.strides)} for shape {tuple(x.shape)}; pass a contiguous copy"
                )

    def _check_strides(self, arrays: dict[str, Any]) -> None:
        """The kernels read q, k, v and dout in place at any strides whose rows are contiguous
        and 16-byte aligned (a [B, T, H, d] projection viewed as [B, H, T, d], k and v as views
        of one fused tensor); anything else is refused before any launch, naming the argument.
        Strides of length-1 axes never matter."""
        for name, x in arrays.items():
            itemsize = x.dtype.itemsize
            outer = [s for s, n in zip(x.strides[:-1], x.shape[:-1], strict=True) if n > 1]
            if (
                x.strides[-1] != itemsize
                or any(s < 0 or s % COPY_ALIGNMENT for s in outer)
                or x.strides[-2] // itemsize >= ROW_STRIDE_LIMIT
            ):
                elements = tuple(
                    s // itemsize if s % itemsize == 0 else s / itemsize for s in x.strides
                )
                raise ValueError(
                    f"{name}: strides {elements} (in elements) cannot be read by the kernels: "
                    "they need the last axis contiguous (stride 1) and every other stride a "
                    f"non-negative multiple of {COPY_ALIGNMENT} bytes "
                    f"({COPY_ALIGNMENT // itemsize} elements of {x.dtype}), rows under "
                    f"{ROW_STRIDE_LIMIT} elements apart. "
                    "Pass a contiguous copy: x.contiguous() (torch), np.ascontiguousarray(x) or "
                    "cupy.ascontiguousarray(x)"
                )

    @staticmethod
    def _strides(name: str, x: Any) -> dict[str, int]:
        """The element strides of x's batch, head and row axes as kernel arguments (0 for an
        axis of length 1, whose stride is never used)."""
        return {
            f"{name}_{axis}_stride": (stride // x.dtype.itemsize if size > 1 else 0)
            for axis, stride, size in zip(
                geometry.STRIDE_AXES, x.strides[:3], x.shape[:3], strict=True
            )
        }

    def _layout_values(self, layout: Layout, columns: bool, kv_group: int) -> dict[str, Any]:
        """The walked index (CSR rows or CSC columns) and the shape and rule scalars."""
        index = self.index_arrays(layout)
        if columns:
            ptr, idx, mask = index.col_ptr, index.row_idx, index.col_mask
        else:
            ptr, idx, mask = index.row_ptr, index.col_idx, index.row_mask
        return {
            "ptr": ptr,
            "idx": idx,
            "mask": mask,
            "mask_table": index.mask_table,
            "n_q": layout.n_q,
            "n_k": layout.n_ctx,
            "q_offset": layout.q_offset,
            "kv_group": kv_group,
            "num_blocks": layout.num_blocks if columns else layout.num_q_blocks,
            "window_left": layout.rule.window_left,
            "window_right": layout.rule.window_right,
        }

    def forward(self, q: Any, k: Any, v: Any, call: AttentionCall) -> tuple[Any, Any]:
        layout, scale, mods = call.layout, call.scale, call.mods
        dtype, shape = self._check_inputs({"q": q, "k": k, "v": v}, layout)
        batch, heads, n_q, head_dim, kv_heads, _ = shape
        layout = kernel_layout(layout)
        with self.on_device_of(q):
            self._check_strides({"q": q, "k": k, "v": v})
            self._check_alignment({"q": q, "k": k, "v": v})
            variant = modifier_variant(mods, scale)
            block, rule = layout.blocksize, layout.rule.kind
            if not variant and self._sm90a_forward((q, k, v), block, head_dim, dtype):
                result = self._forward_sm90(q, k, v, layout, scale, shape, dtype)
                if result is not None:
                    return result
            config = KernelConfig(
                "attn_fwd",
                head_dim,
                dtype,
                batch,
                heads,
                n_q,
                block,
                rule,
                variant,
                geometry.pairs_rows("attn_fwd", block, head_dim, dtype)
                and layout_pairs_rows(layout),
            )
            return self._launch_forward(
                config,
                q,
                layout,
                scale,
                heads // kv_heads,
                lambda out: {"out": out},
                q=q,
                k=k,
                v=v,
                **self._score_values(call),
                **self._strides("q", q),
                **self._strides("k", k),
                **self._strides("v", v),
            )

    def _launch_forward(
        self,
        config: KernelConfig,
        q: Any,
        layout: Layout,
        scale: float,
        kv_group: int,
        out_values: Callable[[Any], dict[str, Any]],
        /,
        **values: Any,
    ) -> tuple[Any, Any]:
        """(out, lse) of a forward launch of ``config``: out allocated like q and handed to the
        kernel as ``out_values(out)`` (the array, or its tensor map), lse float32 [batch, heads,
        n_q], the scale and the layout's arrays; ``values``, the kernel's own (q among them:
        the arguments before are positional only)."""
        batch, heads, n_q = q.shape[:3]
        out = self.output(q.shape, q.dtype)
        lse = self.output((batch, heads, n_q), self.xp.float32)
        self.launch(
            config,
            **out_values(out),
            lse=lse,
            scale=scale,
            **self._layout_values(layout, columns=False, kv_group=kv_group),
            **values,
        )
        return out, lse

    def _forward_sm90(
        self, q: Any, k: Any, v: Any, layout: Layout, scale: float, shape: tuple, dtype: str
    ) -> tuple[Any, Any] | None:
        """The forward on attn_fwd_sm90 (inputs checked, on their device): q, k and v reach it
        as tensor maps. None, before anything is allocated or launched, when the device refuses
        one of those maps (encodes): the caller runs attn_fwd."""
        batch, heads, n_q, head_dim, kv_heads, n_k = shape
        kv_group = heads // kv_heads
        if (
            geometry.kernel_family() == geometry.SM90_PERSISTENT_FAMILY
            and head_dim in geometry.SM90_PERSISTENT_HEAD_DIMS
            and (
                not isinstance(layout, DeviceLayout)
                or layout_build.work_list_fits(
                    layout.num_q_blocks, layout.num_blocks, heads, batch, layout.blocksize
                )
            )
        ):
            return self._forward_sm90_persistent(q, k, v, layout, scale, shape, dtype)
        key_pairs = geometry.sm90_key_pairs(layout.blocksize, head_dim, dtype)
        rescale_skip = geometry.sm90_rescale_skip(head_dim, key_pairs)
        exp2_poly = geometry.sm90_exp2_poly(head_dim, key_pairs)
        config = KernelConfig(
            geometry.SM90_FWD,
            head_dim,
            dtype,
            batch,
            heads,
            n_q,
            layout.blocksize,
            layout.rule.kind,
            key_pairs=key_pairs,
            rescale_skip=rescale_skip,
            exp2_poly=exp2_poly,
            consumers=geometry.sm90_consumers(
                layout.blocksize, head_dim, key_pairs, rescale_skip, exp2_poly
            ),
        )
        groups = geometry.sm90_cta_groups(batch, heads, n_k, head_dim, dtype, kv_group)
        return self._launch_sm90_forward(config, q, k, v, layout, scale, cta_groups=groups)

    def _launch_sm90_forward(
        self, config: KernelConfig, q: Any, k: Any, v: Any, layout: Layout, scale: float, **extra
    ) -> tuple[Any, Any] | None:
        """(out, lse) of an sm_90a forward launch of ``config`` (its own arguments in
        ``extra``): q, k and v as tensor maps; None, before the outputs are allocated or
        anything is launched, when the device refuses one of them (encodes)."""
        # a K/V copy is a tile, or with key pairs one 64-block half of it
        kv_rows = min(config.tile_n, layout.blocksize)
        input_maps = {
            **self._panel_map("q", q, config.tile_m),
            **self._panel_map("k", k, kv_rows),
            **self._panel_map("v", v, kv_rows),
        }
        if not all(self.encodes(input_maps[name]) for name in ("q", "k", "v")):
            return None
        return self._launch_forward(
            config,
            q,
            layout,
            scale,
            q.shape[1] // k.shape[1],
            lambda out: self._panel_map("out", out, geometry.SM90_STORE_ROWS),
            **input_maps,
            **extra,
        )

    def _forward_sm90_persistent(
        self, q: Any, k: Any, v: Any, layout: Layout, scale: float, shape: tuple, dtype: str
    ) -> tuple[Any, Any] | None:
        """The forward on attn_fwd_sm90_persistent, as _forward_sm90 (None where the device
        refuses a map): the layout's work list (_sm90_work), one CTA an SM; then, where the
        list may split rows, attn_fwd_sm90_merge over their chunks' partials."""
        batch, heads, n_q, head_dim, kv_heads, n_k = shape
        kv_group = heads // kv_heads
        key_pairs = geometry.sm90_key_pairs(layout.blocksize, head_dim, dtype)
        # the device's SMs: the grid, and the few-items rule of the work list's threshold
        sms = self.multiprocessors(q)
        work = self._sm90_work(layout, (batch, n_k, dtype, kv_group, head_dim, key_pairs, sms))
        ctas = geometry.sm90_persistent_ctas(sms, work.num_items)
        xp = self.xp
        slots = max(work.slots, 1)  # (a pointer to pass where no row is split)
        part_out = self.output((slots, geometry.SM90_TILE_M, head_dim), xp.float32)
        part_lse = self.output((slots, geometry.SM90_TILE_M), xp.float32)
        config = KernelConfig(
            geometry.SM90_FWD_PERSISTENT,
            head_dim,
            dtype,
            n_rows=ctas,
            block=layout.blocksize,
            rule=layout.rule.kind,
            key_pairs=key_pairs,
            rescale_skip=geometry.sm90_rescale_skip(head_dim, key_pairs),
            exp2_poly=geometry.sm90_exp2_poly(head_dim, key_pairs),
        )
        result = self._launch_sm90_forward(
            config,
            q,
            k,
            v,
            layout,
            scale,
            work_list=work.items,
            num_items=work.num_items,
            heads=heads,
            work_counter=work.work_counter,
            part_out=part_out,
            part_lse=part_lse,
        )
        if result is None or not work.num_merges:
            return result
        out, lse = result
        rows = work.num_merges * geometry.SM90_TILE_M
        self.launch(
            KernelConfig(geometry.SM90_FWD_MERGE, head_dim, dtype, n_rows=rows),
            part_out=part_out,
            part_lse=part_lse,
            merge_list=work.merges,
            out=out,
            lse=lse,
            n_q=n_q,
            rows=rows,
        )
        return out, lse

    def _sm90_work(
        self, layout: Layout, key: tuple[int, int, str, int, int, bool, int]
    ) -> layout_build.DeviceWorkList:
        """attn_fwd_sm90_persistent's work for ``layout`` and (batch, keys, dtype, kv group,
        head dim, key pairs, the device's SMs), where its kernels read it: a device layout's
        built where it lives by layout_build.sm90_work_list on every call (no host round trip;
        not kept, since a build recorded into a CUDA graph only runs when the graph does), a host
        layout's from its cached geometry.sm90_work_list, copied over as a list of exactly its
        entries."""
        batch, n_k, dtype, kv_group, head_dim, key_pairs, sms = key
        if isinstance(layout, DeviceLayout):
            return layout_build.sm90_work_list(
                self,
                layout.blocks,
                batch,
                n_k,
                head_dim,
                dtype,
                kv_group,
                layout.blocksize,
                key_pairs=key_pairs,
                sms=sms,
            )
        work = _layout_work_list(layout, key)
        return layout_build.DeviceWorkList(
            items=self.xp.asarray(work.items),
            work_counter=self.zeroed_output((1,), self.xp.int32),
            merges=self.xp.asarray(work.merges),
            split_tiles=work.split_tiles,
            num_items=len(work.items),
            num_merges=len(work.merges),
            slots=work.slots,
        )

    def _sm90a_forward(
        self, qkv: tuple[Any, Any, Any], block: int, head_dim: int, dtype: str
    ) -> bool:
        """Whether this forward runs the sm_90a family (geometry.kernel_family: asked for, or by
        default on this backend; supported for these sizes and strides on this device; whether
        the device takes the tensor maps is _forward_sm90's to ask)."""
        family = geometry.kernel_family()
        wanted = family in (geometry.SM90_FAMILY, geometry.SM90_PERSISTENT_FAMILY) or (
            family == geometry.AUTO_FAMILY and self.sm90a_by_default
        )
        return (
            wanted
            and geometry.sm90_forward_supports(block, head_dim, dtype)
            and all(_tma_describes(x) for x in qkv)
            and self.runs_sm90a(qkv[0])
        )

    def _sm90a_backward(
        self, arrays: tuple[Any, ...], block: int, head_dim: int, dtype: str
    ) -> bool:
        """Whether this backward runs attn_bwd_sm90: only where CUATTN_KERNELS=sm90a asks (it has
        never run on a GPU), for the sizes it has and inputs tensor maps describe."""
        return (
            geometry.kernel_family() == geometry.SM90_FAMILY
            and geometry.sm90_backward_supports(block, head_dim, dtype)
            and all(_tma_describes(x) for x in arrays)
            and self.runs_sm90a(arrays[0])
        )

    def _delta(self, out: Any, dout: Any, dlse: Any | None, head_dim: int, dtype: str) -> Any:
        """delta = rowsum(dout * out) - dlse, float32 [batch, heads, n_q], by
        attn_bwd_preprocess (which reads dlse only when given: a one-element stand-in
        otherwise)."""
        xp = self.xp
        batch, heads, n_q = out.shape[:3]
        use_dlse = dlse is not None
        delta = self.output((batch, heads, n_q), xp.float32)
        self.launch(
            KernelConfig("attn_bwd_preprocess", head_dim, dtype, batch, heads, n_q),
            out=out,
            dout=dout,
            dlse=xp.ascontiguousarray(dlse) if use_dlse else xp.zeros(1, xp.float32),
            delta=delta,
            n_q=n_q,
            use_dlse=int(use_dlse),
            **self._strides("dout", dout),
        )
        return delta

    def _backward_sm90(
        self, saved: tuple, dlse: Any | None, layout: Layout, scale: float, shape: tuple, dtype: str
    ) -> tuple[Any, Any, Any] | None:
        """(dq, dk, dv) by attn_bwd_sm90 from ``saved`` (q, k, v, out, lse, dout; checked, on
        their device): delta by attn_bwd_preprocess, lse (log2 domain) and delta padded to whole
        steps, the main kernel with its dQ reduces into a zeroed fp32 accumulator, then
        attn_bwd_sm90_dq. CUATTN_BWD_DQ=unordered runs the instantiation whose reduces skip the
        semaphores (geometry.BWD_DQ_ENV); CUATTN_BWD_SM90=persistent runs
        attn_bwd_sm90_persistent, one CTA an SM claiming the same items in the same order
        (geometry.BWD_SM90_ENV). None, before any launch, when the device refuses a tensor map:
        the caller runs the mma.sync pair."""
        q, k, v, out, lse, dout = saved
        batch, heads, n_q, head_dim, kv_heads, n_k = shape
        xp = self.xp
        persistent = geometry.sm90_backward_schedule() == geometry.BWD_SM90_PERSISTENT
        persistent &= geometry.sm90_backward_persistent_supports(
            layout.blocksize, head_dim, layout.rule.kind
        )
        key_blocks = geometry.sm90_bwd_key_blocks(layout.blocksize)
        # persistent: its grid (CTAs) and the pairs' sizes, which the grid no longer gives
        items = -(-layout.num_blocks // key_blocks) * kv_heads * batch
        schedule = (
            {
                "kernel": geometry.SM90_BWD_PERSISTENT,
                "batch": 1,
                "heads": 1,
                "n_rows": geometry.sm90_persistent_ctas(self.multiprocessors(q), items),
            }
            if persistent
            else {"kernel": geometry.SM90_BWD, "batch": batch, "heads": kv_heads, "n_rows": n_k}
        )
        config = KernelConfig(
            schedule["kernel"],
            head_dim,
            dtype,
            schedule["batch"],
            schedule["heads"],
            schedule["n_rows"],
            layout.blocksize,
            layout.rule.kind,
            dq_unordered=geometry.sm90_backward_dq_order() == geometry.BWD_DQ_UNORDERED,
        )
        sizes = {"kv_heads": kv_heads, "batch_size": batch} if persistent else {}
        maps = {
            **self._panel_map("q", q, config.tile_n),
            **self._panel_map("k", k, config.tile_m),
            **self._panel_map("v", v, config.tile_m),
            **self._panel_map("dout", dout, config.tile_n),
        }
        step = config.tile_n
        n_padded = -(-n_q // step) * step
        stats = self.output((batch, heads, 2, n_padded), xp.float32)
        maps["stats"] = TensorMap.of(stats, (step, 2, 1, 1))
        if not all(self.encodes(maps[name]) for name in ("q", "k", "v", "dout", "stats")):
            return None
        delta = self._delta(out, dout, dlse, head_dim, dtype)
        # lse in the log2 domain, +inf where a row has nothing to attend and past n_q (its P is
        # then exactly 0); delta 0 past n_q
        stats[:, :, 0, n_q:] = xp.inf
        stats[:, :, 1, n_q:] = 0
        stats[:, :, 0, :n_q] = xp.where(xp.isneginf(lse), xp.float32(xp.inf), lse * _LOG2E)
        stats[:, :, 1, :n_q] = delta
        dq_accum = self.zeroed_output((batch, heads, n_padded, head_dim), xp.float32)
        # a semaphore per (step, head, batch), then the work counter
        counters = self.zeroed_output((batch * heads * (n_padded // step) + 1,), xp.int32)
        dk, dv = (self.output(k.shape, k.dtype) for _ in range(2))
        index = self.index_arrays(layout)
        kv_group = heads // kv_heads
        if isinstance(layout, DeviceLayout):  # built where it lives, no host round trip
            tile_order, ranks = layout_build.sm90_backward_order(
                self, layout, index, key_blocks, kv_group
            )
        else:
            tile_order, ranks = (
                xp.asarray(order) for order in _layout_backward_order(layout, key_blocks, kv_group)
            )
        self.launch(
            config,
            **maps,
            dk=dk,
            dv=dv,
            dq_accum=dq_accum,
            semaphores=counters[:-1],
            work_counter=counters[-1:],
            col_ptr=index.col_ptr,
            row_idx=index.row_idx,
            col_mask=index.col_mask,
            dq_ranks=ranks,
            tile_order=tile_order,
            mask_table=index.mask_table,
            n_q=n_q,
            n_k=n_k,
            q_offset=layout.q_offset,
            kv_group=kv_group,
            num_k_blocks=layout.num_blocks,
            scale=scale,
            window_left=layout.rule.window_left,
            window_right=layout.rule.window_right,
            cta_groups=geometry.sm90_backward_cta_groups(
                batch, kv_heads, n_q, head_dim, dtype, kv_group
            ),
            **sizes,
        )
        dq = self.output(q.shape, q.dtype)
        self.launch(
            KernelConfig(geometry.SM90_BWD_DQ, head_dim, dtype, batch, heads, n_q),
            dq_accum=dq_accum,
            dq=dq,
            n_q=n_q,
            n_q_padded=n_padded,
            scale=scale,
        )
        return dq, dk, dv

    def encodes(self, map_: TensorMap) -> bool:
        """Whether this backend's device takes the tensor map (the interpreter checks its own
        reading of the driver's rules at launch and fails the launch on a violation)."""
        return True

    def _panel_map(self, name: str, x: Any, rows: int) -> dict[str, Any]:
        """attn_fwd_sm90's arguments for x: its tensor map and first column (panel_map)."""
        map_, col = panel_map(x, self.data_address(x), rows)
        return {name: map_, f"{name}_col": col}

    def _score_values(self, call: AttentionCall) -> dict[str, Any]:
        """The block and decode kernels' arguments for the call's score modifiers: the softcap,
        the score operands (stand-ins where absent; the dense score bias is the block kernels'
        alone, the decode kernels take no such argument) and dropout."""
        operands: ScoreOperands = call.operands
        return {
            "softcap": call.mods.softcap,
            **self._alibi_values(operands.alibi_slopes),
            **self._key_bias_values(operands.key_bias),
            **self._rel_bias_values(operands.rel_bias),
            **self._score_bias_values(operands.score_bias),
            **_dropout_values(call.mods, operands.dropout_seed, self.xp),
        }

    def _absent(self, operand: str, *scalars: str) -> dict[str, Any]:
        """The kernels' arguments of a score operand the call does not carry: a one-element
        stand-in the kernels do not read, and 0 for its flag, strides and sizes."""
        return {operand: self.xp.zeros(1, self.xp.float32), **dict.fromkeys(scalars, 0)}

    def _score_bias_values(self, bias: Any | None) -> dict[str, Any]:
        """The block kernels' dense-bias arguments: the bias in place, as a one-element view of
        its first element (nothing is copied, whatever its strides: the kernels read it at its
        four element strides, 0 along a broadcast axis, inside the visited tiles only), and how
        it is stored (float32, or q's 16-bit dtype read as the kernel's own type); or a
        one-element stand-in the kernels do not read."""
        if bias is None:
            return self._absent("score_bias", "use_score_bias", *_SCORE_BIAS_STRIDES)
        if self.on_gpu and geometry.score_bias_family() != geometry.DECODE_FP8_KERNEL_FAMILY:
            raise ValueError(
                f"score_bias: the kernels' dense score bias has not run on a GPU yet; set "
                f"{geometry.SCORE_BIAS_ENV}={geometry.DECODE_FP8_KERNEL_FAMILY} to run it, or "
                "compute the call on CPU arrays"
            )
        first, strides = self._score_bias_operand(bias)
        padded = (1,) * (4 - bias.ndim) + tuple(bias.shape)
        strides = (0,) * (4 - bias.ndim) + strides
        kind = "float32" if bias.dtype == self.xp.float32 else "narrow"
        return {
            "score_bias": first,
            "use_score_bias": geometry.SCORE_BIAS_KINDS[kind],
            **{
                name: (stride if size > 1 else 0)
                for name, stride, size in zip(_SCORE_BIAS_STRIDES, strides, padded, strict=True)
            },
        }

    def _score_bias_operand(self, bias: Any) -> tuple[Any, tuple[int, ...]]:
        """(what the kernels take for the bias: a one-element view of its first element,
        nothing copied; its element strides)."""
        strides = tuple(stride // bias.dtype.itemsize for stride in bias.strides)
        return bias[(slice(0, 1),) * bias.ndim], strides

    def _rel_bias_values(self, table: Any | None) -> dict[str, Any]:
        """The kernels' relative-position arguments: the table (contiguous float32 [heads,
        2M + 1] or [batch, heads, 2M + 1], checked by the public call), its batch stride (0: one
        table per head) and M, or a one-element stand-in the kernels do not read."""
        if table is None:
            return self._absent(
                "rel_bias", "use_rel_bias", "rel_bias_batch_stride", "rel_max_distance"
            )
        table = self.xp.ascontiguousarray(table)
        return {
            "rel_bias": table,
            "use_rel_bias": 1,
            "rel_bias_batch_stride": 0 if table.ndim == 2 else table.shape[1] * table.shape[2],
            "rel_max_distance": rel_max_distance(table),
        }

    def _alibi_values(self, slopes: Any | None) -> dict[str, Any]:
        """The block kernels' ALiBi arguments: the slopes (contiguous float32 [heads] or
        [batch, heads], checked by the public call) and their batch stride, or a one-element
        stand-in the kernels do not read."""
        if slopes is None:
            return self._absent("alibi_slopes", "use_alibi", "alibi_batch_stride")
        slopes = self.xp.ascontiguousarray(slopes)
        stride = 0 if slopes.ndim == 1 else slopes.shape[1]
        return {"alibi_slopes": slopes, "use_alibi": 1, "alibi_batch_stride": stride}

    def _key_bias_values(self, key_bias: Any | None) -> dict[str, Any]:
        """The block kernels' key-bias arguments: float32 [batch, n_k] or [batch, heads, n_k]
        (checked by the public call) made contiguous and its element strides (head 0 for one
        row per batch), or a one-element stand-in the kernels do not read."""
        if key_bias is None:
            return self._absent(
                "key_bias", "use_key_bias", "key_bias_batch_stride", "key_bias_head_stride"
            )
        key_bias = self.xp.ascontiguousarray(key_bias)
        n_k = key_bias.shape[-1]
        heads = key_bias.shape[1] if key_bias.ndim == 3 else 1
        return {
            "key_bias": key_bias,
            "use_key_bias": 1,
            "key_bias_batch_stride": heads * n_k,
            "key_bias_head_stride": n_k if key_bias.ndim == 3 else 0,
        }

    def backward(
        self,
        q: Any,
        k: Any,
        v: Any,
        out: Any,
        lse: Any,
        dout: Any,
        dlse: Any | None,
        call: AttentionCall,
    ) -> tuple[Any, ...]:
        """(dq, dk, dv), bit-identical run to run; ``dlse`` (float32 like lse, or None) is
        the gradient reaching the lse output, subtracted from delta by the preprocess kernel;
        the call is the forward's. Each given operand's gradient
        follows, in SCORE_OPERANDS order: the slopes' and the table's from per-row shares of
        the dQ pass, the key bias's from per-query-head sums of the dK/dV pass, the dense score
        bias's from the dQ pass's dS of every visited element (or, broadcast over the queries,
        from the key bias's sums), summed here in a fixed order; a seed array's is None.

        dQ is its own pass over the CSR rows, without atomics: on an H100 that measured
        1.2-2.5x faster than adding it with fp32 atomics inside the dK/dV kernel, so the
        deterministic sequence is the only one.
        """
        layout, scale, mods = call.layout, call.scale, call.mods
        operands = call.operands
        alibi_slopes, key_bias, rel_bias, score_bias = (
            operands.alibi_slopes,
            operands.key_bias,
            operands.rel_bias,
            operands.score_bias,
        )
        dropout_seed = operands.dropout_seed
        arrays = {"q": q, "k": k, "v": v, "out": out, "dout": dout}
        dtype, shape = self._check_inputs(arrays, layout)
        batch, heads, n_q, head_dim, kv_heads, n_k = shape
        layout = kernel_layout(layout)
        kv_group = heads // kv_heads
        xp = self.xp
        if not self.is_array(lse) or lse.shape != (batch, heads, n_q) or lse.dtype != xp.float32:
            raise ValueError(
                f"lse: expected float32 {(batch, heads, n_q)} {self.array_kind} (as the forward "
                f"returns it), got {type(lse).__name__} {getattr(lse, 'dtype', '')} "
                f"{getattr(lse, 'shape', '')}"
            )
        use_dlse = dlse is not None
        if use_dlse and (
            not self.is_array(dlse) or dlse.shape != lse.shape or dlse.dtype != xp.float32
        ):
            raise ValueError(
                f"dlse: expected float32 {(batch, heads, n_q)} {self.array_kind} (like lse), got "
                f"{type(dlse).__name__} {getattr(dlse, 'dtype', '')} {getattr(dlse, 'shape', '')}"
            )
        with self.on_device_of(q):
            self._check_strides({"q": q, "k": k, "v": v, "dout": dout})
            # out and lse are the forward's own (contiguous) results; a copy only if not
            out, lse = xp.ascontiguousarray(out), xp.ascontiguousarray(lse)
            self._check_alignment({"q": q, "k": k, "v": v, "out": out, "dout": dout})
            if (
                not modifier_variant(mods, scale)
                and not any(call.operands.given)
                and (
                    not isinstance(layout, DeviceLayout)
                    or layout_build.backward_order_fits(
                        layout.num_blocks, geometry.sm90_bwd_key_blocks(layout.blocksize)
                    )
                )
                and self._sm90a_backward((q, k, v, dout), layout.blocksize, head_dim, dtype)
            ):
                saved = (q, k, v, out, lse, dout)
                result = self._backward_sm90(saved, dlse, layout, scale, shape, dtype)
                if result is not None:
                    return result
            named = {"q": q, "k": k, "v": v, "dout": dout}
            strides = {
                stride: value
                for name, x in named.items()
                for stride, value in self._strides(name, x).items()
            }
            per_head = (head_dim, dtype, batch, heads)
            delta = self._delta(out, dout, dlse, head_dim, dtype)
            dq = self.output(q.shape, q.dtype)
            # dK, dV per query head; with kv_group == 1 that is already k's shape.
            dk, dv = (self.output((batch, heads, n_k, head_dim), q.dtype) for _ in range(2))
            tensors = {"q": q, "k": k, "v": v, "dout": dout, "lse": lse, "delta": delta}
            variant = {
                "block": layout.blocksize,
                "rule": layout.rule.kind,
                "mods": modifier_variant(mods, scale),
            }
            biases = self._score_values(call)
            # the key bias's gradient per query head (a stand-in the kernel does not write
            # without a key bias); a score bias broadcast over the queries takes the same sums
            # a frozen score bias (no gradient asked) needs neither of its gradient's buffers
            bias_grad = score_bias is not None and not mods.score_bias_frozen
            by_key = bias_grad and _score_bias_by_key(score_bias)
            if key_bias is None and not by_key:
                key_rows = xp.zeros(1, xp.float32)
            else:
                key_rows = self.output((batch, heads, n_k), xp.float32)
            self.launch(
                KernelConfig("attn_bwd_dkdv", *per_head, n_k, **variant),
                **tensors,
                dk=dk,
                dv=dv,
                scale=scale,
                **biases,
                key_bias_grad=key_rows,
                use_key_bias_grad=int(key_bias is not None or by_key),
                **self._layout_values(layout, columns=True, kv_group=kv_group),
                **strides,
            )
            # ALiBi's slope gradient per query row; without slopes a one-element input the
            # kernel does not write (no output of the launch)
            if alibi_slopes is None:
                alibi_rows = xp.zeros(1, xp.float32)
            else:
                alibi_rows = self.output((batch, heads, n_q), xp.float32)
            # the table's gradient per query row and column: the kernel writes only the
            # columns a row's visited keys reach, so the rest must be 0
            if rel_bias is None:
                rel_rows = xp.zeros(1, xp.float32)
            else:
                rel_rows = self.zeroed_output(
                    (batch, heads, n_q, int(rel_bias.shape[-1])), xp.float32
                )
            # any other score bias: dS of every visited element, 0 elsewhere (the kernel writes
            # each visited element once), its broadcast axes summed below
            if not bias_grad or by_key:
                score_planes = xp.zeros(1, xp.float32)
            else:
                score_planes = self.zeroed_output((batch, heads, n_q, n_k), xp.float32)
            self.launch(
                KernelConfig("attn_bwd_dq", *per_head, n_q, **variant),
                **tensors,
                dq=dq,
                scale=scale,
                **biases,
                alibi_grad=alibi_rows,
                use_alibi_grad=int(alibi_slopes is not None),
                rel_bias_grad=rel_rows,
                use_rel_bias_grad=int(rel_bias is not None),
                score_bias_grad=score_planes,
                use_score_bias_grad=int(bias_grad and not by_key),
                **self._layout_values(layout, columns=False, kv_group=kv_group),
                **strides,
            )
            if kv_group > 1:
                config = KernelConfig("attn_bwd_sum_groups", head_dim, dtype, batch, kv_heads, n_k)
                summed = []
                for per_head in (dk, dv):
                    summed.append(self.output(k.shape, k.dtype))
                    self.launch(
                        config, per_head=per_head, summed=summed[-1], n_k=n_k, kv_group=kv_group
                    )
                dk, dv = summed
        grads: tuple[Any, ...] = (dq, dk, dv)
        if alibi_slopes is not None:
            grads += (self._slopes_gradient(alibi_rows, alibi_slopes.ndim),)
        if key_bias is not None:
            grads += (self._key_bias_gradient(key_rows, key_bias.ndim),)
        if rel_bias is not None:
            grads += (self._rel_bias_gradient(rel_rows, rel_bias.ndim),)
        if bias_grad:
            rows = key_rows if by_key else score_planes
            grads += (self._score_bias_gradient(rows, by_key, score_bias),)
        elif score_bias is not None:
            grads += (None,)  # a frozen score bias: no gradient asked
        if dropout_seed is not None:
            grads += (None,)  # a seed has no gradient
        return grads

    def _rel_bias_gradient(self, rows: Any, table_ndim: int) -> Any:
        """The relative-position table's gradient from the dQ pass's per-row shares [batch,
        heads, n_q, 2M + 1]: summed over the rows, and over the batch for one table per head
        (fixed order)."""
        summed = rows.sum(axis=2)
        return summed if table_ndim == 3 else summed.sum(axis=0)

    def _score_bias_gradient(self, rows: Any, by_key: bool, bias: Any) -> Any:
        """The dense score bias's gradient from dS [batch, heads, n_q, n_k] (float32), or, for
        a bias broadcast over the queries (``by_key``), from the dK/dV pass's sums over the
        queries [batch, heads, n_k]: summed over the axes the bias broadcasts (in a fixed order,
        float32), shaped and typed like the bias."""
        planes = rows[:, :, None, :] if by_key else rows
        padded = (1,) * (4 - bias.ndim) + tuple(bias.shape)
        axes = tuple(a for a, d in enumerate(padded) if d == 1 and planes.shape[a] != 1)
        summed = planes.sum(axis=axes, keepdims=True) if axes else planes
        return summed.reshape(bias.shape).astype(bias.dtype)

    def _key_bias_gradient(self, rows: Any, bias_ndim: int) -> Any:
        """The key bias's gradient from the dK/dV pass's per-query-head sums [batch, heads,
        n_k]: as they are, or summed over the heads (in order) for one row per batch."""
        return rows if bias_ndim == 3 else rows.sum(axis=1)

    def _slopes_gradient(self, rows: Any, slopes_ndim: int) -> Any:
        """ALiBi's slope gradient from the dQ pass's per-row shares [batch, heads, n_q]: summed
        over the rows, and over the batch for one slope per head (float32, fixed order)."""
        summed = rows.sum(axis=2)
        return (summed.sum(axis=0) if slopes_ndim == 1 else summed).astype(self.xp.float32)

    def merge_states(self, out_a: Any, lse_a: Any, out_b: Any, lse_b: Any) -> tuple[Any, Any]:
        """The merge kernel (kernels/merge_states.cu) over every row of out [..., head_dim]."""
        arrays = {"out_a": out_a, "lse_a": lse_a, "out_b": out_b, "lse_b": lse_b}
        self._check_placement(arrays)
        for name, array in arrays.items():
            if not array.flags.c_contiguous:
                raise ValueError(f"{name}: the merge kernel reads contiguous arrays")
        if np.dtype(out_a.dtype).name not in geometry.DTYPES:
            raise TypeError(
                f"out_a: dtype {out_a.dtype} has no kernel; the kernels accept "
                f"{', '.join(geometry.DTYPES)}"
            )
        if lse_a.dtype != self.xp.float32 or lse_b.dtype != self.xp.float32:
            raise TypeError(f"lse_a, lse_b: the kernels take float32, got {lse_a.dtype}")
        head_dim = int(out_a.shape[-1])
        if head_dim not in geometry.HEAD_DIMS:
            raise ValueError(
                f"out_a: head_dim {head_dim} has no kernel; supported: {geometry.HEAD_DIMS}"
            )
        rows = int(np.prod(out_a.shape[:-1]))
        with self.on_device_of(out_a):
            self._check_alignment({"out_a": out_a, "out_b": out_b})
            out = self.output(tuple(out_a.shape), out_a.dtype)
            lse = self.output(tuple(lse_a.shape), self.xp.float32)
            if rows:
                config = KernelConfig(
                    "merge_states", head_dim, geometry.kernel_dtype(out_a.dtype), n_rows=rows
                )
                self.launch(
                    config,
                    **{k: v.reshape(-1) for k, v in arrays.items()},
                    out=out.reshape(-1),
                    lse=lse.reshape(-1),
                    rows=rows,
                )
        return out, lse

    def decode(self, q: Any, cache: Any, call: AttentionCall) -> tuple[Any, Any]:
        """(out, lse) of q over the tokens a serving KVCache keeps, through the decode kernels
        (its policy's page choice and token scores included: cuattn/serving/decode.py)."""
        from cuattn.serving.decode import kernel_decode

        return kernel_decode(self, q, cache, call)

    def decode_pages(
        self,
        q: Any,
        k_pages: Any,
        v_pages: Any,
        book: dict[str, Any],
        chosen: Any | None,
        call: AttentionCall,
        keep_scores: bool,
        resident_ctas: int,
        gqa: bool = False,
        fp8: tuple[Any, Any, str] | None = None,
    ) -> tuple[Any, Any, Any | None]:
        """Split-KV decode over a paged cache (kernels/attn_decode.cu, then the splits' merge in
        kernels/merge_states.cu; or with ``gqa`` the tensor-core kernels/attn_decode_gqa.cu,
        where geometry.decode_gqa_applies, which merges its splits itself, in its modifier
        variant where geometry.decode_gqa_mods): (out like q, lse
        float32 [B, H, t_q], and with keep_scores the per-token scores [B, H, t_q, max_pages *
        page_size], -inf where a token did not count, written for the slots below each table's
        page count and not past them). The call's scale and score modifiers: softcap, ALiBi
        (``alibi_slopes``, float32 [heads] or [batch, heads]), ``key_bias`` (float32 [batch,
        time_k] or [batch, heads, time_k] by token position), ``rel_bias`` (float32 [heads,
        2M + 1] or [batch, heads, 2M + 1] by token minus query position), dropout (its seed
        in an array operand or the modifiers). ``book``: the cache's bookkeeping arrays by name
        (DECODE_BOOK: slot_pos, page_table, page_count, lengths). ``fp8``: (k_scale, v_scale,
        kv_dtype) of fp8 pages (_check_fp8_pages), or None. Shapes as the kernel file's header;
        the cache (cuattn/serving) checks its own arrays, this checks q against them."""
        _refuse_decode_score_bias(call)
        if fp8 is not None:
            gqa = self._check_fp8_pages(q, k_pages, v_pages, fp8) and gqa
        if tuple(book) != DECODE_BOOK:
            raise ValueError(f"book: the cache's arrays {DECODE_BOOK}, got {tuple(book)}")
        self._check_placement({"q": q, "k_pages": k_pages, "v_pages": v_pages, **book})
        self._check_contiguous({"k_pages": k_pages, "v_pages": v_pages, **book})
        _, kv_heads, max_pages = book["page_table"].shape
        page_size = int(k_pages.shape[1])
        if int(k_pages.shape[0]) * page_size > geometry.DECODE_MAX_SLOTS:
            raise ValueError(
                f"k_pages: {int(k_pages.shape[0])} pages of {page_size} tokens; the decode "
                f"kernels index at most {geometry.DECODE_MAX_SLOTS} slots (int32)"
            )
        # a table row and a page per (sequence, kv head), positions in slot_pos
        walk = dict(
            kv_heads=kv_heads,
            max_pages=max_pages,
            page_size=page_size,
            table_batch_stride=kv_heads * max_pages,
            table_head_stride=max_pages,
            page_rows=page_size,
            token_rows=1,
            head_rows=0,
            use_slot_pos=1,
        )
        return self._decode_launch(
            q, k_pages, v_pages, book, walk, chosen, call, keep_scores, resident_ctas, gqa, fp8
        )

    def decode_block_table(
        self,
        q: Any,
        k_pages: Any,
        v_pages: Any,
        block_table: Any,
        lengths: Any,
        chosen: Any | None,
        call: AttentionCall,
        resident_ctas: int,
        gqa: bool = False,
        fp8: tuple[Any, Any, str] | None = None,
    ) -> tuple[Any, Any]:
        """The decode kernels of ``decode_pages`` over a caller's page table (vLLM's and
        FlashAttention's ``block_table`` layout, cuattn.paged_decode): k_pages, v_pages
        [num_blocks, block_size, kv_heads, head_dim] read in place at their strides (the same
        for both; head_dim contiguous, every other stride a whole number of head_dim rows),
        block_table int32 [batch, max_blocks] (entries contiguous) naming the blocks of each
        sequence's tokens in order for every kv head, lengths int64 [batch] the tokens of each
        (the blocks past ceil(length / block_size) are not read). Positions are the tokens'
        places in their sequence; ``chosen`` (uint8 [batch, heads, t_q, max_blocks]) as Quest's
        in decode_pages. Returns (out like q, lse float32 [batch, heads, t_q]). The caller
        (cuattn/serving/paged.py) checks the table's values; this checks shapes and strides."""
        _refuse_decode_score_bias(call)
        if fp8 is not None:
            gqa = self._check_fp8_pages(q, k_pages, v_pages, fp8) and gqa
        self._check_placement(
            {
                "q": q,
                "k_pages": k_pages,
                "v_pages": v_pages,
                "block_table": block_table,
                "lengths": lengths,
            }
        )
        self._check_contiguous({"lengths": lengths})
        num_blocks, block_size, kv_heads, head_dim = (int(d) for d in k_pages.shape)
        batch, max_blocks = (int(d) for d in block_table.shape)
        itemsize = k_pages.dtype.itemsize
        # the stride of a length-1 axis is never used
        strides, v_strides = (
            [st // itemsize if n > 1 else 0 for st, n in zip(x.strides, x.shape, strict=True)]
            for x in (k_pages, v_pages)
        )
        if strides != v_strides or tuple(v_pages.shape) != tuple(k_pages.shape):
            raise ValueError(
                f"v_pages: shape {tuple(v_pages.shape)} and strides {tuple(v_pages.strides)}; "
                f"the kernels read k_pages and v_pages at one set of strides, k_pages's "
                f"{tuple(k_pages.shape)} and {tuple(k_pages.strides)}"
            )
        if head_dim > 1 and strides[3] != 1 or any(st % head_dim for st in strides[:3]):
            raise ValueError(
                f"k_pages: strides {tuple(k_pages.strides)} bytes for shape "
                f"{tuple(k_pages.shape)}; the kernels read each token's head_dim elements "
                "contiguously and every other stride as a whole number of head_dim rows (a "
                "contiguous [num_blocks, block_size, kv_heads, head_dim], or a view of one "
                "block axis of a larger contiguous cache)"
            )
        page_rows, token_rows, head_rows = (st // head_dim for st in strides[:3])
        last_row = (num_blocks - 1) * page_rows + (block_size - 1) * token_rows
        last_row += (kv_heads - 1) * head_rows
        if last_row >= geometry.DECODE_MAX_SLOTS:
            raise ValueError(
                f"k_pages: shape {tuple(k_pages.shape)} spans {last_row + 1} rows of head_dim; "
                f"the decode kernels index at most {geometry.DECODE_MAX_SLOTS} (int32)"
            )
        table_strides = tuple(int(st) // 4 for st in block_table.strides)
        if max_blocks > 1 and table_strides[1] != 1:
            raise ValueError(
                f"block_table: strides {tuple(block_table.strides)} bytes; the kernels read a "
                "sequence's entries contiguously (a row slice of a larger table is fine)"
            )
        xp = self.xp
        with self.on_device_of(q):
            book = dict(
                slot_pos=xp.zeros(1, xp.int64),  # stand-ins: positions come in order
                page_table=block_table,
                page_count=xp.zeros(1, xp.int32),
                lengths=lengths,
            )
        walk = dict(
            kv_heads=kv_heads,
            max_pages=max_blocks,
            page_size=block_size,
            table_batch_stride=table_strides[0] if batch > 1 else 0,
            table_head_stride=0,  # every kv head reads the sequence's row
            page_rows=page_rows,
            token_rows=token_rows,
            head_rows=head_rows,
            use_slot_pos=0,
        )
        no_scores = False  # a caller's own table keeps no per-token scores
        out, lse, _ = self._decode_launch(
            q, k_pages, v_pages, book, walk, chosen, call, no_scores, resident_ctas, gqa, fp8
        )
        return out, lse

    def _decode_launch(
        self,
        q: Any,
        k_pages: Any,
        v_pages: Any,
        book: dict[str, Any],
        walk: dict[str, int],
        chosen: Any | None,
        call: AttentionCall,
        keep_scores: bool,
        resident_ctas: int,
        gqa: bool,
        fp8: tuple[Any, Any, str] | None = None,
    ) -> tuple[Any, Any, Any | None]:
        """decode_pages's and decode_block_table's launches, once each one's checks are done:
        ``book`` the arrays of DECODE_BOOK (stand-ins where ``walk`` says the kernels read
        none), ``walk`` the pages' geometry as the kernels take it: kv_heads, max_pages,
        page_size, and the table and page strides (kernels/attn_decode.cu PageWalk)."""
        scale, mods = call.scale, call.mods
        kv_heads, max_pages, page_size = walk["kv_heads"], walk["max_pages"], walk["page_size"]
        arrays = {"q": q, "k_pages": k_pages, "v_pages": v_pages}
        batch, heads, t_q, head_dim = q.shape
        dtype = geometry.kernel_dtype(q.dtype)
        if head_dim not in geometry.HEAD_DIMS:
            raise ValueError(
                f"q: head_dim {head_dim} has no kernel; supported: {geometry.HEAD_DIMS}"
            )
        xp = self.xp
        if gqa and not geometry.decode_gqa_applies(head_dim, dtype):
            raise ValueError(
                f"gqa: attn_decode_gqa does not apply to head_dim {head_dim}, dtype {dtype}; it "
                f"takes head dims {geometry.DECODE_GQA_HEAD_DIMS} and "
                f"{geometry.DECODE_GQA_DTYPES} (every score modifier, per-token scores and "
                f"scale), with {geometry.DECODE_ENV}={geometry.DECODE_GQA_FAMILY}"
            )
        # the tensor-core kernel's modifier variant: modifiers, scores, an fp16 q's large scale
        gqa_mods = gqa and geometry.decode_gqa_mods(dtype, mods.any, keep_scores, scale)
        with self.on_device_of(q):
            q = xp.ascontiguousarray(q)  # a few rows per sequence; the kernel reads them once
            self._check_alignment(arrays)
            if gqa:
                chunks = geometry.decode_gqa_row_chunks(heads // kv_heads, t_q)
                splits, per_split = geometry.decode_gqa_splits(
                    batch * kv_heads * chunks, max_pages, resident_ctas
                )
            else:
                chunks = geometry.decode_row_chunks(heads // kv_heads, t_q, head_dim)
                splits, per_split = geometry.decode_splits(
                    batch * kv_heads * chunks, max_pages, resident_ctas
                )
            out = self.output(q.shape, q.dtype)
            lse = self.output((batch, heads, t_q), xp.float32)
            if gqa and splits == 1:  # attn_decode_gqa writes out and lse itself
                part_out = part_lse = xp.zeros(1, xp.float32)
            else:
                part_out = self.output((batch, heads, t_q, splits, head_dim), xp.float32)
                part_lse = self.output((batch, heads, t_q, splits), xp.float32)
            tokens = max_pages * page_size
            # written below each table's page count only (attn_decode_mass reads no further)
            scores = (
                self.output((batch, heads, t_q, tokens), xp.float32)
                if keep_scores
                else xp.zeros(1, xp.float32)
            )
            use_chosen = chosen is not None
            chosen = xp.ascontiguousarray(chosen) if use_chosen else xp.zeros(1, xp.uint8)
            # what both decode kernels read: the cache's arrays, the partials, the sizes
            common = dict(
                q=q,
                k_pages=k_pages,
                v_pages=v_pages,
                **book,
                chosen=chosen,
                part_out=part_out,
                part_lse=part_lse,
                heads=heads,
                t_q=t_q,
                **walk,
                splits=splits,
                pages_per_split=per_split,
                scale=scale,
                use_chosen=int(use_chosen),
            )
            kernel = geometry.DECODE_GQA_KERNEL if gqa else "attn_decode_split"
            if fp8 is not None:
                kernel = geometry.DECODE_GQA_FP8_KERNEL if gqa else geometry.DECODE_FP8_KERNEL
                common.update(k_scale=fp8[0], v_scale=fp8[1])
            config = KernelConfig(
                kernel,
                head_dim,
                dtype,
                batch=batch,
                heads=kv_heads * chunks,
                n_rows=splits,
                mods=gqa_mods if gqa else mods.any,
                kv_dtype=None if fp8 is None else fp8[2],
            )
            if gqa:
                self.launch(
                    config,
                    **common,
                    out=out,
                    lse=lse,
                    # the last CTA of a (sequence, kv head, row chunk) merges its splits
                    tickets=xp.zeros((batch, kv_heads * chunks), xp.int32),
                    token_scores=scores,
                    **self._score_values(call),
                    keep_scores=int(keep_scores),
                )
            else:
                self.launch(
                    config,
                    **common,
                    token_scores=scores,
                    **self._score_values(call),
                    keep_scores=int(keep_scores),
                )
                rows = batch * heads * t_q
                self.launch(
                    KernelConfig("attn_decode_merge", head_dim, dtype, n_rows=rows),
                    part_out=part_out,
                    part_lse=part_lse,
                    out=out,
                    lse=lse,
                    rows=rows,
                    splits=splits,
                )
        return out, lse, (scores if keep_scores else None)

    def _check_fp8_pages(self, q: Any, k_pages: Any, v_pages: Any, fp8: tuple) -> bool:
        """Checks fp8 pages (kernels/attn_decode.cu attn_decode_split_fp8; with gqa and a bf16
        q, kernels/attn_decode_gqa.cu attn_decode_gqa_fp8): k_pages, v_pages uint8 codes of
        ``kv_dtype`` (geometry.KV_DTYPES) [num_pages, page_size, head_dim], k_scale, v_scale
        float32 [num_pages] their pages' scales (cuattn/serving/fp8.py); q float16 or bfloat16.
        On a GPU only with CUATTN_DECODE_FP8=kernel (opt-in until a GPU has run it); the
        interpreter always runs it. Whether the tensor-core kernel takes this q (an fp16 q keeps
        the split kernel: geometry.DECODE_GQA_FP8_Q_DTYPES)."""
        k_scale, v_scale, kv_dtype = fp8
        if kv_dtype not in geometry.KV_DTYPES:
            raise TypeError(f"kv_dtype must be one of {geometry.KV_DTYPES}, got {kv_dtype!r}")
        q_dtype = np.dtype(q.dtype).name
        if q_dtype not in geometry.DECODE_FP8_Q_DTYPES:
            raise TypeError(
                f"q: dtype {q_dtype}; the fp8 decode kernels take q in "
                f"{geometry.DECODE_FP8_Q_DTYPES}"
            )
        for name, array, dtype in (
            ("k_pages", k_pages, np.uint8),
            ("v_pages", v_pages, np.uint8),
            ("k_scale", k_scale, np.float32),
            ("v_scale", v_scale, np.float32),
        ):
            if np.dtype(array.dtype) != dtype:
                raise TypeError(f"{name}: dtype {array.dtype}, expected {np.dtype(dtype).name}")
        pages = int(k_pages.shape[0])
        for name, array in (("k_scale", k_scale), ("v_scale", v_scale)):
            if tuple(array.shape) != (pages,):
                raise ValueError(f"{name}: shape {tuple(array.shape)}, expected ({pages},)")
        if self.on_gpu and geometry.decode_fp8_family() != geometry.DECODE_FP8_KERNEL_FAMILY:
            raise ValueError(
                f"k_pages: fp8 pages run attn_decode_split_fp8, which has not run on a GPU "
                f"yet; set {geometry.DECODE_FP8_ENV}={geometry.DECODE_FP8_KERNEL_FAMILY} to run "
                "it, or decode with backend='interp'"
            )
        self._check_placement({"k_scale": k_scale, "v_scale": v_scale})
        self._check_contiguous({"k_scale": k_scale, "v_scale": v_scale})
        return q_dtype in geometry.DECODE_GQA_FP8_Q_DTYPES

    def decode_mass(
        self, token_scores: Any, lse: Any, page_table: Any, page_count: Any, slot_score: Any
    ) -> None:
        """HeavyHitters' score update in place (kernels/attn_decode.cu attn_decode_mass): each
        table slot's attention probability, exp(token_scores - lse) summed over its kv group's
        query rows, added to slot_score (float64 [num_pages, page_size]). token_scores and lse
        as ``decode`` returns them for the same page tables."""
        arrays = {
            "token_scores": token_scores,
            "lse": lse,
            "page_table": page_table,
            "page_count": page_count,
            "slot_score": slot_score,
        }
        self._check_placement(arrays)
        self._check_contiguous(arrays)
        batch, heads, t_q, slots = token_scores.shape
        _, kv_heads, max_pages = page_table.shape
        with self.on_device_of(token_scores):
            self.launch(
                geometry.DecodeMassConfig(slots, batch * kv_heads),
                **arrays,
                heads=heads,
                kv_heads=kv_heads,
                t_q=t_q,
                page_size=slots // max_pages,
                max_pages=max_pages,
            )

    def quest_select(
        self,
        q: Any,
        key_min: Any,
        key_max: Any,
        page_table: Any,
        page_count: Any,
        budget_pages: int,
        resident_ctas: int | None = None,
    ) -> Any:
        """Quest's page choice (kernels/quest_select.cu): uint8 [batch, heads, t_q, max_pages],
        1 where query row (b, head, t) reads table entry j: the ``budget_pages`` entries below
        page_count - 1 with the largest bound max(q, 0) . key_max[page] + min(q, 0) .
        key_min[page] (NaN read as +inf; ties: the lower entry), and the newest entry
        (page_count - 1); 0 elsewhere, past page_count included. q [batch, heads, t_q,
        head_dim] (float32, float16 or bfloat16); key_min, key_max [pool rows, head_dim], both
        float32, or both uint16 holding bfloat16 bits (read as the float32 they widen to);
        page_table int32 [batch, kv_heads, max_pages] naming their rows; page_count int32
        [batch, kv_heads]. ``resident_ctas``: quest_select CTAs the device holds at once
        (geometry.quest_resident_ctas); given, each table is split over CTAs where the pairs
        leave the waves part empty (geometry.quest_splits) and quest_select_rows selects, a
        launch more; None: one CTA a pair, one launch. The bound workspace and the answer come
        from the backend's allocator; the chosen set is the same either way."""
        arrays = {
            "q": q,
            "key_min": key_min,
            "key_max": key_max,
            "page_table": page_table,
            "page_count": page_count,
        }
        self._check_placement(arrays)
        dtype = geometry.kernel_dtype(q.dtype)
        batch, heads, t_q, head_dim = (int(d) for d in q.shape)
        if head_dim not in geometry.HEAD_DIMS:
            raise ValueError(
                f"q: head_dim {head_dim} has no kernel; supported: {geometry.HEAD_DIMS}"
            )
        bound_kind = np.dtype(key_min.dtype)
        if bound_kind not in (np.dtype(np.float32), np.dtype(np.uint16)):
            raise TypeError(
                f"key_min: dtype {key_min.dtype}, expected float32 or uint16 (bfloat16 bits)"
            )
        for name, array, kind in (
            ("key_max", key_max, bound_kind),
            ("page_table", page_table, np.int32),
            ("page_count", page_count, np.int32),
        ):
            if np.dtype(array.dtype) != kind:
                raise TypeError(f"{name}: dtype {array.dtype}, expected {np.dtype(kind).name}")
        for name in ("key_min", "key_max"):
            if tuple(arrays[name].shape[1:]) != (head_dim,):
                raise ValueError(
                    f"{name}: shape {tuple(arrays[name].shape)}, expected [pool rows, {head_dim}]"
                )
        if page_table.ndim != 3 or int(page_table.shape[0]) != batch:
            raise ValueError(
                f"page_table: shape {tuple(page_table.shape)}, expected [{batch}, kv_heads, "
                "max_pages]"
            )
        _, kv_heads, max_pages = (int(d) for d in page_table.shape)
        if heads % kv_heads:
            raise ValueError(f"q: heads={heads} is not a multiple of kv_heads={kv_heads}")
        if tuple(page_count.shape) != (batch, kv_heads):
            raise ValueError(
                f"page_count: shape {tuple(page_count.shape)}, expected ({batch}, {kv_heads})"
            )
        if isinstance(budget_pages, bool) or not isinstance(budget_pages, (int, np.integer)):
            raise TypeError(f"budget_pages must be an int, got {type(budget_pages).__name__}")
        if budget_pages < 0:
            raise ValueError(f"budget_pages must be >= 0, got {budget_pages}")
        if resident_ctas is not None and (
            isinstance(resident_ctas, bool)
            or not isinstance(resident_ctas, (int, np.integer))
            or resident_ctas < 1
        ):
            raise ValueError(f"resident_ctas must be a positive int or None, got {resident_ctas!r}")
        pairs = batch * kv_heads
        splits, per_split = (1, max_pages)
        if resident_ctas is not None:
            splits, per_split = geometry.quest_splits(pairs, max_pages, int(resident_ctas))
        bound_dtype = "float32" if bound_kind == np.float32 else "bfloat16"
        xp = self.xp
        with self.on_device_of(q):
            q = xp.ascontiguousarray(q)
            self._check_contiguous({k: v for k, v in arrays.items() if k != "q"})
            shape = (batch, heads, t_q, max_pages)
            bounds = self.output(shape, xp.float32)
            chosen = xp.empty(shape, dtype=xp.uint8)
            if not self.on_gpu:  # the interpreter's poison: the kernel writes every entry
                chosen.fill(QUEST_UNWRITTEN)
            if pairs and max_pages:
                self.launch(
                    geometry.QuestSelectConfig(head_dim, dtype, bound_dtype, pairs, splits),
                    q=q,
                    key_min=key_min,
                    key_max=key_max,
                    page_table=page_table,
                    page_count=page_count,
                    bounds=bounds,
                    chosen=chosen,
                    heads=heads,
                    kv_heads=kv_heads,
                    t_q=t_q,
                    max_pages=max_pages,
                    pages_per_split=per_split,
                    budget_pages=int(budget_pages),
                )
                if splits > 1 and batch * heads * t_q:
                    self.launch(
                        geometry.QuestRowsConfig(batch * heads * t_q),
                        bounds=bounds,
                        page_count=page_count,
                        chosen=chosen,
                        heads=heads,
                        kv_heads=kv_heads,
                        t_q=t_q,
                        max_pages=max_pages,
                        budget_pages=int(budget_pages),
                    )
        return chosen
