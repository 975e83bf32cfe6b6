"""decode_attention: the newest queries of each sequence against the tokens a KVCache keeps.

q [batch, heads, t_q, head_dim] holds each sequence's last t_q positions (a step: t_q = 1;
speculative or chunked decoding: more), causal against the kept keys: query i of sequence b is
position L_b - t_q + i and sees the kept tokens at positions <= it. heads is a multiple of the
cache's kv_heads (GQA: query head h reads kv head h // (heads / kv_heads)). Quest reads only
the pages it chooses per query (cuattn.policies); HeavyHitters gets every attended token's
probability, summed over the query heads of its group and the t_q queries, added to its score.

NaN and inf (docs/design.md §7) propagate as in a dense float64 masked softmax over the kept
tokens, identically on the reference and the kernels: every row walks its whole page table, and
a token it may not attend has its score replaced by -inf, never multiplied; what follows for
each row, HeavyHitters' scores and Quest's page bounds: docs/serving.md, section "Special
values in decode".

Backends: a cache on a CUDA device runs the split-KV kernels (kernels/attn_decode.cu: the
splits of each page table in parallel; kernels/merge_states.cu: their merge), as does
``backend="interp"`` on the CPU; with CUATTN_DECODE=gqa the tensor-core kernel
(kernels/attn_decode_gqa.cu, which merges its own splits) takes the decodes it applies to
(geometry.decode_gqa_applies: fp16/bf16, head dims 16-256, modifiers and HeavyHitters too),
opt-in until a GPU has run it; a NumPy cache runs the reference by default: exact, written
with the array library, one (sequence, kv head) pair at a time. Quest's page choice is computed
on the cache's device from the per-page key bounds (kernels/quest_select.cu, one launch, or two
where a few long tables are split over the device, on the interpreter and on a GPU with
CUATTN_QUEST=kernel; the array library's operations otherwise);
HeavyHitters turns the kernel's per-token scores into probabilities with the merged lse in one
more kernel (no second pass over K) that adds them to the cache's scores where they are
(nothing read back).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from cuattn import backends as _backends
from cuattn._util import host_array, stable_kind
from cuattn.adapters import dispatch, dlpack
from cuattn.backends import geometry
from cuattn.backends.call import (
    AttentionCall,
    ScoreMods,
    ScoreOperands,
    checked_operands,
    rel_max_distance,
)
from cuattn.backends.cuda_runtime import device_arch_and_sms
from cuattn.backends.dropout import keep_mask, seed_of
from cuattn.backends.numpy_ref import modified_scores
from cuattn.serving.cache import KVCache

__all__ = [
    "decode_attention",
    "kernel_call",
    "kernel_decode",
    "quest_chosen",
    "quest_kernel_applies",
    "reference_decode",
    "reference_rows",
]

# Decode CTAs the interpreter pretends a device holds: small, so that tests split page tables.
INTERP_RESIDENT_CTAS = 8
T = TypeVar("T")


def _check(q: Any, cache: KVCache, scale: Any) -> float:
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a cuattn.KVCache, got {type(cache).__name__}")
    if not hasattr(q, "shape") or not hasattr(q, "dtype"):
        raise TypeError(f"q must be an array, got {type(q).__name__}")
    if dispatch.wants_gradient((q,)):
        # The cache holds values, not a graph: an output without a gradient would be silent.
        raise ValueError(
            "q requires a gradient, which decode_attention does not compute (the cache keeps "
            "values, not their graph); call it under torch.no_grad() or outside jax "
            "transformations, or train with sparse_attention"
        )
    shape = tuple(int(d) for d in q.shape)
    if len(shape) != 4 or shape[0] != cache.batch or shape[3] != cache.head_dim:
        raise ValueError(
            f"q must be [batch={cache.batch}, heads, t_q, head_dim={cache.head_dim}], got {shape}"
        )
    batch, heads, t_q, head_dim = shape
    if heads % cache.kv_heads:
        raise ValueError(
            f"q has heads={heads}, which is not a multiple of the cache's kv_heads={cache.kv_heads}"
        )
    cache.check_input_dtype("q", q)
    shortest = int(cache.lengths.min())
    if not 1 <= t_q <= shortest:
        raise ValueError(
            f"q has t_q={t_q} queries per sequence; they are each sequence's newest tokens, so "
            f"1 <= t_q <= the shortest sequence ({shortest} tokens appended)"
        )
    cache._check_device("q", q)
    return decode_scale(scale, head_dim)


def decode_scale(scale: Any, head_dim: int) -> float:
    """A decode call's score scale: a real number, or None for 1 / sqrt(head_dim)."""
    if scale is None:
        return float(head_dim) ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    return float(scale)


