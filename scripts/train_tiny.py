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
import os
import sys
import time

# The matrices here are tiny: BLAS worker threads cost more in hand-offs than they save, and on a
# busy 2-core CI box their busy-waiting makes a step ~5x slower. Set before NumPy loads BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from cuattn.autograd.tape import saved_nbytes  # noqa: E402
from cuattn.tools.tinylm import TinyConfig, adam_step, init_params, loss, zen  # noqa: E402

# Layer 0 "local", layer 1 "strided" with n_ctx / stride = 8 = one block per residue class: the
# transposed strided layout.
CONFIG = TinyConfig()
LOG_EVERY = 25


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
    text = zen()
    chars = sorted(set(text))
    data = np.array([chars.index(c) for c in text], dtype=np.int64)
    rng = np.random.default_rng(args.seed)
    params = init_params(xp, len(chars), rng, CONFIG)
    n_params = sum(t.size for t in params.values())
    print(f"{len(text)} characters, vocab {len(chars)}, {n_params} parameters")

    def batch() -> tuple:
        starts = rng.integers(0, len(data) - CONFIG.n_ctx - 1, size=args.batch)
        windows = np.stack([data[s : s + CONFIG.n_ctx + 1] for s in starts])
        return xp.asarray(windows[:, :-1]), xp.asarray(windows[:, 1:])

    idx, targets = batch()
    held = {r: saved_nbytes(loss(params, idx, targets, CONFIG, r)) for r in (False, True)}
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
        value = loss(params, idx, targets, CONFIG, args.recompute)
        value.backward()
        adam_step(params, state, step, args.lr)
        last = value.item()
        first = last if first is None else first
        if step % LOG_EVERY == 0 or step == 1:
            print(f"step {step:4d}  loss {last:.3f}  ({time.perf_counter() - start:.1f} s)")
    print(
        f"loss {first:.3f} -> {last:.3f} in {args.steps} steps, {time.perf_counter() - start:.1f} s"
    )
    return 0 if last < first else 1


if __name__ == "__main__":
    sys.exit(main())
