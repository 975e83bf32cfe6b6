"""Synthetic long-range tasks for ``python -m dev generate --task``: prompts whose answer is
far back.

The character model of ``python -m dev generate`` gains almost nothing from context beyond a few
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
tried again at the rate ``python -m dev generate`` uses. The answer is written in plain digits. A
prompt of ``context - PASSKEY_DIGITS + 1`` tokens and the answer fed back one digit at a time
fill exactly ``context`` positions.

Multi-key associative recall: ``RECALL_PAIRS`` pairs scattered in the filler, each a key token
(distinct keys, from ``RECALL_KEYS``) followed by a value of ``VALUE_DIGITS`` digits; the
prompt ends with one of the keys and the question token, and the answer is that key's value in
plain digits. Unlike the passkey, which span matters is known only from the prompt's last
tokens, and the other pairs are decoys of the same form. The value is more than one digit
because the first answer token comes from the prefill's full attention: only the later ones are
decoded over what a policy kept. Each value digit is written with a token of its key and place
(key k, place j, digit d), so the model finds it by content, matching the asked key, in one
hop. Values as plain placed digits after their key need two hops (the value learns its key
from the token before it): one trial (context 256, 4 pairs of 8 keys, batch 16, learning rate
3e-3) was at 11 % held-out exact match after 950 steps. The fused tokens with 4 pairs of 8 keys
were at 5-12 % after 1200 steps at context 256 and 2050 at 128, so the task keeps 2 pairs of 4
keys, which one trial at context 128 (batch 32) learned to 92-98 % from step 2000.

Copy: a span of ``COPY_LEN`` random digits at a chosen depth in filler, and the question at the
end; the answer is the whole span, in order, in plain digits. Its digits are written as the
passkey's are, with a token of their place (place j, digit d; places of their own, so the
passkey's vocabulary stays as it was), found by content in one hop. What the copy adds is
length: the span is an eighth of the default context, longer than the smallest budget (10 %),
and every one of its tokens is needed, so a policy keeps all of a long contiguous span or
fails the prompt; and only the first answer digit comes from the prefill, the other
``COPY_LEN - 1`` from decode steps over what the cache keeps. Digits repeat (unlike the
passkey's), so no digit can be inferred from the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cuattn.autograd.tape import Tensor, no_grad
from dev.tinylm import TinyConfig, _embed, adam_step, block, init_params
from dev.tinylm_ops import cross_entropy, layer_norm

__all__ = [
    "PASSKEY_DIGITS",
    "TASKS",
    "VOCAB",
    "LongTask",
    "Trained",
    "exact_match",
    "held_out_match",
    "needle_start",
    "copy_prompts",
    "passkey_prompts",
    "recall_prompts",
    "value_tokens",
    "train_task",
]

DIGITS = 10
PASSKEY_DIGITS = 4
PLACED = DIGITS  # first id of the placed digits: place j, digit d is PLACED + DIGITS * j + d
FILLER = PLACED + DIGITS * PASSKEY_DIGITS  # first filler id
FILLER_TOKENS = 8
ASK = FILLER + FILLER_TOKENS  # the question, last token of every prompt
VOCAB = ASK + 1

# recall: the passkey's tokens plus the keys, so that the passkey model's vocabulary (and with
# it its initialisation and results) stays as it was
VALUE_DIGITS = 2  # digits per value; the answer's first comes from the prefill
RECALL_PAIRS = 2  # key-value pairs per prompt, one of them asked for
RECALL_KEYS = 4  # key tokens to draw each prompt's distinct keys from
KEY = VOCAB  # first key id
VALUE = KEY + RECALL_KEYS  # key k, place j, digit d is VALUE + DIGITS * (VALUE_DIGITS * k + j) + d
RECALL_VOCAB = VALUE + DIGITS * VALUE_DIGITS * RECALL_KEYS
PAIR_SPAN = 1 + VALUE_DIGITS  # a key token, then its value
RECALL_QUESTION = 2  # the asked key, then ASK

# training's held-out check (train_task's stop_at): its prompts come from their own stream
# ([seed, CHECK_STREAM]; the table's held-out prompts are [seed, 1]), run CHECK_BATCH at a time
CHECK_EVERY = 100
CHECK_PROMPTS = 128
CHECK_STREAM = 2
CHECK_BATCH = 32

# copy: the recall vocabulary plus the span's placed digits, the earlier tasks' ids unchanged
COPY_LEN = 16  # digits in the span and the answer
COPY = RECALL_VOCAB  # place j, digit d of the span is COPY + DIGITS * j + d
COPY_VOCAB = COPY + DIGITS * COPY_LEN


def needle_start(
    depth: np.ndarray, prompt_len: int, span: int = PASSKEY_DIGITS, question: int = 1
) -> np.ndarray:
    """int64: where a needle of ``span`` tokens at ``depth`` (0: the first token, 1: right
    before the question of ``question`` tokens) starts in a prompt of ``prompt_len`` tokens."""
    last = prompt_len - question - span  # the needle ends right before the question
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

    def distinct_digits() -> np.ndarray:
        return np.stack([rng.permutation(DIGITS)[:PASSKEY_DIGITS] for _ in range(count)])

    return _placed_span(rng, count, prompt_len, depth, distinct_digits, PLACED)


def _placed_span(
    rng: np.random.Generator,
    count: int,
    prompt_len: int,
    depth: np.ndarray | None,
    digits: Callable[[], np.ndarray],
    first: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(prompts int64 [count, prompt_len], answers [count, span]): filler, the answers
    ``digits()`` draws written as placed digits (place j, digit d: first + DIGITS * j + d) at
    each prompt's ``depth`` (uniform at random when None), and ASK last."""
    if depth is None:
        depth = rng.random(count)
    prompts = rng.integers(FILLER, FILLER + FILLER_TOKENS, size=(count, prompt_len))
    answers = digits()
    span = answers.shape[1]
    at = needle_start(depth, prompt_len, span)[:, None] + np.arange(span)
    np.put_along_axis(prompts, at, first + DIGITS * np.arange(span) + answers, axis=1)
    prompts[:, -1] = ASK
    return prompts, answers