def _quiet_specials(fn: Callable[..., T]) -> Callable[..., T]:
    """NaN and inf take the course of a dense computation (module doc): the invalid operations
    and overflows that carry them are expected, not warned about. A fresh errstate per call."""

    @functools.wraps(fn)
    def quiet(*args: Any, **kwargs: Any) -> T:
        with np.errstate(invalid="ignore", over="ignore"):
            return fn(*args, **kwargs)

    return quiet


def _page_bounds(xp: Any, qf: Any, lo: Any, hi: Any) -> Any:
    """Quest's bound of float32 queries qf [..., n, d] against pages' key bounds lo, hi [...,
    pages, d]: sum_i max(q_i lo_i, q_i hi_i) = max(q, 0) . hi + min(q, 0) . lo, two matrix
    products (no [pages, d] product per query), [..., n, pages]. The reference and the device
    path share it, so that special values give both the same bound: a NaN one (a NaN key or
    query element, or 0 * inf) becomes +inf, a page read ahead of every other."""
    positive, negative = xp.maximum(qf, 0), xp.minimum(qf, 0)
    bound = positive @ xp.swapaxes(hi, -1, -2) + negative @ xp.swapaxes(lo, -1, -2)
    return xp.where(xp.isnan(bound), xp.inf, bound)


@_quiet_specials
def _quest_pages(cache: KVCache, b: int, h: int, q_group: Any, length: int) -> np.ndarray:
    """bool [g, t_q, pages in table order]: the pages each query reads (Quest)."""
    xp, policy = cache.xp, cache.policy
    table = cache.pages(b, h)
    lo, hi = cache.page_bounds(xp.asarray(table))
    bound = _page_bounds(xp, q_group.astype(xp.float32), lo, hi)  # [g, t_q, pages]
    bound = host_array(bound)
    newest = (length - 1) // cache.page_size
    chosen = np.zeros(bound.shape, dtype=bool)
    chosen[..., newest] = True
    others = np.delete(np.arange(len(table)), newest)
    order = np.argsort(-bound[..., others], axis=-1, kind="stable")[..., : policy.pages]
    np.put_along_axis(chosen, others[order], True, axis=-1)
    return chosen


def _resident_ctas(impl: Any, head_dim: int, dtype: str, gqa: bool) -> int:
    """Decode CTAs (attn_decode_gqa's with ``gqa``) the current device holds at once."""
    if not impl.on_gpu:
        return INTERP_RESIDENT_CTAS
    arch, sms = device_arch_and_sms()
    if gqa:
        return geometry.decode_gqa_resident_ctas(arch, sms, head_dim, dtype)
    return geometry.decode_resident_ctas(arch, sms, head_dim, dtype)


def _quest_resident_ctas(impl: Any, head_dim: int) -> int:
    """quest_select CTAs the current device holds at once (its table splits follow)."""
    if not impl.on_gpu:
        return INTERP_RESIDENT_CTAS
    arch, sms = device_arch_and_sms()
    return geometry.quest_resident_ctas(arch, sms, head_dim)


def quest_kernel_applies(impl: Any, qb: Any) -> bool:
    """Whether Quest's choice runs kernels/quest_select.cu: on a kernel backend
    (``impl.quest_select``), for q of a kernel dtype and head dim, on the interpreter always and
    on a GPU where CUATTN_QUEST=kernel asks for it (opt-in until a GPU has run it)."""
    if impl is None or not hasattr(impl, "quest_select"):
        return False
    if np.dtype(qb.dtype).name not in geometry.DTYPES or int(qb.shape[3]) not in geometry.HEAD_DIMS:
        return False
    return not impl.on_gpu or geometry.quest_family() == geometry.QUEST_KERNEL_FAMILY


