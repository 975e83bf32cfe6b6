// TMA (sm_90a): 2-D tensor copies between global and shared memory described by a tensor map,
// each behind one small named device function like the instructions of ptx.cuh and
// mbarrier.cuh. A load lands in shared memory through the asynchronous proxy and completes the
// transaction bytes of an mbarrier phase; a store reads shared memory through the asynchronous
// proxy, so the plain stores that wrote its source must be followed by fence_proxy_async().
//
// The tensor map is a kernel parameter (`const __grid_constant__ TensorMap`, the PTX ISA's
// "Tensor-map": a 128-byte object in .param space, accessed by address). On a GPU its bytes are
// the opaque encoding cuTensorMapEncodeTiled writes; under the CPU interpreter the same 128 bytes
// hold the description itself (cuattn/backends/tensor_map.py; its fields are the arguments
// cuTensorMapEncodeTiled takes), and the functions below apply the documented semantics: the
// destination is poisoned (0xFF) at issue and filled when the barrier phase completes, with the
// swizzle of the PTX ISA's "Swizzling Modes" and zeros for the elements outside the tensor ("Out
// of Boundary Access", zero fill mode); misuse a GPU does not report is a launch hazard.
//
// Coordinates are in elements, innermost (contiguous) dimension first, as in the PTX ISA.
#pragma once

#include "mbarrier.cuh"

// CUtensorMapSwizzle's values, which are also the number of row bits the pattern XORs into the
// 16-byte chunk index (PTX ISA "Swizzling Modes": a 32B pattern repeats every 2 lines of 128
// bytes, 64B every 4, 128B every 8).
enum TmaSwizzle : unsigned {
  TMA_SWIZZLE_NONE = 0,
  TMA_SWIZZLE_32B = 1,
  TMA_SWIZZLE_64B = 2,
  TMA_SWIZZLE_128B = 3,
};

// Size of a tensor map object (PTX ISA "Tensor-map"); the driver requires 64-byte alignment.
constexpr int TENSOR_MAP_BYTES = 128;
// cuTensorMapEncodeTiled's largest rank without interleave (and cp.async.bulk.tensor's .5d).
constexpr int TMA_MAX_RANK = 5;

struct alignas(64) TensorMap {
#ifdef CUATTN_INTERP
  const void* global;              // element (0, ..., 0)
  u64 dims[TMA_MAX_RANK];          // elements per dimension, innermost first
  u64 strides[TMA_MAX_RANK - 1];   // bytes from one index of dimension d + 1 to the next
  u32 box[TMA_MAX_RANK];           // elements per copy, innermost first
  u32 rank;
  u32 element_bytes;
  u32 swizzle;  // TmaSwizzle
  unsigned char unused[TENSOR_MAP_BYTES - sizeof(void*) - (2 * TMA_MAX_RANK - 1) * sizeof(u64) -
                       (TMA_MAX_RANK + 3) * sizeof(u32)];
#else
  u64 opaque[TENSOR_MAP_BYTES / 8];
#endif
};
static_assert(sizeof(TensorMap) == TENSOR_MAP_BYTES, "a tensor map is 128 bytes");

