"""cuattn as a Hugging Face transformers attention implementation: attn_implementation="cuattn".

    import cuattn.compat.transformers                     # registers "cuattn" (idempotent)
    cfg.cuattn_pattern = {"mode": "fixed", "blocksize": 64, "local_attn_ctx": 128,
                          "num_verts": 4, "vertsize": 1}  # optional; default dense ("all")
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="cuattn")

Every attention layer of the model then runs ``cuattn.sparse_attention`` with a
:class:`cuattn.Pattern` made from ``config.cuattn_pattern`` (make_layout's arguments except
n_ctx, n_q and heads; ``mode`` names the pattern), causal or not as the layer is, for whatever
query and key lengths the layer sees (prefill, and decoding with a KV cache: queries aligned to
the end of the keys). GQA layers pass their kv heads as they are. A layer with a sliding window
(Mistral-style ``sliding_window``) under the dense pattern runs the ``local`` pattern with that
window, which is the same mask.
Not supported, each a ValueError naming it: padding tokens (a batch whose attention mask is not
all ones: pack the sequences with ``cuattn.sparse_attention_varlen`` instead), dropout in
training, ``softcap``, ``position_bias``, ``output_attentions``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from cuattn import api
from cuattn.layout.pattern import Pattern

__all__ = ["DEFAULT_PATTERN", "NAME", "attention_forward", "pattern_of", "register"]

NAME = "cuattn"
CONFIG_ATTRIBUTE = "cuattn_pattern"
DEFAULT_PATTERN = {"mode": "all", "blocksize": 64}
DENSE_MODE = "all"
WINDOW_MODE = "local"


def pattern_of(config: Any, heads: int, causal: bool, sliding_window: int | None = None) -> Pattern:
    """The Pattern a layer runs: ``config.cuattn_pattern`` (or DEFAULT_PATTERN) for ``heads``."""
    spec = dict(getattr(config, CONFIG_ATTRIBUTE, None) or DEFAULT_PATTERN)
    if "mode" not in spec:
        raise ValueError(
            f"config.{CONFIG_ATTRIBUTE} must name its pattern with 'mode', got {spec!r}"
        )
    mode = spec.pop("mode")
    blocksize = spec.pop("blocksize", DEFAULT_PATTERN["blocksize"])
    if sliding_window is not None:
        if mode != DENSE_MODE:
            raise ValueError(
                f"this layer has sliding_window={sliding_window} and config.{CONFIG_ATTRIBUTE} "
                f"asks for {mode!r}; cuattn runs a sliding window as the 'local' pattern of the "
                "dense mode only"
            )
        mode, spec = WINDOW_MODE, {"local_attn_ctx": int(sliding_window)}
    return Pattern(mode, heads, blocksize, causal=causal, **spec)


def _refuse(name: str, why: str) -> None:
    raise ValueError(f"attn_implementation='cuattn' does not support {name}: {why}")


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
    """transformers' attention-function signature: query [batch, heads, q_len, head_dim], key
    and value [batch, kv_heads, kv_len, head_dim]; returns ([batch, q_len, heads, head_dim],
    None)."""
    if attention_mask is not None:
        _refuse(
            "padding tokens",
            "the batch's attention mask has zeros; pack the sequences and call "
            "cuattn.sparse_attention_varlen",
        )
    if dropout and module.training:
        _refuse("attention dropout", f"dropout={dropout} while training")
    for name in ("softcap", "position_bias"):
        if kwargs.get(name) is not None:
            _refuse(name, "the kernels add nothing to the scores")
    if kwargs.get("output_attentions"):
        _refuse("output_attentions", "the probabilities are never materialised")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    pattern = pattern_of(module.config, query.shape[1], bool(causal), kwargs.get("sliding_window"))
    out = api.sparse_attention(query, key, value, pattern, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register(name: str = NAME) -> str:
    """Register cuattn under ``name`` with transformers' attention and mask interfaces; the
    mask function is FlashAttention's (None unless the batch has padding)."""
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


register()
