"""paged_decode: decode attention over a page table the caller owns (vLLM's and FlashAttention's).

The layout of vLLM's paged KV cache and of FlashAttention's ``flash_attn_with_kvcache(...,
block_table=...)``: k_pages, v_pages [num_blocks, block_size, kv_heads, head_dim] (a pool of
blocks every sequence and kv head share), block_table int32 [batch, max_blocks] (sequence b's
tokens 0, 1, ... are at block block_table[b, t // block_size], offset t % block_size, for every
kv head), seq_lens int32 [batch] (tokens of each sequence; the table's entries past
ceil(seq_lens[b] / block_size) are never read, so any padding value will do there).

The arrays are read in place, whatever framework holds them (DLPack): nothing is copied but the
B lengths (widened to int64) and, when given, the block mask (expanded to the kernels' [batch,
heads, t_q, max_blocks] bytes). CUDA arrays (and ``backend="interp"`` on the CPU) run the decode
kernels KVCache uses (kernels/attn_decode.cu and its merge, kernels/attn_decode_gqa.cu with
CUATTN_DECODE=gqa), addressing the blocks through their strides; NumPy arrays run the reference
(cuattn/serving/decode.py reference_rows), the same arithmetic decode_attention's NumPy path does.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cuattn import backends as _backends
from cuattn._util import array_module, ceil_div, dtype_name, host_array
from cuattn.adapters import dispatch, dlpack
from cuattn.backends import geometry
from cuattn.backends.call import AttentionCall, ScoreMods, ScoreOperands, checked_operands
from cuattn.backends.kernels import KernelBackend
from cuattn.serving import fp8
from cuattn.serving.cache import FP8_INPUT_DTYPES
from cuattn.serving.decode import _quiet_specials, _resident_ctas, decode_scale, reference_rows

__all__ = ["paged_decode"]

PAGE_DTYPES = ("float16", "bfloat16", "float32")  # what the kernels read (float64: the reference)
CODE_DTYPE = "uint8"  # fp8 pages: their codes, of the format kv_dtype names (cuattn/serving/fp8.py)
INDEX_DTYPE = "int32"  # block_table's and seq_lens's, as vLLM and FlashAttention hold them


def _shape(name: str, x: Any, want: str) -> tuple[int, ...]:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array {want}, got {type(x).__name__}")
    return tuple(int(d) for d in x.shape)


def _check_shapes(
    q: Any, k_pages: Any, v_pages: Any, block_table: Any, seq_lens: Any, kv_dtype: str | None
) -> tuple[int, ...]:
    """Shapes and dtypes (docs/design.md §7: by name, before anything runs); returns (batch,
    heads, t_q, head_dim, num_blocks, block_size, kv_heads, max_blocks)."""
    q_shape = _shape("q", q, "[batch, heads, t_q, head_dim]")
    if len(q_shape) != 4:
        raise ValueError(f"q must be [batch, heads, t_q, head_dim], got shape {q_shape}")
    batch, heads, t_q, head_dim = q_shape
    want = f"[num_blocks, block_size, kv_heads, head_dim={head_dim}]"
    k_shape = _shape("k_pages", k_pages, want)
    if len(k_shape) != 4 or k_shape[3] != head_dim:
        raise ValueError(f"k_pages must be {want} (q's head_dim), got shape {k_shape}")
    v_shape = _shape("v_pages", v_pages, want)
    if v_shape != k_shape:
        raise ValueError(f"v_pages must have k_pages's shape {k_shape}, got {v_shape}")
    num_blocks, block_size, kv_heads, _ = k_shape
    if block_size < 1 or kv_heads < 1:
        raise ValueError(
            f"k_pages must hold blocks of at least one token and kv head, got {k_shape}"
        )
    if heads % kv_heads:
        raise ValueError(
            f"q has heads={heads}, which is not a multiple of k_pages's kv_heads={kv_heads} "
            "(GQA: query head h reads kv head h // (heads / kv_heads))"
        )
    q_dtype = dtype_name(q.dtype)
    if kv_dtype is not None and kv_dtype not in fp8.FP8_DTYPES:
        raise TypeError(f"kv_dtype must be None or one of {fp8.FP8_DTYPES}, got {kv_dtype!r}")
    accepted = FP8_INPUT_DTYPES if kv_dtype else (*PAGE_DTYPES, "float64")
    if q_dtype not in accepted:
        raise TypeError(
            f"q has dtype {q_dtype}; paged_decode takes {accepted}"
            + (f" over {kv_dtype} pages" if kv_dtype else " (float64 on NumPy)")
        )
    page_dtype = CODE_DTYPE if kv_dtype else q_dtype
    for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if dtype_name(x.dtype) != page_dtype:
            raise TypeError(
                f"{name} has dtype {dtype_name(x.dtype)}; "
                + (
                    f"{kv_dtype} pages are their uint8 codes (a torch float8 tensor: "
                    "x.view(torch.uint8))"
                    if kv_dtype
                    else f"q has {q_dtype}, and the pages and q must share one dtype (uint8 "
                    "codes with kv_dtype for fp8 pages; cuattn never casts silently)"
                )
            )
    table_shape = _shape("block_table", block_table, f"int32 [batch={batch}, max_blocks]")
    if len(table_shape) != 2 or table_shape[0] != batch:
        raise ValueError(
            f"block_table must be [batch={batch}, max_blocks] (q's batch), got shape {table_shape}"
        )
    lens_shape = _shape("seq_lens", seq_lens, f"int32 [batch={batch}]")
    if lens_shape != (batch,):
        raise ValueError(f"seq_lens must be [batch={batch}] (q's batch), got shape {lens_shape}")
    for name, x in (("block_table", block_table), ("seq_lens", seq_lens)):
        if dtype_name(x.dtype) != INDEX_DTYPE:
            raise TypeError(
                f"{name} has dtype {dtype_name(x.dtype)}; it must be {INDEX_DTYPE}, as vLLM and "
                "FlashAttention hold it (cuattn never casts silently)"
            )
    return (batch, heads, t_q, head_dim, num_blocks, block_size, kv_heads, table_shape[1])


def _check_table(xp: Any, table: Any, lens: Any, num_blocks: int, block_size: int) -> np.ndarray:
    """The table's values, before any launch: every length in [0, max_blocks * block_size] and
    every entry a sequence reads (the first ceil(length / block_size) of its row) a block of
    k_pages. Reads the B lengths and one flag back to the host (the first bad entry's place
    when there is one). Returns the lengths (host int64)."""
    host_lens = host_array(lens).astype(np.int64)
    max_blocks = int(table.shape[1])
    room = max_blocks * block_size
    wrong = np.flatnonzero((host_lens < 0) | (host_lens > room))
    if wrong.size:
        b = int(wrong[0])
        raise ValueError(
            f"seq_lens[{b}] = {int(host_lens[b])}; a length must be in [0, max_blocks * "
            f"block_size = {max_blocks} * {block_size} = {room}] (block_table's room)"
        )
    used = xp.arange(max_blocks)[None, :] < xp.asarray(ceil_div(host_lens, block_size))[:, None]
    bad = used & ((table < 0) | (table >= num_blocks))
    if bool(bad.any()):
        b, j = (int(i) for i in np.argwhere(host_array(bad))[0])
        raise ValueError(
            f"block_table[{b}, {j}] = {int(table[b, j])}, a block sequence {b} reads (its "
            f"{int(host_lens[b])} tokens use its first {ceil_div(int(host_lens[b]), block_size)} "
            f"entries); block ids must be in [0, num_blocks = {num_blocks})"
        )
    return host_lens


def _chosen(xp: Any, block_mask: Any, sizes: tuple[int, int, int, int]) -> Any:
    """block_mask (bool or uint8, [batch, max_blocks], [batch, heads, max_blocks] or [batch,
    heads, t_q, max_blocks]) as the kernels' uint8 [batch, heads, t_q, max_blocks]."""
    batch, heads, t_q, max_blocks = sizes
    shape = tuple(int(d) for d in block_mask.shape)
    accepted = {
        (batch, max_blocks): (batch, 1, 1, max_blocks),
        (batch, heads, max_blocks): (batch, heads, 1, max_blocks),
        (batch, heads, t_q, max_blocks): (batch, heads, t_q, max_blocks),
    }
    if shape not in accepted:
        raise ValueError(
            f"block_mask must be [batch, max_blocks] = ({batch}, {max_blocks}), [batch, heads, "
            f"max_blocks] = ({batch}, {heads}, {max_blocks}) or [batch, heads, t_q, max_blocks] "
            f"= ({batch}, {heads}, {t_q}, {max_blocks}) (block_table's columns), got {shape}"
        )
    if dtype_name(block_mask.dtype) not in ("bool", "uint8"):
        raise TypeError(f"block_mask must be bool or uint8, got {dtype_name(block_mask.dtype)}")
    wide = xp.broadcast_to((block_mask != 0).reshape(accepted[shape]), sizes)
    return xp.ascontiguousarray(wide.astype(xp.uint8))


