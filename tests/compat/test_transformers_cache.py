"""cuattn.compat.transformers.Cache inside transformers' generate: tiny random Llama and Qwen2
(GQA: 4 query heads on 2 kv heads), CPU, no downloads.

The reference for a compressing cache is the same model under a full DynamicCache whose
attention masks out, per layer and kv head, every token the cuattn cache did not keep: if the
cache stored the wrong keys, attended an evicted token or missed a kept one, the logits differ.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import cuattn.compat.transformers as hf  # noqa: E402
from cuattn import policies  # noqa: E402
from tests.helpers.attn_cases import rel  # noqa: E402

VOCAB, PROMPT, NEW = 97, 24, 6
BUDGET, PAGE = 8, 4  # tokens per (sequence, kv head); pages of 4 so the budget is 2 pages
LOGITS_RTOL = 1e-12  # float64: the cuattn cache against SDPA's full DynamicCache
KEPT_RTOL = 1e-10  # float64: against the full cache with the evicted tokens masked out
REFERENCE = "kept_tokens_for_test"
SMALL = {
    "sliding": lambda: policies.SlidingWindow(BUDGET),
    "streaming": lambda: policies.StreamingLLM(sinks=2, window=BUDGET - 2),
    "h2o": lambda: policies.HeavyHitters(BUDGET, recent=2),
    "snapkv": lambda: policies.SnapKV(BUDGET, window=3, kernel_size=3),
}


def _config(arch):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return (transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config)(**common)


@functools.cache
def _models(arch, dtype=torch.float64):
    """(SDPA, cuattn, masked reference): the same random weights, eval mode."""
    torch.manual_seed(0)
    cfg = _config(arch)
    auto = transformers.AutoModelForCausalLM
    sdpa = auto.from_config(copy.deepcopy(cfg), attn_implementation="sdpa", dtype=dtype)
    ours = auto.from_config(copy.deepcopy(cfg), attn_implementation=hf.NAME, dtype=dtype)
    ref = auto.from_config(copy.deepcopy(cfg), attn_implementation=REFERENCE, dtype=dtype)
    ours.load_state_dict(sdpa.state_dict())
    ref.load_state_dict(sdpa.state_dict())
    return sdpa.eval(), ours.eval(), ref.eval()


def _ids(batch=2, n=PROMPT, seed=1):
    return torch.randint(1, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


# Per layer: bool [batch, kv_heads, kv_len], the keys the reference may attend (absent: all).
_KEPT: dict[int, torch.Tensor] = {}


def _kept_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Float64 causal attention over the keys _KEPT allows (GQA by repeating kv heads)."""
    group = query.shape[1] // key.shape[1]
    q_len, kv_len = query.shape[2], key.shape[2]
    key, value = (x.repeat_interleave(group, dim=1) for x in (key, value))
    s = query @ key.transpose(-1, -2) * scaling
    i = torch.arange(q_len)[:, None] + kv_len - q_len
    allowed = (torch.arange(kv_len)[None, :] <= i)[None, None]
    if module.layer_idx in _KEPT:
        allowed = allowed & _KEPT[module.layer_idx].repeat_interleave(group, dim=1)[:, :, None]
    p = torch.softmax(s.masked_fill(~allowed, -torch.inf), dim=-1)
    return (p @ value).transpose(1, 2).contiguous(), None


# The keyword generate and forward take a Cache under (it was renamed within the supported range).
CACHE = hf.cache_keyword(transformers.LlamaForCausalLM)

transformers.AttentionInterface.register(REFERENCE, _kept_attention)
transformers.masking_utils.AttentionMaskInterface.register(
    REFERENCE, transformers.masking_utils.flash_attention_mask
)


def _kept_mask(kv, length):
    """bool [batch, kv_heads, length]: the positions the KVCache kv keeps."""
    pos = torch.from_numpy(kv.positions())
    allowed = torch.zeros(kv.batch, kv.kv_heads, length + 1, dtype=torch.bool)
    allowed.scatter_(2, torch.where(pos < 0, length, pos), True)
    return allowed[..., :length]