#ifdef CUATTN_INTERP
namespace cuattn_interp {
// The CUDA programming guide's "Shared-Memory Bank Swizzling" (table of swizzle requirements for
// compute capability 9): a TMA's shared memory is 128-byte aligned, its global memory 16-byte
// aligned, 128-byte with a swizzle; the box's inner dimension is at most the swizzle width.
constexpr uintptr_t TMA_SMEM_ALIGNMENT = 128;
constexpr uintptr_t TMA_GLOBAL_ALIGNMENT = 16;
constexpr uintptr_t TMA_SWIZZLED_GLOBAL_ALIGNMENT = 128;
// The driver's limits on a tiled tensor map (cuTensorMapEncodeTiled): box sizes 1..256, inner
// box bytes and row strides multiples of 16.
constexpr u32 TMA_MAX_BOX = 256;
constexpr size_t TMA_CHUNK_BYTES = 16;  // the swizzle's unit, and the granularity of a box row
// A swizzle pattern XORs the 16-byte chunk index (address bits 4..6) with the index of the
// 128-byte shared-memory line (bits 7..), so it repeats every 2^mode lines.
constexpr int SWIZZLE_CHUNK_SHIFT = 4;
constexpr int SWIZZLE_LINE_SHIFT = 7;

// Bytes of a box row a swizzle mode allows (32, 64, 128), and after which its pattern repeats
// (256, 512, 1024 bytes).
inline size_t swizzle_width(unsigned mode) { return TMA_CHUNK_BYTES << mode; }
inline uintptr_t swizzle_repeat(unsigned mode) {
  return uintptr_t(1) << (SWIZZLE_LINE_SHIFT + mode);
}

// The shared-memory address at which a swizzled copy puts the byte that lands at `address`
// without swizzle (PTX ISA "Swizzling Modes"; the pattern is anchored at the repeat boundary,
// which is why the destination must be aligned to it for a reader to find its data).
inline uintptr_t swizzle(uintptr_t address, unsigned mode) {
  const uintptr_t line_bits = (address >> SWIZZLE_LINE_SHIFT) & ((uintptr_t(1) << mode) - 1);
  return address ^ (line_bits << SWIZZLE_CHUNK_SHIFT);
}

// cuTensorMapEncodeTiled's limit on the byte strides of the outer dimensions.
constexpr u64 TMA_STRIDE_LIMIT = u64(1) << 40;

// What cuTensorMapEncodeTiled would refuse in `map`, or "" when it is valid.
inline std::string tensor_map_error(const TensorMap& map) {
  if (map.rank < 1 || map.rank > u32(TMA_MAX_RANK)) {
    return "rank " + std::to_string(map.rank) + " (1 to " + std::to_string(TMA_MAX_RANK) + ")";
  }
  const u64 row_bytes = u64(map.box[0]) * map.element_bytes;
  const uintptr_t global = reinterpret_cast<uintptr_t>(map.global);
  if (map.swizzle > TMA_SWIZZLE_128B) return "unknown swizzle mode " + std::to_string(map.swizzle);
  if (map.element_bytes == 0 || (map.element_bytes & (map.element_bytes - 1)) != 0 ||
      map.element_bytes > 8) {
    return "element size " + std::to_string(map.element_bytes) + " bytes";
  }
  for (u32 d = 0; d < map.rank; ++d) {
    if (map.box[d] < 1 || map.box[d] > TMA_MAX_BOX) {
      return "box dimension " + std::to_string(d) + " of " + std::to_string(map.box[d]) +
             " elements (1 to 256)";
    }
    if (map.dims[d] < 1) return "tensor dimension " + std::to_string(d) + " is empty";
  }
  for (u32 d = 0; d + 1 < map.rank; ++d) {
    if (map.strides[d] % TMA_CHUNK_BYTES != 0 || map.strides[d] >= TMA_STRIDE_LIMIT) {
      return "a stride of " + std::to_string(map.strides[d]) + " bytes for dimension " +
             std::to_string(d + 1) + " (a multiple of 16 under 2^40)";
    }
  }
  if (row_bytes % TMA_CHUNK_BYTES != 0) {
    return "box rows of " + std::to_string(row_bytes) + " bytes (a multiple of 16)";
  }
  if (map.swizzle != TMA_SWIZZLE_NONE && row_bytes > swizzle_width(map.swizzle)) {
    return "box rows of " + std::to_string(row_bytes) + " bytes, wider than the " +
           std::to_string(swizzle_width(map.swizzle)) + "-byte swizzle";
  }
  const uintptr_t alignment =
      map.swizzle == TMA_SWIZZLE_NONE ? TMA_GLOBAL_ALIGNMENT : TMA_SWIZZLED_GLOBAL_ALIGNMENT;
  if (global % alignment != 0) {
    return "a global address not aligned to " + std::to_string(alignment) + " bytes";
  }
  return "";
}

// Checks one TMA's tensor map and shared-memory address; false (and a hazard) when a GPU would
// fault or lay the data out where no reader of this project looks for it.
inline bool tma_operands_ok(const TensorMap& map, int coordinates, const void* smem,
                            const char* what) {
  const std::string error = tensor_map_error(map);
  if (!error.empty()) {
    report_hazard(std::string(what) + " with an invalid tensor map: " + error);
    return false;
  }
  if (u32(coordinates) != map.rank) {
    // the instruction's .Nd names the rank; a GPU rejects a map of another
    report_hazard(std::string(what) + " with " + std::to_string(coordinates) +
                  " coordinates on a tensor map of rank " + std::to_string(map.rank));
    return false;
  }
  const uintptr_t address = reinterpret_cast<uintptr_t>(smem);
  if (address % TMA_SMEM_ALIGNMENT != 0) {
    report_hazard(std::string(what) + " at shared-memory offset " +
                  std::to_string(smem_offset(smem)) + ", not 128-byte aligned");
    return false;
  }
  if (map.swizzle != TMA_SWIZZLE_NONE && address % swizzle_repeat(map.swizzle) != 0) {
    // A GPU then starts the pattern part-way (the CUDA guide's "swizzle pattern pointer offset")
    // and every reader, a wgmma descriptor included, would have to add that offset.
    report_hazard(std::string(what) + " at shared-memory offset " +
                  std::to_string(smem_offset(smem)) + " with the " +
                  std::to_string(swizzle_width(map.swizzle)) +
                  "-byte swizzle, not aligned to the pattern's " +
                  std::to_string(swizzle_repeat(map.swizzle)) + "-byte repeat");
    return false;
  }
  return true;
}

// Calls visit(at, global, offset, bytes) for every 16-byte chunk of the box at `coords` (one per
// dimension): `at` is the chunk's swizzled shared-memory address; its bytes [offset, offset +
// bytes) hold elements inside the tensor, which start at `global` (nullptr and 0 bytes when none
// does). The box lands as rows of box[0] elements, dimension 1 varying fastest, then 2, ...
template <typename Visit>
inline void for_each_box_chunk(const TensorMap& map, const int* coords, const void* smem,
                               Visit visit) {
  const size_t row_bytes = size_t(map.box[0]) * map.element_bytes;
  const int64_t chunk_elements = int64_t(TMA_CHUNK_BYTES / map.element_bytes);
  const auto base = reinterpret_cast<uintptr_t>(smem);
  size_t rows = 1;
  for (u32 d = 1; d < map.rank; ++d) rows *= map.box[d];
  for (size_t r = 0; r < rows; ++r) {
    // the row's place in the outer dimensions, and whether it lies inside the tensor
    bool row_inside = true;
    int64_t row_offset = 0;
    size_t rest = r;
    for (u32 d = 1; d < map.rank; ++d) {
      const int64_t at = int64_t(coords[d]) + int64_t(rest % map.box[d]);
      rest /= map.box[d];
      row_inside = row_inside && at >= 0 && at < int64_t(map.dims[d]);
      row_offset += at * int64_t(map.strides[d - 1]);
    }
    for (size_t c = 0; c < row_bytes / TMA_CHUNK_BYTES; ++c) {
      auto* at = reinterpret_cast<unsigned char*>(
          swizzle(base + r * row_bytes + c * TMA_CHUNK_BYTES, map.swizzle));
      const int64_t col = int64_t(coords[0]) + int64_t(c) * chunk_elements;
      const int64_t first = std::max<int64_t>(0, -col);
      const int64_t last = std::min<int64_t>(chunk_elements, int64_t(map.dims[0]) - col);
      if (!row_inside || first >= last) {
        visit(at, nullptr, 0, 0);
        continue;
      }
      const auto* global = static_cast<const unsigned char*>(map.global) + row_offset +
                           (col + first) * map.element_bytes;
      visit(at, global, size_t(first) * map.element_bytes,
            size_t(last - first) * map.element_bytes);
    }
  }
}

// The bytes one copy of `map`'s box moves (out-of-bounds elements included).
inline size_t box_bytes(const TensorMap& map) {
  size_t bytes = map.element_bytes;
  for (u32 d = 0; d < map.rank; ++d) bytes *= map.box[d];
  return bytes;
}

template <int RANK>
inline void tma_load(void* dst, const TensorMap& map, const int (&coords)[RANK], void* bar) {
  if (!tma_operands_ok(map, RANK, dst, "a TMA load")) return;
  for_each_box_chunk(map, coords, dst,
                     [](unsigned char* at, const unsigned char*, size_t, size_t) {
                       async_proxy_fill(at, 0xFF, TMA_CHUNK_BYTES);
                     });
  std::array<int, RANK> kept;
  std::copy(coords, coords + RANK, kept.begin());
  async_copy_to_shared(bar, box_bytes(map), [=] {
    for_each_box_chunk(map, kept.data(), dst, [](unsigned char* at, const unsigned char* global,
                                                 size_t offset, size_t bytes_inside) {
      // zero fill mode: elements outside the tensor land as 0
      unsigned char chunk[TMA_CHUNK_BYTES] = {};
      if (global) std::memcpy(chunk + offset, global, bytes_inside);
      async_proxy_write(at, chunk, TMA_CHUNK_BYTES);
    });
  });
}

template <int RANK>
inline void tma_store(const TensorMap& map, const int (&coords)[RANK], const void* src) {
  if (!tma_operands_ok(map, RANK, src, "a TMA store")) return;
  if (std::any_of(coords, coords + RANK, [](int c) { return c < 0; })) {
    // PTX ISA, "Restriction on Tensor Copy instructions", the .global.shared::cta direction
    std::string at;
    for (int d = 0; d < RANK; ++d) at += (d ? ", " : "") + std::to_string(coords[d]);
    report_hazard("a TMA store at negative coordinates (" + at + ")");
    return;
  }
  std::array<int, RANK> kept;
  std::copy(coords, coords + RANK, kept.begin());
  // The source is read until the store's group is retired: kept here to show a change to it.
  std::vector<unsigned char> issued;
  bool fenced = true;
  for_each_box_chunk(map, kept.data(), src,
                     [&](const unsigned char* at, const unsigned char*, size_t, size_t) {
                       fenced = fenced && async_proxy_read_ok(at, TMA_CHUNK_BYTES, "a TMA store");
                       issued.insert(issued.end(), at, at + TMA_CHUNK_BYTES);
                     });
  if (!fenced) return;
  self().bulk_ops.push_back({-1, [=] {
    size_t i = 0;
    bool changed = false;
    for_each_box_chunk(map, kept.data(), src, [&](const unsigned char* at,
                                                  const unsigned char* global, size_t offset,
                                                  size_t bytes_inside) {
      changed = changed || std::memcmp(at, issued.data() + i, TMA_CHUNK_BYTES) != 0;
      // elements outside the tensor are not written
      if (global) {
        std::memcpy(const_cast<unsigned char*>(global), issued.data() + i + offset, bytes_inside);
      }
      i += TMA_CHUNK_BYTES;
    });
    if (changed) {
      report_hazard("the source of a TMA store at shared-memory offset " +
                    std::to_string(smem_offset(src)) +
                    " changed before cp.async.bulk.wait_group.read retired it");
    }
  }});
}

inline void tma_store_commit() { bulk_commit_group(); }
inline void tma_store_wait(int pending) { bulk_wait_group(pending); }

// cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32: `bytes` of floats at `src` in
// shared memory added element by element into `dst` in global memory, through the asynchronous
// proxy. The source is read (and must stay unchanged) until a wait_group.read retires the group;
// the sums are written then.
inline void bulk_reduce_add(float* dst, const float* src, unsigned bytes) {
  if (reinterpret_cast<uintptr_t>(dst) % TMA_CHUNK_BYTES != 0 ||
      reinterpret_cast<uintptr_t>(src) % TMA_CHUNK_BYTES != 0 || bytes % TMA_CHUNK_BYTES != 0 ||
      bytes == 0) {
    report_hazard("a bulk reduce of " + std::to_string(bytes) + " bytes at shared-memory offset " +
                  std::to_string(smem_offset(src)) +
                  " (addresses 16-byte aligned and a non-zero multiple of 16 bytes)");
    return;
  }
  if (tracked_offset(src, bytes) < 0) {
    report_hazard("a bulk reduce whose source is not in dynamic shared memory");
    return;
  }
  if (!async_proxy_read_ok(src, bytes, "a bulk reduce")) return;
  std::vector<float> issued(bytes / sizeof(float));
  std::memcpy(issued.data(), src, bytes);
  BulkGroupOp op{-1, [=] {
    if (std::memcmp(src, issued.data(), bytes) != 0) {
      report_hazard("the source of a bulk reduce at shared-memory offset " +
                    std::to_string(smem_offset(src)) +
                    " changed before cp.async.bulk.wait_group.read retired it");
    }
    for (size_t i = 0; i < issued.size(); ++i) dst[i] += issued[i];
  }};
  op.writes_global = true;
  self().bulk_ops.push_back(std::move(op));
}
}  // namespace cuattn_interp
#endif

