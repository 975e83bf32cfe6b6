// Test kernels for the Hopper primitives of kernels/common/tma.cuh and wgmma.cuh, run through
// the CPU interpreter by tests/backends/test_interp_hopper.py and compiled for sm_90a with
// NVRTC; scripts/hopper_probe.py runs the same kernels on a GPU. Each kernel moves raw bytes
// between global memory and what the primitive put in (or read from) shared memory, so the test
// compares them with the layouts the PTX ISA documents, not with the interpreter's own decoders.
// A hazard test has a kernel with the mistake and the same kernel without it. Every mbarrier
// wait is bounded, so a kernel that would hang a GPU traps there instead.
#include "common/smem.cuh"
#include "common/warpgroup.cuh"
#include "common/wgmma.cuh"

// Shared-memory layout of the TMA kernels: the mbarrier first, the tile at TILE_OFFSET (the
// largest swizzle repeat, so that every mode is aligned there) or wherever the test moves it.
constexpr int TILE_OFFSET = 1024;
constexpr int THREADS = 64;

// One TMA load of the box at (x, y) into shared memory at `tile_offset`, announced as
// `announced` bytes (before the copy is issued, or after it with COPY_FIRST, as the CUDA
// programming guide's examples do); every thread then waits for the phase (unless WAIT is
// false: the read then sees what the destination holds at issue) and `out` receives the tile's
// raw bytes.
template <bool WAIT, bool COPY_FIRST>
__global__ void test_tma_load(const __grid_constant__ TensorMap map, int x, int y,
                              int tile_offset, int announced, unsigned char* out, int bytes) {
  unsigned char* smem = dynamic_smem<unsigned char>();
  u64* bar = reinterpret_cast<u64*>(smem);
  if (threadIdx.x == 0) mbarrier_init(bar, 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    if (!COPY_FIRST) mbarrier_arrive_expect_tx(bar, unsigned(announced));
    tma_load_2d(smem + tile_offset, map, x, y, bar);
    if (COPY_FIRST) mbarrier_arrive_expect_tx(bar, unsigned(announced));
  }
  if (WAIT) mbarrier_wait_parity_or_trap(bar, 0);
  for (int i = int(threadIdx.x); i < bytes; i += THREADS) out[i] = smem[tile_offset + i];
  if (!WAIT) mbarrier_wait_parity_or_trap(bar, 0);
}

// One TMA load of the box at (x, y, z, w) of a rank-4 map (the forward's [batch, heads, rows,
// columns] operands), like test_tma_load; with WRONG_RANK issued as a 2-D load (x, y) instead.
template <bool WRONG_RANK>
__global__ void test_tma_load_4d(const __grid_constant__ TensorMap map, int x, int y, int z,
                                 int w, unsigned char* out, int bytes) {
  unsigned char* smem = dynamic_smem<unsigned char>();
  u64* bar = reinterpret_cast<u64*>(smem);
  if (threadIdx.x == 0) mbarrier_init(bar, 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_tx(bar, unsigned(bytes));
    if (WRONG_RANK) {
      tma_load_2d(smem + TILE_OFFSET, map, x, y, bar);
    } else {
      tma_load_4d(smem + TILE_OFFSET, map, x, y, z, w, bar);
    }
  }
  mbarrier_wait_parity_or_trap(bar, 0);
  for (int i = int(threadIdx.x); i < bytes; i += THREADS) out[i] = smem[TILE_OFFSET + i];
}

// How test_setmaxnreg goes wrong.
enum RegisterBug {
  REG_OK = 0,
  REG_TOO_MANY = 1,  // the producer keeps 40: 128 x (40 + 240 + 240) > 65536
  REG_UNALIGNED = 2, // one warp of the first consumer asks for 232 instead of 240
};
constexpr int SETMAXNREG_THREADS = 384;  // a producer warpgroup and two consumers, as the forward

