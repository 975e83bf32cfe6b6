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
  cuattn_interp::mbarrier_arrive_only(bar);
#else
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(address),
               "r"(bytes)
               : "memory");
#endif
}

#ifndef CUATTN_INTERP
// One mbarrier.try_wait (BLOCKING: the hardware may suspend the thread for a while first) or
// mbarrier.test_wait (returns at once) on the phase with parity `parity`: whether it completed.
template <bool BLOCKING>
__device__ __forceinline__ bool mbarrier_poll_parity(u64* bar, unsigned parity) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  unsigned done;
#define CUATTN_MBARRIER_POLL(INSTRUCTION)                                                    \
  asm volatile("{\n.reg .pred p;\nmbarrier." INSTRUCTION ".parity.shared::cta.b64 p, [%1], %2;\n" \
               "selp.u32 %0, 1, 0, p;\n}\n"                                                   \
               : "=r"(done)                                                                  \
               : "r"(address), "r"(parity)                                                   \
               : "memory")
  if constexpr (BLOCKING) {
    CUATTN_MBARRIER_POLL("try_wait");
  } else {
    CUATTN_MBARRIER_POLL("test_wait");
  }
#undef CUATTN_MBARRIER_POLL
  return done != 0;
}
#endif

// Whether the phase with parity `parity` has completed, without blocking (mbarrier.test_wait:
// `parity` names the current phase or the one before it, so right after mbarrier.init parity 1
// reads as completed, which is what lets a producer's first wait on an empty stage pass).
__device__ __forceinline__ bool mbarrier_test_wait_parity(u64* bar, unsigned parity) {
#ifdef CUATTN_INTERP
  return cuattn_interp::mbarrier_phase_completed(bar, parity);
#else
  return mbarrier_poll_parity<false>(bar, parity);
#endif
}

// Blocks until the phase with parity `parity` has completed. mbarrier.try_wait is sm_90's; an
// sm_80 build polls with test_wait (kernels/attn_decode_gqa.cu runs on both).
__device__ __forceinline__ void mbarrier_wait_parity(u64* bar, unsigned parity) {
#ifdef CUATTN_INTERP
  cuattn_interp::mbarrier_wait_parity(bar, parity);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  while (!mbarrier_poll_parity<false>(bar, parity)) {
  }
#else
  while (!mbarrier_poll_parity<true>(bar, parity)) {
  }
#endif
}

// One arrival on `bar`'s current phase once every cp.async this thread issued before it has
// landed (cp.async.mbarrier.arrive.noinc, sm_80): the copies' completion, handed to the threads
// that wait on the barrier. .noinc: the arrival is one of the `count` given to mbarrier_init.
// Under the interpreter the copies land (zero-filled where cp_async_16 said invalid) when the
// phase completes, so a reader that skips the wait sees the poison of the issue.
__device__ __forceinline__ void cp_async_mbarrier_arrive_noinc(u64* bar) {
#ifdef CUATTN_INTERP
  cuattn_interp::cp_async_mbarrier_arrive(bar);
#else
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(bar));
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(address) : "memory");
#endif
}

// Clock cycles a bounded wait spins before it traps: about a second at Hopper's clocks, far
// beyond any phase a working kernel waits for.
constexpr long long MBARRIER_SPIN_LIMIT_CYCLES = 1LL << 31;

// mbarrier_wait_parity for code run on a GPU to find out whether it works (probes, tests): a
// phase that never completes traps (the launch fails with an error) instead of hanging the GPU.
// The interpreter reports such a wait itself, with the barrier and the parity, so it just waits.
__device__ __forceinline__ void mbarrier_wait_parity_or_trap(u64* bar, unsigned parity) {
#ifdef CUATTN_INTERP
  cuattn_interp::mbarrier_wait_parity(bar, parity);
#else
  const long long start = clock64();
  while (!mbarrier_poll_parity<true>(bar, parity)) {
    if (clock64() - start > MBARRIER_SPIN_LIMIT_CYCLES) __trap();
  }
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

// A ring of STAGES shared-memory stages that one producer thread fills with bulk copies and a
// fixed set of consumer threads reads (the PTX ISA's producer-consumer pattern). Item t of the
// stream goes to stage t % STAGES in round t / STAGES; full[s] completes a phase when the
// producer's arrival and the bytes it announced are in, empty[s] when every consumer thread has
// arrived. Waits are on parities, so no party may run a whole phase ahead: every consumer waits
// for item t's full phase before it arrives on its empty barrier, even for an item it does not
// read (arrivals only count: a consumer arriving for round r + 1 while another is still in round
// r would complete round r's phase without it). The ring lives in shared memory; thread 0 calls
// init, then a __syncthreads.
template <int STAGES>
struct StageRing {
  u64 full[STAGES];
  u64 empty[STAGES];

  __device__ __forceinline__ void init(int consumer_threads) {
    for (int s = 0; s < STAGES; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], consumer_threads);
    }
  }
  static __device__ __forceinline__ int stage(int t) { return t % STAGES; }
  static __device__ __forceinline__ unsigned parity(int t) { return unsigned(t / STAGES) & 1u; }

  // The producer: waits until item t's stage is free (round 0: the phase before the first
  // counts as complete), announces `bytes` for it and returns the barrier its copies complete.
  __device__ __forceinline__ u64* acquire(int t, unsigned bytes) {
    mbarrier_wait_parity(&empty[stage(t)], parity(t) ^ 1u);
    mbarrier_arrive_expect_tx(&full[stage(t)], bytes);
    return &full[stage(t)];
  }
  // A consumer: waits until item t has landed.
  __device__ __forceinline__ void wait(int t) { mbarrier_wait_parity(&full[stage(t)], parity(t)); }
  // A consumer: done with item t (every asynchronous read of it retired).
  __device__ __forceinline__ void release(int t) { mbarrier_arrive(&empty[stage(t)]); }
};
