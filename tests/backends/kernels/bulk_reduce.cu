// Test kernels for the dQ reduction primitives of kernels/attn_bwd_sm90.cu: the bulk reduce
// (kernels/common/tma.cuh) and the semaphores that order it across CTAs
// (kernels/common/semaphore.cuh), run through the CPU interpreter by
// tests/backends/test_interp_bulk_reduce.py and compiled for sm_90a with NVRTC. Each kernel has
// a mistake a GPU punishes by timing (a wrong sum, a hang) and the same kernel without it.
#include "common/semaphore.cuh"
#include "common/smem.cuh"
#include "common/tma.cuh"

constexpr int REDUCE_THREADS = 64;
constexpr int REDUCE_FLOATS = 256;  // the tile each CTA adds: 1 KB

// How test_ordered_reduce goes wrong.
enum ReduceBug {
  REDUCE_OK = 0,
  REDUCE_EARLY_REUSE = 1,      // the tile is overwritten before the reduce has read it
  REDUCE_EARLY_RELEASE = 2,    // the turn is handed on after wait_group.read only
  REDUCE_NO_FENCE = 3,         // no fence.proxy.async between the tile's stores and the reduce
  REDUCE_WRONG_ORDER = 4,      // work claimed w waits for turn claimed + 1 (a later CTA's)
  REDUCE_BLOCK_INDEX = 5,      // the item is the CTA's index, not claimed in start order
};

// Every CTA claims a work item w (counters[1]), fills its tile with values[w * REDUCE_FLOATS ..]
// and adds the tile into `sum` in the order of the items: it waits until the semaphore
// (counters[0]) holds w, reduces, waits for the reduce to complete and releases w + 1. `sum`
// is then the sum of the tiles in item order, bit for bit, whatever order the CTAs run in.
template <int BUG>
__global__ void test_ordered_reduce(const float* values, float* sum, int* counters, int items) {
  float* tile = dynamic_smem<float>();
  __shared__ int claimed;
  if (threadIdx.x == 0) claimed = claim_work(&counters[1]);
  __syncthreads();
  const int w = BUG == REDUCE_BLOCK_INDEX ? int(blockIdx.x) : claimed;
  for (int i = int(threadIdx.x); i < REDUCE_FLOATS; i += REDUCE_THREADS) {
    tile[i] = values[w * REDUCE_FLOATS + i];
  }
  if (BUG != REDUCE_NO_FENCE) fence_proxy_async();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int turn = BUG == REDUCE_WRONG_ORDER ? (w + 1) % items : w;
    semaphore_wait(&counters[0], turn);
    bulk_reduce_add_f32(sum, tile, unsigned(REDUCE_FLOATS * sizeof(float)));
    tma_store_commit();
    if (BUG == REDUCE_EARLY_REUSE) tile[0] = 0.0f;
    if (BUG == REDUCE_EARLY_RELEASE) {
      tma_store_wait_read<0>();
      semaphore_release(&counters[0]);
      bulk_wait_group_complete<0>();
    } else {
      bulk_wait_group_complete<0>();
      semaphore_release(&counters[0]);
    }
  }
}
