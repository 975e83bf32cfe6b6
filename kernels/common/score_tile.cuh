// Score tiles: where each element of a warp's accumulator tile sits, the element rule applied to
// a whole tile, and the paired stores of a finished row. Tiles are warp tiles in the mma
// accumulator layout (ptx.cuh): a warp holds M_FRAGS fragments of 16 rows; element (j, e) of a
// lane's fragment sits at fragment row g + 8 * (e / 2), column 8 * j + 2 * t + e % 2, with
// g = lane / 4, t = lane % 4 (AccLayout, ptx.cuh, names those positions).
#pragma once

#include "mask.cuh"
#include "ptx.cuh"

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// A single fragment seen as a one-fragment stack, so one-fragment callers share the code below.
template <int N>
__device__ __forceinline__ float (&as_frags(float (&s)[N / 8][4]))[1][N / 8][4] {
  return *reinterpret_cast<float (*)[1][N / 8][4]>(&s);
}

// Sets disallowed elements of M_FRAGS stacked score fragments (rows row_first, row_first + 16,
// ...) to -inf. ROWS_ARE_QUERIES tells which axis of the tile is the query axis (forward and dQ:
// rows; dK/dV, which work on S^T: columns). The bitmask rule reads one mask row per query and
// reuses its bits for every key of the tile instead of one table load per element.
template <int RULE, int BLOCK, int M_FRAGS, int N, bool ROWS_ARE_QUERIES>
__device__ __forceinline__ void mask_score_frags(float (&s)[M_FRAGS][N / 8][4], const RuleParams& p,
                                                 int row_first, int col_first, int q_block,
                                                 int k_block, int mask_id) {
  const AccLayout frag;
#pragma unroll
  for (int m = 0; m < M_FRAGS; ++m) {
    if constexpr (RULE == MASK_BITMASK && ROWS_ARE_QUERIES) {
      static_assert(N <= 48 || N == 64, "a tile row's mask bits come from at most two words");
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int q = row_first + 16 * m + frag.row(2 * r);
        const unsigned long long bits =
            mask_id < 0 ? ~0ull
                        : mask_row_bits<BLOCK>(p, mask_id, q - q_block * BLOCK,
                                               col_first - k_block * BLOCK);
#pragma unroll
        for (int j = 0; j < N / 8; ++j) {
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int col = frag.col(j, 2 * r + c);
            const bool allowed = col_first + col < p.n_k && ((bits >> col) & 1ull);
            if (!allowed) s[m][j][2 * r + c] = -INFINITY;
          }
        }
      }
    } else if constexpr (RULE == MASK_BITMASK) {
      // S^T: columns are queries; rows g and g + 8 are keys, 16-aligned, so one word of the
      // query's mask row holds both.
      const int key_first = row_first + 16 * m;
#pragma unroll
      for (int j = 0; j < N / 8; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int q = col_first + frag.col(j, c);
          const unsigned long long bits =
              mask_id < 0 ? ~0ull
                          : mask_row_bits<BLOCK>(p, mask_id, q - q_block * BLOCK,
                                                 key_first - k_block * BLOCK);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int key_offset = frag.row(2 * r);
            const bool allowed = key_first + key_offset < p.n_k && ((bits >> key_offset) & 1ull);
            if (!allowed) s[m][j][2 * r + c] = -INFINITY;
          }
        }
      }
    } else {
      // Causal and window rules depend only on position - k (position = q + q_offset); with the
      // tile's offsets taken out once, each element costs an add and two compares (this runs at
      // the register limit).
      const int q_minus_k_base = p.q_offset + (ROWS_ARE_QUERIES ? row_first + 16 * m - col_first
                                                                : col_first - row_first - 16 * m);
      const int keys_left = ROWS_ARE_QUERIES ? p.n_k - col_first : p.n_k - row_first - 16 * m;
#pragma unroll
      for (int j = 0; j < N / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = frag.row(e), col = frag.col(j, e);
          const int key = ROWS_ARE_QUERIES ? col : row;
          const int q_minus_k = q_minus_k_base + (ROWS_ARE_QUERIES ? row - col : col - row);
          bool allowed = key < keys_left;
          if (mask_id >= 0) {
            if constexpr (RULE == MASK_CAUSAL) {
              allowed = allowed && q_minus_k >= 0;
            } else if constexpr (RULE == MASK_WINDOW) {
              allowed = allowed && q_minus_k < p.window_left && -q_minus_k < p.window_right;
            }
          }
          if (!allowed) s[m][j][e] = -INFINITY;
        }
      }
    }
  }
}