def _page_scales(
    xp: Any, name: str, scale: Any, kv_dtype: str | None, num_blocks: int, like: Any
) -> Any:
    """fp8 pages' scale ``name`` (k_scale, v_scale) as the kernels' float32 [num_blocks]: a
    number (one for the whole cache, vLLM's; default 1) filled in, or a float32 [num_blocks]
    array (one per block) as it is. None without fp8 pages."""
    if kv_dtype is None:
        if scale is not None:
            raise ValueError(f"{name} is for fp8 pages (kv_dtype=...); these pages hold values")
        return None
    if scale is None or isinstance(scale, (int, float, np.floating)):
        if isinstance(scale, bool) or not np.isfinite(1.0 if scale is None else scale):
            raise TypeError(f"{name} must be a finite number or a float32 array, got {scale!r}")
        return xp.full(num_blocks, 1.0 if scale is None else float(scale), dtype=xp.float32)
    info = dlpack.describe(scale, name)
    if info != dlpack.describe(like, "k_pages"):
        raise ValueError(f"{name} is a {info}; k_pages is a {dlpack.describe(like, 'k_pages')}")
    array = dlpack.to_backend(scale, info, name)
    if dtype_name(array.dtype) != "float32" or tuple(array.shape) != (num_blocks,):
        raise ValueError(
            f"{name} must be a number or float32 [num_blocks] = ({num_blocks},) (a scale per "
            f"block), got {dtype_name(array.dtype)} {tuple(array.shape)}"
        )
    return xp.ascontiguousarray(array)


