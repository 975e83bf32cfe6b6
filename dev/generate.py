"""``python -m dev generate``: what each KV-cache policy costs a language model, measured.

Trains the tiny character transformer of dev.tinylm (scripts/train_tiny.py's model,
with dense causal attention over a 256-character context) on the source of Python's argparse
module, then reads held-out text (the source of optparse) token by token with a KVCache per
layer: the first ``--prompt`` characters as a prefill (full attention, then the policy
evicts), every later one as a decode step (append, then decode_attention over what the cache
keeps). Each policy runs at budgets of 25 % and 50 % of the context. Printed per row: kept KV
bytes at the end (all layers, per sequence), next-token agreement with the full cache (greedy
argmax, same inputs), perplexity on the held-out characters, and decode tokens per second.

    python -m dev generate                       # about 2 minutes on 2 CPU cores
    python -m dev generate --steps 60 --windows 2 --png generate.png

``--task passkey`` measures what the character model cannot show: it trains the same
transformer on passkey prompts (dev.longtasks: a needle of digits at a chosen depth
in random filler, asked for at the end), checks its full-cache accuracy on held-out prompts,
then answers them under every policy at budgets of 10, 25, 50 and 75 % of the context: the
prompt as one prefill through the cache (SnapKV votes with its queries there), the answer
decoded greedily one digit at a time over what the cache keeps. H2O reads the prompt as
decode steps instead: its scores are the attention decode queries pay, and a prefill gives
none. Printed per row: kept KV bytes at the end, exact-match accuracy overall and per needle
depth, and decode tokens per second.

    python -m dev generate --task passkey --markdown passkey.md --png passkey.png

``--task recall`` is the same measurement on multi-key associative recall (dev.
longtasks: key-value pairs scattered in filler, one key asked for at the end): which span
answers is known only from the prompt's last tokens. Its depth axis is the asked pair's.

    python -m dev generate --task recall --markdown recall.md --png recall.png

``--task copy`` asks for a whole span of 16 digits at a chosen depth (dev.longtasks),
longer than the smallest budget: a policy must keep all of it, and all but its first digit are
decoded over what the cache keeps. Its depth axis is the span's.

    python -m dev generate --task copy --markdown copy.md --png copy.png

``--transformers`` answers the same prompts again through ``transformers``' ``generate``: the
trained model as a GPT-2 (dev.tinylm_hf) with attention by cuattn and
``cuattn.compat.transformers.Cache`` holding each policy, as a user's model would run it. Two
columns say what that path scores and on what share of prompts it answers exactly as the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import cuattn
from cuattn import policies
from cuattn.tools.bench.report import rows_table
from dev import longtasks
from dev.tinylm import TinyConfig, adam_step, init_params, loss, prefill, step_logits

CONFIG = TinyConfig(
    n_ctx=256, width=64, heads=4, blocksize=32, layer_modes=({"attn_mode": "all"},) * 2
)
PAGE_SIZE = 16
BUDGET_SHARES = (0.25, 0.5)
SINKS = 4
RECENT_SHARE = 4  # HeavyHitters keeps budget // RECENT_SHARE recent tokens
POLICY_NAMES = ("sliding", "streaming", "h2o", "quest")
TASKS = ("text", *longtasks.TASKS)

# --task passkey: the shortest context, 512, which the 2-layer model still learns on
# one CPU core in minutes (a step of the tape's NumPy attention takes about 0.7 s there)
PASSKEY_CONFIG = TinyConfig(
    n_ctx=512, width=64, heads=4, blocksize=64, layer_modes=({"attn_mode": "all"},) * 2
)
PASSKEY_SHARES = (0.1, 0.25, 0.5, 0.75)
PASSKEY_POLICIES = ("sliding", "streaming", "h2o", "quest", "snapkv", "ada-snapkv")
# the long tasks' full cache again with pages narrower than the model's float32: bfloat16, and
# fp8 codes with a scale per page (the model's keys and values rounded to bfloat16 first)
NARROW_KV_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
KV_BYTES = {"float32": 4, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
FP8_SCALE_BYTES = 8  # an fp8 page's float32 key and value scales
# --task copy and recall: context 512, as the passkey, trained until a held-out check passes
# STOP_MATCH (longtasks.train_task's stop_at) or the steps run out. In trials at 512 (seed 0, one
# core beside other work) copy's held-out exact match (64 prompts) was 0.73-0.80 at steps
# 800-1050 and 0.95-1.00 from step 1300 to 1900 (batch 16, 0.7 s a step); recall's rose from
# 0.23 at step 400 to 0.45 at 850 (batch 32, 1.5-2.4 s a step), still climbing. At 128, 1200
# steps of copy and 3000 of recall had sufficed.
COPY_CONTEXT = 512
COPY_STEPS = 3000
RECALL_CONTEXT = 512
RECALL_STEPS = 4000
STOP_MATCH = 0.98
# per long task: the default context
LONG_CONTEXT = {"passkey": PASSKEY_CONFIG.n_ctx, "recall": RECALL_CONTEXT, "copy": COPY_CONTEXT}
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)  # needle depth: 0 the prompt's start, 1 its end
DEPTH_PLOT_SHARE = 0.25  # the budget whose accuracy-vs-depth curves are plotted
SNAP_WINDOW = 8  # SnapKV's observation window: the smallest budget (10 % of 512) holds it
STREAMED = ("h2o",)  # policies that read the prompt as decode steps (module doc)
# --transformers: the columns it adds, and prompts per generate call
HF_ACCURACY = "generate accuracy"
HF_SAME = "same answers"
HF_BATCH = 50
FULL_ACCURACY_FLOOR = 0.95  # below it, policies' accuracies say nothing; the header says so


def texts() -> tuple[str, str]:
    """(training text, held-out text): two stdlib modules' source, on every interpreter."""
    import argparse as train_module
    import optparse as held_module

    return inspect.getsource(train_module), inspect.getsource(held_module)


