// Dynamic shared memory, the CTA-wide tile loader, and 16-byte shared reads widened to float.
#pragma once

#include "ptx.cuh"

// Base of the block's dynamic shared memory (size set at launch by cuattn/backends/geometry.py).
template <typename T>
__device__ __forceinline__ T* dynamic_smem() {
#ifdef CUATTN_INTERP
  return reinterpret_cast<T*>(cuattn_interp::dynamic_smem);
#else
  extern __shared__ __align__(16) unsigned char cuattn_dynamic_smem[];
  return reinterpret_cast<T*>(cuattn_dynamic_smem);
#endif
}

// Row stride (elements) of a shared tile with COLS columns: padded by 16 bytes so the eight row
// addresses of one ldmatrix fall in different banks, and still 16-byte aligned for cp.async.
template <typename T, int COLS>
struct SmemStride {
  static constexpr int value = COLS + 16 / int(sizeof(T));
};

// Starts an asynchronous copy of a ROWS x COLS tile (gmem rows `gmem_ld` elements apart) into
// shared memory; rows >= valid_rows are zero-filled and never read from global memory.
// All NUM_THREADS threads of the CTA take part; the caller commits, waits and syncs.
//
// When the tile's 16-byte chunks divide evenly among the threads and a row's chunks divide the
// thread count (every tile cuattn/backends/geometry.py chooses for the attention kernels), each
// thread copies one column of COPIES rows ROW_STEP apart: a static trip count, the row and
// column computed once, and constant-stride pointer steps. A loop over `chunk = tid; chunk <
// CHUNKS; chunk += NUM_THREADS` instead has a trip count that depends on tid (the compiler does
// not know tid < NUM_THREADS): a general loop with a remainder that recomputes row, column and
// both addresses at every copy, ~22 instructions per cp.async.
// UNROLL: issue the COPIES copies unrolled (each a cp.async with its own address, no loop
// counter or pointer steps), for kernels with the registers to keep those addresses live.
template <int ROWS, int COLS, int NUM_THREADS, bool UNROLL = false, typename T>
__device__ __forceinline__ void load_tile_async(T* smem, int smem_ld, const T* gmem, int gmem_ld,
                                                int valid_rows) {
  constexpr int CHUNK = 16 / int(sizeof(T));  // elements per 16-byte copy
  static_assert(COLS % CHUNK == 0, "tile rows must be whole 16-byte chunks");
  constexpr int CHUNKS_PER_ROW = COLS / CHUNK;
  constexpr int CHUNKS = ROWS * CHUNKS_PER_ROW;
  const int tid = int(threadIdx.x);
  if constexpr (CHUNKS % NUM_THREADS == 0 && NUM_THREADS % CHUNKS_PER_ROW == 0) {
    constexpr int COPIES = CHUNKS / NUM_THREADS;
    constexpr int ROW_STEP = NUM_THREADS / CHUNKS_PER_ROW;
    const int row = tid / CHUNKS_PER_ROW;
    const int col = (tid % CHUNKS_PER_ROW) * CHUNK;
    T* dst = smem + row * smem_ld + col;
    const T* src = gmem + row * gmem_ld + col;
    const int src_step = ROW_STEP * gmem_ld;
    int rows_left = valid_rows - row;
    if constexpr (UNROLL) {
#pragma unroll
      for (int i = 0; i < COPIES; ++i) {
        const bool valid = rows_left > i * ROW_STEP;
        cp_async_16(dst + i * ROW_STEP * smem_ld, valid ? src + i * src_step : gmem, valid);
      }
    } else {
      // Rolled: an unrolled copy keeps every copy's address live at once, which the kernels at
      // the register limit pay for in spills (dK/dV, the 32-rows-per-warp forward).
#pragma unroll 1
      for (int i = 0; i < COPIES; ++i) {
        cp_async_16(dst, rows_left > 0 ? src : gmem, rows_left > 0);
        dst += ROW_STEP * smem_ld;
        src += src_step;
        rows_left -= ROW_STEP;
      }
    }
  } else {
    for (int chunk = tid; chunk < CHUNKS; chunk += NUM_THREADS) {
      const int row = chunk / CHUNKS_PER_ROW;
      const int col = (chunk % CHUNKS_PER_ROW) * CHUNK;
      const bool valid = row < valid_rows;
      const T* src = gmem + (valid ? row * gmem_ld + col : 0);
      cp_async_16(smem + row * smem_ld + col, src, valid);
    }
  }
}

// Sixteen bytes of shared memory (16-byte aligned) as four 32-bit words, one vector load.
__device__ __forceinline__ void load_16_words(const void* smem, u32 (&words)[4]) {
#ifdef CUATTN_INTERP
  cuattn_interp::require_aligned(smem, 16);
  std::memcpy(words, smem, 16);
#else
  const uint4 raw = *reinterpret_cast<const uint4*>(smem);
  words[0] = raw.x;
  words[1] = raw.y;
  words[2] = raw.z;
  words[3] = raw.w;
#endif
}

// Sixteen bytes of shared memory (16 / sizeof(T) elements, 16-byte aligned) widened to float,
// read as one vector load: the unit in which the decode kernel reads K rows and q.
template <typename T>
__device__ __forceinline__ void load_16_as_float(const T* smem, float (&out)[16 / sizeof(T)]) {
  constexpr int ELEMS = 16 / int(sizeof(T));
  if constexpr (is_fp8_type<T>::value) {  // fp8 codes: two at a time through an fp16 pair
    u32 words[4];
    load_16_words(smem, words);
#pragma unroll
    for (int k = 0; k < ELEMS / 2; ++k) {
      const u32 pair = fp8x2_to_half2<T>((unsigned short)(words[k / 2] >> (16 * (k % 2))));
      out[2 * k] = unpack_element<__half>(pair, 0);
      out[2 * k + 1] = unpack_element<__half>(pair, 1);
    }
    return;
  }
#ifdef CUATTN_INTERP
  cuattn_interp::require_aligned(smem, 16);
  for (int k = 0; k < ELEMS; ++k) out[k] = to_float(smem[k]);
#else
  const uint4 raw = *reinterpret_cast<const uint4*>(smem);
  const T* elems = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int k = 0; k < ELEMS; ++k) out[k] = to_float(elems[k]);
#endif
}
