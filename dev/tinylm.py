"""A tiny character transformer on cuattn's tape, for scripts/train_tiny.py and
``python -m dev generate``.

Pre-norm blocks (layer norm, attention through ``cuattn.blocksparse_attention`` with each
layer's pattern, a GELU MLP), learned token and position embeddings, a linear head; Adam.
A layer may choose its blocks from the data (``{"attn_mode": "topk", "topk": k}``:
cuattn.dynamic's top-k blocks per sequence, fresh every step). ``step_logits`` runs one new
token per sequence with a :class:`cuattn.KVCache` per layer and ``cuattn.decode_attention``
(what generation with a KV cache does), through the same ops: ``Tensor``'s arithmetic and
:mod:`dev.tinylm_ops`' layer norm, GELU, embedding and cross-entropy.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import cuattn
from cuattn import dynamic
from cuattn.autograd.tape import Tensor
from dev.tinylm_ops import cross_entropy, embedding, gelu, layer_norm

BETAS = (0.9, 0.99)
# A layer mode {"attn_mode": "topk", "topk": k} chooses its blocks from the data at every call.
TOPK_MODE = "topk"
ADAM_EPS = 1e-8
MLP_RATIO = 4


@dataclass(frozen=True)
class TinyConfig:
    n_ctx: int = 64
    width: int = 64
    heads: int = 4
    blocksize: int = 8
    layer_modes: tuple[dict[str, Any], ...] = field(
        default=(
            {"attn_mode": "local", "local_attn_ctx": 16},
            {"attn_mode": "strided", "local_attn_ctx": 8},
        )
    )

    @property
    def head_dim(self) -> int:
        return self.width // self.heads


def zen() -> str:
    """The Zen of Python, shipped with every interpreter (stored rot13-encoded in `this`)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


def init_params(xp: Any, vocab: int, rng: np.random.Generator, config: TinyConfig) -> dict:
    width = config.width

    def param(*shape: int, std: float | None = None, value: float | None = None) -> Tensor:
        if value is not None:
            arr = np.full(shape, value)
        else:
            arr = rng.standard_normal(shape) * (std if std is not None else 1 / math.sqrt(shape[0]))
        return Tensor(xp.asarray(arr, dtype=xp.float32), requires_grad=True)

    p = {"tok": param(vocab, width, std=0.1), "pos": param(config.n_ctx, width, std=0.1)}
    for layer in range(len(config.layer_modes)):
        for name in ("ln1", "ln2"):
            p[f"{layer}.{name}.w"] = param(width, value=1.0)
            p[f"{layer}.{name}.b"] = param(width, value=0.0)
        for name in ("wq", "wk", "wv", "wo"):
            p[f"{layer}.{name}"] = param(width, width)
        p[f"{layer}.w1"] = param(width, MLP_RATIO * width)
        p[f"{layer}.b1"] = param(MLP_RATIO * width, value=0.0)
        p[f"{layer}.w2"] = param(MLP_RATIO * width, width)
        p[f"{layer}.b2"] = param(width, value=0.0)
    p["lnf.w"], p["lnf.b"] = param(width, value=1.0), param(width, value=0.0)
    p["head"] = param(width, vocab)
    return p


def _mlp(x: Tensor, p: dict, layer: int) -> Tensor:
    h = layer_norm(x, p[f"{layer}.ln2.w"], p[f"{layer}.ln2.b"])
    hidden = gelu(h @ p[f"{layer}.w1"] + p[f"{layer}.b1"])
    return x + (hidden @ p[f"{layer}.w2"] + p[f"{layer}.b2"])


