"""python -m dev generate: the quality-vs-memory table runs, and its rows mean what they say."""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest

from dev import generate, longtasks


def test_generate_smoke(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    args = parser.parse_args(
        [
            "--steps",
            "3",
            "--windows",
            "1",
            "--markdown",
            str(tmp_path / "t.md"),
            "--png",
            str(tmp_path / "p.png"),
        ]
    )
    assert generate.run(args) == 0
    rows = [line.split("|")[1:-1] for line in (tmp_path / "t.md").read_text().splitlines()[4:]]
    table = {(r[0].strip(), r[1].strip()): r for r in rows}
    per_token = generate.CONFIG.head_dim * 4 * 2 * generate.CONFIG.heads * 2  # layers = 2
    assert float(table[("full cache", "-")][3]) == 1.0  # agrees with itself
    assert int(table[("sliding", "64")][2]) == 64 * per_token  # exactly the budget is kept
    assert int(table[("quest", "64")][2]) == int(table[("full cache", "-")][2])  # evicts nothing
    assert (tmp_path / "p.png").stat().st_size > 0
    assert "held-out windows" in capsys.readouterr().out


def test_passkey_prompt_holds_the_needle_at_its_depth():
    rng = np.random.default_rng(3)
    depth = np.array([0.0, 0.25, 0.5, 1.0])
    context = 40
    prompts, answers = longtasks.passkey_prompts(rng, depth.size, context, depth)
    digits = longtasks.PASSKEY_DIGITS
    prompt_len = context - digits + 1
    assert prompts.shape == (depth.size, prompt_len) and answers.shape == (depth.size, digits)
    starts = longtasks.needle_start(depth, prompt_len)
    assert starts.tolist() == [0, 8, 16, prompt_len - 1 - digits]  # depth 1: before the question
    assert (prompts[:, -1] == longtasks.ASK).all()
    for prompt, answer, start in zip(prompts, answers, starts, strict=True):
        needle = prompt[start : start + digits]
        place = np.arange(digits)
        assert (needle == longtasks.PLACED + longtasks.DIGITS * place + answer).all()
        rest = np.delete(prompt[:-1], start + place)
        assert ((rest >= longtasks.FILLER) & (rest < longtasks.ASK)).all()  # filler only
        assert len(set(answer.tolist())) == digits  # distinct digits
    assert (answers >= 0).all() and (answers < longtasks.DIGITS).all()


def test_exact_match_needs_every_digit():
    answers = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [0, 1, 2, 3]])
    predicted = np.array([[1, 2, 3, 4], [5, 6, 7, 9], [3, 2, 1, 0]])
    assert longtasks.exact_match(predicted, answers).tolist() == [True, False, False]


SMOKE_CONTEXT = 80  # the smallest budget, 10 %, holds SnapKV's window of 8


def _smoke_table(task: str, tmp_path) -> list[str]:
    """The markdown table of a tiny `python -m dev generate --task TASK` run (2 steps, 1 prompt)."""
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    args = parser.parse_args(
        ["--task", task, "--steps", "2", "--context", str(SMOKE_CONTEXT), "--prompts", "1"]
        + ["--markdown", str(tmp_path / "t.md"), "--png", str(tmp_path / "p.png")]
    )
    assert generate.run(args) == 0
    return (tmp_path / "t.md").read_text().splitlines()