@_quiet_specials
def reference_paged(
    qb: Any,
    k_pages: Any,
    v_pages: Any,
    table: Any,
    host_lens: np.ndarray,
    chosen: Any | None,
    call: AttentionCall,
    scales: tuple[Any, Any, str] | None = None,
) -> tuple[Any, Any]:
    """paged_decode's exact computation on NumPy (or CuPy) arrays, one (sequence, kv head) at
    a time: the tokens the table names, in order, through reference_rows (decode_attention's
    reference); fp8 pages (``scales``: k_scale, v_scale float32 [num_blocks], kv_dtype) read
    as their codes' values times their block's scale, as the kernels read them. Returns (out
    like q, lse float32, float64 for float64)."""
    xp = array_module(qb)
    batch, heads, t_q, head_dim = (int(d) for d in qb.shape)
    block_size, kv_heads = int(k_pages.shape[1]), int(k_pages.shape[2])
    group = heads // kv_heads
    acc = xp.float64 if dtype_name(qb.dtype) == "float64" else xp.float32
    out = xp.zeros((batch, heads, t_q, head_dim), dtype=acc)
    lse = xp.full((batch, heads, t_q), -np.inf, dtype=acc)
    host_table = host_array(table)
    host_chosen = None if chosen is None else host_array(chosen)
    for b in range(batch):
        length = int(host_lens[b])
        if length == 0:
            continue
        pos = np.arange(length)
        entry = pos // block_size
        blocks, offsets = xp.asarray(host_table[b, entry]), xp.asarray(pos % block_size)
        q_pos = np.arange(length - t_q, length)
        for h in range(kv_heads):
            heads_of = slice(h * group, (h + 1) * group)
            keys, values = k_pages[blocks, offsets, h], v_pages[blocks, offsets, h]
            if scales is not None:
                k_scale, v_scale, kv_dtype = scales
                keys = fp8.decode(xp, keys, kv_dtype) * k_scale[blocks][:, None]
                values = fp8.decode(xp, values, kv_dtype) * v_scale[blocks][:, None]
            rows = None if host_chosen is None else host_chosen[b, heads_of][..., entry] != 0
            out[b, heads_of], lse[b, heads_of], _ = reference_rows(
                xp, qb, call, b, heads_of, keys, values, q_pos, pos, rows, acc
            )
    return out.astype(qb.dtype), lse