def chosen_attention(q: Tensor, k: Tensor, v: Tensor, topk: int, config: TinyConfig) -> Tensor:
    """Attention on a layout chosen per sequence from its own q and k (cuattn.dynamic's top-k
    blocks, causal), fresh at every call; the choice takes no gradient, the attention does.
    The sequences run as one packed varlen call, each on its own layout."""
    batch, n, width = q.shape
    heads = config.heads
    q4, k4 = (cuattn.split_heads(t.data, heads) for t in (q, k))
    layouts = [
        dynamic.topk_blocks(q4[b : b + 1], k4[b : b + 1], config.blocksize, topk)
        for b in range(batch)
    ]
    cu = np.arange(0, batch * n + 1, n, dtype=np.int64)
    packed = [t.reshape(batch * n, heads, width // heads) for t in (q, k, v)]
    return cuattn.sparse_attention_varlen(*packed, cu, cu, layouts).reshape(batch, n, width)


def block(x: Tensor, p: dict, layer: int, config: TinyConfig) -> Tensor:
    h = layer_norm(x, p[f"{layer}.ln1.w"], p[f"{layer}.ln1.b"])
    q, k, v = (h @ p[f"{layer}.{w}"] for w in ("wq", "wk", "wv"))
    mode = config.layer_modes[layer]
    if mode["attn_mode"] == TOPK_MODE:
        a = chosen_attention(q, k, v, mode["topk"], config)
    else:
        a = cuattn.blocksparse_attention(
            q, k, v, heads=config.heads, blocksize=config.blocksize, **mode
        )
    return _mlp(x + a @ p[f"{layer}.wo"], p, layer)


def _embed(p: dict, idx: Any, first: int = 0) -> Tensor:
    """Token plus position embeddings of idx [batch, n] at positions first, ..., first + n - 1."""
    xp = p["tok"].xp
    positions = xp.arange(first, first + idx.shape[1])[None]
    return embedding(p["tok"], idx) + embedding(p["pos"], positions)


def logits(p: dict, idx: Any, config: TinyConfig, recompute: bool = False) -> Tensor:
    x = _embed(p, idx)
    for layer in range(len(config.layer_modes)):
        with cuattn.recompute(recompute):
            x = block(x, p, layer, config)
    return layer_norm(x, p["lnf.w"], p["lnf.b"]) @ p["head"]


def loss(p: dict, idx: Any, targets: Any, config: TinyConfig, recompute: bool = False) -> Tensor:
    return cross_entropy(logits(p, idx, config, recompute), targets)


def adam_step(p: dict, state: dict, step: int, lr: float) -> None:
    b1, b2 = BETAS
    for name, t in p.items():
        m, v = state.setdefault(name, (t.xp.zeros_like(t.data), t.xp.zeros_like(t.data)))
        m[...] = b1 * m + (1 - b1) * t.grad
        v[...] = b2 * v + (1 - b2) * t.grad * t.grad
        m_hat, v_hat = m / (1 - b1**step), v / (1 - b2**step)
        t.data -= (lr * m_hat / (t.xp.sqrt(v_hat) + ADAM_EPS)).astype(t.data.dtype)
        t.grad = None


def for_cache(cache: Any, x: Any) -> Any:
    """The model's float32 ``x`` in the dtype ``cache`` takes: its own, and for fp8 pages
    bfloat16 (the model dtype the cache quantises from; cuattn never casts silently)."""
    if cache.quantized:
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16)
    return x.astype(cache.dtype, copy=False)


def prefill(p: dict, idx: Any, caches: list, config: TinyConfig) -> Any:
    """Logits of every prompt position (full attention over the prompt, as the model was
    trained), with each layer's keys and values appended to its cache (the policy evicts;
    one that reads queries, SnapKV, is given the prompt's, as it chooses from them)."""
    heads = config.heads
    with cuattn.no_grad():
        x = _embed(p, idx)
        for layer, cache in enumerate(caches):
            h = layer_norm(x, p[f"{layer}.ln1.w"], p[f"{layer}.ln1.b"])
            q, k, v = (h @ p[f"{layer}.{w}"] for w in ("wq", "wk", "wv"))
            a = cuattn.blocksparse_attention(
                q, k, v, heads=heads, blocksize=config.blocksize, **config.layer_modes[layer]
            )
            reads = cache.policy is not None and cache.policy.reads_queries
            queries = for_cache(cache, cuattn.split_heads(q.data, heads)) if reads else None
            keys, values = (for_cache(cache, cuattn.split_heads(t.data, heads)) for t in (k, v))
            cache.append(keys, values, q=queries)
            x = _mlp(x + a @ p[f"{layer}.wo"], p, layer)
        return (layer_norm(x, p["lnf.w"], p["lnf.b"]) @ p["head"]).data


def step_logits(p: dict, token: Any, position: int, caches: list, config: TinyConfig) -> Any:
    """Logits [batch, vocab] after one new token per sequence at ``position``: each layer
    appends the token's key and value to its cache, then ``decode_attention`` over what the
    cache keeps."""
    heads = config.heads
    with cuattn.no_grad():
        x = _embed(p, token[:, None], position)
        for layer, cache in enumerate(caches):
            h = layer_norm(x, p[f"{layer}.ln1.w"], p[f"{layer}.ln1.b"])
            q, k, v = (
                for_cache(cache, cuattn.split_heads((h @ p[f"{layer}.{w}"]).data, heads))
                for w in ("wq", "wk", "wv")
            )
            cache.append(k, v)
            a = cuattn.merge_heads(cuattn.decode_attention(q, cache)).astype(x.data.dtype)
            x = _mlp(x + Tensor(a) @ p[f"{layer}.wo"], p, layer)
        return (layer_norm(x, p["lnf.w"], p["lnf.b"]) @ p["head"]).data[:, 0]