// One fragment: mask_score_frags with M_FRAGS = 1.
template <int RULE, int BLOCK, int N, bool ROWS_ARE_QUERIES>
__device__ __forceinline__ void mask_score_tile(float (&s)[N / 8][4], const RuleParams& p,
                                                int row_first, int col_first, int q_block,
                                                int k_block, int mask_id) {
  mask_score_frags<RULE, BLOCK, 1, N, ROWS_ARE_QUERIES>(as_frags<N>(s), p, row_first, col_first,
                                                        q_block, k_block, mask_id);
}

// How a q.k product becomes the log2-domain score the softmax uses: scale * LOG2E * q.k, or
// with a softcap, softcap * LOG2E * tanh(scale * q.k / softcap) (Gemma 2's logit capping); with
// ALiBi the score then gets -slope * LOG2E * |q_pos - k_pos| (alibi_frags).
struct ScoreScale {
  float factor;        // multiplies q.k: scale * LOG2E, or scale / softcap when capped
  float cap_log2;      // softcap * LOG2E when capped, else 0
  float inv_cap_log2;  // 1 / cap_log2 when capped, else 0
  float alibi_log2;    // -slope * LOG2E of this (batch, head) with ALiBi, else 0

  // slopes: the ALiBi slopes ([batch, heads] float32 at batch stride slopes_batch_stride, 0 for
  // one slope per head), or null; read only by the MODS_SCORE variant.
  template <int MODS>
  __device__ __forceinline__ static ScoreScale make(float scale, float softcap,
                                                    const float* slopes, int slopes_batch_stride,
                                                    int batch, int head) {
    float alibi_log2 = 0.f;
    if (MODS == MODS_SCORE && slopes != nullptr) {
      alibi_log2 = -slopes[batch * slopes_batch_stride + head] * LOG2E;
    }
    if (MODS == MODS_SCORE && softcap > 0.f) {
      return {scale / softcap, softcap * LOG2E, 1.f / (softcap * LOG2E), alibi_log2};
    }
    return {scale * LOG2E, 0.f, 0.f, alibi_log2};
  }
};

// ALiBi's bias in the log2 domain for a query at position q_pos = q + q_offset (end-aligned, as
// the rules and FlashAttention place it) and a key at k_pos: alibi_log2 * |q_pos - k_pos|.
// Positions are exact in float up to 2^24.
__device__ __forceinline__ float alibi_bias(const ScoreScale& sc, int q_minus_k) {
  return sc.alibi_log2 * fabsf(float(q_minus_k));
}

// Adds a bias that depends on the query and key positions, bias_of(q_pos - k_pos) (log2
// domain), to M_FRAGS stacked score fragments (the layout of mask_score_frags: rows row_first,
// row_first + 16, ...; ROWS_ARE_QUERIES tells which axis holds the queries). Query positions
// are end-aligned, q + q_offset, as the rules and FlashAttention place them. A masked -inf
// stays -inf.
template <int M_FRAGS, int N, bool ROWS_ARE_QUERIES, typename BiasOf>
__device__ __forceinline__ void position_bias_frags(float (&s)[M_FRAGS][N / 8][4], int q_offset,
                                                    int row_first, int col_first,
                                                    const BiasOf& bias_of) {
  const AccLayout frag;
#pragma unroll
  for (int m = 0; m < M_FRAGS; ++m) {
    const int base = q_offset + (ROWS_ARE_QUERIES ? row_first + 16 * m - col_first
                                                  : col_first - row_first - 16 * m);
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = frag.row(e), col = frag.col(j, e);
        s[m][j][e] += bias_of(base + (ROWS_ARE_QUERIES ? row - col : col - row));
      }
    }
  }
}