@_quiet_specials
def quest_chosen(cache: KVCache, qb: Any, table: Any, count: Any, impl: Any = None) -> Any:
    """uint8 [B, H, t_q, max_pages]: the pages each query reads (Quest), on the device, by the
    bound _page_bounds computes from the cache's page_bounds (float32, or its bfloat16 bits
    widened). With a kernel backend ``impl`` where quest_kernel_applies: kernels/quest_select.cu
    (its bounds summed in a fixed float32 order, 0 past each table's page count; each table
    split over CTAs where the pairs are too few to fill the device, then a selection kernel);
    otherwise the array library's operations below."""
    if quest_kernel_applies(impl, qb):
        resident = _quest_resident_ctas(impl, int(qb.shape[3]))
        return impl.quest_select(
            qb, cache.key_min, cache.key_max, table, count, cache.policy.pages, resident
        )
    xp, policy = cache.xp, cache.policy
    batch, heads, t_q, head_dim = qb.shape
    kv_heads, max_pages = table.shape[1], table.shape[2]
    group = heads // kv_heads
    safe = xp.maximum(table, 0)
    lo, hi = cache.page_bounds(safe)  # [B, Hkv, max_pages, d] float32
    qf = qb.astype(xp.float32).reshape(batch, kv_heads, group * t_q, head_dim)
    bound = _page_bounds(xp, qf, lo, hi).reshape(batch, kv_heads, group, t_q, max_pages)
    page = xp.arange(max_pages)
    newest = (count - 1)[:, :, None, None, None]
    # only real pages other than the newest compete; ties go to the lower page
    ranked = xp.where((page < count[:, :, None, None, None]) & (page != newest), bound, -xp.inf)
    order = xp.argsort(-ranked, axis=-1, **stable_kind(xp))[..., : policy.pages]
    chosen = xp.zeros(ranked.shape, dtype=xp.uint8)
    xp.put_along_axis(chosen, order, 1, axis=-1)
    chosen = xp.where(page == newest, 1, chosen).astype(xp.uint8)
    return chosen.reshape(batch, heads, t_q, max_pages)


def kernel_call(
    impl: Any,
    cache: KVCache,
    qb: Any,
    call: AttentionCall,
    chosen: Any | None = None,
    keep_scores: bool = False,
) -> tuple[Any, Any, Any | None]:
    """The decode kernels (``impl.decode_pages``) on q and the arrays ``cache`` keeps where they
    run: (out, lse, per-token scores or None). No policy work: kernel_decode adds that. The
    kernel route: attn_decode_gqa where CUATTN_DECODE=gqa asks for it and it applies
    (geometry.decode_gqa_applies), attn_decode_split otherwise."""
    gqa = geometry.decode_gqa_applies(cache.head_dim, cache.dtype)
    table, count = cache.device_tables()
    # fp8 pages: their codes, their pages' scales
    fp8 = (cache.k_scale, cache.v_scale, cache.dtype) if cache.quantized else None
    book = dict(
        slot_pos=cache.device_slot_pos(),
        page_table=table,
        page_count=count,
        lengths=cache.device_lengths(),
    )
    return impl.decode_pages(
        qb,
        cache.k_pages,
        cache.v_pages,
        book,
        chosen,
        call,
        keep_scores,
        _resident_ctas(impl, cache.head_dim, cache.dtype, gqa),
        gqa=gqa,
        fp8=fp8,
    )


def kernel_decode(impl: Any, qb: Any, cache: KVCache, call: AttentionCall) -> tuple[Any, Any]:
    """A kernel backend's decode (its ``decode``): Quest's page choice on the device, the
    kernels, then HeavyHitters' token scores from the per-token scores and the merged lse."""
    quest = cache.policy is not None and cache.policy.selects_pages
    keep_scores = cache.policy is not None and cache.policy.scores_tokens
    chosen = None
    if quest:
        table, count = cache.device_tables()
        chosen = quest_chosen(cache, qb, table, count, impl=impl)
    out, lse, scores = kernel_call(impl, cache, qb, call, chosen, keep_scores)
    if keep_scores:  # each kept token's probability, from its score and the merged lse
        impl.decode_mass(scores, lse, *cache.device_tables(), cache.slot_score)
    return out, lse


