// Test kernels for the primitives of kernels/common/ (run through the CPU interpreter by
// tests/backends/test_interp_primitives.py and compared with NumPy). Each kernel moves data between
// global memory and the documented per-lane fragment layouts by plain indexing, so the PTX
// wrappers are checked against the PTX ISA's layouts, not against each other.
#include "common/mbarrier.cuh"
#include "common/smem.cuh"
#include "common/warp_gemm.cuh"

// d = a * b + c for one m16n8k16: a [16][16], b [16][8] (k-major), c and d [16][8].
template <typename T>
__global__ void test_mma(const T* a, const T* b, const float* c, float* d) {
  const int lane = int(threadIdx.x) % 32;
  const int g = lane / 4, t = lane % 4;
  u32 a_frag[4], b_frag[2];
  float c_frag[4], d_frag[4];
  for (int r = 0; r < 4; ++r) {
    const int row = g + 8 * (r % 2), col = 2 * t + 8 * (r / 2);
    a_frag[r] = u32(bits_of(a[row * 16 + col])) | (u32(bits_of(a[row * 16 + col + 1])) << 16);
  }
  for (int r = 0; r < 2; ++r) {
    const int row = 2 * t + 8 * r;
    b_frag[r] = u32(bits_of(b[row * 8 + g])) | (u32(bits_of(b[(row + 1) * 8 + g])) << 16);
  }
  for (int e = 0; e < 4; ++e) c_frag[e] = c[(g + 8 * (e / 2)) * 8 + 2 * t + e % 2];
  mma_m16n8k16<T>(d_frag, a_frag, b_frag, c_frag);
  for (int e = 0; e < 4; ++e) d[(g + 8 * (e / 2)) * 8 + 2 * t + e % 2] = d_frag[e];
}

// The four 8x8 quadrants of a 16x16 tile through ldmatrix .x4 (matrix m = rows 8*(m%2),
// columns 8*(m/2)); out[lane][m] is register m of that lane.
template <bool TRANS>
__global__ void test_ldmatrix(const __half* src, u32* out) {
  __shared__ __align__(16) __half tile[16 * 16];
  const int lane = int(threadIdx.x) % 32;
  for (int i = lane; i < 256; i += 32) tile[i] = src[i];
  __syncwarp();
  const int m = lane / 8, r = lane % 8;
  const __half* row = tile + ((m % 2) * 8 + r) * 16 + (m / 2) * 8;
  u32 regs[4];
  if constexpr (TRANS) {
    ldmatrix_x4_trans(regs, row);
  } else {
    ldmatrix_x4(regs, row);
  }
  for (int i = 0; i < 4; ++i) out[lane * 4 + i] = regs[i];
  __syncwarp();
}

constexpr int GEMM_N = 32;
constexpr int GEMM_K = 32;
enum GemmForm : int { FORM_RS_NK = 0, FORM_TS_KN = 1, FORM_REGS_KN = 2 };

