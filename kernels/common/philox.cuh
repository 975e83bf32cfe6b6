// Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) and
// attention dropout's keep decisions from it. A counter-based generator: the four 32-bit words
// of counter (c0, c1, c2, c3) under a 64-bit key are a pure function of both, so the backward
// regenerates the forward's mask exactly and nothing of size T x T is stored. The NumPy
// reference (cuattn/backends/dropout.py) computes the same words; tests check both against
// Random123's known-answer vectors.
//
// Which word decides which score: in every 16 x 16 block of (query, key), element (q, k) uses
// counter (c0, c1, c2, c3) = ((k / 16) * 8 + k % 8, (q / 16) * 8 + q % 8, head, batch) and word
// 2 * ((q / 8) % 2) + (k / 8) % 2, so one call serves the 2 x 2 elements {q, q + 8} x {k, k + 8}:
// exactly what one lane holds of two adjacent 8-column n-tiles, whether its fragment's rows are
// queries (forward, dQ) or keys (dK/dV). The score is kept when the word is >= threshold
// (floor(p * 2^32)), and a kept probability is scaled by 1 / (1 - p).
#pragma once

#include "score_tile.cuh"  // as_frags, AccLayout
#include "types.cuh"

constexpr u32 PHILOX_M0 = 0xD2511F53u;  // the round multipliers and key increments of Philox-4x32
constexpr u32 PHILOX_M1 = 0xCD9E8D57u;
constexpr u32 PHILOX_W0 = 0x9E3779B9u;
constexpr u32 PHILOX_W1 = 0xBB67AE85u;
constexpr int PHILOX_ROUNDS = 10;

__device__ __forceinline__ u32 mul_hi(u32 a, u32 b) {
#ifdef CUATTN_INTERP
  return u32((u64(a) * u64(b)) >> 32);
#else
  return __umulhi(a, b);
#endif
}

// The four words of Philox-4x32-10 at counter c under key (k0, k1), in c.
__device__ __forceinline__ void philox4x32_10(u32 (&c)[4], u32 k0, u32 k1) {
#pragma unroll
  for (int round = 0; round < PHILOX_ROUNDS; ++round) {
    const u32 hi0 = mul_hi(PHILOX_M0, c[0]), lo0 = PHILOX_M0 * c[0];
    const u32 hi1 = mul_hi(PHILOX_M1, c[2]), lo1 = PHILOX_M1 * c[2];
    c[0] = hi1 ^ c[1] ^ k0;
    c[1] = lo1;
    c[2] = hi0 ^ c[3] ^ k1;
    c[3] = lo0;
    k0 += PHILOX_W0;
    k1 += PHILOX_W1;
  }
}

// A call's dropout: off (threshold 0) or the keep rule above. The block kernels' grids put the
// head on blockIdx.y and the batch on blockIdx.z, which words() reads where it needs them (held
// in registers they cost the fp32 d = 256 kernels a spill).
struct Dropout {
  u32 threshold;  // floor(p * 2^32): a word below it drops its score; 0: no dropout
  u32 key0, key1;  // the seed's low and high words
  float scale;  // 1 / (1 - p)

  // The seed is a parameter, or with use_words two 32-bit words in global memory, the low one
  // first (a seed jax traced or torch drew on the device: no host ever reads it).
  __device__ __forceinline__ static Dropout make(long long threshold, long long seed,
                                                 const u32* words, int use_words, float scale) {
    if (use_words) return {u32(threshold), words[0], words[1], scale};
    return {u32(threshold), u32(seed), u32(u64(seed) >> 32), scale};
  }
  __device__ __forceinline__ bool on() const { return threshold != 0u; }
  // The four words for the 2 x 2 elements {q, q + 8} x {k, k + 8} of a 16 x 16 block, q and k
  // the block's first query and key plus an offset below 8.
  __device__ __forceinline__ void words(u32 (&w)[4], int q, int k) const {
    w[0] = u32((k / 16) * 8 + k % 8);
    w[1] = u32((q / 16) * 8 + q % 8);
    w[2] = blockIdx.y;  // the head
    w[3] = blockIdx.z;  // the batch
    philox4x32_10(w, key0, key1);
  }
};

// Whether element (q, k) of (batch, head) is kept: the word the 16 x 16 block rule above gives
// it, from one generator call of its own (the decode kernel's rows are single queries at their
// positions, its columns the tokens at theirs; both below 2^31).
__device__ __forceinline__ bool dropout_keeps(const Dropout& d, int batch, int head, long long q,
                                              long long k) {
  u32 w[4] = {u32((k / 16) * 8 + k % 8), u32((q / 16) * 8 + q % 8), u32(head), u32(batch)};
  philox4x32_10(w, d.key0, d.key1);
  const bool key_half = (k / 8) % 2, query_half = (q / 8) % 2;
  const u32 word = query_half ? (key_half ? w[3] : w[2]) : (key_half ? w[1] : w[0]);
  return word >= d.threshold;
}

// Dropout on M_FRAGS stacked score fragments (the layout of mask_score_frags: rows row_first,
// row_first + 16, ...; ROWS_ARE_QUERIES tells which axis holds the queries; row_first and
// col_first multiples of 16, N a multiple of 16) in place: a kept value times the scale, a
// dropped one 0.
template <int M_FRAGS, int N, bool ROWS_ARE_QUERIES>
__device__ __forceinline__ void dropout_frags(float (&s)[M_FRAGS][N / 8][4], const Dropout& d,
                                              int row_first, int col_first) {
  const AccLayout frag;
#pragma unroll
  for (int m = 0; m < M_FRAGS; ++m) {
#pragma unroll
    for (int jj = 0; jj < N / 8; jj += 2) {  // two n-tiles: one 16 x 16 block
#pragma unroll
      for (int c = 0; c < 2; ++c) {  // the lane's two columns of each n-tile
        const int row = row_first + 16 * m + frag.g, col = col_first + 8 * jj + 2 * frag.t + c;
        u32 w[4];
        if (ROWS_ARE_QUERIES) {
          d.words(w, row, col);
        } else {
          d.words(w, col, row);
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {  // n-tile jj + half
#pragma unroll
          for (int r = 0; r < 2; ++r) {  // row g + 8 r
            // the word of (query half, key half): rows are queries or keys
            const u32 word = ROWS_ARE_QUERIES ? w[2 * r + half] : w[2 * half + r];
            float& x = s[m][jj + half][2 * r + c];
            x = word >= d.threshold ? x * d.scale : 0.f;
          }
        }
      }
    }
  }
}

template <int N, bool ROWS_ARE_QUERIES>
__device__ __forceinline__ void dropout_tile(float (&s)[N / 8][4], const Dropout& d,
                                             int row_first, int col_first) {
  dropout_frags<1, N, ROWS_ARE_QUERIES>(as_frags<N>(s), d, row_first, col_first);
}
