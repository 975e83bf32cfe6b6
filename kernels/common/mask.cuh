// The element rule inside a block that needs it (docs/design.md §2): q is a query row, k a key
// index, both in computed order; the k < n_k bound always applies. With n_q queries and n_k keys
// the queries are the last n_q positions: the causal and window rules measure from query row q's
// position q + q_offset (q_offset = n_k - n_q), as FlashAttention >= 2.1 and SDPA's bottom-right
// causal mask do. Bitmasks were evaluated on the host with the same convention.
#pragma once

#include "types.cuh"

struct RuleParams {
  int n_q;       // query rows
  int n_k;       // keys
  int q_offset;  // n_k - n_q: query row q sits at position q + q_offset
  int window_left;
  int window_right;
  const u32* mask_table;  // [n_masks, BLOCK, words] (bitmask rule only)
};

// Bits first_col, first_col + 1, ... (up to the block's end, at most 64 - first_col % 32 of
// them) of row `row` of bitmask `mask_id`: one or two word loads serve a whole row of a tile.
template <int BLOCK>
__device__ __forceinline__ unsigned long long mask_row_bits(const RuleParams& p, int mask_id,
                                                            int row, int first_col) {
  constexpr int WORDS = (BLOCK + 31) / 32;
  const u32* words = p.mask_table + (size_t(mask_id) * BLOCK + row) * WORDS;
  const int w = first_col / 32;
  unsigned long long bits = words[w];
  if (w + 1 < WORDS) bits |= (unsigned long long)(words[w + 1]) << 32;
  return bits >> (first_col % 32);
}

// Whether query q sees key k inside layout block (q_block, k_block) whose mask entry is mask_id.
template <int RULE, int BLOCK>
__device__ __forceinline__ bool element_allowed(const RuleParams& p, int q, int k, int q_block,
                                                int k_block, int mask_id) {
  if (k >= p.n_k) return false;
  if (mask_id < 0) return true;  // a full block: no element rule inside it
  if constexpr (RULE == MASK_CAUSAL) {
    return k <= q + p.q_offset;
  } else if constexpr (RULE == MASK_WINDOW) {
    const int pos = q + p.q_offset;
    return (pos - k < p.window_left) && (k - pos < p.window_right);
  } else if constexpr (RULE == MASK_BITMASK) {
    const int c = k - k_block * BLOCK;
    return (mask_row_bits<BLOCK>(p, mask_id, q - q_block * BLOCK, c) & 1ull) != 0;
  } else {
    return true;
  }
}

// Whether a q-tile x k-tile rectangle can be skipped or needs no per-element test; lets sub-tiles
// of a big block that lie wholly above the causal diagonal (or outside the window) cost nothing.
enum TileCoverage : int { TILE_EMPTY = 0, TILE_PARTIAL = 1, TILE_FULL = 2 };

template <int RULE>
__device__ __forceinline__ int tile_coverage(const RuleParams& p, int q0, int q1, int k0, int k1,
                                             int mask_id) {
  // q0..q1 (query rows) and k0..k1 (keys) are inclusive ranges of the tile. The key end comes
  // first: a tile past it is empty and one across it needs the k < n_k test, whatever the layout
  // says.
  if (k0 >= p.n_k) return TILE_EMPTY;
  const bool ragged = k1 >= p.n_k;
  if (mask_id < 0) return ragged ? TILE_PARTIAL : TILE_FULL;
  q0 += p.q_offset;  // rows -> positions
  q1 += p.q_offset;
  if constexpr (RULE == MASK_CAUSAL) {
    if (k0 > q1) return TILE_EMPTY;
    return (k1 <= q0 && !ragged) ? TILE_FULL : TILE_PARTIAL;
  } else if constexpr (RULE == MASK_WINDOW) {
    // allowed: q - k < window_left and k - q < window_right
    if (q0 - k1 >= p.window_left || k0 - q1 >= p.window_right) return TILE_EMPTY;
    const bool all_in = (q1 - k0 < p.window_left) && (k1 - q0 < p.window_right);
    return (all_in && !ragged) ? TILE_FULL : TILE_PARTIAL;
  } else if constexpr (RULE == MASK_BITMASK) {
    return TILE_PARTIAL;
  } else {
    return ragged ? TILE_PARTIAL : TILE_FULL;
  }
}
