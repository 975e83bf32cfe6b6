// Warp specialisation (sm_90a): a warpgroup hands registers to the others with setmaxnreg, so
// a producer warpgroup that only issues TMA copies runs on few registers and the consumer
// warpgroups, which hold the wgmma accumulators, on many; named barriers let two warpgroups take
// turns without stopping the rest of the CTA. Each function is one instruction, like those of
// ptx.cuh.
//
// bar.sync id, threads / bar.arrive id, threads: named barrier `id` (1 to 15; 0 is
// __syncthreads') completes a phase when `threads` threads (a multiple of 32) have arrived;
// bar.sync waits for it, bar.arrive does not. Two warpgroups alternate with two of them: each
// waits on its own (bar.sync, 256) and lets the other go (bar.arrive on the other's, 256). Under
// the interpreter a named barrier is kept as an mbarrier is (cuda_shim.h): a wait that can never
// complete is reported with the barrier, and one phase arrived at with two counts is a hazard.
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

// Arrives on named barrier `id` of `threads` threads and waits for its phase to complete.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
#ifdef CUATTN_INTERP
  cuattn_interp::named_barrier_sync(id, threads);
#else
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
#endif
}

// Arrives on named barrier `id` of `threads` threads without waiting.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
#ifdef CUATTN_INTERP
  cuattn_interp::named_barrier_arrive(id, threads);
#else
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
#endif
}