// ALiBi's bias on stacked fragments. The caller skips it when alibi_log2 is 0 (no ALiBi).
template <int M_FRAGS, int N, bool ROWS_ARE_QUERIES>
__device__ __forceinline__ void alibi_frags(float (&s)[M_FRAGS][N / 8][4], const ScoreScale& sc,
                                            int q_offset, int row_first, int col_first) {
  position_bias_frags<M_FRAGS, N, ROWS_ARE_QUERIES>(
      s, q_offset, row_first, col_first, [&](int q_minus_k) { return alibi_bias(sc, q_minus_k); });
}

template <int N, bool ROWS_ARE_QUERIES>
__device__ __forceinline__ void alibi_tile(float (&s)[N / 8][4], const ScoreScale& sc,
                                           int q_offset, int row_first, int col_first) {
  alibi_frags<1, N, ROWS_ARE_QUERIES>(as_frags<N>(s), sc, q_offset, row_first, col_first);
}

// A relative-position table's row for this (batch, head): 2 * max_distance + 1 biases (natural
// units, T5's and Swin's learned bias by distance); a score of keys k_pos - q_pos apart reads
// column clamp(k_pos - q_pos, -max_distance, max_distance) + max_distance, so every read is in
// the row whatever the positions (a ragged tile's rest is masked anyway). The row is a few
// hundred floats that every CTA of the head reads: L1 holds it after the first tile.
struct RelBias {
  const float* center;  // the row's column for distance 0; null: no table
  int max_distance;
  __device__ __forceinline__ float log2_at(int q_minus_k) const {
    const int rel = -q_minus_k;  // k_pos - q_pos
    const int clamped = rel < -max_distance ? -max_distance : (rel > max_distance ? max_distance : rel);
    return center[clamped] * LOG2E;
  }
  // The table of (batch, head) [batch, heads, 2M + 1] at batch stride batch_stride (0: one table
  // for every batch), or null without one.
  __device__ __forceinline__ static RelBias make(const float* table, int use, int batch_stride,
                                                 int max_distance, int batch, int head) {
    if (!use) return {nullptr, 0};
    const size_t row = size_t(batch) * batch_stride + size_t(head) * (2 * max_distance + 1);
    return {table + row + max_distance, max_distance};
  }
};

template <int M_FRAGS, int N, bool ROWS_ARE_QUERIES>
__device__ __forceinline__ void rel_bias_frags(float (&s)[M_FRAGS][N / 8][4], const RelBias& rb,
                                               int q_offset, int row_first, int col_first) {
  position_bias_frags<M_FRAGS, N, ROWS_ARE_QUERIES>(
      s, q_offset, row_first, col_first, [&](int q_minus_k) { return rb.log2_at(q_minus_k); });
}

template <int N, bool ROWS_ARE_QUERIES>
__device__ __forceinline__ void rel_bias_tile(float (&s)[N / 8][4], const RelBias& rb,
                                              int q_offset, int row_first, int col_first) {
  rel_bias_frags<1, N, ROWS_ARE_QUERIES>(as_frags<N>(s), rb, q_offset, row_first, col_first);
}

// The relative-position table's gradient from one dQ warp tile of dS (rows: queries q_first +
// 16 rows, columns: keys k_first + N): a middle column of a row is reached by exactly one key,
// so its dS is stored as it comes into that row's part of rows_grad ([n_q rows of 2M + 1],
// zeroed by the caller); the keys at distance <= -M and >= M (the first and last columns) add
// their dS to first_ds / last_ds (this lane's share of its two rows; with M = 0, distance 0
// goes to first_ds and the rest to last_ds, both the one column). Rows past n_q are not stored.
template <int N>
__device__ __forceinline__ void rel_grad_tile(const float (&ds)[N / 8][4], const RelBias& rb,
                                              int q_offset, int q_first, int k_first, int n_q,
                                              float* rows_grad, float (&first_ds)[2],
                                              float (&last_ds)[2]) {
  const AccLayout frag;
  const int reach = rb.max_distance;
  // k_pos - q_pos of this lane's element (0, 0); the others differ by compile-time constants
  const int rel_first = k_first + frag.col(0, 0) - q_offset - q_first - frag.row(0);
  float* row_grad[2];
  bool row_valid[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int q_row = q_first + frag.row(2 * r);
    row_valid[r] = q_row < n_q;
    row_grad[r] = rows_grad + size_t(row_valid[r] ? q_row : 0) * (2 * reach + 1) + reach;
  }
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      // selects and a predicated store, no branches: lanes of a warp take different ways
      const int rel = rel_first + 8 * j + e % 2 - 8 * (e / 2);
      const bool first = rel <= -reach, last = !first && rel >= reach;
      first_ds[e / 2] += first ? ds[j][e] : 0.f;
      last_ds[e / 2] += last ? ds[j][e] : 0.f;
      if (!first && !last && row_valid[e / 2]) row_grad[e / 2][rel] = ds[j][e];
    }
  }
}