// Copies the box at (x, y) of a rank-2 `map` into shared memory at `dst` (128-byte aligned;
// aligned to the pattern's repeat, 256/512/1024 bytes, when swizzled) and completes the box's
// bytes (out-of-bounds elements included) on `bar`'s current phase.
__device__ __forceinline__ void tma_load_2d(void* dst, const TensorMap& map, int x, int y,
                                            u64* bar) {
#ifdef CUATTN_INTERP
  cuattn_interp::tma_load<2>(dst, map, {x, y}, bar);
#else
  const unsigned dst_address = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const unsigned bar_address = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst_address),
      "l"(reinterpret_cast<u64>(&map)), "r"(x), "r"(y), "r"(bar_address)
      : "memory");
#endif
}

// tma_load_2d for a rank-4 `map` (e.g. [batch, heads, rows, columns]: x the column, y the row,
// z the head, w the batch); the box's rows land one after another, y varying fastest.
__device__ __forceinline__ void tma_load_4d(void* dst, const TensorMap& map, int x, int y, int z,
                                            int w, u64* bar) {
#ifdef CUATTN_INTERP
  cuattn_interp::tma_load<4>(dst, map, {x, y, z, w}, bar);
#else
  const unsigned dst_address = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const unsigned bar_address = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst_address),
      "l"(reinterpret_cast<u64>(&map)), "r"(x), "r"(y), "r"(z), "r"(w), "r"(bar_address)
      : "memory");