def _decoy_starts(rng: np.random.Generator, asked: int, last: int) -> list[int]:
    """Starts of RECALL_PAIRS - 1 pairs in [0, last], overlapping neither each other nor the
    asked pair at ``asked``: drawn at random until they fit, which is quick while the pairs
    take a small share of the prompt."""
    taken = [asked]
    while len(taken) < RECALL_PAIRS:
        start = int(rng.integers(0, last + 1))
        if all(abs(start - t) >= PAIR_SPAN for t in taken):
            taken.append(start)
    return taken[1:]


def value_tokens(key: int, digits: np.ndarray) -> np.ndarray:
    """The tokens that write ``digits`` as the value of key number ``key``."""
    return VALUE + DIGITS * (VALUE_DIGITS * key + np.arange(VALUE_DIGITS)) + digits


def recall_prompts(
    rng: np.random.Generator, count: int, context: int, depth: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(prompts int64 [count, context - VALUE_DIGITS + 1], answers int64 [count,
    VALUE_DIGITS]): RECALL_PAIRS key-value pairs in filler, the asked pair at its ``depth`` (one
    per prompt; uniform at random when None) and the others at random, then the asked key and
    ASK. The answer is the asked key's value."""
    prompt_len = context - VALUE_DIGITS + 1
    last = prompt_len - RECALL_QUESTION - PAIR_SPAN
    if last + 1 < 2 * PAIR_SPAN * RECALL_PAIRS:  # room enough for the decoys to be drawn
        raise ValueError(f"context={context} cannot hold {RECALL_PAIRS} recall pairs")
    if depth is None:
        depth = rng.random(count)
    prompts = rng.integers(FILLER, FILLER + FILLER_TOKENS, size=(count, prompt_len))
    values = rng.integers(0, DIGITS, size=(count, RECALL_PAIRS, VALUE_DIGITS))
    asked = needle_start(depth, prompt_len, PAIR_SPAN, RECALL_QUESTION)
    for prompt, value, start in zip(prompts, values, asked, strict=True):
        keys = rng.permutation(RECALL_KEYS)[:RECALL_PAIRS]  # keys[0] is asked
        starts = [int(start), *_decoy_starts(rng, int(start), last)]
        for key, digits, at in zip(keys, value, starts, strict=True):
            prompt[at] = KEY + key
            prompt[at + 1 : at + PAIR_SPAN] = value_tokens(key, digits)
        prompt[-RECALL_QUESTION] = KEY + keys[0]
    prompts[:, -1] = ASK
    return prompts, values[:, 0]


def copy_prompts(
    rng: np.random.Generator, count: int, context: int, depth: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(prompts int64 [count, context - COPY_LEN + 1], answers int64 [count, COPY_LEN]): each
    prompt's span of COPY_LEN placed digits at its ``depth`` (one per prompt; uniform at random
    when None) in filler, then ASK. The answer is the span's digits."""
    prompt_len = context - COPY_LEN + 1
    if prompt_len < COPY_LEN + 1:
        raise ValueError(f"context={context} cannot hold a {COPY_LEN}-digit copy prompt")

    def any_digits() -> np.ndarray:
        return rng.integers(0, DIGITS, size=(count, COPY_LEN))

    return _placed_span(rng, count, prompt_len, depth, any_digits, COPY)


def exact_match(predicted: np.ndarray, answers: np.ndarray) -> np.ndarray:
    """bool [count]: whether every answer token was predicted."""
    return (np.asarray(predicted) == np.asarray(answers)).all(axis=-1)


Prompts = Callable[
    [np.random.Generator, int, int, np.ndarray | None], tuple[np.ndarray, np.ndarray]
]


@dataclass(frozen=True)
class LongTask:
    """What ``python -m dev generate`` needs of a task to train on it and score policies: its
    prompt generator (rng, count, context, depth -> prompts, answers), the vocabulary it
    draws from, and what its answer is, for the table's header."""

    name: str
    prompts: Prompts
    vocab: int
    answer_len: int
    answer: str


TASKS = {
    "passkey": LongTask(
        "passkey", passkey_prompts, VOCAB, PASSKEY_DIGITS, f"a {PASSKEY_DIGITS}-digit passkey"
    ),
    "recall": LongTask(
        "recall",
        recall_prompts,
        RECALL_VOCAB,
        VALUE_DIGITS,
        f"the {VALUE_DIGITS}-digit value of 1 of {RECALL_PAIRS} keys",
    ),
    "copy": LongTask("copy", copy_prompts, COPY_VOCAB, COPY_LEN, f"a {COPY_LEN}-digit span"),
}


def _answer_logits(params: dict, idx: np.ndarray, config: TinyConfig, answer_len: int) -> Tensor:
    """Logits [batch, answer_len, vocab] at the answer's positions (the last answer_len of
    idx): only they are trained, as the filler is noise by design. The rows are picked by a
    one-hot matrix product, which the tape differentiates."""
    x = _embed(params, idx)
    for layer in range(len(config.layer_modes)):
        x = block(x, params, layer, config)
    n = idx.shape[1]
    pick = np.zeros((answer_len, n), dtype=np.float32)
    pick[np.arange(answer_len), n - answer_len + np.arange(answer_len)] = 1.0
    h = Tensor(pick) @ x
    return layer_norm(h, params["lnf.w"], params["lnf.b"]) @ params["head"]


@dataclass(frozen=True)
class Trained:
    """What ``train_task`` returns: the parameters, the steps taken, the last batch's answer
    loss (nats per answer token) and exact-match share, and the last held-out check's share
    (NaN when none ran)."""

    params: dict
    steps: int
    loss: float
    matched: float
    checked: float


def held_out_match(
    params: dict, task: LongTask, config: TinyConfig, prompts: np.ndarray, answers: np.ndarray
) -> float:
    """Exact-match share of ``answers`` under teacher forcing (each answer token predicted from
    the prompt and the right tokens before it): what greedy decoding with the full cache
    answers whenever it gets every token right."""
    idx = np.concatenate([prompts, answers[:, :-1]], axis=1)
    right = []
    with no_grad():
        for first in range(0, len(idx), CHECK_BATCH):
            rows = slice(first, first + CHECK_BATCH)
            logits = _answer_logits(params, idx[rows], config, task.answer_len)
            right.append(exact_match(logits.data.argmax(-1), answers[rows]))
    return float(np.concatenate(right).mean())


def train_task(
    task: LongTask,
    config: TinyConfig,
    steps: int,
    batch: int,
    lr: float,
    seed: int,
    stop_at: float | None = None,
) -> Trained:
    """Adam steps on fresh ``task`` prompts of ``config.n_ctx`` positions: ``steps`` of them,
    or fewer when ``stop_at`` is given and a held-out check (CHECK_PROMPTS prompts of their own
    random stream, every CHECK_EVERY steps) reaches that exact-match share."""
    rng = np.random.default_rng(seed)
    params = init_params(np, task.vocab, rng, config)
    check = None
    if stop_at is not None:
        check_rng = np.random.default_rng([seed, CHECK_STREAM])
        check = task.prompts(check_rng, CHECK_PROMPTS, config.n_ctx, None)
    state: dict = {}
    value, matched, checked = float("nan"), float("nan"), float("nan")
    step = 0
    while step < steps:
        step += 1
        prompts, answers = task.prompts(rng, batch, config.n_ctx, None)
        idx = np.concatenate([prompts, answers[:, :-1]], axis=1)
        logits = _answer_logits(params, idx, config, task.answer_len)
        loss = cross_entropy(logits, answers)
        loss.backward()
        adam_step(params, state, step, lr)
        value = loss.item()
        matched = float(exact_match(logits.data.argmax(-1), answers).mean())
        if check is not None and step % CHECK_EVERY == 0:
            checked = held_out_match(params, task, config, *check)
            if checked >= stop_at:
                break
    return Trained(params, step, value, matched, checked)
