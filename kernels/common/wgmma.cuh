// wgmma (sm_90a): the warpgroup's asynchronous matrix multiply-accumulate
// D[64 x N] (+)= A[64 x 16] * B[16 x N], fp32 accumulators, fp16 or bf16 operands read from
// shared memory through matrix descriptors, each instruction behind one small named device
// function like those of ptx.cuh. Both operands are K-major (imm-trans-a = imm-trans-b = 0):
// A as 64 rows of K, B as N rows of K.
//
// Under the CPU interpreter each thread computes its own accumulator fragment when it issues
// the instruction, from the operands as they are then, and the PTX ISA's rules a GPU does not
// check are reported as launch hazards: an issue with no wgmma.fence since the accumulators were
// last handed back to other instructions, accumulators written before the wgmma.wait_group that
// retires their group (they read as NaN until then), operand shared memory that changes between
// issue and retirement or that plain stores wrote with no fence.proxy.async after them, and a
// warpgroup whose threads do not all issue the same instructions (.aligned).
//
// Accumulator fragment (PTX ISA, "Register Fragments", wgmma .m64nNk16 matrix D; the same as
// CUTLASS's CLayout_64xN): warp w of the warpgroup holds rows 16w..16w+15; with g = lane / 4 and
// t = lane % 4, element i of a thread's N/2 floats is row 16w + g + 8 * ((i / 2) % 2), column
// 8 * (i / 4) + 2t + i % 2.
#pragma once

#include "tma.cuh"

// The descriptor's swizzle field (PTX ISA, "Matrix Descriptor Format", bits 62-63), numbered
// unlike the tensor map's TmaSwizzle.
enum WgmmaSwizzle : unsigned {
  WGMMA_SWIZZLE_NONE = 0,
  WGMMA_SWIZZLE_128B = 1,
  WGMMA_SWIZZLE_64B = 2,
  WGMMA_SWIZZLE_32B = 3,
};

constexpr int WGMMA_M = 64;
constexpr int WGMMA_K = 16;
constexpr int WARPGROUP_WARPS = 4;
// Matrix Descriptor Format: each of the start address, leading and stride byte offsets is
// stored as matrix-descriptor-encode(x) = (x & 0x3FFFF) >> 4 in a 14-bit field.
constexpr u64 DESCRIPTOR_ENCODE_MASK = 0x3FFFF;
constexpr int DESCRIPTOR_ENCODE_SHIFT = 4;
constexpr u64 DESCRIPTOR_FIELD_MASK = 0x3FFF;
constexpr int DESCRIPTOR_LEADING_BIT = 16;
constexpr int DESCRIPTOR_STRIDE_BIT = 32;
constexpr int DESCRIPTOR_BASE_OFFSET_BIT = 49;
constexpr u64 DESCRIPTOR_BASE_OFFSET_MASK = 0x7;
constexpr int DESCRIPTOR_SWIZZLE_BIT = 62;

__device__ __forceinline__ u64 descriptor_encode(u64 x) {
  return (x & DESCRIPTOR_ENCODE_MASK) >> DESCRIPTOR_ENCODE_SHIFT;
}

// Descriptor of a K-major operand at `smem` (PTX ISA, "Canonical Layouts"): 8-row groups
// `stride_bytes` apart; without swizzle each 8x16-byte core matrix is contiguous and the next
// along K is `leading_bytes` on, with a swizzle a row is the swizzle width and the leading
// offset is unused. The pattern's base offset is 0: the operand's swizzle atoms start on the
// pattern's repeat, as TMA destinations here always do.
__device__ __forceinline__ u64 wgmma_descriptor(const void* smem, unsigned leading_bytes,
                                                unsigned stride_bytes, WgmmaSwizzle swizzle) {
  const u64 address = static_cast<u64>(__cvta_generic_to_shared(smem));
  return descriptor_encode(address) | (descriptor_encode(leading_bytes) << DESCRIPTOR_LEADING_BIT) |
         (descriptor_encode(stride_bytes) << DESCRIPTOR_STRIDE_BIT) |
         (u64(swizzle) << DESCRIPTOR_SWIZZLE_BIT);
}

