// wgmma (sm_90a): the warpgroup's asynchronous matrix multiply-accumulate
// D[64 x N] (+)= A[64 x 16] * B[16 x N], fp32 accumulators, fp16 or bf16 operands, N = 16, 32,
// 64, 128 or 256, each instruction behind one small named device function like those of
// ptx.cuh. B is read from shared memory through a matrix descriptor, K-major (N rows of K,
// imm-trans-b = 0: K^T of QK^T, stored as K's rows) or MN-major (K rows of N, imm-trans-b = 1:
// V of P.V, stored as V's rows, which 16-bit types allow); A either K-major from shared memory
// (64 rows of K, imm-trans-a = 0: wgmma_m64k16, the form of QK^T) or from four 32-bit registers
// per thread (wgmma_m64k16_rs, the form of P.V, whose P is the softmax of an accumulator
// fragment).
//
// Under the CPU interpreter each thread computes its own accumulator fragment when it issues
// the instruction, from the operands as they are then, and the PTX ISA's rules a GPU does not
// check are reported as launch hazards: an issue with no wgmma.fence since the accumulators were
// last handed back to other instructions, accumulators written before the wgmma.wait_group that
// retires their group (they read as NaN until then), operand shared memory or A registers that
// change between issue and retirement, shared memory that plain stores wrote with no
// fence.proxy.async after them, and a warpgroup whose threads do not all issue the same
// instructions (.aligned).
//
// Fragments (PTX ISA, "Register Fragments": the figures of the wgmma .m64nNk16 A and D
// fragments; their text forms are CUTLASS's ALayout_64x16 and CLayout_64xN). Warp w of the
// warpgroup holds rows 16w..16w+15; with g = lane / 4 and t = lane % 4:
//   D: element i of a thread's N/2 floats is row 16w + g + 8 * ((i / 2) % 2), column
//      8 * (i / 4) + 2t + i % 2;
//   A: element v of a thread's 8 halves (register v / 2, the low half first) is row
//      16w + g + 8 * ((v / 2) % 2), k = 2t + v % 2 + 8 * (v / 4).
// The two agree: the accumulators of columns 16j .. 16j + 15 of an N-wide D, elements
// 8j .. 8j + 7, are in the places of A's elements 0..7 of the K-block j, so P.V takes P from
// the QK^T accumulators without leaving the thread.
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

// Which way an operand's elements run in shared memory (imm-trans-a/b: 0 K-major, 1 MN-major).
enum WgmmaMajor : int {
  WGMMA_K_MAJOR = 0,
  WGMMA_MN_MAJOR = 1,
};

constexpr int WGMMA_M = 64;
constexpr int WGMMA_K = 16;
constexpr int WARPGROUP_WARPS = 4;
// 32-bit registers a thread holds of A (8 fp16/bf16 elements, two to a register).
constexpr int WGMMA_A_REGISTERS = 4;
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

// Descriptor of an operand at `smem` (PTX ISA, "Canonical Layouts"). K-major: 8-row groups
// `stride_bytes` apart; without swizzle each 8x16-byte core matrix is contiguous and the next
// along K is `leading_bytes` on, with a swizzle a row is the swizzle width and the leading
// offset is unused. MN-major with a swizzle: a K row is one swizzle width of MN, 8 K rows make
// an atom, the next atom along K is `stride_bytes` on and the next along MN `leading_bytes` on;
// without swizzle the roles swap (core matrices of 8 K rows x 16 bytes, `stride_bytes` apart
// along MN, `leading_bytes` along K). The pattern's base offset is 0: the operand's swizzle
// atoms start on the pattern's repeat, as TMA destinations here always do.
__device__ __forceinline__ u64 wgmma_descriptor(const void* smem, unsigned leading_bytes,
                                                unsigned stride_bytes, WgmmaSwizzle swizzle) {
  const u64 address = static_cast<u64>(__cvta_generic_to_shared(smem));
  return descriptor_encode(address) | (descriptor_encode(leading_bytes) << DESCRIPTOR_LEADING_BIT) |
         (descriptor_encode(stride_bytes) << DESCRIPTOR_STRIDE_BIT) |
         (u64(swizzle) << DESCRIPTOR_SWIZZLE_BIT);
}