// A per-key additive bias (key_bias, in natural units), this (batch, head)'s row: keys
// n_k and beyond are never read (a ragged tile's rest is masked anyway).
struct KeyBias {
  const float* row;  // null: no key bias
  int n_k;
  __device__ __forceinline__ float log2_at(int key) const {
    return key < n_k ? row[key] * LOG2E : 0.f;
  }
};

// Adds the key bias to M_FRAGS stacked score fragments whose columns are keys col_first + ...
// (forward, dQ); every fragment and both rows of a lane share its two columns per n-tile, so a
// tile costs two loads per n-tile. -inf stays -inf; a -inf bias is a masked key.
template <int M_FRAGS, int N>
__device__ __forceinline__ void key_bias_frags(float (&s)[M_FRAGS][N / 8][4], const KeyBias& kb,
                                               int col_first) {
  const AccLayout frag;
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    const float lo = kb.log2_at(col_first + frag.col(j, 0));
    const float hi = kb.log2_at(col_first + frag.col(j, 1));
#pragma unroll
    for (int m = 0; m < M_FRAGS; ++m) {
      s[m][j][0] += lo;
      s[m][j][1] += hi;
      s[m][j][2] += lo;
      s[m][j][3] += hi;
    }
  }
}

// How the score-modifier kernels read a dense score bias (use_score_bias): not at all, in
// float32, or in the kernel's own 16-bit type T (a bias in q's dtype, as SDPA and transformers
// build their float masks): one runtime switch per tile instead of a template argument, which
// would double the 16-bit MODS_SCORE instantiations.
constexpr int SCORE_BIAS_NONE = 0;
constexpr int SCORE_BIAS_FLOAT = 1;
constexpr int SCORE_BIAS_NARROW = 2;

// A dense additive bias broadcast to [batch, heads, n_q, n_k] (score_bias: xformers' attn_bias,
// SDPA's float mask, DeepSpeed's rpe), this (batch, head)'s plane, read in place at element
// strides (0 along a broadcast axis; nothing is assumed contiguous). Only the tiles the walk
// visits are read, and no element past n_q or n_k.
template <typename T>
struct ScoreBias {
  const void* plane;  // element (0, 0) of this (batch, head); null: no score bias
  long long q_stride, k_stride;
  int n_q, n_k;
  bool narrow;  // stored in T, else in float32

  __device__ __forceinline__ static ScoreBias make(const void* bias, int kind,
                                                   long long batch_stride, long long head_stride,
                                                   long long q_stride, long long k_stride, int n_q,
                                                   int n_k, int batch, int head) {
    if (kind == SCORE_BIAS_NONE) return {nullptr, 0, 0, 0, 0, false};
    const bool narrow = is_half_type<T>::value && kind == SCORE_BIAS_NARROW;
    const long long origin = batch * batch_stride + head * head_stride;
    const char* plane = static_cast<const char*>(bias) +
                        origin * static_cast<long long>(narrow ? sizeof(T) : sizeof(float));
    return {plane, q_stride, k_stride, n_q, n_k, narrow};
  }
};