#ifdef CUATTN_INTERP
namespace cuattn_interp {
// A decoded matrix descriptor; byte quantities.
struct MatrixDescriptor {
  size_t start;
  size_t leading;
  size_t stride;
  unsigned base_offset;
  unsigned swizzle;  // WgmmaSwizzle
};

inline MatrixDescriptor decode_descriptor(u64 descriptor) {
  auto field = [&](int bit) {
    return size_t((descriptor >> bit) & DESCRIPTOR_FIELD_MASK) << DESCRIPTOR_ENCODE_SHIFT;
  };
  return {field(0), field(DESCRIPTOR_LEADING_BIT), field(DESCRIPTOR_STRIDE_BIT),
          unsigned((descriptor >> DESCRIPTOR_BASE_OFFSET_BIT) & DESCRIPTOR_BASE_OFFSET_MASK),
          unsigned(descriptor >> DESCRIPTOR_SWIZZLE_BIT)};
}

// The row bits a descriptor's swizzle XORs into the chunk index, as TmaSwizzle numbers them
// (128B: 3, 64B: 2, 32B: 1, none: 0): the patterns are the same (PTX ISA, "Shared Memory Matrix
// Layout": Swizzle<3,4,3>, <2,4,3>, <1,4,3>).
inline unsigned descriptor_swizzle_bits(unsigned field) {
  return field == WGMMA_SWIZZLE_NONE ? TMA_SWIZZLE_NONE : TMA_SWIZZLE_128B + 1 - field;
}

// Shared-memory offset of element (row, k) of a K-major operand, row < 64 (A) or < N (B),
// k < 16: the K-major canonical layout ((8, m), (T, 2)) : ((row pitch, stride), (1, chunk
// step)) in bytes, T elements to a 16-byte chunk, then the swizzle of the address.
inline size_t operand_offset(const MatrixDescriptor& d, int row, int k, size_t element_bytes) {
  const int per_chunk = int(TMA_CHUNK_BYTES / element_bytes);
  const unsigned mode = descriptor_swizzle_bits(d.swizzle);
  const size_t row_pitch = mode == TMA_SWIZZLE_NONE ? TMA_CHUNK_BYTES : swizzle_width(mode);
  const size_t chunk_step = mode == TMA_SWIZZLE_NONE ? d.leading : TMA_CHUNK_BYTES;
  const size_t unswizzled = d.start + size_t(row % 8) * row_pitch + size_t(row / 8) * d.stride +
                            size_t(k % per_chunk) * element_bytes +
                            size_t(k / per_chunk) * chunk_step;
  return swizzle(unswizzled, mode);
}

// One operand element, recorded for the retirement's check that it did not change.
struct OperandRead {
  size_t offset;
  unsigned short bits;
};

template <typename T>
inline float read_operand(const MatrixDescriptor& d, int row, int k,
                          std::vector<OperandRead>& reads) {
  const size_t offset = operand_offset(d, row, k, sizeof(T));
  if (offset + sizeof(T) > dynamic_smem_bytes) {
    report_hazard("a wgmma operand element at shared-memory offset " + std::to_string(offset) +
                  ", past the end of dynamic shared memory");
    return 0.0f;
  }
  async_proxy_read_ok(dynamic_smem + offset, sizeof(T), "a wgmma.mma_async operand");
  unsigned short bits;
  std::memcpy(&bits, dynamic_smem + offset, sizeof(bits));
  reads.push_back({offset, bits});
  T value;
  std::memcpy(&value, &bits, sizeof(value));
  return to_float(value);
}

inline uint64_t mix_digest(uint64_t digest, uint64_t value) {
  // FNV-1a's prime: order-sensitive, so the same instructions in another order differ too
  constexpr uint64_t PRIME = 0x100000001b3ULL;
  return (digest ^ value) * PRIME;
}

template <typename T, int N>
inline void wgmma_issue(float* d, u64 desc_a, u64 desc_b, bool accumulate) {
  ThreadState& me = self();
  if (!me.wgmma_fenced) {
    report_hazard("wgmma.mma_async with no wgmma.fence since the warpgroup's registers were "
                  "last accessed by other instructions");
  }
  me.wgmma_digest = mix_digest(mix_digest(mix_digest(me.wgmma_digest, desc_a), desc_b),
                               u64(N) * 2 + u64(accumulate));
  const MatrixDescriptor a = decode_descriptor(desc_a), b = decode_descriptor(desc_b);
  if (a.base_offset != 0 || b.base_offset != 0) {
    report_hazard("a wgmma descriptor with a non-zero matrix base offset (operands here start "
                  "on their swizzle pattern's repeat)");
    return;
  }
  // What the accumulators hold for this instruction: the result of the latest one still in
  // flight on the same registers (chained instructions are ordered by the hardware), else the
  // registers themselves.
  const float* c = d;
  for (auto op = me.wgmma_ops.rbegin(); op != me.wgmma_ops.rend(); ++op) {
    if (op->d == d) {
      c = op->result.data();
      break;
    }
  }
  const int warp = me.warp_index % WARPGROUP_WARPS, g = me.lane / 4, t = me.lane % 4;
  std::vector<OperandRead> reads;
  std::vector<float> result(N / 2);
  for (int i = 0; i < N / 2; ++i) {
    const int row = 16 * warp + g + 8 * ((i / 2) % 2);
    const int col = 8 * (i / 4) + 2 * t + i % 2;
    float sum = accumulate ? c[i] : 0.0f;
    for (int k = 0; k < WGMMA_K; ++k) {
      sum = std::fma(read_operand<T>(a, row, k, reads), read_operand<T>(b, col, k, reads), sum);
    }
    result[i] = sum;
  }
  std::memset(d, 0xFF, sizeof(float) * (N / 2));
  auto check = [reads = std::move(reads)] {
    for (const OperandRead& read : reads) {
      unsigned short now;
      std::memcpy(&now, dynamic_smem + read.offset, sizeof(now));
      if (now == read.bits) continue;
      report_hazard("wgmma operand shared memory at offset " + std::to_string(read.offset) +
                    " changed between wgmma.mma_async and the wgmma.wait_group retiring it");
      return;
    }
  };
  me.wgmma_ops.push_back({-1, d, std::move(result), std::move(check)});
}

inline void wgmma_commit() { commit_group(self().wgmma_ops, self().wgmma_committed_groups); }

// Retires every committed group but the `keep` most recent: operands checked, accumulators
// written (by the last instruction on each set of registers; the earlier ones fed it).
inline void wgmma_wait(int keep) {
  ThreadState& me = self();
  std::vector<WgmmaOp> still;
  for (size_t i = 0; i < me.wgmma_ops.size(); ++i) {
    WgmmaOp& op = me.wgmma_ops[i];
    if (op.group < 0 || op.group >= me.wgmma_committed_groups - keep) {
      still.push_back(std::move(op));
      continue;
    }
    op.check();
    const bool superseded =
        std::any_of(me.wgmma_ops.begin() + i + 1, me.wgmma_ops.end(),
                    [&](const WgmmaOp& later) { return later.d == op.d; });
    if (superseded) continue;
    for (size_t e = 0; e < op.result.size(); ++e) {
      uint32_t bits;
      std::memcpy(&bits, op.d + e, sizeof(bits));
      if (bits != ~0u) {
        report_hazard("accumulator registers of a wgmma.mma_async written before the "
                      "wgmma.wait_group retiring it");
        break;
      }
    }
    std::memcpy(op.d, op.result.data(), sizeof(float) * op.result.size());
  }
  me.wgmma_ops.swap(still);
  // the accumulators are the other instructions' again: the next wgmma needs a fence first
  me.wgmma_fenced = false;
}
}  // namespace cuattn_interp
#endif