def decode_attention(
    q: Any,
    cache: KVCache,
    scale: float | None = None,
    return_lse: bool = False,
    *,
    softcap: float | None = None,
    alibi_slopes: Any = None,
    key_bias: Any = None,
    rel_bias: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: int | Any | None = None,
    backend: str | None = None,
) -> Any:
    """Exact attention of each sequence's newest queries over the tokens a KVCache keeps.

    Query i of sequence b (of L_b tokens appended) sits at position ``L_b - t_q + i`` and
    attends, causally, exactly the tokens the cache keeps (``cache.positions()``) at positions
    <= its own; query head h reads kv head ``h // (heads / kv_heads)`` (GQA, MQA). The policy
    takes part: Quest reads only the pages it chooses per query, and HeavyHitters adds each
    attended token's probability (summed over its kv group's query heads and the t_q queries)
    to the token's score. The score modifiers apply by the kept tokens' positions (an evicted
    token's neighbours keep their distance). NaN and inf propagate as in a dense masked
    softmax over the kept tokens: docs/serving.md, section "Special values in decode"; the
    kernels and their costs: its section "The cache, the decode kernels, the policies".

    Args:
        q (array): [batch, heads, t_q, head_dim], each sequence's newest t_q tokens (a step:
            t_q = 1; speculative or chunked decoding: more, at most the shortest sequence);
            the cache's batch and head_dim, heads a multiple of its kv_heads, its dtype (float16
            or bfloat16 for an fp8 cache), on its device; any array library (DLPack).
        cache (KVCache): the keys and values, after the append of the queries' own tokens.
        scale (float, optional): the score scale; None (default) is ``1 / sqrt(head_dim)``.
        return_lse (bool): also return each row's log-sum-exp (default False).
        softcap (float, optional): as in :func:`cuattn.sparse_attention`: ``softcap *
            tanh(s / softcap)`` before the biases (HeavyHitters then scores the capped
            probabilities; Quest's page bounds keep their order, the cap being monotone). None
            or 0 (default): off. Keyword only.
        alibi_slopes (array, optional): float32 [heads] or [batch, heads], q's kind of array:
            adds ``-slope * (query position - token position)`` after the cap. Keyword only.
        key_bias (array, optional): float32 [batch, time_k] or [batch, heads, time_k], time_k
            at least the longest sequence: adds ``key_bias[b, (h,) token position]`` to each
            kept token's score. Keyword only.
        rel_bias (array, optional): float32 [heads, 2 M + 1] or [batch, heads, 2 M + 1]: adds
            the column ``clamp(token position - query position, -M, M) + M``. Quest's page
            bounds leave the biases out. Keyword only.
        dropout_p (float): Monte Carlo dropout (an inference call computes no gradient): each
            row's probability of a token is dropped, or scaled by ``1 / (1 - p)``, after the
            softmax, by the generator at (query position, token position, query head, batch);
            the lse and HeavyHitters' scores are of every probability. In [0, 1), default 0.0
            (off). Keyword only.
        dropout_seed (int | array, optional): the dropout mask's key, as in
            :func:`cuattn.sparse_attention`. Keyword only.
        backend (str, optional): ``"numpy"`` (the exact reference; default for a host cache),
            ``"interp"`` (the decode kernels on the CPU) or ``"cuda"`` (default for a cache on
            a GPU). Keyword only.

    Returns:
        out like q ([batch, heads, t_q, head_dim], q's dtype and kind of array); with
        ``return_lse=True`` the pair ``(out, lse)``, lse [batch, heads, t_q] (float32 from the
        kernels, float64 from the reference on float64), natural log, -inf for a row that
        attends nothing (whose out is 0).

    Raises:
        TypeError: ``cache`` not a KVCache; q not an array or of a dtype the cache does not
            take; ``scale``, ``softcap``, ``dropout_p`` or ``dropout_seed`` of the wrong type; a
            score operand not an array of q's kind, or of the wrong dtype.
        ValueError: q requiring a gradient; q's shape not fitting the cache (batch, head_dim,
            heads not a multiple of kv_heads, t_q outside [1, the shortest sequence]); q on
            another device than the cache; a value out of range (``softcap`` < 0, ``dropout_p``
            outside [0, 1), a seed outside [0, 2^63)); a score operand's shape not fitting; the
            backend unknown or not fitting the cache's device, or without a decode kernel for
            the cache (its head dim; fp8 pages on a GPU without ``CUATTN_DECODE_FP8=kernel``).

    Example:
        >>> import numpy as np, cuattn
        >>> cache = cuattn.KVCache(batch=1, kv_heads=2, head_dim=64, dtype="float32")
        >>> k = np.random.randn(1, 2, 10, 64).astype(np.float32)
        >>> cache.append(k, k)
        >>> q = np.random.randn(1, 8, 1, 64).astype(np.float32)  # 8 query heads on 2 kv heads
        >>> cuattn.decode_attention(q, cache).shape
        (1, 8, 1, 64)
    """
    scale = _check(q, cache, scale)
    mods = ScoreMods.from_arguments(softcap)
    batch, heads = int(q.shape[0]), int(q.shape[1])
    # a seed held in an array travels as a score operand
    mods, seed_words = dispatch.dropout_mods(mods, q, dropout_p, dropout_seed)
    longest = int(cache.lengths.max(initial=0))
    given = ScoreOperands(alibi_slopes, key_bias, rel_bias, dropout_seed=seed_words)
    checked_operands(q, (batch, heads, int(q.shape[2]), longest), given, covering=True)
    call = AttentionCall(None, scale, return_lse=bool(return_lse), backend=backend, mods=mods)
    info = dlpack.describe(q, "q")
    impl = _backends.resolve_backend(backend, on_device=cache.xp is not np)
    with dlpack.stream_for(info), dlpack.on_device(cache.info):
        qb = dlpack.to_backend(q, info, "q")
        operands = given.map(lambda name, x: dlpack.to_backend(x, info, name))
        out, lse = impl.decode(qb, cache, call.with_operands(operands))
        out_q, lse_q = dlpack.from_backend(out, info), dlpack.from_backend(lse, info)
    return (out_q, lse_q) if return_lse else out_q