// One bias element at a byte address, stored in T (narrow) or in float32. Both loads share the
// address and one of them is predicated off: one copy of the tile's code serves both storage
// types instead of a copy each.
template <typename T>
__device__ __forceinline__ float bias_at(const char* address, bool narrow) {
  if (is_half_type<T>::value && narrow) return to_float(*reinterpret_cast<const T*>(address));
  return *reinterpret_cast<const float*>(address);
}

// factor * score bias added to M_FRAGS stacked fragments in the layout of mask_score_frags
// (ROWS_ARE_QUERIES: forward and dQ; dK/dV work on S^T): LOG2E adds it in the log2 domain,
// -LOG2E takes it back out. Rows at or past their axis's end and columns past theirs are not
// read. Callers add it before the mask: a masked score is replaced, so a bias read in a masked
// corner of a visited tile (NaN or anything) leaves no trace.
template <int M_FRAGS, int N, bool ROWS_ARE_QUERIES, typename T>
__device__ __forceinline__ void score_bias_frags(float (&s)[M_FRAGS][N / 8][4],
                                                 const ScoreBias<T>& sb, int row_first,
                                                 int col_first, float factor) {
  const AccLayout frag;
  // in bytes (a multiply, not a shift: a flipped view's strides are negative)
  const long long bytes = sb.narrow ? sizeof(T) : sizeof(float);
  const long long row_step = (ROWS_ARE_QUERIES ? sb.q_stride : sb.k_stride) * bytes;
  const long long col_step = (ROWS_ARE_QUERIES ? sb.k_stride : sb.q_stride) * bytes;
  const int rows_end = ROWS_ARE_QUERIES ? sb.n_q : sb.n_k;
  const int col = col_first + frag.col(0, 0);
  const int cols_left = (ROWS_ARE_QUERIES ? sb.n_k : sb.n_q) - col;
  const char* plane = static_cast<const char*>(sb.plane) + col * col_step;
#pragma unroll
  for (int m = 0; m < M_FRAGS; ++m) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row_first + 16 * m + frag.row(2 * r);
      if (row >= rows_end) continue;
      const char* row_bias = plane + row * row_step;
#pragma unroll
      for (int j = 0; j < N / 8; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          if (8 * j + c < cols_left) {
            const float bias = bias_at<T>(row_bias + (8 * j + c) * col_step, sb.narrow);
            s[m][j][2 * r + c] = fmaf(bias, factor, s[m][j][2 * r + c]);
          }
        }
      }
    }
  }
}

template <int N, bool ROWS_ARE_QUERIES, typename T>
__device__ __forceinline__ void score_bias_tile(float (&s)[N / 8][4], const ScoreBias<T>& sb,
                                                int row_first, int col_first, float factor) {
  score_bias_frags<1, N, ROWS_ARE_QUERIES>(as_frags<N>(s), sb, row_first, col_first, factor);
}

// The score bias's gradient from one dQ warp tile of dS (rows: queries q_first + 16, columns:
// keys k_first + N) into this (batch, head)'s [n_q, n_k] float32 plane, zeroed by the caller:
// every element of a visited tile is written once (one dQ CTA owns each query row, and the walk
// visits each of its tiles once), none past n_q or n_k.
template <int N>
__device__ __forceinline__ void score_bias_grad_tile(const float (&ds)[N / 8][4], float* plane,
                                                     int n_q, int n_k, int q_first, int k_first) {
  const AccLayout frag;
  const int keys_left = n_k - k_first - frag.col(0, 0);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int q_row = q_first + frag.row(2 * r);
    if (q_row >= n_q) continue;
    float* row_grad = plane + size_t(q_row) * n_k + k_first + frag.col(0, 0);
#pragma unroll
    for (int j = 0; j < N / 8; ++j) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        if (8 * j + c < keys_left) row_grad[8 * j + c] = ds[j][2 * r + c];
      }
    }
  }
}

// A warp tile of q.k products -> log2-domain scores (before masking: any finite scale is
// allowed, and -inf must stay -inf; a capped score is finite whatever q.k is). MODS_NONE is a
// plain multiply. (The forward's plain kernels skip it: row_probs.)
template <int MODS, int N>
__device__ __forceinline__ void score_tile(float (&s)[N / 8][4], const ScoreScale& sc) {
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[j][e] *= sc.factor;
      if constexpr (MODS == MODS_SCORE) {
        if (sc.cap_log2 > 0.f) s[j][e] = sc.cap_log2 * tanhf(s[j][e]);
      }
    }
  }
}

