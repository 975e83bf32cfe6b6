"""Attention dropout's keep decisions: Philox-4x32-10 (Salmon et al., SC 2011) in NumPy, and which
of its words decides which score. The kernels compute the same words (kernels/common/philox.cuh);
both are checked against Random123's known-answer vectors, and the kernels' masks against these.

Element (batch b, head h, query q, key k), in the layout's computed token order, uses counter
(c0, c1, c2, c3) = ((k // 16) * 8 + k % 8, (q // 16) * 8 + q % 8, h, b) under the key (seed's
low 32 bits, its high 32 bits), and word 2 * ((q // 8) % 2) + (k // 8) % 2 of the four: one
generator call serves the 2 x 2 elements {q, q + 8} x {k, k + 8} of a 16 x 16 block. The score's
probability is kept when the word is >= floor(p * 2^32), and scaled by 1 / (1 - p).
"""

from __future__ import annotations

import numpy as np

PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # the round multipliers of Philox-4x32
PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # the key increments
PHILOX_ROUNDS = 10
WORD_BITS = 32
SEED_BITS = 64
_MASK32 = (1 << WORD_BITS) - 1


def philox4x32_10(counter: tuple, key: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """The four words of Philox-4x32-10 for counters (four broadcastable uint32 arrays or ints)
    under key (k0, k1), as uint32 arrays."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint32) for c in counter)
    k0, k1 = (int(k) & _MASK32 for k in key)
    m0, m1 = (np.uint64(m) for m in PHILOX_M)
    for _ in range(PHILOX_ROUNDS):
        p0 = c0.astype(np.uint64) * m0
        p1 = c2.astype(np.uint64) * m1
        hi0, lo0 = (p0 >> np.uint64(WORD_BITS)).astype(np.uint32), p0.astype(np.uint32)
        hi1, lo1 = (p1 >> np.uint64(WORD_BITS)).astype(np.uint32), p1.astype(np.uint32)
        c0, c1, c2, c3 = hi1 ^ c1 ^ np.uint32(k0), lo1, hi0 ^ c3 ^ np.uint32(k1), lo0
        k0, k1 = (k0 + PHILOX_W[0]) & _MASK32, (k1 + PHILOX_W[1]) & _MASK32
    return c0, c1, c2, c3


def threshold(p: float) -> int:
    """floor(p * 2^32): a word below it drops its score (0 <= p < 1)."""
    return int(np.floor(np.float64(p) * 2.0**WORD_BITS))


def seed_of(words: np.ndarray) -> int:
    """The 64-bit key a seed array holds (backends/call.py check_seed_words: 8 bytes, the low
    word first), read on the host: the NumPy reference's arrays are there already."""
    return int.from_bytes(np.ascontiguousarray(words).tobytes(), "little")


def keep_mask(
    p: float, seed: int, batch: np.ndarray, head: np.ndarray, q: np.ndarray, k: np.ndarray
) -> np.ndarray:
    """Whether each element (broadcastable integer arrays batch, head, q, k) is kept."""
    q, k = np.asarray(q, np.int64), np.asarray(k, np.int64)
    counter = ((k // 16) * 8 + k % 8, (q // 16) * 8 + q % 8, head, batch)
    words = np.stack(np.broadcast_arrays(*philox4x32_10(counter, (seed, seed >> WORD_BITS))))
    which = 2 * ((q // 8) % 2) + (k // 8) % 2
    chosen = np.take_along_axis(words, np.broadcast_to(which, words.shape[1:])[None], axis=0)[0]
    return chosen >= np.uint32(threshold(p))
