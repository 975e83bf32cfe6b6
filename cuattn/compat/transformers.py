"""cuattn as a Hugging Face transformers attention implementation: attn_implementation="cuattn".

    import cuattn.compat.transformers                     # registers "cuattn" (idempotent)
    cfg.cuattn_pattern = {"attn_mode": "fixed", "blocksize": 64, "local_attn_ctx": 128,
                          "num_verts": 4, "vertsize": 1}  # optional; default dense ("all")
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="cuattn")

Every attention layer of the model then runs cuattn with a :class:`cuattn.Pattern` made from
``config.cuattn_pattern`` (make_layout's arguments; the layer decides ``causal``, ``heads``,
``n_ctx`` and ``n_q``). Padding, 4-D masks and packed rows run as a packed varlen batch; Gemma
2's softcap, T5's relative-position bias and attention dropout map onto cuattn's modifiers;
``Cache(policy=...)`` keeps generate's KV cache in cuattn's paged KVCache. All of it, the
supported releases and what is refused: docs/frameworks.md, section "Hugging Face
transformers", and docs/serving.md, section "In Hugging Face generate".
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from cuattn import api
from cuattn.compat.distance_bias import distance_table
from cuattn.compat.hf_cache import Cache, cache_keyword, take_layer
from cuattn.layout.pattern import Pattern
from cuattn.layout.registry import modes

__all__ = [
    "DEFAULT_PATTERN",
    "Cache",
    "NAME",
    "cache_keyword",
    "attention_forward",
    "check_config",
    "mask_forward",
    "pattern_of",
    "register",
]

NAME = "cuattn"
CONFIG_ATTRIBUTE = "cuattn_pattern"
DEFAULT_BLOCKSIZE = 64
DEFAULT_PATTERN = {"attn_mode": "all", "blocksize": DEFAULT_BLOCKSIZE}
DENSE_MODE = "all"
WINDOW_MODE = "local"

# make_layout's arguments that each attention layer decides, so a config must not set them.
LAYER_KEYS = {
    "causal": "the layer is causal or not (a decoder's self-attention or an encoder's)",
    "heads": "it is the layer's number of query heads",
    "n_ctx": "each call's keys give the length",
    "n_q": "each call's queries give the length",
}

# Parsed config specs, by their text: the parse is not repeated for every layer of every
# forward.
_SPECS: dict[str, tuple[str, int, dict[str, Any]]] = {}


def _spec(config: Any) -> tuple[str, int, dict[str, Any]]:
    """(attn_mode, blocksize, other make_layout arguments) of ``config.cuattn_pattern``."""
    raw = getattr(config, CONFIG_ATTRIBUTE, None)
    if raw is None:
        raw = DEFAULT_PATTERN
    if not isinstance(raw, Mapping):
        raise TypeError(
            f"config.{CONFIG_ATTRIBUTE} must be a dict of make_layout's arguments (with "
            f"'attn_mode'), got {type(raw).__name__} {raw!r}"
        )
    text = repr(sorted(raw.items(), key=lambda item: str(item[0])))
    if text in _SPECS:
        mode, blocksize, options = _SPECS[text]
        return mode, blocksize, dict(options)
    spec = dict(raw)
    if "mode" in spec:
        raise ValueError(
            f"config.{CONFIG_ATTRIBUTE} names its pattern with 'attn_mode', as make_layout "
            f"does, not 'mode': got {raw!r}"
        )
    if "attn_mode" not in spec:
        raise ValueError(
            f"config.{CONFIG_ATTRIBUTE} must name its pattern with 'attn_mode' (one of "
            f"{modes()}), got {raw!r}"
        )
    for key, why in LAYER_KEYS.items():
        if key in spec:
            raise ValueError(
                f"config.{CONFIG_ATTRIBUTE} must not set {key!r} (got {key}={spec[key]!r}): "
                f"each attention layer decides it, because {why}"
            )
    mode = spec.pop("attn_mode")
    if not isinstance(mode, str) or mode not in modes():
        raise ValueError(
            f"config.{CONFIG_ATTRIBUTE}['attn_mode'] must be one of {modes()}, got {mode!r}"
        )
    blocksize = spec.pop("blocksize", DEFAULT_BLOCKSIZE)
    _SPECS[text] = (mode, blocksize, dict(spec))
    return mode, blocksize, spec


def _pattern(mode: str, heads: int, blocksize: int, causal: bool, options: dict) -> Pattern:
    try:
        return Pattern(mode, heads, blocksize, causal=causal, **options)
    except (TypeError, ValueError) as err:
        raise type(err)(f"config.{CONFIG_ATTRIBUTE}: {err}") from err


def check_config(config: Any, heads: int | None = None) -> None:
    """Validate ``config.cuattn_pattern`` now, with every check that needs no sequence length.

    transformers gives a custom attention implementation no hook when a model is built, so the
    adapter runs this itself at the start of every forward (in the mask function, before any
    layer); call it after setting the attribute to fail even earlier.

    Args:
        config (PretrainedConfig): the model's config; without ``cuattn_pattern`` the default
            (dense) pattern is checked.
        heads (int, optional): the query heads; None (default) is
            ``config.num_attention_heads`` (heads-dependent checks, e.g. num_verts dividing
            heads, are skipped when neither is known).

    Raises:
        TypeError: ``cuattn_pattern`` is not a dict; an argument of the wrong type, or one the
            pattern does not take.
        ValueError: no or an unknown ``attn_mode``; a key a layer decides (``causal``,
            ``heads``, ``n_ctx``, ``n_q``); a value the pattern refuses.
    """
    mode, blocksize, options = _spec(config)
    heads = heads if heads is not None else getattr(config, "num_attention_heads", None)
    if isinstance(heads, int) and heads > 0:
        causal = bool(getattr(config, "is_causal", True))
        _pattern(mode, heads, blocksize, causal, options)


def pattern_of(config: Any, heads: int, causal: bool, sliding_window: int | None = None) -> Pattern:
    """The Pattern a layer runs: ``config.cuattn_pattern`` (or DEFAULT_PATTERN) for ``heads``.

    Args:
        config (PretrainedConfig): the model's config.
        heads (int): the layer's query heads.
        causal (bool): whether the layer is causal.
        sliding_window (int, optional): the layer's sliding window (Mistral-style), run as the
            ``local`` pattern; only with the dense pattern. None (default): no window.

    Returns:
        Pattern: the layer's pattern.

    Raises:
        TypeError: as :func:`check_config`.
        ValueError: a sliding window with a pattern other than the dense one; as
            :func:`check_config`.
    """
    mode, blocksize, options = _spec(config)
    if sliding_window is not None:
        if mode != DENSE_MODE:
            raise ValueError(
                f"this layer has sliding_window={sliding_window} and config.{CONFIG_ATTRIBUTE} "
                f"asks for attn_mode={mode!r}; cuattn runs a sliding window as the 'local' "
                "pattern of the dense mode only"
            )
        mode, options = WINDOW_MODE, {"local_attn_ctx": int(sliding_window)}
    return _pattern(mode, heads, blocksize, causal, options)


def _refuse(name: str, why: str) -> None:
    raise ValueError(f"attn_implementation='cuattn' does not support {name}: {why}")


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[batch, heads, time, dim] -> [batch * time, heads, dim] (the varlen token order)."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0))


# The packed path reads data (which tokens are kept, cu_seqlens, the layout built on the host),
# so it runs eagerly under torch.compile (a graph break), as FlashAttention's varlen path does.
@torch.compiler.disable
def _varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    pattern: Pattern,
    scores: dict[str, float | None],
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    keep_q: torch.Tensor | None = None,
    keep_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the sequences ``cu_q``/``cu_k`` cut from the flattened tokens (those of
    ``keep_*`` when given: flat indices), scattered back to [batch, q_len, heads, head_dim] with
    zeros at queries that are not kept."""
    batch, heads, q_len, head_dim = query.shape
    q, k, v = _flat(query), _flat(key), _flat(value)
    if keep_q is not None:
        q = q.index_select(0, keep_q)
    if keep_k is not None:
        k, v = k.index_select(0, keep_k), v.index_select(0, keep_k)
    out = api.sparse_attention_varlen(q, k, v, cu_q, cu_k, pattern.layout, **scores)
    if keep_q is not None:
        out = out.new_zeros(batch * q_len, heads, head_dim).index_copy(0, keep_q, out)
    return out.reshape(batch, q_len, heads, head_dim)