def test_generate_passkey_smoke(tmp_path, capsys):
    lines = _smoke_table("passkey", tmp_path)
    columns = [c.strip() for c in lines[2].split("|")[1:-1]]
    assert columns[5:10] == [f"depth {d:g}" for d in generate.DEPTHS]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[4:]]
    table = {(r[0], r[1]): dict(zip(columns, r, strict=True)) for r in rows}
    budgets = [int(share * SMOKE_CONTEXT) for share in generate.PASSKEY_SHARES]
    narrow = {(f"full cache, {d} pages", "-") for d in generate.NARROW_KV_DTYPES}
    assert set(table) == {("full cache", "-")} | narrow | {
        (name, str(b)) for name in generate.PASSKEY_POLICIES for b in budgets
    }
    config = generate.PASSKEY_CONFIG
    per_token = config.head_dim * 4 * 2 * config.heads * len(config.layer_modes)
    decoded = longtasks.PASSKEY_DIGITS - 1  # the answer digits fed back to the cache
    full = table[("full cache", "-")]
    assert int(full["KV bytes"]) == SMOKE_CONTEXT * per_token  # the prompt and the answer fed back
    # narrower pages: bfloat16 half the bytes; fp8 a quarter, and a page's two float32 scales
    half = table[("full cache, bfloat16 pages", "-")]
    assert int(half["KV bytes"]) == SMOKE_CONTEXT * per_token // 2
    kept = SMOKE_CONTEXT * config.heads * len(config.layer_modes)
    scales = kept / generate.PAGE_SIZE * generate.FP8_SCALE_BYTES
    for kv_dtype in ("float8_e4m3fn", "float8_e5m2"):
        fp8 = table[(f"full cache, {kv_dtype} pages", "-")]
        assert int(fp8["KV bytes"]) == int(SMOKE_CONTEXT * per_token // 4 + scales)
        assert 0.0 <= float(fp8["accuracy"]) <= 1.0
    for budget in budgets:
        assert int(table[("sliding", str(budget))]["KV bytes"]) == budget * per_token
        assert table[("quest", str(budget))]["KV bytes"] == full["KV bytes"]  # evicts nothing
        # SnapKV chose from the prefill's queries (without them it keeps everything), then
        # decoding grew the cache
        snap = int(table[("snapkv", str(budget))]["KV bytes"])
        assert snap == (budget + decoded) * per_token
        assert 0.0 <= float(table[("h2o", str(budget))]["accuracy"]) <= 1.0
    assert (tmp_path / "p.png").stat().st_size > 0
    assert "full-cache accuracy" in capsys.readouterr().out


def test_recall_prompt_asks_the_pair_at_its_depth():
    rng = np.random.default_rng(5)
    depth = np.array([0.0, 0.25, 0.5, 0.75, 1.0])
    context = 64
    prompts, answers = longtasks.recall_prompts(rng, depth.size, context, depth)
    value_len = longtasks.VALUE_DIGITS
    prompt_len = context - value_len + 1
    assert prompts.shape == (depth.size, prompt_len) and answers.shape == (depth.size, value_len)
    span, question = longtasks.PAIR_SPAN, longtasks.RECALL_QUESTION
    starts = longtasks.needle_start(depth, prompt_len, span, question)
    assert starts[0] == 0 and starts[-1] == prompt_len - question - span  # before the question
    assert (prompts[:, -1] == longtasks.ASK).all()
    for prompt, answer, start in zip(prompts, answers, starts, strict=True):
        asked = prompt[-question]
        assert prompt[start] == asked  # the asked pair's key sits at its depth
        value = longtasks.value_tokens(asked - longtasks.KEY, answer)
        assert (prompt[start + 1 : start + span] == value).all()  # and its value
        keys = np.flatnonzero((prompt >= longtasks.KEY) & (prompt < longtasks.VALUE))[:-1]
        assert len(keys) == longtasks.RECALL_PAIRS  # the asked pair and its decoys
        assert len(set(prompt[keys].tolist())) == len(keys)  # distinct keys: one answer
        for at in keys:  # every key is followed by a whole value of its own
            digits = prompt[at + 1 : at + span] - longtasks.value_tokens(
                prompt[at] - longtasks.KEY, 0
            )
            assert ((digits >= 0) & (digits < longtasks.DIGITS)).all()
        pairs = (keys[:, None] + np.arange(span)).ravel()
        rest = np.delete(prompt[:-question], pairs)
        assert ((rest >= longtasks.FILLER) & (rest < longtasks.ASK)).all()  # filler only
    assert (answers >= 0).all() and (answers < longtasks.DIGITS).all()


def _kv_bytes(lines: list[str]) -> tuple[dict, int]:
    """({(policy, budget): KV bytes} of a smoke table, a token's bytes over both layers)."""
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[4:]]
    config = generate.PASSKEY_CONFIG
    per_token = config.head_dim * 4 * 2 * config.heads * len(config.layer_modes)
    return {(r[0], r[1]): int(r[3]) for r in rows}, per_token


