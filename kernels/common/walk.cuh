// The layout walk every block kernel shares.
//
// A CTA owns the positions own_first..own_last of one axis (queries in the forward and the dQ
// pass, keys in the dK/dV pass) inside one layout block. Its active partners are the entries of
// that block's CSR row (forward, dQ: col_idx/row_mask) or CSC column (dK/dV: row_idx/col_mask).
// ActiveTiles cuts each entry's block into sub-tiles of OTHER_TILE positions along the other
// axis and yields, in layout order, the sub-tiles the element rule does not empty, each with its
// coverage (TILE_FULL: no per-element test needed). It is an iterator rather than a loop body
// so a pipelined kernel can ask for the next tile early and start its copy before the current
// tile's math.
#pragma once

#include "mask.cuh"
#include "ptx.cuh"

struct ActiveTile {
  int start;     // first position on the other axis
  int block;     // the layout block it lies in
  int mask_id;   // the entry's mask (-1: a full block)
  int coverage;  // TILE_FULL or TILE_PARTIAL
};

// Coverage of a tile of own positions [own_first, own_last] x other positions [other_first,
// other_first + OTHER_TILE - 1]; OWN_IS_QUERY says which axis is the query axis.
template <int RULE, int OTHER_TILE, bool OWN_IS_QUERY>
__device__ __forceinline__ int coverage_of(const RuleParams& rule, int own_first, int own_last,
                                           int other_first, int mask_id) {
  const int other_last = other_first + OTHER_TILE - 1;
  return OWN_IS_QUERY
             ? tile_coverage<RULE>(rule, own_first, own_last, other_first, other_last, mask_id)
             : tile_coverage<RULE>(rule, other_first, other_last, own_first, own_last, mask_id);
}

template <int RULE, int BLOCK, int OTHER_TILE, bool OWN_IS_QUERY>
struct ActiveTiles {
  using Tile = ActiveTile;
  static constexpr int SUB_TILES = BLOCK / OTHER_TILE;
  static_assert(BLOCK % OTHER_TILE == 0, "a block is whole sub-tiles");

  // entries: this block's [begin, end) pair of the CSR row_ptr (CSC col_ptr). The walk holds
  // only its position; the rule and the own range come with each call, so a kernel at its
  // register limit does not carry copies of them.
  __device__ __forceinline__ ActiveTiles(const int* entries, const int* partner_blocks,
                                         const int* partner_masks)
      : blocks_(partner_blocks), masks_(partner_masks), entry_(entries[0]), end_(entries[1]) {}

  // The walk cut to the row's entries [cut[0], cut[1]) (counted from the row's first: a chunk of
  // a split row, its blocks found by the host), before the first next(). Offsets rather than
  // blocks: no search, so a producer at its register limit holds nothing more.
  template <typename Cut>
  __device__ __forceinline__ void restrict_to(Cut cut) {
    end_ = entry_ + cut[1];
    entry_ += cut[0];
  }

  // The next sub-tile the rule does not empty for own positions [own_first, own_last]; false
  // when the walk is over. Uniform across the CTA.
  __device__ __forceinline__ bool next(ActiveTile& tile, const RuleParams& rule, int own_first,
                                       int own_last) {
    while (entry_ < end_) {
      const int block = blocks_[entry_];
      const int mask_id = masks_[entry_];
      while (sub_ < SUB_TILES) {
        const int start = block * BLOCK + sub_ * OTHER_TILE;
        ++sub_;
        if (start >= (OWN_IS_QUERY ? rule.n_k : rule.n_q)) break;  // a ragged last block's rest
        const int coverage =
            coverage_of<RULE, OTHER_TILE, OWN_IS_QUERY>(rule, own_first, own_last, start, mask_id);
        if (coverage != TILE_EMPTY) {
          tile = ActiveTile{start, block, mask_id, coverage};
          return true;
        }
      }
      ++entry_;
      sub_ = 0;
    }
    return false;
  }

 private:
  const int* blocks_;
  const int* masks_;
  int entry_;
  int end_;
  int sub_ = 0;
};

// The forward's walk when one CTA owns the queries of two adjacent layout blocks (a and b =
// a + 1; geometry.py pairs 64-blocks so that each K/V tile read through L2 feeds 128 rows, not
// 64): the union of the two CSR rows, merged in key order (host layouts list each row's blocks in
// ascending order), each key sub-tile yielded once, to every warp with its own block's entry
// mask and its own rows' coverage: TILE_EMPTY where its block's row does not hold the tile (the
// warp skips it). The walk only reads the warp's own block's mask and tests the warp's own rows:
// the yield itself depends on the two rows' blocks alone, so it stays uniform across the CTA.
// The sm_90a backward walks the union of two CSC columns the same way (OWN_IS_QUERY = false:
// the own axis is keys, the tiles are query steps).
struct PairedTile {
  int start;     // first key (query, in a column walk)
  int block;     // the key (query) block it lies in
  int mask_id;   // the warp's block's entry mask (-1: a full block, or none held)
  int coverage;  // of the warp's own rows
  int entry;     // the index entry of the first of the two blocks that holds it
};