@torch.compiler.disable
def _padding_of_4d(
    mask: torch.Tensor, causal: bool, window: int | None, batch: int, q_len: int
) -> torch.Tensor:
    """The 2-D padding mask [batch, kv] a 4-D mask is made of, when it is that padding combined
    with the layer's rule (causal or not, window) in the kept tokens' own positions; a
    ValueError naming the mask otherwise. Rows of padded queries are not compared: their
    output is zeros here, whatever the mask says."""
    name = f"a 4-D attention_mask of shape {tuple(mask.shape)}"
    if mask.shape[0] not in (1, batch) or mask.shape[2] not in (1, q_len) or mask.shape[3] < q_len:
        raise ValueError(
            f"attention_mask of shape {tuple(mask.shape)} does not fit a batch of {batch} with "
            f"{q_len} queries: a 4-D mask is [batch or 1, heads or 1, q_len or 1, kv_len]"
        )
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.dtype.is_floating_point:
        # transformers' additive masks: 0 where allowed, finfo.min (or -inf) where masked.
        blocked = mask <= torch.finfo(mask.dtype).min / 2
        if not ((mask == 0) | blocked).all():
            _refuse(
                name,
                "it adds values other than 0 and a large negative number to the scores (a "
                "score bias), which cuattn cannot express as blocks and a rule",
            )
        allowed = ~blocked
    else:
        raise TypeError(
            f"attention_mask must be bool or floating point (additive) when 4-D, got {mask.dtype}"
        )
    if not (allowed == allowed[:, :1]).all():
        _refuse(name, "it differs between heads; cuattn reads one padding mask per sequence")
    allowed = allowed[:, 0].expand(batch, q_len, -1)  # [batch, 1, 1, kv]: BERT's older form
    keep = allowed.any(dim=1)  # a kept key is one some query sees
    position = keep.cumsum(1) - 1  # the kept tokens' own positions: padding removed
    q_pos = position[:, -q_len:, None]
    k_pos = position[:, None, :]
    expected = keep[:, None, :] & ((k_pos <= q_pos) if causal else torch.ones_like(allowed))
    if window is not None:
        near = (q_pos - k_pos < window) if causal else ((q_pos - k_pos).abs() < window)
        expected = expected & near
    rows = keep[:, -q_len:, None]
    if ((allowed != expected) & rows).any():
        rule = ("causal" if causal else "bidirectional") + (
            f" with sliding_window={window}" if window is not None else ""
        )
        _refuse(
            name,
            f"it is not a padding mask combined with the layer's {rule} rule; express the "
            "pattern as config.cuattn_pattern, or pack the sequences (position_ids that "
            "restart, or cuattn.sparse_attention_varlen)",
        )
    return keep