// The descriptor of the same operand `bytes` further on in shared memory (a multiple of 16):
// the start address field holds the address / 16, and shared memory (under 2^18 bytes) keeps
// the sum inside its 14 bits, so a kernel computes one descriptor per buffer and adds offsets
// (most of them compile-time constants) instead of encoding an address per instruction.
__device__ __forceinline__ u64 descriptor_advance(u64 descriptor, unsigned bytes) {
  return descriptor + (bytes >> DESCRIPTOR_ENCODE_SHIFT);
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

// Rows of a canonical layout's core matrix or swizzle atom (K rows when MN-major).
constexpr int CANONICAL_GROUP_ROWS = 8;

// Shared-memory offset of element (row, k) of an operand, row < 64 (A) or < N (B), k < 16, in
// bytes, then the swizzle of the address; T elements to a 16-byte chunk, W of them to a
// swizzle width (PTX ISA, "Canonical Layouts", in elements):
//   K-major:                ((8, m), (T, 2k)) : ((row pitch, SBO), (1, chunk step))
//   MN-major, no swizzle:   ((T, 1, m), (8, k)) : ((1, T, SBO), (T, LBO))
//   MN-major, swizzled:     ((T, W, m), (8, k)) : ((1, T, LBO), (W T, SBO))
inline size_t operand_offset(const MatrixDescriptor& d, int row, int k, size_t element_bytes,
                             WgmmaMajor major) {
  const int per_chunk = int(TMA_CHUNK_BYTES / element_bytes);
  const unsigned mode = descriptor_swizzle_bits(d.swizzle);
  const int group = CANONICAL_GROUP_ROWS;
  size_t unswizzled;
  if (major == WGMMA_K_MAJOR) {
    const size_t row_pitch = mode == TMA_SWIZZLE_NONE ? TMA_CHUNK_BYTES : swizzle_width(mode);
    const size_t chunk_step = mode == TMA_SWIZZLE_NONE ? d.leading : TMA_CHUNK_BYTES;
    unswizzled = d.start + size_t(row % group) * row_pitch + size_t(row / group) * d.stride +
                 size_t(k % per_chunk) * element_bytes + size_t(k / per_chunk) * chunk_step;
  } else if (mode == TMA_SWIZZLE_NONE) {
    unswizzled = d.start + size_t(row % per_chunk) * element_bytes +
                 size_t(row / per_chunk) * d.stride + size_t(k % group) * TMA_CHUNK_BYTES +
                 size_t(k / group) * d.leading;
  } else {
    const size_t width = swizzle_width(mode);
    const int per_width = int(width / element_bytes);
    unswizzled = d.start + size_t(row % per_width) * element_bytes +
                 size_t(row / per_width) * d.leading + size_t(k % group) * width +
                 size_t(k / group) * d.stride;
  }
  return swizzle(unswizzled, mode);
}

// One operand element, recorded for the retirement's check that it did not change.
struct OperandRead {
  size_t offset;
  unsigned short bits;
};

template <typename T>
inline float read_operand(const MatrixDescriptor& d, int row, int k, WgmmaMajor major,
                          std::vector<OperandRead>& reads) {
  const size_t offset = operand_offset(d, row, k, sizeof(T), major);
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

// Index (0..7) of A's element (row, k) among the 8 halves of the thread holding it, lane
// 4 * (row % 8) + (k % 8) / 2 of warp row / 16 (the A fragment above).
inline int wgmma_a_element_index(int row, int k) {
  return k % 2 + 2 * ((row / 8) % 2) + 4 * (k / 8);
}

inline uint64_t mix_digest(uint64_t digest, uint64_t value) {
  // FNV-1a's prime: order-sensitive, so the same instructions in another order differ too
  constexpr uint64_t PRIME = 0x100000001b3ULL;
  return (digest ^ value) * PRIME;
}

// What the digest of an instruction with A in registers records in place of A's descriptor.
constexpr u64 A_IN_REGISTERS = ~0ULL;

// Folds the identity of one wgmma.mma_async into the thread's digest (.aligned: the threads of
// a warpgroup must all issue the same ones) and checks what every issue needs: a wgmma.fence
// since the accumulators were last handed back, and descriptors whose matrix base offset is 0.
inline bool wgmma_issue_ok(u64 operand_a, u64 desc_b, WgmmaMajor b_major, int n,
                           bool accumulate) {
  ThreadState& me = self();
  if (!me.wgmma_fenced) {
    report_hazard("wgmma.mma_async with no wgmma.fence since the warpgroup's registers were "
                  "last accessed by other instructions");
  }
  me.wgmma_digest = mix_digest(mix_digest(mix_digest(me.wgmma_digest, operand_a), desc_b),
                               (u64(n) * 4 + u64(b_major)) * 2 + u64(accumulate));
  for (u64 descriptor : {operand_a, desc_b}) {
    if (descriptor == A_IN_REGISTERS || decode_descriptor(descriptor).base_offset == 0) continue;
    report_hazard("a wgmma descriptor with a non-zero matrix base offset (operands here start "
                  "on their swizzle pattern's repeat)");
    return false;
  }
  return true;
}

// Computes this thread's N / 2 accumulators of D = A * B (+ D) at issue: A's element (row, k)
// from a_element(row, k, reads), B's from shared memory through `b` (laid out `b_major`), each
// shared-memory element
// recorded in `reads`. The accumulators read NaN until the wgmma.wait_group retiring the
// instruction, which runs `check_a` and reports any element read here that changed since.
template <typename T, int N, typename AElement>
inline void wgmma_fragment(float* d, const MatrixDescriptor& b, WgmmaMajor b_major,
                           bool accumulate, AElement a_element, std::function<void()> check_a) {
  ThreadState& me = self();
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
      sum = std::fma(a_element(row, k, reads), read_operand<T>(b, col, k, b_major, reads), sum);
    }
    result[i] = sum;
  }
  std::memset(d, 0xFF, sizeof(float) * (N / 2));
  auto check = [reads = std::move(reads), check_a = std::move(check_a)] {
    check_a();
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

template <typename T, int N, WgmmaMajor B_MAJOR, WgmmaMajor A_MAJOR>
inline void wgmma_issue(float* d, u64 desc_a, u64 desc_b, bool accumulate) {
  // the digest tells the two A layouts apart through the majors it folds in
  if (!wgmma_issue_ok(desc_a, desc_b, WgmmaMajor(B_MAJOR + 2 * A_MAJOR), N, accumulate)) return;
  const MatrixDescriptor a = decode_descriptor(desc_a);
  auto a_element = [&](int row, int k, std::vector<OperandRead>& reads) {
    return read_operand<T>(a, row, k, A_MAJOR, reads);
  };
  wgmma_fragment<T, N>(d, decode_descriptor(desc_b), B_MAJOR, accumulate, a_element, [] {});
}

// The A operand from registers: the rows of A a thread's accumulators need are held by the four
// threads of its quad (lanes 4g .. 4g + 3 of its warp), so the warp exchanges its registers
// first (every thread of the warpgroup issues the instruction: .aligned).
template <typename T, int N, WgmmaMajor B_MAJOR>
inline void wgmma_issue_rs(float* d, const u32* a, u64 desc_b, bool accumulate) {
  const uint32_t* all = warp_exchange(a, WGMMA_A_REGISTERS * sizeof(u32));
  if (!wgmma_issue_ok(A_IN_REGISTERS, desc_b, B_MAJOR, N, accumulate)) return;
  const int quad = 4 * (self().lane / 4);
  auto a_element = [=](int row, int k, std::vector<OperandRead>&) {
    const int holder = quad + (k % 8) / 2;
    const int v = wgmma_a_element_index(row, k);
    const u32 word = all[holder * EXCHANGE_WORDS + v / 2];
    const unsigned short bits = static_cast<unsigned short>(v % 2 ? word >> 16 : word);
    T value;
    std::memcpy(&value, &bits, sizeof(value));
    return to_float(value);
  };
  std::array<u32, WGMMA_A_REGISTERS> issued;
  std::memcpy(issued.data(), a, sizeof(issued));
  wgmma_fragment<T, N>(d, decode_descriptor(desc_b), B_MAJOR, accumulate, a_element,
                       [a, issued] {
    if (std::memcmp(a, issued.data(), sizeof(issued)) == 0) return;
    report_hazard("the A fragment registers of a wgmma.mma_async changed between its issue and "
                  "the wgmma.wait_group retiring it");
  });
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

// The same for A fragments held in registers (wgmma_m64k16_rs): computed before the
// wgmma.fence that precedes their wgmma, not sunk past it by the compiler.
template <int COUNT>
__device__ __forceinline__ void wgmma_fence_operands(u32 (&a)[COUNT]) {
#ifndef CUATTN_INTERP
  for (int i = 0; i < COUNT; ++i) asm volatile("" : "+r"(a[i])::"memory");
#endif
}

#ifndef CUATTN_INTERP
// The asm operands of one wgmma: first the accumulators, a "+f" constraint per register of d in
// order; the PTX operand numbers of groups of 8 of them; the numbers of the 6 operands that
// follow COUNT accumulators (numbered operands only: NVRTC rejects named ones).
#define CUATTN_D4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define CUATTN_D8(i) CUATTN_D4(i), CUATTN_D4(i + 4)
#define CUATTN_D16(i) CUATTN_D8(i), CUATTN_D8(i + 8)
#define CUATTN_D32(i) CUATTN_D16(i), CUATTN_D16(i + 16)
#define CUATTN_D64(i) CUATTN_D32(i), CUATTN_D32(i + 32)
#define CUATTN_D128(i) CUATTN_D64(i), CUATTN_D64(i + 64)
#define CUATTN_ACC_0 "%0, %1, %2, %3, %4, %5, %6, %7"
#define CUATTN_ACC_1 "%8, %9, %10, %11, %12, %13, %14, %15"
#define CUATTN_ACC_2 "%16, %17, %18, %19, %20, %21, %22, %23"
#define CUATTN_ACC_3 "%24, %25, %26, %27, %28, %29, %30, %31"
#define CUATTN_ACC_4 "%32, %33, %34, %35, %36, %37, %38, %39"
#define CUATTN_ACC_5 "%40, %41, %42, %43, %44, %45, %46, %47"
#define CUATTN_ACC_6 "%48, %49, %50, %51, %52, %53, %54, %55"
#define CUATTN_ACC_7 "%56, %57, %58, %59, %60, %61, %62, %63"
#define CUATTN_ACC_8 "%64, %65, %66, %67, %68, %69, %70, %71"
#define CUATTN_ACC_9 "%72, %73, %74, %75, %76, %77, %78, %79"
#define CUATTN_ACC_10 "%80, %81, %82, %83, %84, %85, %86, %87"
#define CUATTN_ACC_11 "%88, %89, %90, %91, %92, %93, %94, %95"
#define CUATTN_ACC_12 "%96, %97, %98, %99, %100, %101, %102, %103"
#define CUATTN_ACC_13 "%104, %105, %106, %107, %108, %109, %110, %111"
#define CUATTN_ACC_14 "%112, %113, %114, %115, %116, %117, %118, %119"
#define CUATTN_ACC_15 "%120, %121, %122, %123, %124, %125, %126, %127"
#define CUATTN_ACC_0_3 CUATTN_ACC_0 ", " CUATTN_ACC_1 ", " CUATTN_ACC_2 ", " CUATTN_ACC_3
#define CUATTN_ACC_4_7 CUATTN_ACC_4 ", " CUATTN_ACC_5 ", " CUATTN_ACC_6 ", " CUATTN_ACC_7
#define CUATTN_ACC_8_11 CUATTN_ACC_8 ", " CUATTN_ACC_9 ", " CUATTN_ACC_10 ", " CUATTN_ACC_11
#define CUATTN_ACC_12_15 CUATTN_ACC_12 ", " CUATTN_ACC_13 ", " CUATTN_ACC_14 ", " CUATTN_ACC_15
#define CUATTN_REGS_8 "{" CUATTN_ACC_0 "}"
#define CUATTN_REGS_16 "{" CUATTN_ACC_0 ", " CUATTN_ACC_1 "}"
#define CUATTN_REGS_32 "{" CUATTN_ACC_0_3 "}"
#define CUATTN_REGS_64 "{" CUATTN_ACC_0_3 ", " CUATTN_ACC_4_7 "}"
#define CUATTN_REGS_128 \
  "{" CUATTN_ACC_0_3 ", " CUATTN_ACC_4_7 ", " CUATTN_ACC_8_11 ", " CUATTN_ACC_12_15 "}"
#define CUATTN_AFTER_8 "%8", "%9", "%10", "%11", "%12", "%13"
#define CUATTN_AFTER_16 "%16", "%17", "%18", "%19", "%20", "%21"
#define CUATTN_AFTER_32 "%32", "%33", "%34", "%35", "%36", "%37"
#define CUATTN_AFTER_64 "%64", "%65", "%66", "%67", "%68", "%69"
#define CUATTN_AFTER_128 "%128", "%129", "%130", "%131", "%132", "%133"
// The wgmma with scale-d from `accumulate` (0: D = A * B), imm-scale-a/b 1, A K-major and B
// K-major (imm-trans-b 0: the _K forms) or MN-major (1: the _MN forms); A from a descriptor (SS:
// operands desc_a, desc_b, accumulate) or from registers (RS: a[0..3], desc_b, accumulate; that
// form has no imm-trans-a).
#define CUATTN_WGMMA_ASM(SHAPE_TYPES, OPERANDS, ACCUMULATE, INPUTS, ...)                         \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " ACCUMULATE ", 0;\n"                          \
               "wgmma.mma_async.sync.aligned." SHAPE_TYPES " " OPERANDS ";\n}\n"               \
               : __VA_ARGS__                                                                     \
               : INPUTS)
#define CUATTN_WGMMA_SS(TRANS_A, TRANS_B, SHAPE_TYPES, REGS, N0, N1, N2, N3, N4, N5, ...)        \
  CUATTN_WGMMA_ASM(SHAPE_TYPES, REGS ", " N0 ", " N1 ", p, 1, 1, " TRANS_A ", " TRANS_B, N2,      \
                   CUATTN_SS_INPUTS, __VA_ARGS__)
#define CUATTN_WGMMA_RS(TRANS_B, SHAPE_TYPES, REGS, N0, N1, N2, N3, N4, N5, ...)                 \
  CUATTN_WGMMA_ASM(SHAPE_TYPES,                                                                  \
                   REGS ", {" N0 ", " N1 ", " N2 ", " N3 "}, " N4 ", p, 1, 1, " TRANS_B, N5,     \
                   CUATTN_RS_INPUTS, __VA_ARGS__)
#define CUATTN_WGMMA_SS_K(...) CUATTN_WGMMA_SS("0", "0", __VA_ARGS__)
#define CUATTN_WGMMA_SS_MN(...) CUATTN_WGMMA_SS("0", "1", __VA_ARGS__)
#define CUATTN_WGMMA_SS_A_MN_K(...) CUATTN_WGMMA_SS("1", "0", __VA_ARGS__)
#define CUATTN_WGMMA_SS_A_MN_MN(...) CUATTN_WGMMA_SS("1", "1", __VA_ARGS__)
#define CUATTN_WGMMA_RS_K(...) CUATTN_WGMMA_RS("0", __VA_ARGS__)
#define CUATTN_WGMMA_RS_MN(...) CUATTN_WGMMA_RS("1", __VA_ARGS__)
#define CUATTN_SS_INPUTS "l"(desc_a), "l"(desc_b), "r"(int(accumulate))
#define CUATTN_RS_INPUTS \
  "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate))
// FORM (CUATTN_WGMMA_SS_K, _SS_MN, _RS_K or _RS_MN) for N = N_TEXT, fp16 or bf16 by T: COUNT = N / 2 accumulators.
#define CUATTN_WGMMA_N(FORM, N_TEXT, REGS, AFTER, ACCUMULATORS)                                  \
  if constexpr (is_same_type<T, __half>::value) {                                                \
    FORM("m64n" N_TEXT "k16.f32.f16.f16", REGS, AFTER, ACCUMULATORS);                            \
  } else {                                                                                       \
    FORM("m64n" N_TEXT "k16.f32.bf16.bf16", REGS, AFTER, ACCUMULATORS);                          \
  }
// Every N of FORM.
#define CUATTN_WGMMA_ALL_N(FORM)                                                                 \
  if constexpr (N == 16) {                                                                       \
    CUATTN_WGMMA_N(FORM, "16", CUATTN_REGS_8, CUATTN_AFTER_8, CUATTN_D8(0))                      \
  } else if constexpr (N == 32) {                                                                \
    CUATTN_WGMMA_N(FORM, "32", CUATTN_REGS_16, CUATTN_AFTER_16, CUATTN_D16(0))                   \
  } else if constexpr (N == 64) {                                                                \
    CUATTN_WGMMA_N(FORM, "64", CUATTN_REGS_32, CUATTN_AFTER_32, CUATTN_D32(0))                   \
  } else if constexpr (N == 128) {                                                               \
    CUATTN_WGMMA_N(FORM, "128", CUATTN_REGS_64, CUATTN_AFTER_64, CUATTN_D64(0))                  \
  } else {                                                                                       \
    CUATTN_WGMMA_N(FORM, "256", CUATTN_REGS_128, CUATTN_AFTER_128, CUATTN_D128(0))               \
  }
#endif

// The shapes written out above.
template <typename T, int N>
constexpr bool WGMMA_SHAPE_OK =
    is_half_type<T>::value && (N == 16 || N == 32 || N == 64 || N == 128 || N == 256);

// d (the N / 2 accumulators of this thread) = A * B (+ d when `accumulate`): one
// wgmma.mma_async.m64nNk16.f32 of T (__half or __nv_bfloat16) operands, both from shared memory,
// A laid out A_MAJOR (K-major: 64 rows of K; MN-major, imm-trans-a = 1: K rows of 64, e.g. dS
// of dS K stored as dS^T's rows, which 16-bit types allow), B laid out B_MAJOR.
template <typename T, int N, WgmmaMajor B_MAJOR = WGMMA_K_MAJOR,
          WgmmaMajor A_MAJOR = WGMMA_K_MAJOR>
__device__ __forceinline__ void wgmma_m64k16(float (&d)[N / 2], u64 desc_a, u64 desc_b,
                                             bool accumulate) {
  static_assert(WGMMA_SHAPE_OK<T, N>, "fp16 or bf16 operands, N = 16, 32, 64, 128 or 256");
#ifdef CUATTN_INTERP
  cuattn_interp::wgmma_issue<T, N, B_MAJOR, A_MAJOR>(d, desc_a, desc_b, accumulate);
#else
  if constexpr (A_MAJOR == WGMMA_K_MAJOR && B_MAJOR == WGMMA_K_MAJOR) {
    CUATTN_WGMMA_ALL_N(CUATTN_WGMMA_SS_K)
  } else if constexpr (A_MAJOR == WGMMA_K_MAJOR) {
    CUATTN_WGMMA_ALL_N(CUATTN_WGMMA_SS_MN)
  } else if constexpr (B_MAJOR == WGMMA_K_MAJOR) {
    CUATTN_WGMMA_ALL_N(CUATTN_WGMMA_SS_A_MN_K)
  } else {
    CUATTN_WGMMA_ALL_N(CUATTN_WGMMA_SS_A_MN_MN)
  }
#endif
}

// The same with A from registers: `a` holds this thread's A fragment (the header's layout), and
// neither its registers nor the accumulators may be touched until the wgmma.wait_group that
// retires the instruction.
template <typename T, int N, WgmmaMajor B_MAJOR = WGMMA_K_MAJOR>
__device__ __forceinline__ void wgmma_m64k16_rs(float (&d)[N / 2],
                                                const u32 (&a)[WGMMA_A_REGISTERS], u64 desc_b,
                                                bool accumulate) {
  static_assert(WGMMA_SHAPE_OK<T, N>, "fp16 or bf16 operands, N = 16, 32, 64, 128 or 256");
#ifdef CUATTN_INTERP
  cuattn_interp::wgmma_issue_rs<T, N, B_MAJOR>(d, a, desc_b, accumulate);
#else
  if constexpr (B_MAJOR == WGMMA_K_MAJOR) {
    CUATTN_WGMMA_ALL_N(CUATTN_WGMMA_RS_K)
  } else {
    CUATTN_WGMMA_ALL_N(CUATTN_WGMMA_RS_MN)
  }
#endif
}