def make_policy(name: str, budget: int, kv_heads: int = CONFIG.heads) -> Any:
    """The policy ``name`` keeping ``budget`` tokens per kv head (Quest: reading them)."""
    if name == "sliding":
        return policies.SlidingWindow(budget)
    if name == "streaming":
        return policies.StreamingLLM(SINKS, budget - SINKS)
    if name == "h2o":
        return policies.HeavyHitters(budget, budget // RECENT_SHARE)
    if name == "snapkv":
        return policies.SnapKV(budget, SNAP_WINDOW)
    if name == "ada-snapkv":  # the same tokens per layer, spent where the votes are highest
        return policies.SnapKV(policies.head_adaptive(budget * kv_heads), SNAP_WINDOW)
    return policies.Quest(max(budget // PAGE_SIZE - 1, 1), PAGE_SIZE)  # + the newest page


def train(
    data: np.ndarray, vocab: int, steps: int, batch: int, lr: float, seed: int
) -> tuple[dict, float]:
    """Parameters after ``steps`` Adam steps, and the last batch's loss (nats per character)."""
    rng = np.random.default_rng(seed)
    params = init_params(np, vocab, rng, CONFIG)
    state: dict = {}
    last = float("nan")
    for step in range(1, steps + 1):
        starts = rng.integers(0, len(data) - CONFIG.n_ctx - 1, size=batch)
        windows = np.stack([data[s : s + CONFIG.n_ctx + 1] for s in starts])
        value = loss(params, windows[:, :-1], windows[:, 1:], CONFIG)
        value.backward()
        adam_step(params, state, step, lr)
        last = value.item()
    return params, last


def read(params: dict, held: np.ndarray, prompt: int, policy_name: str | None, budget: int):
    """Teacher-forced pass over held [batch, n_ctx]: (log-probs of every target after the
    prompt, greedy predictions, kept KV bytes per sequence, decode seconds)."""
    batch = held.shape[0]
    caches = [
        cuattn.KVCache(
            batch,
            CONFIG.heads,
            CONFIG.head_dim,
            "float32",
            page_size=PAGE_SIZE,
            policy=None if policy_name is None else make_policy(policy_name, budget),
        )
        for _ in CONFIG.layer_modes
    ]
    outputs = [prefill(params, held[:, :prompt], caches, CONFIG)[:, -1]]
    start = time.perf_counter()
    for position in range(prompt, CONFIG.n_ctx - 1):
        outputs.append(step_logits(params, held[:, position], position, caches, CONFIG))
    seconds = time.perf_counter() - start
    logits = np.stack(outputs, axis=1)  # predicts held[:, prompt:]
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    targets = held[:, prompt:]
    chosen = np.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    kept = sum(int((c.positions() >= 0).sum()) for c in caches) / batch
    kv_bytes = kept * CONFIG.head_dim * 4 * 2  # float32 keys and values
    return chosen, logits.argmax(-1), kv_bytes, seconds


# per task: training steps (at most, where a stop applies), batch, learning rate
TRAINING = {
    "text": (400, 8, 3e-3),
    "passkey": (600, 16, 3e-3),
    "recall": (RECALL_STEPS, 32, 3e-3),
    "copy": (COPY_STEPS, 16, 3e-3),
}
# per long task: the held-out share that ends training early (None: every step runs; the
# passkey's committed table was trained so)
STOP_AT = {"passkey": None, "recall": STOP_MATCH, "copy": STOP_MATCH}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", choices=TASKS, default="text", help="what the model learns")
    parser.add_argument(
        "--steps",
        type=int,
        help=(
            f"training steps (text 400, passkey 600; at most: recall {RECALL_STEPS}, copy "
            f"{COPY_STEPS})"
        ),
    )
    parser.add_argument(
        "--batch", type=int, help="training batch (text 8, passkey 16, recall 32, copy 16)"
    )
    parser.add_argument(
        "--stop-at",
        type=float,
        help=(
            "recall, copy: stop training once a held-out check (128 prompts every 100 steps) "
            f"reaches this exact-match share (default {STOP_MATCH}; above 1: never)"
        ),
    )
    parser.add_argument("--lr", type=float, help="Adam's learning rate (3e-3)")
    parser.add_argument(
        "--context",
        type=int,
        help=(
            "passkey, recall, copy: tokens per prompt and answer (passkey: 512, recall: "
            f"{RECALL_CONTEXT}, copy: {COPY_CONTEXT})"
        ),
    )
    parser.add_argument(
        "--prompts", type=int, default=20, help="passkey, recall, copy: held-out prompts per depth"
    )
    parser.add_argument(
        "--transformers",
        action="store_true",
        help=(
            "passkey, recall, copy: also answer every prompt through transformers' generate "
            "(the model as a GPT-2, cuattn.compat.transformers.Cache with each policy)"
        ),
    )
    parser.add_argument("--windows", type=int, default=4, help="text: windows read at once")
    parser.add_argument("--prompt", type=int, default=16, help="text: prefill characters/window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument("--png", type=Path, help="also plot perplexity vs KV bytes here")


def _training(args: argparse.Namespace) -> tuple[int, int, float]:
    steps, batch, lr = TRAINING[args.task]
    return (
        steps if args.steps is None else args.steps,
        batch if args.batch is None else args.batch,
        lr if args.lr is None else args.lr,
    )


def run(args: argparse.Namespace) -> int:
    if args.task in longtasks.TASKS:
        return run_long(args, longtasks.TASKS[args.task])
    steps, batch, lr = _training(args)
    train_text, held_text = texts()
    chars = sorted(set(train_text) | set(held_text))
    encode = {c: i for i, c in enumerate(chars)}
    data = np.array([encode[c] for c in train_text], dtype=np.int64)
    held_ids = np.array([encode[c] for c in held_text], dtype=np.int64)
    start = time.perf_counter()
    params, last_loss = train(data, len(chars), steps, batch, lr, args.seed)
    train_seconds = time.perf_counter() - start
    stride = (len(held_ids) - CONFIG.n_ctx) // max(args.windows, 1)
    held = np.stack([held_ids[i * stride : i * stride + CONFIG.n_ctx] for i in range(args.windows)])

    rows = []
    full_lp, full_pred, full_bytes, full_s = read(params, held, args.prompt, None, 0)
    decoded = held.shape[0] * (CONFIG.n_ctx - 1 - args.prompt)
    rows.append(_row("full cache", "-", full_bytes, 1.0, full_lp, decoded / full_s))
    for share in BUDGET_SHARES:
        budget = int(share * CONFIG.n_ctx)
        for name in POLICY_NAMES:
            lp, pred, kv_bytes, seconds = read(params, held, args.prompt, name, budget)
            agreement = float((pred == full_pred).mean())
            rows.append(_row(name, f"{budget}", kv_bytes, agreement, lp, decoded / seconds))
    header = (
        f"tiny char LM: {sum(t.size for t in params.values())} parameters, context "
        f"{CONFIG.n_ctx}, trained {steps} steps in {train_seconds:.0f} s (last batch loss "
        f"{last_loss:.3f} nats/char); read {args.windows} held-out windows of {CONFIG.n_ctx} "
        f"characters, prompt {args.prompt}"
    )
    table = rows_table(rows)
    print(header, "", table, sep="\n")
    if args.markdown:
        args.markdown.write_text(header + "\n\n" + table + "\n")
    if args.png:
        _plot(rows, args.png)
    return 0


def answer_prompts(
    params: dict,
    prompts: np.ndarray,
    answer_len: int,
    config: TinyConfig,
    policy_name: str | None,
    budget: int,
    kv_dtype: str = "float32",
) -> tuple[np.ndarray, float, float]:
    """Greedy answers [count, answer_len] to ``prompts`` through a KVCache per layer under the
    policy (None: the full cache) with pages of ``kv_dtype``, the kept KV bytes per prompt at
    the end (all layers; an fp8 cache's page scales included), and
    decode tokens per second. The prompt goes in as one prefill (full attention, then the
    policy chooses; SnapKV from the prompt's queries) and its last position gives the first
    token, as in serving; every later one is a decode step over what the cache keeps. A
    STREAMED policy reads the prompt after its first token as decode steps, so that its
    scores see every query."""
    count, prompt_len = prompts.shape
    caches = [
        cuattn.KVCache(
            count,
            config.heads,
            config.head_dim,
            kv_dtype,
            page_size=PAGE_SIZE,
            policy=None if policy_name is None else make_policy(policy_name, budget, config.heads),
        )
        for _ in config.layer_modes
    ]
    first = 1 if policy_name in STREAMED else prompt_len
    logits = prefill(params, prompts[:, :first], caches, config)[:, -1]
    decoded = 0
    start = time.perf_counter()
    for position in range(first, prompt_len):
        logits = step_logits(params, prompts[:, position], position, caches, config)
        decoded += count
    digits = [logits.argmax(-1)]
    for position in range(prompt_len, prompt_len + answer_len - 1):
        logits = step_logits(params, digits[-1], position, caches, config)
        digits.append(logits.argmax(-1))
        decoded += count
    seconds = time.perf_counter() - start
    kept = sum(int((c.positions() >= 0).sum()) for c in caches) / count
    kv_bytes = kept * config.head_dim * KV_BYTES[kv_dtype] * 2  # keys and values
    if kv_dtype not in ("float32", "bfloat16"):
        kv_bytes += kept / PAGE_SIZE * FP8_SCALE_BYTES
    return np.stack(digits, axis=1), kv_bytes, decoded / seconds


def run_long(args: argparse.Namespace, task: longtasks.LongTask) -> int:
    """Train on ``task``'s prompts, then tabulate accuracy by policy, budget and needle depth."""
    steps, batch, lr = _training(args)
    context = LONG_CONTEXT[task.name] if args.context is None else args.context
    if int(min(PASSKEY_SHARES) * context) < SNAP_WINDOW:
        least = math.ceil(SNAP_WINDOW / min(PASSKEY_SHARES))
        raise ValueError(
            f"--context {context} leaves the smallest budget ({min(PASSKEY_SHARES):.0%}) under "
            f"SnapKV's window of {SNAP_WINDOW} tokens; accepted: a context >= {least}"
        )
    config = dataclasses.replace(PASSKEY_CONFIG, n_ctx=context)
    stop_at = STOP_AT[task.name] if args.stop_at is None else args.stop_at
    start = time.perf_counter()
    trained = longtasks.train_task(task, config, steps, batch, lr, args.seed, stop_at)
    train_seconds = time.perf_counter() - start
    params = trained.params
    # held-out prompts from their own stream: args.prompts at each depth
    depth = np.repeat(DEPTHS, args.prompts)
    held_rng = np.random.default_rng([args.seed, 1])
    prompts, answers = task.prompts(held_rng, depth.size, context, depth)

    def row(name: str, budget: str, share: str, predicted, kv_bytes, tokens_per_s) -> dict:
        right = longtasks.exact_match(predicted, answers)
        cells = {"policy": name, "budget (tokens)": budget, "budget (share)": share}
        cells |= {"KV bytes": int(kv_bytes), "accuracy": float(right.mean())}
        for d in DEPTHS:
            cells[f"depth {d:g}"] = float(right[depth == d].mean())
        return cells | {"tokens/s": tokens_per_s}

    through_hf = _through_generate(args, params, config, task, prompts, answers)

    def answered(
        name: str | None,
        budget: int,
        label: str,
        budget_cell: str,
        share: str,
        kv_dtype: str = "float32",
    ) -> dict:
        predicted, kv_bytes, tokens_per_s = answer_prompts(
            params, prompts, task.answer_len, config, name, budget, kv_dtype
        )
        cells = row(label, budget_cell, share, predicted, kv_bytes, tokens_per_s)
        if not through_hf:
            return cells
        if kv_dtype != "float32":  # generate's cache holds the model's float32
            return cells | {HF_ACCURACY: "-", HF_SAME: "-"}
        return cells | through_hf(name, budget, predicted)

    rows = [answered(None, 0, "full cache", "-", "-")]
    full = rows[0]["accuracy"]
    for kv_dtype in NARROW_KV_DTYPES:
        rows.append(answered(None, 0, f"full cache, {kv_dtype} pages", "-", "-", kv_dtype))
    for share in PASSKEY_SHARES:
        budget = int(share * context)
        for name in PASSKEY_POLICIES:
            rows.append(answered(name, budget, name, str(budget), f"{share:g}"))
    header = (
        f"tiny transformer on {task.name}: {sum(t.size for t in params.values())} "
        f"parameters, context {context} (prompt {prompts.shape[1]} tokens, answer: "
        f"{task.answer}), trained {trained.steps} steps of {batch} prompts in "
        f"{train_seconds:.0f} s{_stop_note(trained, stop_at, steps)} (last batch: loss "
        f"{trained.loss:.3f} nats/digit, exact match {trained.matched:.3f}); "
        f"answered {depth.size} held-out prompts, {args.prompts} at each needle depth; "
        f"full-cache accuracy {full:.3f}"
    )
    if full < FULL_ACCURACY_FLOOR:
        header += f", under {FULL_ACCURACY_FLOOR}: the policies' rows say little"
    table = rows_table(rows)
    print(header, "", table, sep="\n")
    if args.markdown:
        args.markdown.write_text(header + "\n\n" + table + "\n")
    if args.png:
        _plot_long(rows, args.png, context, task.name)
    return 0


def _through_generate(
    args: argparse.Namespace,
    params: dict,
    config: TinyConfig,
    task: longtasks.LongTask,
    prompts: np.ndarray,
    answers: np.ndarray,
) -> Callable[[str | None, int, np.ndarray], dict] | None:
    """With --transformers: a function of (policy, budget, the table's answers) giving the
    columns of the same prompts answered through transformers' generate (the trained model as a
    GPT-2, attn_implementation "cuattn", cuattn.compat.transformers.Cache with the policy): its
    accuracy and the share of prompts whose answer equals the table's. A STREAMED policy's
    table row reads the prompt as decode steps, which generate's one prefill does not: "-"."""
    if not args.transformers:
        return None
    import cuattn.compat.transformers as hf
    from dev import tinylm_hf

    model = tinylm_hf.to_gpt2(params, config, task.vocab, hf.NAME)

    def columns(name: str | None, budget: int, table_answers: np.ndarray) -> dict:
        if name in STREAMED:
            return {HF_ACCURACY: "-", HF_SAME: "-"}

        def cache() -> Any:
            policy = None if name is None else make_policy(name, budget, config.heads)
            return hf.Cache(policy, page_size=PAGE_SIZE)

        got = tinylm_hf.answer_through_generate(model, prompts, task.answer_len, cache, HF_BATCH)
        right = longtasks.exact_match(got, answers)
        same = (got == table_answers).all(axis=1)
        return {HF_ACCURACY: float(right.mean()), HF_SAME: float(same.mean())}

    return columns


def _stop_note(trained: longtasks.Trained, stop_at: float | None, steps: int) -> str:
    """How training ended, for the table's header."""
    if stop_at is None or stop_at > 1:
        return ""
    if math.isnan(trained.checked):
        return f", the step limit reached before the first held-out check (target {stop_at})"
    held = f"{longtasks.CHECK_PROMPTS} held-out prompts at {trained.checked:.3f}"
    if trained.steps < steps:
        return f", stopped at {held} (target {stop_at})"
    return f", the step limit reached with {held} (target {stop_at})"


def _plot_long(rows: list[dict], path: Path, context: int, task: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_budget, by_depth) = plt.subplots(1, 2, figsize=(11, 4))
    full = rows[0]["accuracy"]
    by_budget.axhline(full, color="black", linestyle="--", label="full cache")
    by_depth.axhline(full, color="black", linestyle="--", label="full cache")
    for name in PASSKEY_POLICIES:
        mine = [r for r in rows if r["policy"] == name]
        by_budget.plot(
            [100 * float(r["budget (share)"]) for r in mine],
            [r["accuracy"] for r in mine],
            "o-",
            label=name,
        )
        (at,) = [r for r in mine if float(r["budget (share)"]) == DEPTH_PLOT_SHARE]
        by_depth.plot(DEPTHS, [at[f"depth {d:g}"] for d in DEPTHS], "o-", label=name)
    by_budget.set_xlabel(f"KV budget (% of the {context}-token context)")
    by_budget.set_ylabel(f"{task} exact match")
    by_budget.set_title("accuracy vs budget (all depths)")
    by_depth.set_xlabel("depth of the needle, asked pair or span (0: start, 1: question)")
    by_depth.set_title(f"accuracy vs depth at {DEPTH_PLOT_SHARE:.0%} budget")
    by_budget.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _row(policy, budget, kv_bytes, agreement, log_probs, tokens_per_s):
    return {
        "policy": policy,
        "budget (tokens)": budget,
        "KV bytes": int(kv_bytes),
        "agreement": agreement,
        "perplexity": math.exp(-float(log_probs.mean())),
        "tokens/s": tokens_per_s,
    }


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("full cache", *POLICY_NAMES):
        mine = [r for r in rows if r["policy"] == name]
        ax.plot(
            [r["KV bytes"] / 1024 for r in mine],
            [r["perplexity"] for r in mine],
            "o-" if len(mine) > 1 else "s",
            label=name,
        )
    ax.set_xlabel("KV cache kept at the end (KiB per sequence, all layers)")
    ax.set_ylabel("held-out perplexity (characters)")
    ax.set_title("cuattn KV-cache policies on a tiny char LM")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
