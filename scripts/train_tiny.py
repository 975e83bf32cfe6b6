"""Train a 2-layer block-sparse transformer written on cuattn's tape (character LM, Zen of Python).

    python scripts/train_tiny.py                # NumPy on the CPU: 300 steps in under a minute
    (from the repository root with cuattn installed, pip install -e ., or PYTHONPATH=.)
    python scripts/train_tiny.py --device cuda  # the same code on CuPy arrays (needs a GPU)

Layer 0 uses "local" attention, layer 1 "strided" (the Sparse Transformer factorisation), each
block inside ``cuattn.recompute()`` unless --no-recompute. Prints the loss as it falls and the
bytes the tape holds after one forward with and without recompute.
"""

from __future__ import annotations

import argparse
import codecs
import math
import os
import sys
import time

# The matrices here are tiny: BLAS worker threads cost more in hand-offs than they save, and on a
# busy 2-core CI box their busy-waiting makes a step ~5x slower. Set before NumPy loads BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import cuattn  # noqa: E402
from cuattn.autograd import ops  # noqa: E402
from cuattn.autograd.tape import Tensor, saved_nbytes  # noqa: E402

N_CTX = 64
WIDTH = 64
HEADS = 4
BLOCK = 8
LOCAL_CTX = 16
STRIDE = 8  # n_ctx / stride = 8 = one block per residue class: the transposed strided layout
LAYER_MODES = (
    {"attn_mode": "local", "local_attn_ctx": LOCAL_CTX},
    {"attn_mode": "strided", "local_attn_ctx": STRIDE},
)
BETAS = (0.9, 0.99)
ADAM_EPS = 1e-8
LOG_EVERY = 25


def corpus() -> str:
    """The Zen of Python, shipped with every interpreter (stored rot13-encoded in `this`)."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


def init_params(xp, vocab: int, rng: np.random.Generator) -> dict[str, Tensor]:
    def param(*shape: int, std: float | None = None, value: float | None = None) -> Tensor:
        if value is not None:
            arr = np.full(shape, value)
        else:
            arr = rng.standard_normal(shape) * (std if std is not None else 1 / math.sqrt(shape[0]))
        return Tensor(xp.asarray(arr, dtype=xp.float32), requires_grad=True)

    p = {"tok": param(vocab, WIDTH, std=0.1), "pos": param(N_CTX, WIDTH, std=0.1)}
    for layer in range(len(LAYER_MODES)):
        for name in ("ln1", "ln2"):
            p[f"{layer}.{name}.w"], p[f"{layer}.{name}.b"] = (
                param(WIDTH, value=1.0),
                param(WIDTH, value=0.0),
            )
        for name in ("wq", "wk", "wv", "wo"):
            p[f"{layer}.{name}"] = param(WIDTH, WIDTH)
        p[f"{layer}.w1"], p[f"{layer}.b1"] = param(WIDTH, 4 * WIDTH), param(4 * WIDTH, value=0.0)
        p[f"{layer}.w2"], p[f"{layer}.b2"] = param(4 * WIDTH, WIDTH), param(WIDTH, value=0.0)
    p["lnf.w"], p["lnf.b"] = param(WIDTH, value=1.0), param(WIDTH, value=0.0)
    p["head"] = param(WIDTH, vocab)
    return p


def block(x: Tensor, p: dict[str, Tensor], layer: int) -> Tensor:
    h = ops.layer_norm(x, p[f"{layer}.ln1.w"], p[f"{layer}.ln1.b"])
    q, k, v = (h @ p[f"{layer}.{w}"] for w in ("wq", "wk", "wv"))
    a = cuattn.blocksparse_attention(q, k, v, heads=HEADS, blocksize=BLOCK, **LAYER_MODES[layer])
    x = x + a @ p[f"{layer}.wo"]
    h = ops.layer_norm(x, p[f"{layer}.ln2.w"], p[f"{layer}.ln2.b"])
    return x + (
        ops.gelu(h @ p[f"{layer}.w1"] + p[f"{layer}.b1"]) @ p[f"{layer}.w2"] + p[f"{layer}.b2"]
    )


def forward(p: dict[str, Tensor], idx, targets, recompute: bool) -> Tensor:
    x = ops.embedding(p["tok"], idx) + p["pos"]
    for layer in range(len(LAYER_MODES)):
        with cuattn.recompute(recompute):
            x = block(x, p, layer)
    logits = ops.layer_norm(x, p["lnf.w"], p["lnf.b"]) @ p["head"]
    return ops.cross_entropy(logits, targets)


def adam_step(p: dict[str, Tensor], state: dict, step: int, lr: float) -> None:
    b1, b2 = BETAS
    for name, t in p.items():
        m, v = state.setdefault(name, (t.xp.zeros_like(t.data), t.xp.zeros_like(t.data)))
        m[...] = b1 * m + (1 - b1) * t.grad
        v[...] = b2 * v + (1 - b2) * t.grad * t.grad
        m_hat, v_hat = m / (1 - b1**step), v / (1 - b2**step)
        t.data -= (lr * m_hat / (t.xp.sqrt(v_hat) + ADAM_EPS)).astype(t.data.dtype)
        t.grad = None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--no-recompute", dest="recompute", action="store_false")
    args = parser.parse_args(argv)

    if args.device == "cuda":
        import cupy as xp
    else:
        xp = np
    text = corpus()
    chars = sorted(set(text))
    data = np.array([chars.index(c) for c in text], dtype=np.int64)
    rng = np.random.default_rng(args.seed)
    params = init_params(xp, len(chars), rng)
    n_params = sum(t.size for t in params.values())
    print(f"{len(text)} characters, vocab {len(chars)}, {n_params} parameters")

    def batch() -> tuple:
        starts = rng.integers(0, len(data) - N_CTX - 1, size=args.batch)
        windows = np.stack([data[s : s + N_CTX + 1] for s in starts])
        return xp.asarray(windows[:, :-1]), xp.asarray(windows[:, 1:])

    idx, targets = batch()
    held = {r: saved_nbytes(forward(params, idx, targets, r)) for r in (False, True)}
    saving = held[False] - held[True]
    print(
        f"tape after one forward: {held[False] / 2**20:.2f} MiB plain, "
        f"{held[True] / 2**20:.2f} MiB with recompute (saves {saving / 2**20:.2f} MiB, "
        f"{100 * saving / held[False]:.0f}%)"
    )

    state: dict = {}
    start = time.perf_counter()
    first = last = None
    for step in range(1, args.steps + 1):
        idx, targets = batch()
        loss = forward(params, idx, targets, args.recompute)
        loss.backward()
        adam_step(params, state, step, args.lr)
        last = loss.item()
        first = last if first is None else first
        if step % LOG_EVERY == 0 or step == 1:
            print(f"step {step:4d}  loss {last:.3f}  ({time.perf_counter() - start:.1f} s)")
    print(
        f"loss {first:.3f} -> {last:.3f} in {args.steps} steps, {time.perf_counter() - start:.1f} s"
    )
    return 0 if last < first else 1


if __name__ == "__main__":
    sys.exit(main())