def test_generate_recall_smoke(tmp_path, capsys):
    kv_bytes, per_token = _kv_bytes(_smoke_table("recall", tmp_path))
    assert kv_bytes[("full cache", "-")] == SMOKE_CONTEXT * per_token  # prompt + the value fed back
    budget = int(min(generate.PASSKEY_SHARES) * SMOKE_CONTEXT)
    decoded = longtasks.VALUE_DIGITS - 1
    assert kv_bytes[("snapkv", str(budget))] == (budget + decoded) * per_token
    assert (tmp_path / "p.png").stat().st_size > 0
    assert "tiny transformer on recall" in capsys.readouterr().out


def test_copy_prompt_holds_the_span_at_its_depth():
    rng = np.random.default_rng(7)
    depth = np.array([0.0, 0.5, 1.0])
    context = 48
    prompts, answers = longtasks.copy_prompts(rng, depth.size, context, depth)
    span = longtasks.COPY_LEN
    prompt_len = context - span + 1
    assert prompts.shape == (depth.size, prompt_len) and answers.shape == (depth.size, span)
    starts = longtasks.needle_start(depth, prompt_len, span)
    assert starts.tolist() == [0, (prompt_len - 1 - span) // 2, prompt_len - 1 - span]
    assert (prompts[:, -1] == longtasks.ASK).all()
    for prompt, answer, start in zip(prompts, answers, starts, strict=True):
        place = np.arange(span)
        written = prompt[start : start + span]
        assert (written == longtasks.COPY + longtasks.DIGITS * place + answer).all()
        rest = np.delete(prompt[:-1], start + place)
        assert ((rest >= longtasks.FILLER) & (rest < longtasks.ASK)).all()  # filler only
    assert (answers >= 0).all() and (answers < longtasks.DIGITS).all()
    assert prompts.max() < longtasks.COPY_VOCAB
    with pytest.raises(ValueError, match="context=20 cannot hold a 16-digit copy prompt"):
        longtasks.copy_prompts(rng, 1, 20)


def test_generate_copy_smoke(tmp_path, capsys):
    kv_bytes, per_token = _kv_bytes(_smoke_table("copy", tmp_path))
    assert kv_bytes[("full cache", "-")] == SMOKE_CONTEXT * per_token  # prompt + the span fed back
    decoded = longtasks.COPY_LEN - 1  # all but the first answer digit are decode steps
    for share in generate.PASSKEY_SHARES:
        budget = int(share * SMOKE_CONTEXT)
        assert kv_bytes[("sliding", str(budget))] == budget * per_token
        assert kv_bytes[("snapkv", str(budget))] == (budget + decoded) * per_token
    assert (tmp_path / "p.png").stat().st_size > 0
    assert "tiny transformer on copy" in capsys.readouterr().out


def test_training_stops_at_its_held_out_check_and_not_before():
    """train_task's stop: a target every model meets ends training at the first check, one no
    model meets runs every step; the check equals the exact match the table would count."""
    config = dataclasses.replace(generate.PASSKEY_CONFIG, n_ctx=SMOKE_CONTEXT, width=16)
    task = longtasks.TASKS["copy"]
    steps = longtasks.CHECK_EVERY + 3
    stopped = longtasks.train_task(task, config, steps, 2, 3e-3, seed=0, stop_at=0.0)
    assert stopped.steps == longtasks.CHECK_EVERY and 0.0 <= stopped.checked <= 1.0
    ran = longtasks.train_task(task, config, steps, 2, 3e-3, seed=0, stop_at=1.5)
    assert ran.steps == steps
    # the same seed: the stopped run is the first CHECK_EVERY steps of the full one
    unchecked = longtasks.train_task(task, config, longtasks.CHECK_EVERY, 2, 3e-3, seed=0)
    assert np.isnan(unchecked.checked)
    for name, tensor in stopped.params.items():
        np.testing.assert_array_equal(tensor.data, unchecked.params[name].data)
    rng = np.random.default_rng([0, longtasks.CHECK_STREAM])
    prompts, answers = task.prompts(rng, longtasks.CHECK_PROMPTS, config.n_ctx, None)
    assert stopped.checked == longtasks.held_out_match(
        stopped.params, task, config, prompts, answers
    )
    predicted, _, _ = generate.answer_prompts(
        stopped.params, prompts, task.answer_len, config, None, 0
    )
    assert stopped.checked == longtasks.exact_match(predicted, answers).mean()


def test_generate_copy_says_how_training_ended(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    args = parser.parse_args(
        ["--task", "copy", "--steps", "2", "--context", str(SMOKE_CONTEXT), "--prompts", "1"]
        + ["--stop-at", "0.5"]
    )
    assert generate.run(args) == 0
    out = capsys.readouterr().out
    assert "trained 2 steps of 16 prompts" in out
    assert "the step limit reached before the first held-out check (target 0.5)" in out


def test_the_trained_model_answers_alike_through_transformers_generate():
    """The demo model as a GPT-2 inside transformers' generate, with cuattn's Cache and each
    policy that evicts at prefill or decode, answers every prompt token for token as the table's
    own decode loop does (the NumPy tape's prefill and decode_attention over a KVCache)."""
    pytest.importorskip("transformers")
    import cuattn.compat.transformers as hf
    from dev import tinylm_hf

    config = dataclasses.replace(generate.PASSKEY_CONFIG, n_ctx=SMOKE_CONTEXT)
    task = longtasks.TASKS["copy"]
    trained = longtasks.train_task(task, config, 60, 8, 3e-3, seed=0)
    depth = np.linspace(0, 1, 6)
    prompts, _ = task.prompts(np.random.default_rng(5), depth.size, SMOKE_CONTEXT, depth)
    model = tinylm_hf.to_gpt2(trained.params, config, task.vocab, hf.NAME)
    budget = int(0.3 * SMOKE_CONTEXT)  # under the prompt's 65 tokens: every policy evicts
    for name in (None, "sliding", "streaming", "snapkv", "ada-snapkv", "quest"):
        ours, _, _ = generate.answer_prompts(
            trained.params, prompts, task.answer_len, config, name, budget
        )

        def cache(name=name):
            policy = None if name is None else generate.make_policy(name, budget, config.heads)
            return hf.Cache(policy, page_size=generate.PAGE_SIZE)

        got = tinylm_hf.answer_through_generate(model, prompts, task.answer_len, cache, 4)
        np.testing.assert_array_equal(got, ours, err_msg=str(name))
        assert len(np.unique(ours)) > 1  # a model that says one digit would prove nothing


def test_only_dense_causal_layers_map_to_gpt2():
    pytest.importorskip("transformers")
    from dev import tinylm, tinylm_hf

    config = tinylm.TinyConfig()  # local and strided layers
    params = tinylm.init_params(np, 10, np.random.default_rng(0), config)
    with pytest.raises(ValueError, match="only dense causal layers"):
        tinylm_hf.to_gpt2(params, config, 10, "sdpa")


def test_generate_transformers_flag_adds_its_columns(tmp_path, capsys):
    pytest.importorskip("transformers")
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    args = parser.parse_args(
        ["--task", "recall", "--steps", "2", "--context", str(SMOKE_CONTEXT), "--prompts", "1"]
        + ["--transformers", "--markdown", str(tmp_path / "t.md")]
    )
    assert generate.run(args) == 0
    lines = (tmp_path / "t.md").read_text().splitlines()
    columns = [c.strip() for c in lines[2].split("|")[1:-1]]
    assert columns[-2:] == [generate.HF_ACCURACY, generate.HF_SAME]
    for line in lines[4:]:
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if cells[0] in generate.STREAMED or cells[0].endswith(" pages"):  # narrow pages too
            assert cells[-2:] == ["-", "-"]
        else:
            assert cells[-1] == "1.000", line  # the same answers on every prompt
