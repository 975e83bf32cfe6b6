"""A transformers ``Cache`` kept in cuattn's paged :class:`KVCache`, one per layer, with a policy.

    cache = cuattn.compat.transformers.Cache(policy=policies.SnapKV(budget=64, window=8))
    model.generate(ids, cache=cache, max_new_tokens=32)    # attn_implementation="cuattn"
    # before transformers 5.24: past_key_values=cache (cache_keyword(model) names it)

Why the attention must run through cuattn (``update`` only hands the new tokens over; the
attention function stores them, lets the policy evict and attends to the kept ones), padding,
and what is refused: docs/serving.md, section "In Hugging Face generate".
"""

from __future__ import annotations

import copy
import inspect
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import cache_utils

from cuattn.layout.layout import check_positive_int
from cuattn.serving.cache import KVCache
from cuattn.serving.decode import decode_attention
from cuattn.serving.policies import Policy

__all__ = ["Cache", "cache_keyword", "take_layer"]

DEFAULT_PAGE_SIZE = 16  # KVCache's own default
CLASS_NAME = "cuattn.compat.transformers.Cache"

# The cache whose update is waiting for its attention, per thread: a layer's update and its
# attention run one after the other on the thread that runs the model.
_HANDOFF = threading.local()


class _Pending:
    """An update waiting for its attention: the layer, and the key tensor update returned."""

    def __init__(self, layer: _Layer, key: torch.Tensor) -> None:
        self.layer = layer
        self.key = key