#endif
}

// Writes the box at (x, y) of a rank-2 `map` from shared memory at `src` (aligned as for a
// load); the elements outside the tensor are not written. The read of `src` goes on after this
// returns, until tma_store_wait_read.
__device__ __forceinline__ void tma_store_2d(const TensorMap& map, int x, int y,
                                             const void* src) {
#ifdef CUATTN_INTERP
  cuattn_interp::tma_store<2>(map, {x, y}, src);
#else
  const unsigned src_address = static_cast<unsigned>(__cvta_generic_to_shared(src));
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
          reinterpret_cast<u64>(&map)),
      "r"(x), "r"(y), "r"(src_address)
      : "memory");
#endif
}

// tma_store_2d for a rank-4 `map` (x the column, y the row, z and w the outer dimensions).
__device__ __forceinline__ void tma_store_4d(const TensorMap& map, int x, int y, int z, int w,
                                             const void* src) {
#ifdef CUATTN_INTERP
  cuattn_interp::tma_store<4>(map, {x, y, z, w}, src);
#else
  const unsigned src_address = static_cast<unsigned>(__cvta_generic_to_shared(src));
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::
          "l"(reinterpret_cast<u64>(&map)),
      "r"(x), "r"(y), "r"(z), "r"(w), "r"(src_address)
      : "memory");