// Past every key block: where one row of the pair is walked to its end.
constexpr int PAST_LAST_BLOCK = 0x7fffffff;

// What both paired walks (PairedRowTiles, KeyPairTiles) keep: their place in each of the two
// CSR rows, a = block a's and b = block a + 1's, and which of them the caller's rows lie in.
class PairedRows {
 public:
  // row_a: block a's [begin, end) pair of the CSR row_ptr; has_b: whether block a + 1 exists
  // (the last query block may have no partner); row_block: the calling warp's block (0: a).
  __device__ __forceinline__ PairedRows(const int* row_a, bool has_b, const int* col_idx,
                                        const int* row_mask, int row_block)
      : blocks_(col_idx),
        masks_(row_mask),
        entry_a_(row_a[0]),
        end_a_(row_a[1]),
        entry_b_(row_a[1]),
        end_b_(has_b ? row_a[2] : row_a[1]),
        row_block_(row_block) {}

  // Row a cut to its entries [cut[0], cut[1]) and row b to [cut[2], cut[3]) (counted from each
  // row's first: a chunk of a split row, as ActiveTiles::restrict_to), before the first next().
  // With key pairs a chunk may end or begin inside a tile: each chunk then holds the halves of
  // its own entries.
  template <typename Cut>
  __device__ __forceinline__ void restrict_to(Cut cut) {
    end_a_ = entry_a_ + cut[1];
    entry_a_ += cut[0];
    end_b_ = entry_b_ + cut[3];
    entry_b_ += cut[2];
  }

 protected:
  const int* blocks_;
  const int* masks_;
  int entry_a_;
  int end_a_;
  int entry_b_;
  int end_b_;
  int row_block_;
};

template <int RULE, int BLOCK, int TILE_N, bool OWN_IS_QUERY = true>
struct PairedRowTiles : PairedRows {
  using Tile = PairedTile;
  static constexpr int SUB_TILES = BLOCK / TILE_N;
  static_assert(BLOCK % TILE_N == 0, "a block is whole sub-tiles");
  using PairedRows::PairedRows;

  // The next sub-tile of either row, for the calling warp's rows own_first..own_last; false
  // when both rows are walked.
  __device__ __forceinline__ bool next(PairedTile& tile, const RuleParams& rule, int own_first,
                                       int own_last) {
    while (entry_a_ < end_a_ || entry_b_ < end_b_) {
      const int block_a = entry_a_ < end_a_ ? blocks_[entry_a_] : PAST_LAST_BLOCK;
      const int block_b = entry_b_ < end_b_ ? blocks_[entry_b_] : PAST_LAST_BLOCK;
      const int block = block_a < block_b ? block_a : block_b;
      const bool in_a = block_a == block, in_b = block_b == block;
      const bool held = row_block_ ? in_b : in_a;
      const int mask_id = held ? masks_[row_block_ ? entry_b_ : entry_a_] : -1;
      if (sub_ < SUB_TILES) {
        const int start = block * BLOCK + sub_ * TILE_N;
        ++sub_;
        if (start < (OWN_IS_QUERY ? rule.n_k : rule.n_q)) {  // else a ragged block's rest
          const int coverage = held ? coverage_of<RULE, TILE_N, OWN_IS_QUERY>(
                                          rule, own_first, own_last, start, mask_id)
                                    : TILE_EMPTY;
          tile = PairedTile{start, block, mask_id, coverage, in_a ? entry_a_ : entry_b_};
          return true;
        }
      }
      entry_a_ += in_a;
      entry_b_ += in_b;
      sub_ = 0;
    }
    return false;
  }

 private:
  int sub_ = 0;
};

// The sm_90a forward's walk when its key tiles are twice its blocks (TILE_N = 2 BLOCK, with a
// paired CTA's two query rows a and a + 1): the union of the two CSR rows in key tiles of two
// adjacent key blocks 2j and 2j + 1, each tile yielded once, to every warpgroup with, per half,
// its own block's entry mask and its own rows' coverage (TILE_EMPTY where its row lacks that
// block), and which halves any row of the pair holds (the halves the producer copies; a half no
// row holds is neither copied nor computed). As PairedRowTiles, the yield depends on the two
// rows' blocks alone: uniform across the CTA.
constexpr int KEY_HALVES = 2;
struct KeyPairTile {
  int start;                   // first key: block 2j's
  int block;                   // 2j, its first key block
  int held;                    // bit h: a row of the pair holds block 2j + h
  int mask_id[KEY_HALVES];     // the caller's row's entry mask of each half (-1: full, or none)
  int coverage[KEY_HALVES];    // of the caller's rows, each half
};