// The forward's register hand-over alone: warpgroup 0 gives up registers, 1 and 2 take them;
// out[thread] = thread after it.
template <int BUG>
__global__ void __launch_bounds__(SETMAXNREG_THREADS, 1) test_setmaxnreg(int* out) {
  const int warpgroup = int(threadIdx.x) / 128;
  if (warpgroup == 0) {
    if (BUG == REG_TOO_MANY) {
      warpgroup_registers_decrease<40>();
    } else {
      warpgroup_registers_decrease<24>();
    }
  } else if (BUG == REG_UNALIGNED && threadIdx.x / 32 == 4) {
    warpgroup_registers_increase<232>();
  } else {
    warpgroup_registers_increase<240>();
  }
  out[threadIdx.x] = int(threadIdx.x);
}

// How test_tma_round_trip goes wrong.
enum RoundTripBug {
  TRIP_OK = 0,
  TRIP_NO_WAIT_READ = 1,  // the store's group is never retired before the block ends
  TRIP_EARLY_REUSE = 2,   // the tile is overwritten while the store still reads it
  TRIP_NO_FENCE = 3,      // no fence.proxy.async between the doubling and the store
};

// A float tile through shared memory and back: a TMA load of the box at (x, y) of `in` (both
// maps have boxes of TRIP_BOX elements), every thread doubling its share of the elements in
// place (plain stores, then a proxy fence), a TMA store to the box at (x, y) of `out`.
constexpr int TRIP_BOX = 32 * 8;

template <int BUG>
__global__ void test_tma_round_trip(const __grid_constant__ TensorMap in,
                                    const __grid_constant__ TensorMap out, int x, int y) {
  unsigned char* smem = dynamic_smem<unsigned char>();
  u64* bar = reinterpret_cast<u64*>(smem);
  float* tile = reinterpret_cast<float*>(smem + TILE_OFFSET);
  if (threadIdx.x == 0) mbarrier_init(bar, 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_tx(bar, unsigned(TRIP_BOX * sizeof(float)));
    tma_load_2d(tile, in, x, y, bar);
  }
  mbarrier_wait_parity_or_trap(bar, 0);
  for (int i = int(threadIdx.x); i < TRIP_BOX; i += THREADS) tile[i] *= 2.0f;
  if (BUG != TRIP_NO_FENCE) fence_proxy_async();
  __syncthreads();
  if (threadIdx.x == 0) {
    tma_store_2d(out, x, y, tile);
    tma_store_commit();
    if (BUG != TRIP_NO_WAIT_READ && BUG != TRIP_EARLY_REUSE) tma_store_wait_read<0>();
  }
  if (BUG == TRIP_EARLY_REUSE) {
    __syncthreads();
    for (int i = int(threadIdx.x); i < TRIP_BOX; i += THREADS) tile[i] = 0.0f;
    __syncthreads();
    if (threadIdx.x == 0) tma_store_wait_read<0>();
  }
}

// The mbarrier pipeline of the Hopper forward in small: thread 0 streams PIPE_CHUNKS chunks of
// `in` through PIPE_STAGES shared-memory stages with bulk copies, each stage behind a full
// barrier (one arrival and the copy's bytes) and an empty barrier (one arrival per consumer
// thread); the other PIPE_CONSUMERS threads copy each chunk to `out`. observed[0..1] are
// mbarrier.test_wait on full[0] for parity 0 and 1 right after init, observed[2..3] the same
// after the last chunk. With DEADLOCK the producer announces a byte more than it copies, so the
// first full phase never completes: the bounded waits trap on a GPU. With EARLY_RELEASE each
// consumer arrives on the empty barrier before it reads the stage, which the producer may then
// refill under it. SKIP > 0: the second consumer warp reads no odd chunk (the first copies
// every byte of every chunk) and arrives for it all the same, after waiting for it (SKIP_WAITS)
// or without (SKIP_RUNS_AHEAD: it may then arrive twice on a stage's empty barrier while the
// first warp still reads it, completing that phase without it).
enum PipelineSkip { SKIP_NONE = 0, SKIP_WAITS = 1, SKIP_RUNS_AHEAD = 2 };
constexpr int PIPE_STAGES = 2;
constexpr int PIPE_CHUNKS = 6;
constexpr int PIPE_CHUNK_BYTES = 1024;
constexpr int PIPE_PRODUCER_THREADS = 32;  // a whole warp, of which thread 0 issues the copies
constexpr int PIPE_CONSUMERS = 64;
constexpr int PIPE_STAGE_OFFSET = 128;  // after the barriers, aligned for bulk copies