class _Layer(cache_utils.CacheLayerMixin):
    """One model layer: a KVCache built at the layer's first update (from the key states'
    batch, kv heads, head dim, dtype and device) with its own copy of the policy."""

    def __init__(self, policy: Policy | None, page_size: int) -> None:
        super().__init__()
        self.policy = policy
        self.page_size = page_size
        self.kv: KVCache | None = None
        self.seen = 0  # tokens given, padding included: the positions generate numbers

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, kv_heads, _, head_dim = key_states.shape
        self.kv = KVCache(
            batch,
            kv_heads,
            head_dim,
            key_states.dtype,
            page_size=self.page_size,
            policy=copy.deepcopy(self.policy),
            like=key_states,
        )
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, queries: int | torch.Tensor) -> tuple[int, int]:
        """(kv_length, kv_offset) of the mask. transformers passes the query count, or (its
        older interface) the queries' ``cache_position`` [q_len]."""
        q_len = queries.shape[0] if isinstance(queries, torch.Tensor) else int(queries)
        return self.seen + q_len, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # get_max_length's name in transformers 4.x
        return -1

    def reset(self) -> None:
        self.kv, self.seen, self.is_initialized = None, 0, False

    def _refuse(self, what: str) -> None:
        raise ValueError(
            f"{CLASS_NAME} does not support {what}: the kept tokens are chosen per (sequence, kv "
            "head) and cannot be reordered, repeated or rolled back"
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._refuse("beam search (num_beams > 1)")

    def crop(self, tokens_to_remove: int) -> None:
        self._refuse("crop (assisted or speculative generation)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._refuse("batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._refuse("batch_select_indices")

    # -- what the attention function does -------------------------------------------------

    def _real_tokens(self, attention_mask: torch.Tensor | None, batch: int, q_len: int) -> Any:
        """bool [batch, q_len]: which new tokens are real (None: all), after checking that the
        mask fits what the cache holds."""
        kv = self.kv
        if attention_mask is None:
            if (kv.lengths != self.seen).any():
                raise ValueError(
                    f"attention_mask is None, but the cache holds padded sequences ({CLASS_NAME} "
                    f"stored {kv.lengths.tolist()} real tokens of {self.seen}); pass the 2-D "
                    "mask that covers them, as generate does"
                )
            return None
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 2:
            raise ValueError(
                "attention_mask must be a 2-D [batch, kv_len] padding mask (or None) with "
                f"{CLASS_NAME}, got {_described(attention_mask)}"
            )
        if tuple(attention_mask.shape) != (batch, self.seen + q_len):
            raise ValueError(
                f"attention_mask of shape {tuple(attention_mask.shape)} does not fit {CLASS_NAME}: "
                f"[batch={batch}, {self.seen} cached + {q_len} new tokens] expected"
            )
        if (
            attention_mask.dtype != torch.bool
            and not ((attention_mask == 0) | (attention_mask == 1)).all()
        ):
            raise ValueError("attention_mask must hold 1 for tokens and 0 for padding")
        real = attention_mask != 0
        stored = real[:, : self.seen].sum(1).cpu().numpy()
        if (stored != kv.lengths).any():
            raise ValueError(
                f"attention_mask marks {stored.tolist()} real cached tokens per sequence, but "
                f"{CLASS_NAME} stored {kv.lengths.tolist()}"
            )
        new = real[:, self.seen :]
        if self.seen and not bool(new.all()):
            raise ValueError(
                f"attention_mask pads new tokens after the first forward; {CLASS_NAME} takes "
                "padding in the prefill only (generate's later steps bring real tokens)"
            )
        return None if bool(new.all()) else new

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        prefill: Callable[[], torch.Tensor],
        scale: float | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """The layer's attention [batch, q_len, heads, head_dim] with its new tokens stored:
        ``prefill()`` (dense causal attention over the given tokens) at the first forward,
        decode_attention over the kept tokens after it (module doc)."""
        batch, _, q_len, _ = query.shape
        real = self._real_tokens(attention_mask, batch, q_len)
        if self.seen:
            self.kv.append(key, value)
            out = decode_attention(query, self.kv, scale, softcap=softcap)
            self.seen += q_len
            return out.transpose(1, 2).contiguous()
        out = prefill()
        votes = self.kv.policy is not None and self.kv.policy.reads_queries
        q = query if votes else None
        lengths = None
        if real is not None:  # each sequence's real tokens first, in order
            order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)
            key, value = _take(key, order), _take(value, order)
            q = None if q is None else _take(q, order)
            lengths = real.sum(1).cpu().numpy()
        self.kv.append(key, value, lengths, q=q)
        self.seen += q_len
        return out


def _take(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """x [batch, heads, t, d] with its tokens in ``order`` [batch, t] per sequence."""
    return x.gather(2, order[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


def _described(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def _check_policy(policy: object) -> Policy | list[Policy] | None:
    if policy is None or isinstance(policy, Policy):
        return policy
    if isinstance(policy, Sequence) and not isinstance(policy, str):
        for i, one in enumerate(policy):
            if not isinstance(one, Policy):
                raise TypeError(
                    f"policy[{i}] must be a cuattn.policies policy, got {type(one).__name__}"
                )
        if not policy:
            raise ValueError("policy must hold one policy per layer, got an empty sequence")
        return list(policy)
    raise TypeError(
        "policy must be a cuattn.policies policy (every layer gets its own copy), a sequence "
        f"of them (one per layer, e.g. from policies.pyramid budgets) or None, got "
        f"{type(policy).__name__}"
    )


class Cache(cache_utils.Cache):
    """transformers' Cache kept in one cuattn :class:`KVCache` per layer, with an eviction
    policy.

    Needs ``attn_implementation="cuattn"``; pass it to ``generate`` as ``cache=``
    (transformers 5.24 and later) or ``past_key_values=`` (earlier releases);
    :func:`cache_keyword` says which a model takes. Why the attention must run through cuattn,
    and what is refused: docs/serving.md, section "In Hugging Face generate".

    Args:
        policy (Policy | Sequence[Policy], optional): a ``cuattn.policies`` policy (each layer
            gets its own copy), a sequence of them (one per layer: per-layer budgets such as
            ``policies.pyramid``), or None (default: keep every token).
        page_size (int): tokens per page of each layer's KVCache (Quest's must equal it;
            default 16). Keyword only.

    Raises:
        TypeError: ``policy`` (or an entry) is not a policy; ``page_size`` not an int.
        ValueError: an empty policy sequence; ``page_size`` not positive.

    Example:
        >>> from cuattn import policies  # doctest: +SKIP
        >>> cache = Cache(policy=policies.SnapKV(budget=64, window=8))  # doctest: +SKIP
        >>> model.generate(ids, cache=cache, max_new_tokens=32)  # doctest: +SKIP
    """

    def __init__(
        self,
        policy: Policy | Sequence[Policy] | None = None,
        *,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> None:
        self._policy = _check_policy(policy)
        check_positive_int("page_size", page_size)
        self._page_size = int(page_size)
        self._pending: _Pending | None = None
        super().__init__(layers=[])

    def _policy_of(self, layer_idx: int) -> Policy | None:
        if not isinstance(self._policy, list):
            return self._policy
        if layer_idx >= len(self._policy):
            raise ValueError(
                f"policy holds {len(self._policy)} policies, one per layer, but the model has a "
                f"layer {layer_idx}"
            )
        return self._policy[layer_idx]

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hand the layer's new tokens to cuattn's attention function, which stores them.

        transformers calls it from each attention layer, before its attention.

        Args:
            key_states (torch.Tensor): the new keys, [batch, kv_heads, t, head_dim].
            value_states (torch.Tensor): the new values, key_states' shape.
            layer_idx (int): the layer.
            *args: transformers' further arguments (unread).
            **kwargs: transformers' further keyword arguments (unread).

        Returns:
            tuple: ``(key_states, value_states)`` as they are (cuattn's attention function
            recognises the key tensor).

        Raises:
            TypeError: a state is not a 4-D torch tensor.
            ValueError: the previous layer's attention did not run through cuattn (another
                ``attn_implementation``); more layers than a per-layer policy sequence holds.
        """
        if self._pending is not None:
            self._pending = None
            raise ValueError(
                f"{CLASS_NAME} stores a layer's tokens in cuattn's attention function, but the "
                "last layer's attention did not run through it: load the model with "
                'attn_implementation="cuattn" (import cuattn.compat.transformers registers it)'
            )
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(x, torch.Tensor) or x.ndim != 4:
                raise TypeError(
                    f"{name} must be a torch.Tensor [batch, kv_heads, t, head_dim], got "
                    f"{_described(x)}"
                )
        while len(self.layers) <= layer_idx:
            self.layers.append(_Layer(self._policy_of(len(self.layers)), self._page_size))
        layer = self.layers[layer_idx]
        keys, values = layer.update(key_states, value_states)
        self._pending = _Pending(layer, keys)
        _HANDOFF.cache = weakref.ref(self)
        return keys, values

    def kv_cache(self, layer_idx: int) -> KVCache:
        """The KVCache of one layer (after the layer's first forward).

        Args:
            layer_idx (int): the layer.

        Returns:
            KVCache: the layer's paged cache.

        Raises:
            ValueError: no forward has run the layer yet.
        """
        if not 0 <= layer_idx < len(self.layers) or self.layers[layer_idx].kv is None:
            raise ValueError(f"layer_idx={layer_idx} has no KVCache yet (no forward has run it)")
        return self.layers[layer_idx].kv

    def reset(self) -> None:
        self._pending = None
        super().reset()


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword under which ``model`` (and its ``generate``) takes a Cache.

    ``model.generate(ids, **{cache_keyword(model): cache})`` works on every transformers release
    cuattn supports.

    Args:
        model (torch.nn.Module): a transformers model.

    Returns:
        str: ``"cache"`` where its forward has that parameter (transformers 5.24 renamed it),
        else ``"past_key_values"``.

    Raises:
        TypeError: the model's forward takes neither.
    """
    parameters = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise TypeError(
        f"{type(model).__name__}.forward takes no KV cache (neither 'cache' nor "
        "'past_key_values' is among its parameters)"
    )


def take_layer(key: torch.Tensor) -> _Layer | None:
    """The cuattn cache layer whose ``update`` returned ``key`` and waits for its attention.

    Called by cuattn's attention function; the layer no longer waits afterwards.

    Args:
        key (torch.Tensor): the key tensor an attention layer received.

    Returns:
        The waiting cache layer, or None when ``key`` did not come from a cuattn Cache's
        ``update`` (or was taken already).
    """
    ref = getattr(_HANDOFF, "cache", None)
    cache = ref() if ref is not None else None
    if cache is None or cache._pending is None or cache._pending.key is not key:
        return None
    layer = cache._pending.layer
    cache._pending = None
    _HANDOFF.cache = None
    return layer
