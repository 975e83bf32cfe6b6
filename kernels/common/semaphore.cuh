// Semaphores in global memory that order work across CTAs (sm_90): a CTA waits until an int
// holds its turn, does its work, then hands the turn on by adding 1 with release semantics. What
// a deterministic reduction needs: the adds into one accumulator happen in one fixed order
// whatever order the CTAs run in (kernels/attn_bwd_sm90.cu's dQ).
//
// A wait can only complete if the CTAs it waits for make progress: a kernel must claim its work
// so that every CTA waits only for work claimed before its own (claim_work: an atomic counter),
// which CTAs already running hold. Under the CPU interpreter blocks run one after another, so a
// wait that an earlier block has not satisfied never completes: it is reported as a deadlock
// naming the semaphore, the value waited for and the value held (kernels/interp/cuda_shim.h),
// and a release while this thread's bulk reduces may still be writing is a launch hazard.
#pragma once

#include "types.cuh"

#ifdef CUATTN_INTERP
namespace cuattn_interp {
inline void semaphore_wait(const int* semaphore, int value) {
  ThreadState& me = self();
  me.waits_on_semaphore = semaphore;
  me.semaphore_value = value;
  if (!semaphore_reached(me)) suspend(LaneState::AT_SEMAPHORE);
  me.waits_on_semaphore = nullptr;
}

inline void semaphore_release(int* semaphore) {
  ThreadState& me = self();
  const bool reducing = std::any_of(me.bulk_ops.begin(), me.bulk_ops.end(),
                                    [](const BulkGroupOp& op) { return op.writes_global; });
  if (reducing || !me.bulk_writes_unconfirmed.empty()) {
    report_hazard("a semaphore released while this thread's bulk reduces may still be writing "
                  "global memory (no cp.async.bulk.wait_group without .read before the release)");
    return;
  }
  std::atomic_ref<int>(*semaphore).fetch_add(1, std::memory_order_release);
}
}  // namespace cuattn_interp
#endif

// Spins until *semaphore == value (an acquire load, so what the releasing CTA wrote before its
// release is visible), then orders the acquired view before this thread's later asynchronous-
// proxy accesses to global memory (a bulk reduce).
__device__ __forceinline__ void semaphore_wait(const int* semaphore, int value) {
#ifdef CUATTN_INTERP
  cuattn_interp::semaphore_wait(semaphore, value);
#else
  int held;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(held) : "l"(semaphore) : "memory");
  } while (held != value);
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
#endif
}

// Adds 1 to *semaphore with release semantics: every write of this thread before it (a bulk
// reduce retired by bulk_wait_group_complete included) is visible to the CTA that acquires it.
__device__ __forceinline__ void semaphore_release(int* semaphore) {
#ifdef CUATTN_INTERP
  cuattn_interp::semaphore_release(semaphore);
#else
  asm volatile("fence.acq_rel.gpu;\nred.relaxed.gpu.global.add.s32 [%0], 1;\n" ::"l"(semaphore)
               : "memory");
#endif
}

// The work item this CTA takes: the next value of the counter at `counter` (zeroed before the
// launch), in the order the CTAs start, so that work claimed earlier is held by a CTA already
// running (or done). Called by one thread; the caller shares the value with the CTA.
__device__ __forceinline__ int claim_work(int* counter) { return atomicAdd(counter, 1); }