// The forward's plain kernels (MODS_NONE) keep q.k as the mma made it: their scale is positive
// (the host sends any other to the score-modifier variant, backends/kernels.modifier_variant),
// so the row max of the scores is the scale times the max of the values (rounding is monotone:
// bit for bit), and exp2(score - max) is one FFMA, fma(q.k, scale * log2(e), -max), where
// scaling first costs an FMUL and an FADD. The FMA's exact product leaves the row's largest
// score a residual of up to half an ulp of the max instead of 0; below this magnitude of the
// max (log2 domain) that is under 2^-15, a score's own rounding. Rows past it (scores no model
// makes, but finite) take the unfolded order, huge_score_probs: exactly the variant's rounding.
constexpr float SCALE_FOLD_MAX = 512.f;

// What multiplies a tile's values to make them log2-domain scores: 1 where score_tile scaled
// them already (the variant), scale * log2(e) in the plain forward.
template <int MODS>
__device__ __forceinline__ float score_factor(const ScoreScale& sc) {
  return MODS == MODS_SCORE ? 1.f : sc.factor;
}

// The log2-domain max of a tile row from the max of its values. -inf stays -inf.
template <int MODS>
__device__ __forceinline__ float scaled_max(float value_max, const ScoreScale& sc) {
  return value_max * score_factor<MODS>(sc);
}

// Row r's probabilities exp2(score - base) in place (elements 2r, 2r + 1 of each n-tile of a
// fragment), scores rounded first: the exact order past SCALE_FOLD_MAX (and for a NaN or
// infinite base, where it gives what the variant gives). Returns their sum.
template <int N>
__device__ __forceinline__ float huge_score_probs(float (&s)[N / 8][4], int r, float factor,
                                               float base) {
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      s[j][2 * r + c] = exp2f(__fmul_rn(s[j][2 * r + c], factor) - base);  // not contracted
      sum += s[j][2 * r + c];
    }
  }
  return sum;
}

// Row r's probabilities exp2(score - base) of a forward tile in place; returns their sum.
template <int MODS, int N>
__device__ __forceinline__ float row_probs(float (&s)[N / 8][4], int r, const ScoreScale& sc,
                                           float base) {
  const float factor = score_factor<MODS>(sc);
  if (MODS == MODS_NONE && !(fabsf(base) < SCALE_FOLD_MAX)) {
    return huge_score_probs<N>(s, r, factor, base);
  }
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      s[j][2 * r + c] = exp2f(fmaf(s[j][2 * r + c], factor, -base));
      sum += s[j][2 * r + c];
    }
  }
  return sum;
}

// The softcap's derivative d(capped score) / d(scaled score) = 1 - tanh^2 from a capped log2
// score s: 1 - (s / cap_log2)^2, and 0 where s is masked (-inf) or not a score (NaN). 1 when
// nothing is capped.
template <int MODS>
__device__ __forceinline__ float softcap_slope(float s_log2, const ScoreScale& sc) {
  if constexpr (MODS == MODS_SCORE) {
    if (sc.cap_log2 > 0.f) {
      const float t = s_log2 * sc.inv_cap_log2;
      return fmaxf(1.f - t * t, 0.f);
    }
  }
  return 1.f;
}

// Stores the two adjacent elements a lane holds in one n-tile as one 32-bit (16-bit types) or
// 64-bit (float) write instead of two; dst is 2-element aligned because pair_col is even.
template <typename T>
__device__ __forceinline__ void store_pair(T* dst, float lo, float hi) {
#ifdef CUATTN_INTERP
  cuattn_interp::require_aligned(dst, 2 * sizeof(T));
#endif
  if constexpr (is_half_type<T>::value) {
    *reinterpret_cast<u32*>(dst) = pack_pair<T>(lo, hi);
  } else {
    *reinterpret_cast<float2*>(dst) = make_float2(lo, hi);
  }
}