@torch.compiler.disable
def _padded(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    keep: torch.Tensor,
    pattern: Pattern,
    scores: dict[str, Any],
    causal: bool,
) -> torch.Tensor:
    """Attention of a padded batch: ``keep`` [batch, L] marks the real tokens of the first L
    keys (L < kv_len only with a static cache, whose tail past the mask is unused). A causal
    layer's queries are the last q_len of them (decoding with a cache); a bidirectional layer
    with fewer queries than keys attends across (an encoder-decoder's cross attention: the mask
    is the encoder's, and every query is one)."""
    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    queries_in_mask = causal or q_len == keep.shape[1]
    if (
        keep.shape[0] != batch
        or keep.shape[1] > kv_len
        or queries_in_mask
        and q_len > keep.shape[1]
    ):
        raise ValueError(
            f"attention_mask of shape {tuple(keep.shape)} does not fit a batch of {batch} with "
            f"{q_len} queries and {kv_len} keys: a 2-D mask is [batch, kv_len], a causal "
            "layer's queries being its last q_len positions"
        )
    if keep.dtype != torch.bool:
        if not ((keep == 0) | (keep == 1)).all():
            raise ValueError(
                "attention_mask must hold 1 for tokens and 0 for padding when 2-D, got other "
                f"values (dtype {keep.dtype})"
            )
        keep = keep != 0
    if keep.all():
        out = api.sparse_attention(
            query, key[:, :, : keep.shape[1]], value[:, :, : keep.shape[1]], pattern, **scores
        )
        return out.transpose(1, 2)
    length = keep.shape[1]
    if "rel_bias" in scores:
        _check_padding_keeps_distances(keep, q_len)
    key, value = key[:, :, :length], value[:, :, :length]
    if queries_in_mask:
        keep_q = keep[:, length - q_len :]
    else:
        keep_q = torch.ones(batch, q_len, dtype=torch.bool, device=keep.device)
    flat_k = torch.nonzero(keep.reshape(-1)).reshape(-1)
    flat_q = torch.nonzero(keep_q.reshape(-1)).reshape(-1)
    cu_k = _cu_seqlens(keep.sum(1))
    cu_q = _cu_seqlens(keep_q.sum(1))
    return _varlen(query, key, value, pattern, scores, cu_q, cu_k, flat_q, flat_k)