template <int RULE, int BLOCK>
struct KeyPairTiles : PairedRows {
  using Tile = KeyPairTile;
  using PairedRows::PairedRows;  // row_block: the calling warpgroup's block

  // The next key tile either row holds a block of, for the calling warpgroup's rows
  // own_first..own_last; false when both rows are walked.
  __device__ __forceinline__ bool next(KeyPairTile& tile, const RuleParams& rule, int own_first,
                                       int own_last) {
    if (entry_a_ >= end_a_ && entry_b_ >= end_b_) return false;
    const int block_a = entry_a_ < end_a_ ? blocks_[entry_a_] : PAST_LAST_BLOCK;
    const int block_b = entry_b_ < end_b_ ? blocks_[entry_b_] : PAST_LAST_BLOCK;
    const int first = (block_a < block_b ? block_a : block_b) / KEY_HALVES * KEY_HALVES;
    tile.start = first * BLOCK;
    tile.block = first;
    tile.held = 0;
#pragma unroll
    for (int half = 0; half < KEY_HALVES; ++half) {
      const int block = first + half;
      const bool in_a = entry_a_ < end_a_ && blocks_[entry_a_] == block;
      const bool in_b = entry_b_ < end_b_ && blocks_[entry_b_] == block;
      const bool mine = row_block_ ? in_b : in_a;
      tile.mask_id[half] = mine ? masks_[row_block_ ? entry_b_ : entry_a_] : -1;
      tile.coverage[half] =
          mine ? coverage_of<RULE, BLOCK, true>(rule, own_first, own_last, block * BLOCK,
                                                tile.mask_id[half])
               : TILE_EMPTY;
      tile.held |= int(in_a || in_b) << half;
      entry_a_ += in_a;
      entry_b_ += in_b;
    }
    return true;
  }
};

// The sm_90a forward's walk when one CTA owns the queries of ROWS adjacent layout blocks
// q_block .. q_block + ROWS - 1 (three 64-blocks at d = 64: a consumer warpgroup each): the union
// of their CSR rows in key order, as PairedRowTiles walks two (each key sub-tile yielded once, to
// every warpgroup with its own block's entry mask and its own rows' coverage, TILE_EMPTY where its
// block's row lacks the tile; the yield depends on the rows' blocks alone: uniform across the CTA).
// Row r's entries are row_ptr[r] .. row_ptr[r + 1]: the rows are consecutive in the CSR arrays.
template <int RULE, int BLOCK, int TILE_N, int ROWS>
struct RowUnionTiles {
  using Tile = PairedTile;
  static constexpr int SUB_TILES = BLOCK / TILE_N;
  static_assert(BLOCK % TILE_N == 0, "a block is whole sub-tiles");
  static_assert(ROWS >= 2, "one row is ActiveTiles' walk");

  // rows: block q_block's place in the CSR row_ptr; blocks: how many of the ROWS exist (the
  // last query blocks may have fewer); row_block: the calling warpgroup's block (0: q_block).
  __device__ __forceinline__ RowUnionTiles(const int* rows, int blocks, const int* col_idx,
                                           const int* row_mask, int row_block)
      : blocks_(col_idx), masks_(row_mask), own_row_(1 << row_block) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      entry_[r] = r < blocks ? rows[r] : rows[0];
      end_[r] = r < blocks ? rows[r + 1] : rows[0];
    }
  }

  // The next sub-tile of any row, for the calling warpgroup's rows own_first..own_last; false
  // when every row is walked.
  __device__ __forceinline__ bool next(PairedTile& tile, const RuleParams& rule, int own_first,
                                       int own_last) {
    for (;;) {
      int block = PAST_LAST_BLOCK;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const int row_block = entry_[r] < end_[r] ? blocks_[entry_[r]] : PAST_LAST_BLOCK;
        block = row_block < block ? row_block : block;
      }
      if (block == PAST_LAST_BLOCK) return false;
      bool held = false;
      int mask_id = -1;
      int entry = 0;
#pragma unroll
      for (int r = ROWS - 1; r >= 0; --r) {
        const bool in_r = entry_[r] < end_[r] && blocks_[entry_[r]] == block;
        if (in_r) entry = entry_[r];  // the first row that holds it
        if (in_r && (own_row_ >> r & 1)) {
          held = true;
          mask_id = masks_[entry_[r]];
        }
      }
      if (sub_ < SUB_TILES) {
        const int start = block * BLOCK + sub_ * TILE_N;
        ++sub_;
        if (start < rule.n_k) {  // else a ragged block's rest
          const int coverage =
              held ? coverage_of<RULE, TILE_N, true>(rule, own_first, own_last, start, mask_id)
                   : TILE_EMPTY;
          tile = PairedTile{start, block, mask_id, coverage, entry};
          return true;
        }
      }
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        entry_[r] += entry_[r] < end_[r] && blocks_[entry_[r]] == block;
      }
      sub_ = 0;
    }
  }

 private:
  const int* blocks_;
  const int* masks_;
  int entry_[ROWS];
  int end_[ROWS];
  // The caller's row as a bit: a test of `r == row_block` lets the compiler index entry_ by
  // row_block, which puts the arrays in local memory.
  int own_row_;
  int sub_ = 0;
};

