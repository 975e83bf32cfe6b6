// What one decode CTA owns, from its place in the grid (splits, kv_heads x row chunks, batch)
// that attn_decode_split and attn_decode_gqa share (kernels/attn_decode.cu, attn_decode_gqa.cu).
#pragma once

#include "types.cuh"

// CUDA's integer min is a device builtin the interpreter's host compiler lacks; one spelling.
__device__ __forceinline__ int min_int(int a, int b) { return a < b ? a : b; }

// One split of one (sequence b, kv head)'s pages and up to ROWS of its kv group's
// kv_group x t_q query rows: rows first_row .. first_row + rows - 1 (row r: query head
// kv_head kv_group + r / t_q, query r % t_q). Its table slots are [slot_lo, slot_hi): pages
// [split pages_per_split, ...) of the pair's page count (use_slot_pos: a KVCache's page_count
// [B, kv_heads]) or of its length's pages (a caller's table holds a sequence's tokens in order).
template <int ROWS>
struct DecodeCta {
  int split, kv_head, first_row, rows, b;
  long long length;
  int slot_lo, slot_hi;

  __device__ __forceinline__ DecodeCta(int heads, int kv_heads, int t_q,
                                       const long long* __restrict__ lengths,
                                       const int* __restrict__ page_count, int page_size,
                                       int pages_per_split, int use_slot_pos) {
    const int group_rows = heads / kv_heads * t_q;
    const int row_chunks = (group_rows + ROWS - 1) / ROWS;
    split = int(blockIdx.x);
    kv_head = int(blockIdx.y) / row_chunks;
    first_row = (int(blockIdx.y) % row_chunks) * ROWS;
    rows = min_int(ROWS, group_rows - first_row);
    b = int(blockIdx.z);
    length = lengths[b];
    const int pages = use_slot_pos ? page_count[size_t(b) * kv_heads + kv_head]
                                   : int((length + page_size - 1) / page_size);
    const int page_lo = min_int(split * pages_per_split, pages);
    const int page_hi = min_int(page_lo + pages_per_split, pages);
    slot_lo = page_lo * page_size;
    slot_hi = page_hi * page_size;
  }
};