def _check_padding_keeps_distances(keep: torch.Tensor, q_len: int) -> None:
    """A position_bias over a padded batch runs on each row's tokens packed together: right
    only where padding is at a row's ends (the distances between its tokens do not change) and
    the queries are all the tokens (a packed call has one query offset)."""
    if q_len != keep.shape[1]:
        _refuse(
            "position_bias with padding while decoding (queries fewer than keys)",
            "the packed sequences would need one query offset each",
        )
    position = torch.arange(keep.shape[1], device=keep.device)
    first = torch.where(keep, position, keep.shape[1]).amin(1)
    last = torch.where(keep, position, -1).amax(1)
    if bool(((last - first + 1).clamp(min=0) != keep.sum(1)).any()):
        _refuse(
            "position_bias with padding between a row's tokens",
            "packing the row's tokens would change the distances between them",
        )


def _documents(position_ids: Any, batch: int, q_len: int, kv_len: int) -> torch.Tensor | None:
    """cu_seqlens of the documents of rows packed by ``position_ids``, or None when no row is
    split. A document starts where the positions do not continue by +1 (transformers'
    ``find_packed_sequence_indices``, the rule its SDPA and eager masks use). Only attention
    over whole rows is split (q_len == kv_len: a forward or a prefill; never a decoding step)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.ndim != 2:
        return None  # absent, or multi-axis (mrope) positions: one sequence per row
    if q_len != kv_len or q_len < 2 or position_ids.shape[-1] != q_len:
        return None
    position_ids = position_ids.expand(batch, -1)
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    starts = step != 1
    if torch.compiler.is_compiling():
        # The split is data: a traced graph cannot branch on it, and a silent wrong answer is
        # worse than an error at run time.
        torch._assert_async(
            ~starts.any(),
            "attn_implementation='cuattn' does not support position_ids that split a row into "
            "documents under torch.compile; run eagerly, or pass cu_seq_lens_q/cu_seq_lens_k",
        )
        return None
    if not starts.any():
        return None
    starts[:, 0] = True
    first = torch.nonzero(starts.reshape(-1)).reshape(-1)
    end = torch.tensor([batch * q_len], dtype=first.dtype, device=first.device)
    return torch.cat((first, end))


def _check_cached(
    config: Any,
    causal: bool,
    window: int | None,
    attention_mask: Any,
    kwargs: dict[str, Any],
    batch: int,
    q_len: int,
) -> None:
    """Refuse what a layer stored in a cuattn Cache cannot attend exactly: its decode steps
    attend every kept token, causally, with no other rule."""
    what, mode = None, _spec(config)[0]
    if not causal:
        what = "a bidirectional layer"
    elif window is not None:
        what = f"sliding_window={window} (the decode steps would attend past the window)"
    elif mode != DENSE_MODE:
        what = (
            f"config.{CONFIG_ATTRIBUTE} with attn_mode={mode!r} (the decode steps attend every "
            "kept token; use the dense default)"
        )
    elif kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        what = "packed rows (cu_seq_lens_q / cu_seq_lens_k)"
    elif (
        attention_mask is None
        and _documents(kwargs.get("position_ids"), batch, q_len, q_len) is not None
    ):
        what = "position_ids that split a row into documents (packed rows)"
    if what is not None:
        _refuse(
            f"{what} with cuattn.compat.transformers.Cache",
            "its KV cache holds one causal sequence per row",
        )


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """cuattn as a transformers attention function (``attn_implementation="cuattn"``).

    transformers calls it from each attention layer; padding, packed rows and T5's relative
    bias run as docs/frameworks.md, section "Hugging Face transformers", describes.

    Args:
        module (torch.nn.Module): the attention layer (its ``config``, ``is_causal`` and
            ``training`` are read).
        query (torch.Tensor): [batch, heads, q_len, head_dim].
        key (torch.Tensor): [batch, kv_heads, kv_len, head_dim] (kv_heads dividing heads).
        value (torch.Tensor): key's shape.
        attention_mask (torch.Tensor, optional): None, a 2-D [batch, kv_len] padding mask, or a
            4-D one that is padding plus the layer's rule.
        dropout (float): the layer's attention dropout, applied in training mode (default
            0.0).
        scaling (float, optional): the layer's score scale; None is ``1 / sqrt(head_dim)``.
        is_causal (bool, optional): the layer's causal hint; None: ``module.is_causal`` (a
            causal layer stays causal under a mask or a single query).
        **kwargs: what the layer passes: ``softcap``, ``position_bias`` (T5),
            ``sliding_window``, ``position_ids``, ``cu_seq_lens_q``/``cu_seq_lens_k``; refused:
            ``s_aux``, ``output_attentions``.

    Returns:
        tuple: ``(out, None)``, out [batch, q_len, heads, head_dim] contiguous.

    Raises:
        TypeError: ``attention_mask`` not a tensor; as :func:`check_config`.
        ValueError: an unsupported feature, named (``s_aux``, ``output_attentions``, a 4-D mask
            that is not padding plus the layer's rule, a mask of another rank, a position bias
            not by distance, a sliding window with a sparse pattern, dropout or a position bias
            with a cuattn ``Cache``); as :func:`check_config` and
            :func:`cuattn.sparse_attention`.
    """
    if kwargs.get("s_aux") is not None:
        _refuse("s_aux", "the kernels add nothing of it to the scores")
    # how the scores are formed: the layer's scale, logit soft-capping (Gemma 2) and a
    # relative-position bias (T5)
    scores = {"scale": scaling, "softcap": kwargs.get("softcap")}
    if dropout and module.training:  # as eager's dropout(p, training=module.training)
        scores["dropout_p"] = float(dropout)
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:
        table = distance_table("position_bias", position_bias, query.shape, key.shape[2])
        if table is not None:
            scores["rel_bias"] = table
    if kwargs.get("output_attentions"):
        _refuse("output_attentions", "the probabilities are never materialised")
    batch, _, q_len, _ = query.shape
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    if not causal and getattr(module, "is_causal", None) is True:
        if q_len == 1 or attention_mask is not None:
            # SDPA's hint, not the layer's rule: some models pass is_causal=False whenever a mask
            # is given or a single query runs (GPT-2 in transformers 4.x: "mask is None and
            # q_len > 1"). A causal layer given a mask is still causal, and one query at the end
            # of the keys sees every key under either rule.
            causal = True
    window = kwargs.get("sliding_window")
    pattern = pattern_of(module.config, query.shape[1], causal, window)
    kv_len = key.shape[2]
    layer = take_layer(key)
    if layer is not None:
        for name, what in (("rel_bias", "position_bias"), ("dropout_p", "attention dropout")):
            if name in scores:
                _refuse(f"{what} with cuattn.compat.transformers.Cache", "its decode path has none")
        _check_cached(module.config, causal, window, attention_mask, kwargs, batch, q_len)
        out = layer.attend(
            query,
            key,
            value,
            attention_mask,
            lambda: attention_forward(
                module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
            )[0],
            scaling,
            scores["softcap"],
        )
        return out, None

    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(
                "attention_mask must be a torch.Tensor (2-D padding or 4-D), got "
                f"{type(attention_mask).__name__}"
            )
        if attention_mask.ndim == 4:
            attention_mask = _padding_of_4d(attention_mask, causal, window, batch, q_len)
        elif attention_mask.ndim != 2:
            raise ValueError(
                "attention_mask must be 2-D [batch, kv_len] (padding) or 4-D [batch, heads, "
                f"q_len, kv_len], got shape {tuple(attention_mask.shape)}"
            )
        out = _padded(query, key, value, attention_mask, pattern, scores, causal)
        return out.contiguous(), None

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        return _varlen(query, key, value, pattern, scores, cu_q, cu_k), None
    cu = _documents(kwargs.get("position_ids"), batch, q_len, kv_len)
    if cu is not None:
        return _varlen(query, key, value, pattern, scores, cu, cu), None
    out = api.sparse_attention(query, key, value, pattern, **scores)
    return out.transpose(1, 2).contiguous(), None


def mask_forward(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' mask function for "cuattn": FlashAttention's 2-D padding mask.

    Checks ``config.cuattn_pattern`` and refuses the model's own extra mask functions, which
    the 2-D mask would silently drop. transformers calls it once per forward, before any layer:
    the earliest point a config is seen.

    Args:
        *args: handed to transformers' ``flash_attention_mask`` as they came (the interface
            has named the queries by ``cache_position`` and later by ``q_length``/``q_offset``;
            this function reads neither).
        **kwargs: the same; ``config``, ``use_vmap`` and ``mask_function`` are read.

    Returns:
        torch.Tensor | None: the 2-D [batch, kv_len] padding mask, or None when nothing is
        padded.

    Raises:
        ValueError: the model adds mask functions of its own (``or_mask_function`` /
            ``and_mask_function``); as :func:`check_config`.
        TypeError: as :func:`check_config`.
    """
    config = kwargs.get("config")
    if config is not None:
        check_config(config)
    if _has_extra_mask_functions(kwargs):
        _refuse(
            "a model's own mask functions (or_mask_function / and_mask_function)",
            "this model adds a rule of its own to the causal or bidirectional mask (e.g. "
            "bidirectional image tokens); only padding, causal and a sliding window are read",
        )
    return flash_attention_mask(*args, **kwargs)