// c [16][GEMM_N] = A * B for one warp. a: [16][K] (rs, regs) or [K][16] (ts);
// b: [N][K] (nk) or [K][N] (kn), all dense in global memory.
template <typename T, int FORM>
__global__ void test_warp_gemm(const T* a, const T* b, float* c) {
  constexpr int A_ROWS = FORM == FORM_TS_KN ? GEMM_K : 16;
  constexpr int A_COLS = FORM == FORM_TS_KN ? 16 : GEMM_K;
  constexpr int B_ROWS = FORM == FORM_RS_NK ? GEMM_N : GEMM_K;
  constexpr int B_COLS = FORM == FORM_RS_NK ? GEMM_K : GEMM_N;
  constexpr int LDA = SmemStride<T, A_COLS>::value;
  constexpr int LDB = SmemStride<T, B_COLS>::value;
  __shared__ __align__(16) T a_smem[A_ROWS * LDA];
  __shared__ __align__(16) T b_smem[B_ROWS * LDB];
  __shared__ __align__(16) float scratch[16 * (GEMM_K + 4)];
  const int lane = int(threadIdx.x) % 32;
  const int g = lane / 4, t = lane % 4;
  for (int i = lane; i < A_ROWS * A_COLS; i += 32) a_smem[(i / A_COLS) * LDA + i % A_COLS] = a[i];
  for (int i = lane; i < B_ROWS * B_COLS; i += 32) b_smem[(i / B_COLS) * LDB + i % B_COLS] = b[i];
  __syncwarp();
  float acc[GEMM_N / 8][4] = {};
  if constexpr (FORM == FORM_RS_NK) {
    warp_gemm_rs_nk<GEMM_N, GEMM_K>(acc, a_smem, LDA, b_smem, LDB);
  } else if constexpr (FORM == FORM_TS_KN) {
    warp_gemm_ts_kn<GEMM_N, GEMM_K>(acc, a_smem, LDA, b_smem, LDB);
  } else {
    float a_frag[GEMM_K / 8][4];
    for (int j = 0; j < GEMM_K / 8; ++j) {
      for (int e = 0; e < 4; ++e) {
        a_frag[j][e] = to_float(a[(g + 8 * (e / 2)) * GEMM_K + 8 * j + 2 * t + e % 2]);
      }
    }
    warp_gemm_regs_kn<GEMM_N, GEMM_K>(acc, a_frag, b_smem, LDB, scratch);
  }
  for (int j = 0; j < GEMM_N / 8; ++j) {
    for (int e = 0; e < 4; ++e) c[(g + 8 * (e / 2)) * GEMM_N + 8 * j + 2 * t + e % 2] = acc[j][e];
  }
  __syncwarp();
}

// out[lane][0..4] = value of lane ^ (1, 2, 4, 8, 16); out[lane][5] = value of lane 5;
// out[lane][6..7] = quad_max / quad_sum of the values.
__global__ void test_shuffle(const float* in, float* out) {
  const int lane = int(threadIdx.x) % 32;
  const int warp = int(threadIdx.x) / 32;
  const float value = in[warp * 32 + lane];
  float* row = out + (warp * 32 + lane) * 8;
  for (int i = 0; i < 5; ++i) row[i] = __shfl_xor_sync(0xffffffffu, value, 1 << i);
  row[5] = __shfl_sync(0xffffffffu, value, 5);
  row[6] = quad_max(value);
  row[7] = quad_sum(value);
}

// Per block: every thread adds its value into sums[blockIdx.x] atomically, and reads its
// neighbour's value through shared memory after a __syncthreads.
__global__ void test_block(const float* in, float* sums, float* neighbours) {
  __shared__ float values[256];
  const int tid = int(threadIdx.x);
  const int n = int(blockDim.x);
  const float value = in[blockIdx.x * n + tid];
  values[tid] = value;
  atomicAdd(sums + blockIdx.x, value);
  __syncthreads();
  neighbours[blockIdx.x * n + tid] = values[(tid + 1) % n];
}

// float -> T -> float round trip of n values.
template <typename T>
__global__ void test_convert(const float* in, T* out, float* back, int n) {
  for (int i = int(threadIdx.x); i < n; i += int(blockDim.x)) {
    out[i] = from_float<T>(in[i]);
    back[i] = to_float(out[i]);
  }
}

// A [16][32] float tile through load_tile_async; rows >= valid_rows come back as zeros.
__global__ void test_tile_load(const float* src, float* out, int valid_rows) {
  constexpr int LD = SmemStride<float, 32>::value;
  float* tile = dynamic_smem<float>();
  load_tile_async<16, 32, 64>(tile, LD, src, 32, valid_rows);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();
  for (int i = int(threadIdx.x); i < 16 * 32; i += 64) out[i] = tile[(i / 32) * LD + i % 32];
}