template <bool DEADLOCK, bool EARLY_RELEASE = false, int SKIP = SKIP_NONE>
__global__ void test_mbarrier_pipeline(const unsigned char* in, unsigned char* out,
                                       unsigned* observed) {
  unsigned char* smem = dynamic_smem<unsigned char>();
  u64* full = reinterpret_cast<u64*>(smem);
  u64* empty = full + PIPE_STAGES;
  const int tid = int(threadIdx.x);
  if (tid == 0) {
    for (int s = 0; s < PIPE_STAGES; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], PIPE_CONSUMERS);
    }
    observed[0] = mbarrier_test_wait_parity(&full[0], 0);
    observed[1] = mbarrier_test_wait_parity(&full[0], 1);
  }
  __syncthreads();
  for (int c = 0; c < PIPE_CHUNKS; ++c) {
    const int s = c % PIPE_STAGES;
    const unsigned round = unsigned(c / PIPE_STAGES);
    unsigned char* stage = smem + PIPE_STAGE_OFFSET + s * PIPE_CHUNK_BYTES;
    if (tid == 0) {
      // round 0 waits for the phase before the first, complete from the start
      mbarrier_wait_parity_or_trap(&empty[s], (round & 1) ^ 1);
      mbarrier_arrive_expect_tx(&full[s], unsigned(PIPE_CHUNK_BYTES + (DEADLOCK ? 1 : 0)));
      bulk_copy_g2s(stage, in + c * PIPE_CHUNK_BYTES, PIPE_CHUNK_BYTES, &full[s]);
    } else if (tid >= PIPE_PRODUCER_THREADS) {
      const bool skips = SKIP != SKIP_NONE && tid >= PIPE_PRODUCER_THREADS + 32 && c % 2 == 1;
      if (skips) {
        if (SKIP == SKIP_WAITS) mbarrier_wait_parity_or_trap(&full[s], round & 1);
        mbarrier_arrive(&empty[s]);
        continue;
      }
      mbarrier_wait_parity_or_trap(&full[s], round & 1);
      if (EARLY_RELEASE) mbarrier_arrive(&empty[s]);
      // (with SKIP the first consumer warp copies the whole chunk)
      const int first = tid - PIPE_PRODUCER_THREADS;
      const int step = SKIP != SKIP_NONE ? 32 : PIPE_CONSUMERS;
      if (SKIP == SKIP_NONE || first < 32) {
        for (int i = first; i < PIPE_CHUNK_BYTES; i += step) {
          out[c * PIPE_CHUNK_BYTES + i] = stage[i];
        }
      }
      if (!EARLY_RELEASE) mbarrier_arrive(&empty[s]);
    }
  }
  __syncthreads();
  if (tid == 0) {
    observed[2] = mbarrier_test_wait_parity(&full[0], 0);
    observed[3] = mbarrier_test_wait_parity(&full[0], 1);
  }
}

// out[0] = the descriptor of the operand at shared-memory offset `offset`.
__global__ void test_wgmma_descriptor(int offset, int leading, int stride, int swizzle, u64* out) {
  if (threadIdx.x == 0) {
    out[0] = wgmma_descriptor(dynamic_smem<unsigned char>() + offset, unsigned(leading),
                              unsigned(stride), WgmmaSwizzle(swizzle));
  }
}

// How test_wgmma goes wrong.
enum WgmmaBug {
  MMA_OK = 0,
  MMA_NO_PROXY_FENCE = 1,   // the operands' plain stores have no fence.proxy.async after them
  MMA_NO_WGMMA_FENCE = 2,   // no wgmma.fence before the first wgmma.mma_async
  MMA_EARLY_READ = 3,       // the accumulators are read before wgmma.wait_group
  MMA_TOUCHED = 4,          // an accumulator is written before wgmma.wait_group
  MMA_OPERAND_CHANGED = 5,  // B's shared memory is overwritten before wgmma.wait_group
  MMA_PARTIAL = 6,          // the warpgroup's last warp does not issue the wgmma.mma_async
  MMA_A_CHANGED = 7,        // (A from registers) an A register is written before wait_group
};
constexpr int WARPGROUP = 128;

