"""The tiny transformer of ``python -m dev generate --task`` as a Hugging Face GPT-2, so that
the trained demo model answers its prompts through ``transformers``' ``generate`` with
:class:`cuattn.compat.transformers.Cache` and a policy, as a user's model would.

The tiny model (dev.tinylm) is GPT-2's architecture: learned token and position
embeddings, pre-norm blocks of layer norm (eps 1e-5), attention and a tanh-GELU MLP, a final
layer norm, a linear head. Its weights map one to one: ``wq | wk | wv`` side by side are
``c_attn`` (GPT-2's Conv1D computes ``x @ W + b``, as the tape does), ``wo`` is the attention's
``c_proj``, ``w1``/``w2`` the MLP's, the head is an untied ``lm_head``; the attention has no
biases (zeros). Only dense causal layers map (``{"attn_mode": "all"}``, what the long tasks
train): GPT-2 has no sparse patterns.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dev.tinylm import MLP_RATIO, TinyConfig

GELU_TANH = "gelu_new"  # transformers' name for the tanh approximation tinylm_ops.gelu computes
LAYER_NORM_EPS = 1e-5  # tinylm_ops.layer_norm's


def to_gpt2(params: dict, config: TinyConfig, vocab: int, attn_implementation: str) -> Any:
    """A float32 ``GPT2LMHeadModel`` in eval mode holding ``params`` (a tiny model trained on a
    vocabulary of ``vocab`` tokens), its attention run by ``attn_implementation``."""
    import torch
    import transformers

    for layer, mode in enumerate(config.layer_modes):
        if mode != {"attn_mode": "all"}:
            raise ValueError(
                f"layer {layer} attends by {mode}; only dense causal layers ({{'attn_mode': "
                "'all'}) map to GPT-2"
            )
    width = config.width
    gpt2 = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=config.n_ctx,
        n_embd=width,
        n_layer=len(config.layer_modes),
        n_head=config.heads,
        n_inner=MLP_RATIO * width,
        activation_function=GELU_TANH,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=LAYER_NORM_EPS,
        tie_word_embeddings=False,
        bos_token_id=None,  # GPT-2's defaults name token 50256; the tasks have no such tokens
        eos_token_id=None,
    )
    model = transformers.GPT2LMHeadModel._from_config(
        gpt2, attn_implementation=attn_implementation, dtype=torch.float32
    )

    def w(name: str) -> np.ndarray:
        return np.asarray(params[name].data, dtype=np.float32)

    state = {"transformer.wte.weight": w("tok"), "transformer.wpe.weight": w("pos")}
    for layer in range(len(config.layer_modes)):
        h = f"transformer.h.{layer}"
        qkv = np.concatenate([w(f"{layer}.{name}") for name in ("wq", "wk", "wv")], axis=1)
        state |= {
            f"{h}.ln_1.weight": w(f"{layer}.ln1.w"),
            f"{h}.ln_1.bias": w(f"{layer}.ln1.b"),
            f"{h}.attn.c_attn.weight": qkv,
            f"{h}.attn.c_attn.bias": np.zeros(3 * width, np.float32),
            f"{h}.attn.c_proj.weight": w(f"{layer}.wo"),
            f"{h}.attn.c_proj.bias": np.zeros(width, np.float32),
            f"{h}.ln_2.weight": w(f"{layer}.ln2.w"),
            f"{h}.ln_2.bias": w(f"{layer}.ln2.b"),
            f"{h}.mlp.c_fc.weight": w(f"{layer}.w1"),
            f"{h}.mlp.c_fc.bias": w(f"{layer}.b1"),
            f"{h}.mlp.c_proj.weight": w(f"{layer}.w2"),
            f"{h}.mlp.c_proj.bias": w(f"{layer}.b2"),
        }
    state |= {
        "transformer.ln_f.weight": w("lnf.w"),
        "transformer.ln_f.bias": w("lnf.b"),
        "lm_head.weight": w("head").T.copy(),
    }
    tensors = {name: torch.from_numpy(value) for name, value in state.items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # GPT-2's causal-mask buffers are not weights; every weight must have come from params
    missing = [name for name in missing if not name.endswith((".attn.bias", ".masked_bias"))]
    if missing or unexpected:
        raise RuntimeError(f"GPT-2 mapping: missing {missing}, unexpected {unexpected}")
    return model.eval()


def answer_through_generate(
    model: Any, prompts: np.ndarray, answer_len: int, cache: Any, batch: int
) -> np.ndarray:
    """Greedy answers int64 [count, answer_len] to ``prompts`` from ``model.generate``, ``batch``
    prompts at a time, each batch with a fresh cache from ``cache()`` (a
    cuattn.compat.transformers.Cache, or None for transformers' own)."""
    import torch

    from cuattn.compat.hf_cache import cache_keyword

    answers = []
    for first in range(0, len(prompts), batch):
        ids = torch.from_numpy(np.ascontiguousarray(prompts[first : first + batch]))
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=answer_len,
                min_new_tokens=answer_len,
                do_sample=False,
                pad_token_id=0,
                **{cache_keyword(model): cache()},
            )
        answers.append(out[:, ids.shape[1] :].numpy())
    return np.concatenate(answers)