// Two [16][32] float tiles in two commit groups: the first is read after wait_group<1>, the
// second only after wait_group<0>.
__global__ void test_tile_load_groups(const float* src_a, const float* src_b, float* out_a,
                                      float* out_b) {
  constexpr int LD = SmemStride<float, 32>::value;
  float* tile_a = dynamic_smem<float>();
  float* tile_b = tile_a + 16 * LD;
  load_tile_async<16, 32, 64>(tile_a, LD, src_a, 32, 16);
  cp_async_commit();
  load_tile_async<16, 32, 64>(tile_b, LD, src_b, 32, 16);
  cp_async_commit();
  cp_async_wait_group<1>();
  __syncthreads();
  for (int i = int(threadIdx.x); i < 16 * 32; i += 64) out_a[i] = tile_a[(i / 32) * LD + i % 32];
  cp_async_wait_group<0>();
  __syncthreads();
  for (int i = int(threadIdx.x); i < 16 * 32; i += 64) out_b[i] = tile_b[(i / 32) * LD + i % 32];
}

// One [64][4] float tile reused for a second copy, as a pipelined kernel reuses its K buffer.
// Thread i copies row i (one 16-byte chunk) and reads row (i + 32) % 64, which the other warp
// copied. With BARRIER every read happens before any thread reissues the buffer; without it a
// warp may issue its second copy while the other warp still has to read the first.
template <bool BARRIER>
__global__ void test_buffer_reuse(const float* first, const float* second, float* out) {
  constexpr int ROWS = 64, COLS = 4;
  float* tile = dynamic_smem<float>();
  const int tid = int(threadIdx.x);
  load_tile_async<ROWS, COLS, ROWS>(tile, COLS, first, COLS, ROWS);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();
  const int row = (tid + 32) % ROWS;
  float seen[COLS];
  for (int c = 0; c < COLS; ++c) seen[c] = tile[row * COLS + c];
  if constexpr (BARRIER) __syncthreads();
  load_tile_async<ROWS, COLS, ROWS>(tile, COLS, second, COLS, ROWS);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();
  for (int c = 0; c < COLS; ++c) out[row * COLS + c] = seen[c];
}

// Each lane writes its value to shared memory and reads its neighbour's (lane + 1, within the
// warp); only __syncwarp between the two makes that read well defined.
template <bool SYNC>
__global__ void test_warp_neighbour(const float* in, float* out) {
  __shared__ float values[32];
  const int lane = int(threadIdx.x) % 32;
  values[lane] = in[lane];
  if constexpr (SYNC) __syncwarp();
  out[lane] = values[(lane + 1) % 32];
}

// The lower half of the warp shuffles, the upper half returns first: a warp collective that
// half the warp never reaches, which hangs a GPU.
__global__ void test_divergent_shuffle(const float* in, float* out) {
  const int lane = int(threadIdx.x) % 32;
  if (lane >= 16) return;
  out[lane] = __shfl_xor_sync(0x0000ffffu, in[lane], 1);
}

// Deep recursion through a large frame, to show that a lane's stack holds what a kernel's
// registers and local arrays need (and that the interpreter's lane stacks are separate).
__global__ void test_lane_stack(float* out) {
  float local[4096];
  const int lane = int(threadIdx.x);
  for (int i = 0; i < 4096; ++i) local[i] = float(lane + i);
  __syncthreads();
  float sum = 0.0f;
  for (int i = 0; i < 4096; ++i) sum += local[i];
  out[lane] = sum;
}

// A two-stage bulk-copy pipeline: lane 0 of warp 0 copies each stage's 64 floats into shared
// memory (one mbarrier per stage, one arrival, the stage's bytes announced); warp 1 waits for
// each stage and writes it out. BUG plants one of the mistakes the interpreter must catch.
enum PipelineBug {
  PIPE_OK = 0,
  PIPE_FEW_BYTES = 1,      // announces half the bytes: the copy overflows the phase
  PIPE_MANY_BYTES = 2,     // announces twice the bytes: the phase never completes
  PIPE_WRONG_PARITY = 3,   // waits for parity 1 first: returns at once, before the data
  PIPE_EXTRA_ARRIVAL = 4,  // arrives twice on a barrier that expects one arrival a phase
  PIPE_NO_INIT = 5,        // never initialises the barriers
};
constexpr int PIPE_STAGES = 2;
constexpr int PIPE_FLOATS = 64;
constexpr int PIPE_SMEM = PIPE_STAGES * (PIPE_FLOATS * 4 + 16);