def _kept_counts(cache, layers=2):
    """int [layers, batch, kv_heads]: tokens each layer keeps per (sequence, kv head)."""
    return np.stack([(cache.kv_cache(i).positions() >= 0).sum(-1) for i in range(layers)])


# ---------------------------------------------------------------------------- full budget


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("policy", [None, "sliding", "snapkv", "quest"])
def test_a_budget_that_keeps_everything_generates_sdpas_tokens_and_logits(arch, policy):
    sdpa, ours, _ = _models(arch)
    total = PROMPT + NEW
    make = {
        None: lambda: None,
        "sliding": lambda: policies.SlidingWindow(total),
        "snapkv": lambda: policies.SnapKV(total, window=4),
        # Quest reading every page: its page choice, through the HF path, changes nothing
        "quest": lambda: policies.Quest(pages=total // PAGE + 1, page_size=PAGE),
    }[policy]
    ids = _ids()
    kwargs = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    kwargs.update(return_dict_in_generate=True, output_logits=True)
    want = sdpa.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    cache = hf.Cache(make(), page_size=PAGE)
    got = ours.generate(ids, attention_mask=torch.ones_like(ids), **{CACHE: cache}, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        assert rel(a, b) <= LOGITS_RTOL, step
    assert cache.get_seq_length() == total - 1  # the last token is never fed back
    assert (_kept_counts(cache) == total - 1).all()


def test_float32_greedy_tokens_equal_sdpas():
    sdpa, ours, _ = _models("qwen2", torch.float32)
    ids = _ids(seed=3)
    kwargs = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    want = sdpa.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    got = ours.generate(ids, attention_mask=torch.ones_like(ids), **{CACHE: hf.Cache()}, **kwargs)
    assert torch.equal(got, want)


def test_a_left_padded_batch_generates_sdpas_tokens_and_snapkv_each_prompts_own():
    sdpa, ours, _ = _models("llama")
    ids = _ids(seed=4)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # row 0: 19 real tokens, left padded
    kwargs = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, attention_mask=mask)
    assert torch.equal(
        ours.generate(ids, **{CACHE: hf.Cache()}, **kwargs), sdpa.generate(ids, **kwargs)
    )

    def snapkv():
        return hf.Cache(policies.SnapKV(BUDGET, window=3), page_size=PAGE)

    batch = ours.generate(ids, **{CACHE: snapkv()}, **kwargs)
    for row in range(2):
        prompt = ids[row : row + 1, mask[row] == 1]
        alone = ours.generate(
            prompt,
            **{CACHE: snapkv()},
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
            attention_mask=torch.ones_like(prompt),
        )
        assert torch.equal(batch[row, -NEW:], alone[0, -NEW:]), row


# ---------------------------------------------------------------------------- small budgets


class _Watch(transformers.LogitsProcessor):
    """Reads the cache after every forward of generate (prefill, then each decode step)."""

    def __init__(self, cache):
        self.cache, self.counts, self.pages = cache, [], []

    def __call__(self, input_ids, scores):
        self.counts.append(_kept_counts(self.cache))
        self.pages.append([self.cache.kv_cache(i).num_pages for i in range(2)])
        return scores


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("name", list(SMALL))
def test_small_budgets_keep_every_layer_at_its_budget_through_generate(arch, name):
    _, ours, _ = _models(arch)
    cache = hf.Cache(SMALL[name](), page_size=PAGE)
    watch = _Watch(cache)
    ids = _ids()
    out = ours.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        **{CACHE: cache},
        max_new_tokens=NEW,
        do_sample=False,
        pad_token_id=0,
        logits_processor=transformers.LogitsProcessorList([watch]),
    )
    assert out.shape == (2, PROMPT + NEW)
    assert len(watch.counts) == NEW
    budget_pages = 2 * 2 * (BUDGET // PAGE)  # batch x kv heads x pages of the budget
    for step, (counts, pages) in enumerate(zip(watch.counts, watch.pages, strict=True)):
        if name == "snapkv":  # compresses the prompt; decoding keeps what it adds (SnapKV)
            assert (counts == BUDGET + step).all(), step
        else:
            assert (counts == BUDGET).all(), step
            assert pages == [budget_pages, budget_pages], step  # the pool never grew


@pytest.mark.parametrize("name", list(SMALL))
def test_each_step_attends_exactly_the_kept_tokens(name):
    _, ours, ref = _models("llama")
    cache = hf.Cache(SMALL[name](), page_size=PAGE)
    full = transformers.DynamicCache()
    ids = _ids(seed=5)
    with torch.no_grad():
        _KEPT.clear()
        got = ours(ids, **{CACHE: cache}, use_cache=True).logits[:, -1]
        want = ref(ids, **{CACHE: full}, use_cache=True).logits[:, -1]
        assert rel(got, want) <= LOGITS_RTOL  # the prefill attends the whole prompt
        for step in range(3):
            token = got.argmax(-1, keepdim=True)
            got = ours(token, **{CACHE: cache}, use_cache=True).logits[:, -1]
            length = PROMPT + step + 1
            everything = ref(token, **{CACHE: copy.deepcopy(full)}, use_cache=True).logits[:, -1]
            for layer in range(2):
                _KEPT[layer] = _kept_mask(cache.kv_cache(layer), length)
            want = ref(token, **{CACHE: full}, use_cache=True).logits[:, -1]
            assert rel(got, want) <= KEPT_RTOL, step
            assert rel(got, everything) > KEPT_RTOL * 1e3, step  # the masking is seen
            if name == "sliding":  # the policy's own rule, read independently of the cache
                assert _KEPT[0][..., : length - BUDGET].sum() == 0
                assert _KEPT[0][..., length - BUDGET :].all()
            _KEPT.clear()
    assert full.get_seq_length() == cache.get_seq_length() == PROMPT + 3


# ---------------------------------------------------------------------------- refusals


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(TypeError, match="policy"):
        hf.Cache("sliding")
    with pytest.raises(TypeError, match=r"policy\[1\]"):
        hf.Cache([policies.SlidingWindow(4), 4])
    with pytest.raises(ValueError, match="policy"):
        hf.Cache([])
    with pytest.raises(TypeError, match="page_size"):
        hf.Cache(page_size=2.5)
    with pytest.raises(ValueError, match="page_size"):
        hf.Cache(page_size=0)
    with pytest.raises(TypeError, match="key_states"):
        hf.Cache().update(np.zeros((1, 2, 3, 4)), torch.zeros(1, 2, 3, 4), 0)


def test_misuse_in_a_model_is_refused_by_name():
    sdpa, ours, _ = _models("llama")
    ids = _ids()
    kwargs = dict(max_new_tokens=2, do_sample=False, pad_token_id=0)
    kwargs["attention_mask"] = torch.ones_like(ids)
    with pytest.raises(ValueError, match="attn_implementation"):
        sdpa.generate(ids, **{CACHE: hf.Cache()}, **kwargs)
    with pytest.raises(ValueError, match="policy holds 1"):
        ours.generate(ids, **{CACHE: hf.Cache([policies.SlidingWindow(4)])}, **kwargs)
    with pytest.raises(ValueError, match="page_size"):
        ours.generate(
            ids, **{CACHE: hf.Cache(policies.Quest(1, page_size=8), page_size=4)}, **kwargs
        )
    with pytest.raises(ValueError, match="num_beams"):
        ours.generate(ids, **{CACHE: hf.Cache()}, num_beams=2, **kwargs)
    cache = hf.Cache()
    with torch.no_grad():
        ours(ids, **{CACHE: cache}, use_cache=True)
        padded_step = torch.ones(2, PROMPT + 1, dtype=torch.long)
        padded_step[1, -1] = 0
        with pytest.raises(ValueError, match="attention_mask pads new tokens"):
            ours(ids[:, :1], **{CACHE: cache}, attention_mask=padded_step, use_cache=True)
    sparse = copy.deepcopy(ours)
    sparse.config.cuattn_pattern = {"attn_mode": "local", "blocksize": 8, "local_attn_ctx": 8}
    with pytest.raises(ValueError, match="cuattn_pattern"):
        sparse.generate(ids, **{CACHE: hf.Cache()}, **kwargs)