#endif
}

// Closes the group of this thread's TMA stores that tma_store_wait_read counts.
__device__ __forceinline__ void tma_store_commit() {
#ifdef CUATTN_INTERP
  cuattn_interp::tma_store_commit();
#else
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most PENDING of this thread's most recent store groups still read their shared
// memory, which may then be written again.
template <int PENDING>
__device__ __forceinline__ void tma_store_wait_read() {
#ifdef CUATTN_INTERP
  cuattn_interp::tma_store_wait(PENDING);
#else
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(PENDING) : "memory");
#endif
}

// Adds the `bytes` (a multiple of 16) of floats at `src` (shared memory, 16-byte aligned) into
// `dst` (global memory, 16-byte aligned), element by element, as one asynchronous bulk
// operation of this thread's current bulk group (tma_store_commit closes it): `src` may be
// written again after tma_store_wait_read, and the sums are complete in global memory after
// bulk_wait_group_complete. The plain stores that wrote `src` need fence_proxy_async first.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const float* src, unsigned bytes) {
#ifdef CUATTN_INTERP
  cuattn_interp::bulk_reduce_add(dst, src, bytes);
#else
  const unsigned src_address = static_cast<unsigned>(__cvta_generic_to_shared(src));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::
                   "l"(dst),
               "r"(src_address), "r"(bytes)
               : "memory");
#endif
}

// Waits until at most PENDING of this thread's most recent bulk groups are in flight, their
// writes to global memory included (cp.async.bulk.wait_group, without .read).
template <int PENDING>
__device__ __forceinline__ void bulk_wait_group_complete() {
#ifdef CUATTN_INTERP
  cuattn_interp::bulk_wait_group(PENDING, false);
#else
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(PENDING) : "memory");
#endif
}

// Orders this thread's earlier plain (generic-proxy) shared-memory stores before its later
// asynchronous-proxy accesses, e.g. a TMA store of the tile the threads wrote (each writer
// fences, then a __syncthreads, then one thread issues the store): without it the asynchronous
// proxy may read the memory as it was before those stores (PTX ISA, "Async Proxy").
__device__ __forceinline__ void fence_proxy_async() {
#ifdef CUATTN_INTERP
  cuattn_interp::fence_proxy_async();
#else
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
