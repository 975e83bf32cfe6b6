// Warp specialisation (sm_90a): a warpgroup hands registers to the others with setmaxnreg, so
// a producer warpgroup that only issues TMA copies runs on few registers and the consumer
// warpgroups, which hold the wgmma accumulators, on many. Each function is one instruction,
// like those of ptx.cuh.
//
// setmaxnreg.{inc,dec}.sync.aligned.u32 N sets the registers per thread of the executing
// warpgroup to N (24 to 256, a multiple of 8); all its 128 threads execute the same one. A dec
// returns registers to the CTA's pool, an inc waits until the pool holds enough: requests the
// register file cannot cover hang the GPU. Under the CPU interpreter every request is recorded
// and checked when the block ends (kernels/interp/cuda_shim.h, check_block_end): each
// warpgroup's threads made the same requests, and the warpgroups' last requests fit in the
// register file (a warpgroup that made none keeps what the launch gave it).
#pragma once

#include "types.cuh"

constexpr int SETMAXNREG_MIN = 24;
constexpr int SETMAXNREG_MAX = 256;
constexpr int SETMAXNREG_GRAIN = 8;

#ifdef CUATTN_INTERP
namespace cuattn_interp {
inline void setmaxnreg(int registers) { self().register_requests.push_back(registers); }
}  // namespace cuattn_interp
#endif

// setmaxnreg.inc (INCREASE) or .dec: this warpgroup's registers per thread become REGISTERS.
template <bool INCREASE, int REGISTERS>
__device__ __forceinline__ void warpgroup_set_registers() {
  static_assert(REGISTERS >= SETMAXNREG_MIN && REGISTERS <= SETMAXNREG_MAX &&
                REGISTERS % SETMAXNREG_GRAIN == 0);
#ifdef CUATTN_INTERP
  cuattn_interp::setmaxnreg(REGISTERS);
#else
  if constexpr (INCREASE) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGISTERS));
  } else {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGISTERS));
  }
#endif
}

// Raises this warpgroup's registers per thread to REGISTERS (waits for the pool to hold them).
template <int REGISTERS>
__device__ __forceinline__ void warpgroup_registers_increase() {
  warpgroup_set_registers<true, REGISTERS>();
}

// Lowers this warpgroup's registers per thread to REGISTERS, returning the rest to the pool.
template <int REGISTERS>
__device__ __forceinline__ void warpgroup_registers_decrease() {
  warpgroup_set_registers<false, REGISTERS>();
}