@_quiet_specials
def reference_decode(qb: Any, cache: KVCache, call: AttentionCall) -> tuple[Any, Any]:
    """The exact computation, one (sequence, kv head) pair at a time: every row of the kv group
    against every kept token (module doc), as dense arithmetic takes NaN and inf: the NumPy
    backend's decode."""
    xp = cache.xp
    batch, heads, t_q, head_dim = (int(d) for d in qb.shape)
    group = heads // cache.kv_heads
    acc = xp.float64 if cache.dtype == "float64" else xp.float32
    scores = cache.policy is not None and cache.policy.scores_tokens
    quest = cache.policy is not None and cache.policy.selects_pages
    out = xp.zeros((batch, heads, t_q, head_dim), dtype=acc)
    lse = xp.full((batch, heads, t_q), -np.inf, dtype=acc)
    for b in range(batch):
        length = int(cache.lengths[b])
        q_pos = np.arange(length - t_q, length)
        for h in range(cache.kv_heads):
            pages, offsets, pos = cache.kept(b, h)
            if pos.size == 0:
                continue
            heads_of = slice(h * group, (h + 1) * group)
            keys, values = cache.token_values(xp.asarray(pages), xp.asarray(offsets))
            chosen = None
            if quest:
                chosen_pages = _quest_pages(cache, b, h, qb[b, heads_of], length)
                where = {page: i for i, page in enumerate(cache.pages(b, h))}
                chosen = chosen_pages[..., np.array([where[p] for p in pages])]
            out[b, heads_of], lse[b, heads_of], prob = reference_rows(
                xp, qb, call, b, heads_of, keys, values, q_pos, pos, chosen, acc
            )
            if scores:
                # a NaN probability (a NaN row) adds nothing: the scores stay finite
                mass = xp.where(xp.isnan(prob), 0.0, prob).sum(axis=(0, 1))
                mass = host_array(mass)
                cache.slot_score[pages, offsets] += mass
    return out.astype(qb.dtype), lse