// wgmma.fence: orders the warpgroup's earlier register accesses before the wgmma.mma_async that
// follow; every warp of the warpgroup issues it before the first of them and after touching
// their accumulators.
__device__ __forceinline__ void wgmma_fence() {
#ifdef CUATTN_INTERP
  cuattn_interp::self().wgmma_fenced = true;
#else
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit_group() {
#ifdef CUATTN_INTERP
  cuattn_interp::wgmma_commit();
#else
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

// Waits until at most PENDING of this thread's most recent wgmma groups are in flight; only
// then may the accumulators of the others be read or written.
template <int PENDING>
__device__ __forceinline__ void wgmma_wait_group() {
#ifdef CUATTN_INTERP
  cuattn_interp::wgmma_wait(PENDING);
#else
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING) : "memory");
#endif
}

// Pins the accumulators in registers around a wgmma sequence: an empty asm that reads and
// writes each, so the compiler moves no access to them across it (ptxas otherwise injects
// warpgroup.arrive waits, serialising the wgmma, when it sees accumulators touched in between).
template <int COUNT>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[COUNT]) {
#ifndef CUATTN_INTERP
  for (int i = 0; i < COUNT; ++i) asm volatile("" : "+f"(d[i])::"memory");
#endif
}

#ifndef CUATTN_INTERP
// The accumulator operands of one wgmma: a "+f" constraint per register of d, in order.
#define CUATTN_D4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define CUATTN_D8(i) CUATTN_D4(i), CUATTN_D4(i + 4)
#define CUATTN_D32(i) CUATTN_D8(i), CUATTN_D8(i + 8), CUATTN_D8(i + 16), CUATTN_D8(i + 24)
// The wgmma with scale-d from `accumulate` (0: D = A * B), imm-scale-a/b 1, both K-major.
#define CUATTN_WGMMA(SHAPE_TYPES, REGISTERS, DESC_A, DESC_B, ACCUMULATE, ...)                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " ACCUMULATE ", 0;\n"                          \
               "wgmma.mma_async.sync.aligned." SHAPE_TYPES " " REGISTERS ", " DESC_A           \
               ", " DESC_B ", p, 1, 1, 0, 0;\n}\n"                                              \
               : __VA_ARGS__                                                                    \
               : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)))