template <int BUG>
__global__ void test_bulk_pipeline(const float* in, float* out) {
  constexpr unsigned BYTES = PIPE_FLOATS * sizeof(float);
  float* tiles = dynamic_smem<float>();
  u64* bars = reinterpret_cast<u64*>(tiles + PIPE_STAGES * PIPE_FLOATS);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (BUG != PIPE_NO_INIT && threadIdx.x == 0) {
    for (int s = 0; s < PIPE_STAGES; ++s) mbarrier_init(&bars[s], 1);
  }
  __syncthreads();
  if (warp == 0 && lane == 0) {
    for (int s = 0; s < PIPE_STAGES; ++s) {
      const unsigned announced =
          BUG == PIPE_FEW_BYTES ? BYTES / 2 : (BUG == PIPE_MANY_BYTES ? 2 * BYTES : BYTES);
      mbarrier_arrive_expect_tx(&bars[s], announced);
      if (BUG == PIPE_EXTRA_ARRIVAL) mbarrier_arrive(&bars[s]);
      bulk_copy_g2s(tiles + s * PIPE_FLOATS, in + s * PIPE_FLOATS, BYTES, &bars[s]);
    }
  }
  if (warp == 1) {
    for (int s = 0; s < PIPE_STAGES; ++s) {
      mbarrier_wait_parity(&bars[s], BUG == PIPE_WRONG_PARITY ? 1u : 0u);
      out[s * PIPE_FLOATS + lane] = tiles[s * PIPE_FLOATS + lane];
      out[s * PIPE_FLOATS + 32 + lane] = tiles[s * PIPE_FLOATS + 32 + lane];
    }
  }
}

// cp.async completion handed to another warp through an mbarrier (kernels/attn_decode_gqa.cu's
// producer): each lane of warp 0 copies 16 bytes (4 floats; odd lanes zero-filled, as for an
// evicted slot) and arrives by cp.async.mbarrier.arrive.noinc; warp 1 waits for the phase and
// writes the tile out. SKIP_WAIT: warp 1 reads at once.
constexpr int ASYNC_ARRIVE_FLOATS = 128;
constexpr int ASYNC_ARRIVE_SMEM = ASYNC_ARRIVE_FLOATS * 4 + 16;

template <bool SKIP_WAIT>
__global__ void test_cp_async_mbarrier(const float* in, float* out) {
  float* tile = dynamic_smem<float>();
  u64* bar = reinterpret_cast<u64*>(tile + ASYNC_ARRIVE_FLOATS);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (threadIdx.x == 0) mbarrier_init(bar, 32);
  __syncthreads();
  if (warp == 0) {
    cp_async_16(tile + 4 * lane, in + 4 * lane, lane % 2 == 0);
    cp_async_mbarrier_arrive_noinc(bar);
  } else {
    if (!SKIP_WAIT) mbarrier_wait_parity(bar, 0u);
    for (int i = lane; i < ASYNC_ARRIVE_FLOATS; i += 32) out[i] = tile[i];
  }
  __syncthreads();
}

// Each CTA of a (tiles, heads, batch) grid as attn_fwd_sm90 numbers it (cta_tile_longest_first):
// out[3 * s .. 3 * s + 2] = the tile, head and batch of the CTA that starts s-th (x fastest).
__global__ void test_cta_order(unsigned groups, int* out) {
  if (threadIdx.x != 0) return;
  const unsigned started = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const CtaTile cta = cta_tile_longest_first(groups);
  out[3 * started] = cta.tile;
  out[3 * started + 1] = cta.head;
  out[3 * started + 2] = cta.batch;
}