@_quiet_specials
def reference_rows(
    xp: Any,
    qb: Any,
    call: AttentionCall,
    b: int,
    heads_of: slice,
    keys: Any,
    values: Any,
    q_pos: np.ndarray,
    pos: np.ndarray,
    chosen: np.ndarray | None,
    acc: Any,
) -> tuple[Any, Any, Any]:
    """The exact rows of sequence ``b``'s query heads ``heads_of`` (one kv group: qb[b,
    heads_of], [g, t_q, head_dim], at positions ``q_pos`` [t_q]) against the tokens ``keys``,
    ``values`` [n, head_dim] at positions ``pos`` [n] (host ints), causal, with the call's scale
    and score modifiers, and where ``chosen`` (bool [g, t_q, n], or None: every token) says
    which tokens each row may read: (out [g, t_q, head_dim], lse [g, t_q], each row's
    probabilities [g, t_q, n]) in ``acc``. NaN and inf as the module doc says. The reference
    of decode_attention (reference_decode) and of paged_decode (cuattn/serving/paged.py)."""
    scale, mods, operands = call.scale, call.mods, call.operands
    slopes, key_bias, rel_bias = operands.alibi_slopes, operands.key_bias, operands.rel_bias
    seed = mods.dropout_seed
    if operands.dropout_seed is not None:  # the reference reads the key on the host
        words = operands.dropout_seed
        seed = seed_of(host_array(words))
    batch, heads = int(qb.shape[0]), int(qb.shape[1])
    keys, values = keys.astype(acc), values.astype(acc)
    s = (qb[b, heads_of].astype(acc) @ keys.T) * scale  # [g, t_q, n]
    s = modified_scores(s, mods, xp)
    if slopes is not None:  # ALiBi: -slope * (query position - token position)
        slope = xp.broadcast_to(slopes, (batch, heads))[b, heads_of].astype(acc)
        distance = xp.asarray((q_pos[:, None] - pos[None, :]).astype(np.float64))
        s = s - slope[:, None, None] * distance.astype(acc)
    if key_bias is not None:  # the bias of each kept token's position
        rows = key_bias[b] if key_bias.ndim == 2 else key_bias[b, heads_of]
        s = s + rows[..., xp.asarray(pos)].astype(acc)[..., None, :]
    if rel_bias is not None:  # the table's column of (token - query position)
        reach = rel_max_distance(rel_bias)
        table = rel_bias if rel_bias.ndim == 2 else rel_bias[b]
        column = np.clip(pos[None, :] - q_pos[:, None], -reach, reach) + reach
        s = s + table[heads_of][:, xp.asarray(column)].astype(acc)
    allowed = np.broadcast_to(pos[None, :] <= q_pos[:, None], s.shape)
    if chosen is not None:
        allowed = allowed & chosen
    allowed = xp.asarray(np.ascontiguousarray(allowed))
    s = xp.where(allowed, s, -xp.inf)  # replaced, never multiplied
    m = s.max(axis=-1, keepdims=True)  # NaN-propagating
    # Nothing but -inf: shift by 0 so that exp gives 0, not NaN. NaN and +inf stay: a NaN p
    # (NaN score, or +inf - +inf) makes the row NaN, as the dense computation.
    m = xp.where(m == -xp.inf, 0.0, m)
    p = xp.where(allowed, xp.exp(s - m), 0.0)
    total = p.sum(axis=-1, keepdims=True)
    # total == 0: no allowed key, or only -inf scores: 0 and -inf, written whatever p @ values
    # holds (0 * NaN from a kept v); a NaN total gives NaN for both
    empty = total == 0
    safe = xp.where(empty, 1.0, total)
    kept = p
    if mods.dropout_p:  # after the sums: the lse and the scores are of every p
        query_heads = np.arange(heads_of.start, heads_of.stop)[:, None, None]
        mask = keep_mask(mods.dropout_p, seed, b, query_heads, q_pos[:, None], pos)
        kept = xp.where(xp.asarray(mask), p / (1.0 - mods.dropout_p), 0.0)
    out = xp.where(empty, 0.0, (kept @ values) / safe)
    lse = xp.where(empty, -xp.inf, m + xp.log(safe))[..., 0]
    return out, lse, p / safe
