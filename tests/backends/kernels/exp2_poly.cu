// Test kernel for kernels/common/exp2_poly.cuh (run through the CPU interpreter and built by
// NVRTC for sm_90a by tests/backends/test_attn_fwd_sm90_exp2.py): y[i] = exp2_poly<DEGREE>(x[i])
// for i < n, a grid-stride loop over the arguments (not unrolled: ptxas would count its trips with
// an integer division, whose F2I and MUFU.RCP hide the polynomial's own opcodes).
#include "common/exp2_poly.cuh"

template <int DEGREE>
__global__ void test_exp2_poly(const float* x, float* y, int n) {
#pragma unroll 1
  for (int i = int(blockIdx.x * blockDim.x + threadIdx.x); i < n;
       i += int(gridDim.x * blockDim.x)) {
    y[i] = exp2_poly<DEGREE>(x[i]);
  }
}
