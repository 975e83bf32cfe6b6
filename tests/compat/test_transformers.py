"""attn_implementation="cuattn" on tiny randomly initialised Hugging Face models (no downloads)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import cuattn  # noqa: E402
import cuattn.compat.transformers as hf  # noqa: E402
from tests.helpers.attn_cases import rel  # noqa: E402

VOCAB, SEQ = 97, 100
LOGITS_RTOL = 1e-12  # float64 models: cuattn against SDPA's math kernel
GRAD_RTOL = 1e-10
SPARSE = {"mode": "fixed", "blocksize": 16, "local_attn_ctx": 32, "num_verts": 1, "vertsize": 1}


def _config(arch, **extra):
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    common["max_position_embeddings"] = 256
    if arch == "llama":
        return transformers.LlamaConfig(
            intermediate_size=128, num_key_value_heads=2, **common, **extra
        )
    if arch == "mistral":
        return transformers.MistralConfig(
            intermediate_size=128, num_key_value_heads=2, sliding_window=24, **common, **extra
        )
    return transformers.GPTNeoXConfig(intermediate_size=128, rotary_pct=0.5, **common, **extra)


def _pair(arch, **extra):
    """The same random weights under SDPA and under cuattn, float64."""
    torch.manual_seed(0)
    cfg = _config(arch, **extra)
    make = transformers.AutoModelForCausalLM.from_config
    sdpa = make(cfg, attn_implementation="sdpa", dtype=torch.float64)
    ours = make(cfg, attn_implementation=hf.NAME, dtype=torch.float64)
    ours.load_state_dict(sdpa.state_dict())
    return sdpa, ours


def _ids(seed=1, batch=2, n=SEQ):
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "mistral"])
def test_dense_causal_logits_and_greedy_decoding_match_sdpa(arch):
    sdpa, ours = _pair(arch)
    ids = _ids()
    assert rel(ours(ids).logits.detach(), sdpa(ids).logits.detach()) <= LOGITS_RTOL
    mask = torch.ones(2, 20, dtype=torch.long)
    kwargs = dict(max_new_tokens=12, do_sample=False, attention_mask=mask, pad_token_id=0)
    assert torch.equal(ours.generate(ids[:, :20], **kwargs), sdpa.generate(ids[:, :20], **kwargs))


def test_a_sparse_pattern_runs_forward_and_backward_and_equals_its_mask():
    sdpa, ours = _pair("llama")
    ours.config.cuattn_pattern = SPARSE
    ids = _ids(2)
    ours(ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in ours.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())

    # The same model with SDPA and the pattern's element mask as an explicit attention mask.
    mask = cuattn.Pattern(SPARSE["mode"], 4, **{k: v for k, v in SPARSE.items() if k != "mode"})
    allowed = torch.from_numpy(mask.layout(SEQ, SEQ).to_mask())[None]  # [1, heads, q, k]

    def masked_sdpa(module, q, k, v, attention_mask, scaling=None, **kw):
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=scaling
        )
        return out.transpose(1, 2).contiguous(), None

    transformers.AttentionInterface.register("masked_for_test", masked_sdpa)
    transformers.masking_utils.AttentionMaskInterface.register(
        "masked_for_test", transformers.masking_utils.flash_attention_mask
    )
    sdpa.set_attn_implementation("masked_for_test")
    sdpa(ids, labels=ids).loss.backward()
    for name, p in sdpa.named_parameters():
        assert rel(grads[name], p.grad) <= GRAD_RTOL, name


def test_padding_and_unsupported_options_are_refused_by_name():
    _, ours = _pair("llama")
    ids = _ids(3)
    padded = torch.ones_like(ids)
    padded[0, :5] = 0
    with pytest.raises(ValueError, match="padding tokens"):
        ours(ids, attention_mask=padded)
    ours.config.cuattn_pattern = {"blocksize": 16}
    with pytest.raises(ValueError, match="with 'mode'"):
        ours(ids)
    _, mistral = _pair("mistral")
    mistral.config.cuattn_pattern = SPARSE
    with pytest.raises(ValueError, match="sliding_window=24"):
        mistral(ids)


def test_the_model_compiles_without_graph_breaks_in_attention():
    _, ours = _pair("llama")
    ours.config.cuattn_pattern = SPARSE
    ids = _ids(4)
    want = ours(ids).logits
    got = torch.compile(ours, backend="aot_eager", fullgraph=True)(ids).logits
    assert rel(got.detach(), want.detach()) <= LOGITS_RTOL
