"""Train a 2-layer block-sparse transformer written on cuattn's tape (character LM, Zen of Python).

    python scripts/train_tiny.py                # NumPy on the CPU: 300 steps in under a minute
    (from the repository root with cuattn installed, pip install -e ., or PYTHONPATH=.)
    python scripts/train_tiny.py --device cuda  # the same code on CuPy arrays (needs a GPU)

Layer 0 uses "local" attention, layer 1 "strided" (the Sparse Transformer factorisation), each
block inside ``cuattn.recompute()`` unless --no-recompute. Prints the loss as it falls and the
bytes the tape holds after one forward with and without recompute. ``--pattern dense`` trains
with causal attention, ``--pattern topk`` with blocks chosen from the data at every step
(cuattn.dynamic.topk_blocks per sequence: the choice takes no gradient, the attention does);
``--compare --markdown T --png P`` trains all three from one seed and tabulates and plots them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# The matrices here are tiny: BLAS worker threads cost more in hand-offs than they save, and on a
# busy 2-core CI box their busy-waiting makes a step ~5x slower. Set before NumPy loads BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from cuattn.autograd.tape import saved_nbytes  # noqa: E402
from dev.tinylm import TinyConfig, adam_step, init_params, loss, zen  # noqa: E402

# "fixed": layer 0 "local", layer 1 "strided" with n_ctx / stride = 8 = one block per residue
# class (the transposed strided layout); "dense": causal attention; "topk": both layers choose
# TOPK of the 8 key blocks per query block from the data at every step (cuattn.dynamic).
TOPK = 3
CONFIGS = {
    "fixed": TinyConfig(),
    "dense": TinyConfig(layer_modes=({"attn_mode": "all"},) * 2),
    "topk": TinyConfig(layer_modes=({"attn_mode": "topk", "topk": TOPK},) * 2),
}
LOG_EVERY = 25


def train(config: TinyConfig, args: argparse.Namespace, xp, data: np.ndarray, vocab: int):
    """(loss per step, seconds) of args.steps Adam steps from args.seed."""
    rng = np.random.default_rng(args.seed)
    params = init_params(xp, vocab, rng, config)
    state: dict = {}
    losses = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = rng.integers(0, len(data) - config.n_ctx - 1, size=args.batch)
        windows = np.stack([data[s : s + config.n_ctx + 1] for s in starts])
        idx, targets = xp.asarray(windows[:, :-1]), xp.asarray(windows[:, 1:])
        if step == 1 and not args.compare:
            report_recompute(params, idx, targets, config)
        value = loss(params, idx, targets, config, args.recompute)
        value.backward()
        adam_step(params, state, step, args.lr)
        losses.append(value.item())
        if (step % LOG_EVERY == 0 or step == 1) and not args.compare:
            print(f"step {step:4d}  loss {losses[-1]:.3f}  ({time.perf_counter() - start:.1f} s)")
    return losses, time.perf_counter() - start


def report_recompute(params, idx, targets, config: TinyConfig) -> None:
    held = {r: saved_nbytes(loss(params, idx, targets, config, r)) for r in (False, True)}
    saving = held[False] - held[True]
    print(
        f"tape after one forward: {held[False] / 2**20:.2f} MiB plain, "
        f"{held[True] / 2**20:.2f} MiB with recompute (saves {saving / 2**20:.2f} MiB, "
        f"{100 * saving / held[False]:.0f}%)"
    )


def compare(args, xp, data, vocab) -> int:
    """Every pattern from the same seed: a table of losses and a PNG of the curves."""
    curves = {name: train(config, args, xp, data, vocab) for name, config in CONFIGS.items()}
    tail = max(args.steps // 10, 1)
    lines = [
        f"{args.steps} steps, batch {args.batch}, seed {args.seed}; loss = mean of the last "
        f"{tail} steps' batch losses (nats/char)",
        "",
        "| pattern | first loss | final loss | seconds |",
        "| --- | --- | --- | --- |",
    ]
    for name, (losses, seconds) in curves.items():
        final = float(np.mean(losses[-tail:]))
        lines.append(f"| {name} | {losses[0]:.3f} | {final:.3f} | {seconds:.1f} |")
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name, (losses, _) in curves.items():
            smooth = np.convolve(losses, np.ones(tail) / tail, mode="valid")
            ax.plot(np.arange(tail, len(losses) + 1), smooth, label=name)
        ax.set_xlabel("step")
        ax.set_ylabel(f"training loss (nats/char, mean of {tail} steps)")
        ax.set_title("tiny char LM: fixed, dense and data-chosen (top-k) layouts")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
        plt.close(fig)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--no-recompute", dest="recompute", action="store_false")
    parser.add_argument("--pattern", choices=sorted(CONFIGS), default="fixed")
    parser.add_argument("--compare", action="store_true", help="train every pattern, tabulate")
    parser.add_argument("--markdown", type=Path, help="with --compare: write the table here")
    parser.add_argument("--png", type=Path, help="with --compare: plot the loss curves here")
    args = parser.parse_args(argv)

    if args.device == "cuda":
        import cupy as xp
    else:
        xp = np
    text = zen()
    chars = sorted(set(text))
    data = np.array([chars.index(c) for c in text], dtype=np.int64)
    if args.compare:
        return compare(args, xp, data, len(chars))
    config = CONFIGS[args.pattern]
    n_params = sum(
        t.size for t in init_params(np, len(chars), np.random.default_rng(0), config).values()
    )
    print(f"{len(text)} characters, vocab {len(chars)}, {n_params} parameters, {args.pattern}")
    losses, seconds = train(config, args, xp, data, len(chars))
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps, {seconds:.1f} s")
    return 0 if losses[-1] < losses[0] else 1


if __name__ == "__main__":
    sys.exit(main())