# The element rules transformers builds its own masks from (masking_utils' functions, and the
# closures those return, by qualified name): anything else in a mask function is a model's own.
_OWN_RULES = (
    "causal_mask_function",
    "bidirectional_mask_function",
    "sliding_window_overlay.",
    "sliding_window_bidirectional_overlay.",
    "packed_sequence_mask_function.",
    "padding_mask_function.",
)


def _has_extra_mask_functions(kwargs: dict[str, Any]) -> bool:
    """Whether the mask function holds a rule beyond causal / bidirectional, a sliding window,
    padding and packing. transformers says so itself with ``use_vmap`` where it passes one (set
    exactly when or/and mask functions are given); where it does not, the mask function is
    read: an ``or_masks`` of anything, or an ``and_masks`` of a rule not in ``_OWN_RULES``."""
    if "use_vmap" in kwargs:
        return bool(kwargs["use_vmap"])
    rule = kwargs.get("mask_function")
    return rule is not None and not _only_own_rules(rule)


# A traced forward keeps the answer its trace found: a model's mask function is built the same
# way at every call, and its closures are plain Python that the tracer need not follow.
@torch.compiler.assume_constant_result
def _only_own_rules(rule: Any) -> bool:
    name = getattr(rule, "__qualname__", "")
    if getattr(rule, "__module__", None) != flash_attention_mask.__module__:
        return False
    if name.startswith("and_masks."):
        parts = inspect.getclosurevars(rule).nonlocals.get("mask_functions", ())
        return bool(parts) and all(_only_own_rules(part) for part in parts)
    return name.startswith(_OWN_RULES)


def register(name: str = NAME) -> str:
    """Register cuattn with transformers' attention and mask interfaces (importing this module
    does it for ``"cuattn"``).

    Args:
        name (str): the ``attn_implementation`` name (default ``"cuattn"``).

    Returns:
        str: ``name``.
    """
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_forward)
    return name


register()