// D = A * B for one warpgroup. `image` is the shared memory the test built: B (N rows of K) at
// b_offset and, unless A_IN_REGISTERS, A (64 rows of K) at a_offset, in a K-major canonical
// layout of the PTX ISA; with A_IN_REGISTERS `a_fragments[step][thread][register]` holds each
// thread's A fragment. STEPS wgmma.mma_async of K = 16 each, chained on the same accumulators,
// the descriptors' start addresses `step_bytes` further each time (a compile-time count: a loop
// ptxas cannot unroll makes it inject waits between the instructions); out[thread][i] =
// accumulator i.
// The test kernels' operands: `image` copied into shared memory (plain stores, so a proxy fence
// follows unless PROXY_FENCE is false) and, with A_IN_REGISTERS, each thread's A registers.
template <int STEPS, bool A_IN_REGISTERS>
__device__ __forceinline__ void stage_operands(const unsigned char* image, int image_bytes,
                                               const u32* a_fragments, bool proxy_fence,
                                               u32 (&a)[STEPS][WGMMA_A_REGISTERS]) {
  unsigned char* smem = dynamic_smem<unsigned char>();
  const int tid = int(threadIdx.x);
  for (int i = tid; i < image_bytes; i += WARPGROUP) smem[i] = image[i];
  if (proxy_fence) fence_proxy_async();
  __syncthreads();
  if constexpr (A_IN_REGISTERS) {
    for (int s = 0; s < STEPS; ++s) {
      for (int r = 0; r < WGMMA_A_REGISTERS; ++r) {
        a[s][r] = a_fragments[(s * WARPGROUP + tid) * WGMMA_A_REGISTERS + r];
      }
    }
  }
}

template <typename T, int N, int STEPS, int BUG, bool A_IN_REGISTERS>
__global__ void test_wgmma(const unsigned char* image, int image_bytes, int a_offset,
                           int b_offset, int leading, int stride, int swizzle, int step_bytes,
                           const u32* a_fragments, float* out) {
  unsigned char* smem = dynamic_smem<unsigned char>();
  const int tid = int(threadIdx.x);
  u32 a[STEPS][WGMMA_A_REGISTERS];
  stage_operands<STEPS, A_IN_REGISTERS>(image, image_bytes, a_fragments,
                                        BUG != MMA_NO_PROXY_FENCE, a);
  float d[N / 2];
  wgmma_fence_operands(d);
  if (BUG != MMA_NO_WGMMA_FENCE) wgmma_fence();
  if (BUG != MMA_PARTIAL || tid / 32 != WARPGROUP_WARPS - 1) {
#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      const WgmmaSwizzle mode = WgmmaSwizzle(swizzle);
      const u64 desc_b = wgmma_descriptor(smem + b_offset + s * step_bytes, unsigned(leading),
                                          unsigned(stride), mode);
      if constexpr (A_IN_REGISTERS) {
        wgmma_m64k16_rs<T, N>(d, a[s], desc_b, s > 0);
      } else {
        const u64 desc_a = wgmma_descriptor(smem + a_offset + s * step_bytes, unsigned(leading),
                                            unsigned(stride), mode);
        wgmma_m64k16<T, N>(d, desc_a, desc_b, s > 0);
      }
    }
  }
  wgmma_commit_group();
  if (BUG == MMA_TOUCHED) d[0] = 0.0f;
  if constexpr (A_IN_REGISTERS && BUG == MMA_A_CHANGED) a[0][0] ^= 1u;
  if (BUG == MMA_EARLY_READ) {
    for (int i = 0; i < N / 2; ++i) out[tid * (N / 2) + i] = d[i];
  }
  if (BUG == MMA_OPERAND_CHANGED) {
    __syncthreads();
    for (int i = tid; i < image_bytes - b_offset; i += WARPGROUP) smem[b_offset + i] ^= 1;
    __syncthreads();
  }
  wgmma_wait_group<0>();
  wgmma_fence_operands(d);
  if (BUG != MMA_EARLY_READ) {
    for (int i = 0; i < N / 2; ++i) out[tid * (N / 2) + i] = d[i];
  }
}

