"""``cuattn generate``: what each KV-cache policy costs a language model, measured.

Trains the tiny character transformer of cuattn.tools.tinylm (scripts/train_tiny.py's model,
with dense causal attention over a 256-character context) on the source of Python's argparse
module, then reads held-out text (the source of optparse) token by token with a KVCache per
layer: the first ``--prompt`` characters as a prefill (full attention, then the policy
evicts), every later one as a decode step (append, then decode_attention over what the cache
keeps). Each policy runs at budgets of 25 % and 50 % of the context. Printed per row: kept KV
bytes at the end (all layers, per sequence), next-token agreement with the full cache (greedy
argmax, same inputs), perplexity on the held-out characters, and decode tokens per second.

    cuattn generate                       # about 2 minutes on 2 CPU cores
    cuattn generate --steps 60 --windows 2 --png generate.png
"""

from __future__ import annotations

import argparse
import inspect
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

import cuattn
from cuattn import policies
from cuattn.tools.bench.report import rows_table
from cuattn.tools.tinylm import TinyConfig, adam_step, init_params, loss, prefill, step_logits

CONFIG = TinyConfig(
    n_ctx=256, width=64, heads=4, blocksize=32, layer_modes=({"attn_mode": "all"},) * 2
)
PAGE_SIZE = 16
BUDGET_SHARES = (0.25, 0.5)
SINKS = 4
RECENT_SHARE = 4  # HeavyHitters keeps budget // RECENT_SHARE recent tokens
POLICY_NAMES = ("sliding", "streaming", "h2o", "quest")


def texts() -> tuple[str, str]:
    """(training text, held-out text): two stdlib modules' source, on every interpreter."""
    import argparse as train_module
    import optparse as held_module

    return inspect.getsource(train_module), inspect.getsource(held_module)


def make_policy(name: str, budget: int) -> Any:
    if name == "sliding":
        return policies.SlidingWindow(budget)
    if name == "streaming":
        return policies.StreamingLLM(SINKS, budget - SINKS)
    if name == "h2o":
        return policies.HeavyHitters(budget, budget // RECENT_SHARE)
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=400, help="training steps")
    parser.add_argument("--batch", type=int, default=8, help="training batch")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--windows", type=int, default=4, help="held-out windows read at once")
    parser.add_argument("--prompt", type=int, default=16, help="prefill characters per window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument("--png", type=Path, help="also plot perplexity vs KV bytes here")


def run(args: argparse.Namespace) -> int:
    train_text, held_text = texts()
    chars = sorted(set(train_text) | set(held_text))
    encode = {c: i for i, c in enumerate(chars)}
    data = np.array([encode[c] for c in train_text], dtype=np.int64)
    held_ids = np.array([encode[c] for c in held_text], dtype=np.int64)
    start = time.perf_counter()
    params, last_loss = train(data, len(chars), args.steps, args.batch, args.lr, args.seed)
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
        f"{CONFIG.n_ctx}, trained {args.steps} steps in {train_seconds:.0f} s (last batch loss "
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