#endif

// d (the N / 2 accumulators of this thread) = A * B (+ d when `accumulate`): one
// wgmma.mma_async.m64nNk16.f32 of T (__half or __nv_bfloat16) operands; N is 16 or 64.
template <typename T, int N>
__device__ __forceinline__ void wgmma_m64k16(float (&d)[N / 2], u64 desc_a, u64 desc_b,
                                             bool accumulate) {
  static_assert(is_half_type<T>::value, "wgmma takes fp16 or bf16 operands here");
  static_assert(N == 16 || N == 64, "wgmma_m64k16 is written out for N = 16 and 64");
#ifdef CUATTN_INTERP
  cuattn_interp::wgmma_issue<T, N>(d, desc_a, desc_b, accumulate);
#else
  constexpr bool HALF = is_same_type<T, __half>::value;
  if constexpr (N == 16 && HALF) {
    CUATTN_WGMMA("m64n16k16.f32.f16.f16", "{%0, %1, %2, %3, %4, %5, %6, %7}", "%8", "%9", "%10",
                 CUATTN_D8(0));
  } else if constexpr (N == 16) {
    CUATTN_WGMMA("m64n16k16.f32.bf16.bf16", "{%0, %1, %2, %3, %4, %5, %6, %7}", "%8", "%9",
                 "%10", CUATTN_D8(0));
  } else if constexpr (HALF) {
    CUATTN_WGMMA("m64n64k16.f32.f16.f16",
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, "
                 "%17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}",
                 "%32", "%33", "%34", CUATTN_D32(0));
  } else {
    CUATTN_WGMMA("m64n64k16.f32.bf16.bf16",
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, "
                 "%17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}",
                 "%32", "%33", "%34", CUATTN_D32(0));
  }
#endif
}
