"""Synthetic long-range tasks for ``cuattn generate --task``: prompts whose answer is far back.

The character model of ``cuattn generate`` gains almost nothing from context beyond a few
dozen characters, so no KV-cache policy can hurt it much. A passkey prompt cannot be answered
without one particular span of it, wherever that span sits, so a policy that drops the span
fails the prompt outright and accuracy separates the policies.

Passkey retrieval: random filler tokens, a needle of ``PASSKEY_DIGITS`` distinct digits at a
chosen depth, and a question token at the end; the answer is the digits in order. Each digit of
the needle is written with a token of its own place (place j, digit d), so the model finds
digit j by content alone, in one attention hop from the answer's j-th position: that is what
lets the 2-layer demo transformer learn the task on a CPU in minutes. Plain digits need an
induction circuit (find the digit after the one just written); one trial (context 256, learning
rate 1e-2) had learned only that the digits are distinct after 425 steps, and they were not
tried again at the rate ``cuattn generate`` uses. The answer is written in plain digits. A
prompt of ``context - PASSKEY_DIGITS + 1`` tokens and the answer fed back one digit at a time
fill exactly ``context`` positions.
"""

from __future__ import annotations

import numpy as np

from cuattn.autograd.tape import Tensor
from cuattn.tools.tinylm import TinyConfig, _embed, adam_step, block, init_params
from cuattn.tools.tinylm_ops import cross_entropy, layer_norm

__all__ = [
    "PASSKEY_DIGITS",
    "VOCAB",
    "exact_match",
    "needle_start",
    "passkey_prompts",
    "train_passkey",
]

DIGITS = 10
PASSKEY_DIGITS = 4
PLACED = DIGITS  # first id of the placed digits: place j, digit d is PLACED + DIGITS * j + d
FILLER = PLACED + DIGITS * PASSKEY_DIGITS  # first filler id
FILLER_TOKENS = 8
ASK = FILLER + FILLER_TOKENS  # the question, last token of every prompt
VOCAB = ASK + 1


def needle_start(depth: np.ndarray, prompt_len: int) -> np.ndarray:
    """int64: where a needle at ``depth`` (0: the first token, 1: right before the question)
    starts in a prompt of ``prompt_len`` tokens."""
    last = prompt_len - 1 - PASSKEY_DIGITS  # the needle ends right before the question
    return np.rint(np.asarray(depth, dtype=np.float64) * last).astype(np.int64)


def passkey_prompts(
    rng: np.random.Generator, count: int, context: int, depth: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(prompts int64 [count, context - PASSKEY_DIGITS + 1], answers int64 [count,
    PASSKEY_DIGITS]): each prompt's needle at its ``depth`` (a share of the prompt, one per
    prompt; uniform at random when None)."""
    prompt_len = context - PASSKEY_DIGITS + 1
    if prompt_len < PASSKEY_DIGITS + 1:
        raise ValueError(f"context={context} cannot hold a {PASSKEY_DIGITS}-digit passkey prompt")
    if depth is None:
        depth = rng.random(count)
    prompts = rng.integers(FILLER, FILLER + FILLER_TOKENS, size=(count, prompt_len))
    answers = np.stack([rng.permutation(DIGITS)[:PASSKEY_DIGITS] for _ in range(count)])
    at = needle_start(depth, prompt_len)[:, None] + np.arange(PASSKEY_DIGITS)
    placed = PLACED + DIGITS * np.arange(PASSKEY_DIGITS) + answers
    np.put_along_axis(prompts, at, placed, axis=1)
    prompts[:, -1] = ASK
    return prompts, answers


def exact_match(predicted: np.ndarray, answers: np.ndarray) -> np.ndarray:
    """bool [count]: whether every answer token was predicted."""
    return (np.asarray(predicted) == np.asarray(answers)).all(axis=-1)


def _answer_logits(params: dict, idx: np.ndarray, config: TinyConfig) -> Tensor:
    """Logits [batch, PASSKEY_DIGITS, vocab] at the answer's positions (the last
    PASSKEY_DIGITS of idx): only they are trained, as the filler is noise by design. The rows
    are picked by a one-hot matrix product, which the tape differentiates."""
    x = _embed(params, idx)
    for layer in range(len(config.layer_modes)):
        x = block(x, params, layer, config)
    n = idx.shape[1]
    pick = np.zeros((PASSKEY_DIGITS, n), dtype=np.float32)
    pick[np.arange(PASSKEY_DIGITS), n - PASSKEY_DIGITS + np.arange(PASSKEY_DIGITS)] = 1.0
    h = Tensor(pick) @ x
    return layer_norm(h, params["lnf.w"], params["lnf.b"]) @ params["head"]


def train_passkey(
    config: TinyConfig, steps: int, batch: int, lr: float, seed: int
) -> tuple[dict, float, float]:
    """(parameters, last batch's answer loss in nats per digit, its exact-match share) after
    ``steps`` Adam steps on fresh passkey prompts of ``config.n_ctx`` positions."""
    rng = np.random.default_rng(seed)
    params = init_params(np, VOCAB, rng, config)
    state: dict = {}
    value, matched = float("nan"), float("nan")
    for step in range(1, steps + 1):
        prompts, answers = passkey_prompts(rng, batch, config.n_ctx)
        idx = np.concatenate([prompts, answers[:, :-1]], axis=1)
        logits = _answer_logits(params, idx, config)
        loss = cross_entropy(logits, answers)
        loss.backward()
        adam_step(params, state, step, lr)
        value = loss.item()
        matched = float(exact_match(logits.data.argmax(-1), answers).mean())
    return params, value, matched
