// mbarrier and bulk copies (sm_90): the synchronisation of Hopper's asynchronous copies, each
// behind one small named device function like the instructions of ptx.cuh. Under the CPU
// interpreter each has a C++ version (kernels/interp/cuda_shim.h) that keeps the accounting a
// GPU hides and reports its misuse: a wait that can never complete (with the barrier, its
// phase and the parity waited for), an arrival past the phase, transaction bytes beyond those
// expected, a barrier used before mbarrier.init; a bulk copy's destination reads 0xFF (NaN)
// until its phase completes.
//
// A phase of a barrier initialised with `count` completes when `count` arrivals and every
// transaction byte announced with expect_tx (and delivered by bulk copies) are in; waiting for
// parity P returns once the phase with that parity has completed (the first phase has parity 0).
#pragma once

#include "types.cuh"

// Sets up the barrier (8 bytes of shared memory, 8-byte aligned) for `count` arrivals a phase.
// A fence and a __syncthreads must follow before other threads use it.
__device__ __forceinline__ void mbarrier_init(u64* bar, int count) {
#ifdef CUATTN_INTERP
  cuattn_interp::mbarrier_init(bar, count);
#else
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(address), "r"(count) : "memory");
#endif
}

// One arrival on the current phase.
__device__ __forceinline__ void mbarrier_arrive(u64* bar) {
#ifdef CUATTN_INTERP
  cuattn_interp::mbarrier_arrive(bar);
#else
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(address) : "memory");
#endif
}

// Announces `bytes` of bulk copies for the current phase, then arrives (the producer's call).
__device__ __forceinline__ void mbarrier_arrive_expect_tx(u64* bar, unsigned bytes) {
#ifdef CUATTN_INTERP
  cuattn_interp::mbarrier_expect_tx(bar, bytes);
  cuattn_interp::mbarrier_arrive(bar);
#else
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(address),
               "r"(bytes)
               : "memory");
#endif
}

// Blocks until the phase with parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait_parity(u64* bar, unsigned parity) {
#ifdef CUATTN_INTERP
  cuattn_interp::mbarrier_wait_parity(bar, parity);
#else
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(address),
      "r"(parity)
      : "memory");
#endif
}

// Copies `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory
// through the asynchronous proxy; the bytes complete the transaction count of `bar`'s phase.
__device__ __forceinline__ void bulk_copy_g2s(void* dst_smem, const void* src_gmem, unsigned bytes,
                                              u64* bar) {
#ifdef CUATTN_INTERP
  cuattn_interp::bulk_copy(dst_smem, src_gmem, bytes, bar);
#else
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(dst_smem));
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(dst),
      "l"(src_gmem), "r"(bytes), "r"(address)
      : "memory");
#endif
}