def paged_decode(
    q: Any,
    k_pages: Any,
    v_pages: Any,
    block_table: Any,
    seq_lens: Any,
    scale: float | None = None,
    return_lse: bool = False,
    *,
    block_mask: Any = None,
    kv_dtype: str | None = None,
    k_scale: Any = None,
    v_scale: Any = None,
    softcap: float | None = None,
    alibi_slopes: Any = None,
    key_bias: Any = None,
    rel_bias: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: int | Any | None = None,
    backend: str | None = None,
    check_table: bool = True,
) -> Any:
    """Decode attention of each sequence's newest queries over a paged KV cache the caller
    owns, in vLLM's and FlashAttention's ``block_table`` layout.

    Query i of sequence b sits at position ``seq_lens[b] - t_q + i`` and attends, causally, the
    sequence's tokens at positions <= its own (the bottom-right causal rule of
    ``flash_attn_with_kvcache``); token t of sequence b is at block ``block_table[b, t //
    block_size]``, offset ``t % block_size``, for every kv head. Query head h reads kv head
    ``h // (heads / kv_heads)`` (GQA, MQA). Nothing is copied: the pages, the table and q are
    read where they are (torch, CuPy, jax or NumPy arrays, through DLPack).

    Args:
        q: [batch, heads, t_q, head_dim], cuattn's decode layout (decode_attention's; a
            ``[batch, t_q, heads, head_dim]`` tensor is ``q.transpose(1, 2)``); float16,
            bfloat16 or float32 (float64 on NumPy), the pages' dtype. t_q = 1 for a step, more
            for speculative or chunked decoding.
        k_pages: [num_blocks, block_size, kv_heads, head_dim], at any strides whose head_dim is
            contiguous and whose other strides are whole head_dim rows (a block axis of a
            larger cache, e.g. ``kv_cache[:, 0]`` of [num_blocks, 2, block_size, kv_heads,
            head_dim], is read in place).
        v_pages: like k_pages, same shape and strides.
        block_table: int32 [batch, max_blocks]: each sequence's blocks in token order; the
            entries past ``ceil(seq_lens[b] / block_size)`` are never read. Two sequences may
            name the same block (a shared prefix).
        seq_lens: int32 [batch]: tokens of each sequence in the cache, the new ones included;
            0 gives out 0 and lse -inf for that sequence.
        scale: the score scale; default ``head_dim ** -0.5``.
        return_lse: also return the log-sum-exp of each row's scores.
        block_mask: optional bool or uint8 [batch, max_blocks], [batch, heads, max_blocks] or
            [batch, heads, t_q, max_blocks] over block_table's columns: the blocks each
            sequence (query head, query) reads, the others skipped as if their tokens were
            masked (a page subset: Quest's choice, or the caller's). Tokens keep their
            positions. A row that reads nothing gives 0 and -inf.
        kv_dtype: None (the pages hold q's dtype) or "float8_e4m3fn" / "float8_e5m2": the
            pages are uint8 codes of that format (a torch float8 cache: ``x.view(torch.uint8)``)
            and q is float16 or bfloat16. On a GPU opt-in with CUATTN_DECODE_FP8=kernel, as
            KVCache's fp8 pages.
        k_scale: fp8 key pages' scale: a number for the whole cache (vLLM's; default 1) or
            float32 [num_blocks], one per block; a kept element is ``code * scale``.
        v_scale: fp8 value pages' scale, as k_scale.
        softcap: as in :func:`cuattn.sparse_attention`: ``softcap * tanh(s / softcap)``.
        alibi_slopes: float32 [heads] or [batch, heads]: adds ``-slope * (query position -
            token position)``.
        key_bias: float32 [batch, time_k] or [batch, heads, time_k], time_k at least the
            longest sequence: adds ``key_bias[b, (h,) token position]``.
        rel_bias: float32 [heads, 2M + 1] or [batch, heads, 2M + 1]: adds the column
            ``clamp(token position - query position, -M, M) + M``.
        dropout_p: Monte Carlo dropout of the probabilities, as in
            :func:`cuattn.decode_attention` (default 0.0).
        dropout_seed: its seed, as in :func:`cuattn.decode_attention`.
        backend: "numpy" (the reference; default for CPU arrays), "interp" (the decode
            kernels on the CPU) or "cuda" (default for CUDA arrays).
        check_table: True (default): seq_lens and the block ids a sequence reads are checked
            before any launch, which reads them back to the host (a synchronisation each call).
            False, for an engine that calls once a layer and vouches for its table (as vLLM's
            and FlashAttention's kernels assume): nothing is read back; each length is clamped
            to the table's room (max_blocks * block_size) on the device, a block id outside
            [0, num_blocks) that a sequence reads is undefined behaviour, and a key_bias must
            cover the table's room. The NumPy backend checks either way.

    Returns:
        out like q ([batch, heads, t_q, head_dim], q's dtype and kind of array); with
        ``return_lse`` also lse [batch, heads, t_q] (float32; float64 from the reference on
        float64), natural log, -inf for a row that attends nothing.

    Raises:
        TypeError: an argument that is not an array, a dtype the kernels do not take (q and
            the pages differing, block_table or seq_lens not int32, a block_mask neither bool
            nor uint8).
        ValueError: q requiring a gradient; shapes that do not fit (q's batch or head_dim,
            heads not a multiple of kv_heads, k_pages and v_pages differing), a seq_len outside
            [0, max_blocks * block_size], a block id a sequence reads outside [0, num_blocks),
            arrays of different frameworks or devices, strides the kernels cannot read. All
            before any kernel runs.

    Example:
        >>> out = cuattn.paged_decode(q, k_cache, v_cache, block_table, seq_lens)
        >>> for layer in range(num_layers):  # table checked by the caller: no sync per layer
        ...     out = cuattn.paged_decode(q, k[layer], v[layer], table, lens, check_table=False)
    """
    sizes = _check_shapes(q, k_pages, v_pages, block_table, seq_lens, kv_dtype)
    if not isinstance(check_table, bool):
        raise TypeError(f"check_table must be True or False, got {check_table!r}")
    batch, heads, t_q, head_dim, num_blocks, block_size, kv_heads, max_blocks = sizes
    named = {"q": q, "k_pages": k_pages, "v_pages": v_pages}
    named.update(block_table=block_table, seq_lens=seq_lens)
    if block_mask is not None:
        named["block_mask"] = block_mask
    info = dlpack.common_info(named)
    if dispatch.wants_gradient((q,)):
        raise ValueError(
            "q requires a gradient, which paged_decode does not compute (an inference call); "
            "call it under torch.no_grad() or outside jax transformations"
        )
    scale = decode_scale(scale, head_dim)
    mods = ScoreMods.from_arguments(softcap)
    mods, seed_words = dispatch.dropout_mods(mods, q, dropout_p, dropout_seed)
    impl = _backends.resolve_backend(backend, on_device=info.device == "cuda")
    with dlpack.stream_for(info), dlpack.on_device(info):
        arrays = {name: dlpack.to_backend(x, info, name) for name, x in named.items()}
        xp = array_module(arrays["q"])
        trusted = not check_table and isinstance(impl, KernelBackend)
        if trusted:  # nothing read back: the longest a sequence can be is the table's room
            host_lens, longest = None, max_blocks * block_size
        else:
            host_lens = _check_table(
                xp, arrays["block_table"], arrays["seq_lens"], num_blocks, block_size
            )
            longest = int(host_lens.max(initial=0))
        given = ScoreOperands(alibi_slopes, key_bias, rel_bias, dropout_seed=seed_words)
        checked_operands(q, (batch, heads, t_q, longest), given, covering=True)
        call = AttentionCall(None, scale, return_lse=bool(return_lse), backend=backend, mods=mods)
        operands = given.map(lambda name, x: dlpack.to_backend(x, info, name))
        call = call.with_operands(operands)
        chosen = None
        if block_mask is not None:
            chosen = _chosen(xp, arrays["block_mask"], (batch, heads, t_q, max_blocks))
        qb, kb, vb = arrays["q"], arrays["k_pages"], arrays["v_pages"]
        table = arrays["block_table"]
        k_scales, v_scales = (
            _page_scales(xp, name, x, kv_dtype, num_blocks, k_pages)
            for name, x in (("k_scale", k_scale), ("v_scale", v_scale))
        )
        scales = None if kv_dtype is None else (k_scales, v_scales, kv_dtype)
        if not isinstance(impl, KernelBackend):  # the NumPy backend: the reference
            out, lse = reference_paged(qb, kb, vb, table, host_lens, chosen, call, scales)
        elif batch == 0 or max_blocks == 0:  # nothing to read: every row is empty
            out = xp.zeros(qb.shape, qb.dtype)
            lse = xp.full((batch, heads, t_q), -np.inf, dtype=xp.float32)
        else:
            dtype = kv_dtype or dtype_name(qb.dtype)  # an fp8 kernel's geometry: its pages'
            gqa = geometry.decode_gqa_applies(head_dim, dtype)
            lengths = xp.asarray(arrays["seq_lens"], dtype=xp.int64)
            if trusted:  # the kernels then never walk past a table row
                lengths = xp.clip(lengths, 0, max_blocks * block_size)
            resident = _resident_ctas(impl, head_dim, dtype, gqa)
            out, lse = impl.decode_block_table(
                qb, kb, vb, table, lengths, chosen, call, resident, gqa=gqa, fp8=scales
            )
        out_q, lse_q = dlpack.from_backend(out, info), dlpack.from_backend(lse, info)
    return (out_q, lse_q) if return_lse else out_q