// The forward's walk over a CTA's query rows: ActiveTiles over query block q_block's CSR row,
// or with ROW_BLOCKS = 2 PairedRowTiles over blocks q_block and q_block + 1 (row_block: which
// of the two the caller's rows lie in; the last query block may have no partner), in key tiles
// of two blocks (KeyPairTiles) where TILE_N is twice the block, or with ROW_BLOCKS = 3
// RowUnionTiles over q_block .. q_block + 2.
template <int ROW_BLOCKS, int RULE, int BLOCK, int TILE_N>
__device__ __forceinline__ auto forward_walk(const int* row_ptr, const int* col_idx,
                                             const int* row_mask, int head, int num_blocks,
                                             int q_block, int row_block) {
  const int* entries = row_ptr + head * (num_blocks + 1) + q_block;
  if constexpr (TILE_N > BLOCK) {
    static_assert(ROW_BLOCKS == 2 && TILE_N == KEY_HALVES * BLOCK, "a paired CTA's key pairs");
    return KeyPairTiles<RULE, BLOCK>(entries, q_block + 1 < num_blocks, col_idx, row_mask,
                                     row_block);
  } else if constexpr (ROW_BLOCKS > 2) {
    const int blocks = num_blocks - q_block < ROW_BLOCKS ? num_blocks - q_block : ROW_BLOCKS;
    return RowUnionTiles<RULE, BLOCK, TILE_N, ROW_BLOCKS>(entries, blocks, col_idx, row_mask,
                                                          row_block);
  } else if constexpr (ROW_BLOCKS == 2) {
    return PairedRowTiles<RULE, BLOCK, TILE_N>(entries, q_block + 1 < num_blocks, col_idx,
                                               row_mask, row_block);
  } else {
    return ActiveTiles<RULE, BLOCK, TILE_N, true>(entries, col_idx, row_mask);
  }
}

// One warp's view of a forward tile: the entry mask of the query block its rows lie in (`row` 0,
// or 1 for the second block of a paired CTA) and the coverage narrowed to the warp's own rows
// first..last: a FULL tile stays FULL, a PARTIAL one may be FULL or EMPTY for these rows alone.
struct WarpTile {
  int mask_id;
  int coverage;
};

template <int RULE, int TILE_N>
__device__ __forceinline__ WarpTile warp_view(const ActiveTile& tile, int, const RuleParams& rule,
                                             int first, int last) {
  const int coverage =
      tile.coverage == TILE_FULL
          ? TILE_FULL
          : coverage_of<RULE, TILE_N, true>(rule, first, last, tile.start, tile.mask_id);
  return {tile.mask_id, coverage};
}

template <int RULE, int TILE_N>
__device__ __forceinline__ WarpTile warp_view(const PairedTile& tile, int, const RuleParams&, int,
                                             int) {
  return {tile.mask_id, tile.coverage};  // the walk tested the warp's own rows already
}

// The double-buffered walk of the backward kernels: every active tile of `walk` in order, with
// the next tile's copy in flight while the current one is computed and one barrier per step.
//   load_step(stage, start)  starts the copies of the tile at `start` into buffer `stage` (0/1)
//                            and commits them (cp.async) or stores them (plain stores)
//   body(tile, stage)        the math on the tile in buffer `stage`
// The barrier after the wait makes buffer `stage` visible to every warp and guarantees every
// warp is done with the other buffer before load_step overwrites it. The CTA's own copies, if
// issued before the call, are waited for with the first step's.
template <typename Walk, typename LoadStep, typename Body>
__device__ __forceinline__ void walk_double_buffered(Walk& walk, const RuleParams& rule,
                                                     int own_first, int own_last,
                                                     LoadStep&& load_step, Body&& body) {
  ActiveTile tile;
  bool active = walk.next(tile, rule, own_first, own_last);
  if (active) load_step(0, tile.start);
  int stage = 0;
  while (active) {
    ActiveTile next_tile;
    const bool has_next = walk.next(next_tile, rule, own_first, own_last);
    cp_async_wait_group<0>();
    __syncthreads();
    if (has_next) load_step(stage ^ 1, next_tile.start);
    body(tile, stage);
    tile = next_tile;
    active = has_next;
    stage ^= 1;
  }
  cp_async_wait_all();  // an own tile with no active partner still retires its copies
}