// D = A * B for one warpgroup with B MN-major (imm-trans-b = 1: K rows of N, the way P.V reads V
// as stored), A K-major from shared memory or from registers as in test_wgmma, or with A_MN_MAJOR
// A MN-major from shared memory too (imm-trans-a = 1: K rows of 64, the way dS K reads dS^T as
// stored); `image` holds A at a_offset (unless A_IN_REGISTERS) and B at b_offset in the
// canonical layouts of `swizzle`. STEPS chained instructions of K = 16, the descriptors advancing
// a_step_bytes (A) and b_step_bytes (B: two groups of 8 K rows) each time; out[thread][i] =
// accumulator i.
template <typename T, int N, int STEPS, bool A_IN_REGISTERS, bool A_MN_MAJOR = false>
__global__ void test_wgmma_mn_major(const unsigned char* image, int image_bytes, int a_offset,
                                    int b_offset, int a_leading, int a_stride, int b_leading,
                                    int b_stride, int swizzle, int a_step_bytes,
                                    int b_step_bytes, const u32* a_fragments, float* out) {
  unsigned char* smem = dynamic_smem<unsigned char>();
  const int tid = int(threadIdx.x);
  u32 a[STEPS][WGMMA_A_REGISTERS];
  stage_operands<STEPS, A_IN_REGISTERS>(image, image_bytes, a_fragments, true, a);
  float d[N / 2];
  wgmma_fence_operands(d);
  wgmma_fence();
  const WgmmaSwizzle mode = WgmmaSwizzle(swizzle);
#pragma unroll
  for (int s = 0; s < STEPS; ++s) {
    const u64 desc_b = wgmma_descriptor(smem + b_offset + s * b_step_bytes, unsigned(b_leading),
                                        unsigned(b_stride), mode);
    if constexpr (A_IN_REGISTERS) {
      wgmma_m64k16_rs<T, N, WGMMA_MN_MAJOR>(d, a[s], desc_b, s > 0);
    } else {
      const u64 desc_a = wgmma_descriptor(smem + a_offset + s * a_step_bytes, unsigned(a_leading),
                                          unsigned(a_stride), mode);
      if constexpr (A_MN_MAJOR) {
        wgmma_m64k16<T, N, WGMMA_MN_MAJOR, WGMMA_MN_MAJOR>(d, desc_a, desc_b, s > 0);
      } else {
        wgmma_m64k16<T, N, WGMMA_MN_MAJOR>(d, desc_a, desc_b, s > 0);
      }
    }
  }
  wgmma_commit_group();
  wgmma_wait_group<0>();
  wgmma_fence_operands(d);
  for (int i = 0; i < N / 2; ++i) out[tid * (N / 2) + i] = d[i];
}

// How test_named_barrier_turns goes wrong.
enum TurnBug {
  TURNS_OK = 0,
  TURNS_NO_OPENING = 1,   // the second warpgroup never opens: the first waits forever
  TURNS_WRONG_COUNT = 2,  // the second warpgroup arrives for 128 threads, the first waits for 256
};
constexpr int TURN_ROUNDS = 4;
constexpr int TURN_THREADS = 256;  // two warpgroups, as the forward's consumers

// Two warpgroups take turns on named barriers 1 and 2 as the forward's consumers do: in each
// of TURN_ROUNDS rounds warpgroup w waits for its turn, its first thread appends w to `log`, and
// it passes the turn; the second opens, the first closes. log[0 .. 2 TURN_ROUNDS) = 0, 1, 0, ...
template <int BUG>
__global__ void test_named_barrier_turns(int* log) {
  __shared__ int written;
  const int warpgroup = int(threadIdx.x) / 128;
  if (threadIdx.x == 0) written = 0;
  __syncthreads();
  const int mine = 1 + warpgroup, theirs = 2 - warpgroup;
  const int opening = BUG == TURNS_WRONG_COUNT ? 128 : TURN_THREADS;
  if (warpgroup == 1 && BUG != TURNS_NO_OPENING) named_barrier_arrive(1, opening);
  for (int round = 0; round < TURN_ROUNDS; ++round) {
    named_barrier_sync(mine, TURN_THREADS);
    if (threadIdx.x % 128 == 0) log[written++] = warpgroup;
    named_barrier_arrive(theirs, TURN_THREADS);
  }
  if (warpgroup == 0) named_barrier_sync(mine, TURN_THREADS);
}
