// CPU shim that makes kernels/*.cu valid C++20 under g++ (the cuattn kernel interpreter).
//
// Execution model (docs/design.md §5):
//   * every CUDA thread of a block is a fiber (its own stack, switched in user space) and one host
//     thread runs them all: a lane runs until it reaches a warp-collective operation, a barrier
//     or its end, then hands control back to the scheduler below, so no lane ever needs a kernel
//     futex or a host context switch (with a host thread per CUDA thread, half of the
//     interpreter's time went to the operating system's scheduler);
//   * blocks run one after another, so `__shared__` (a function-local static here) is valid for
//     one block at a time and shared by exactly that block's threads;
//   * warps take turns: between two __syncthreads exactly one warp runs, in an order shuffled
//     at every barrier (seeded by CUATTN_INTERP_SEED, default 0, so a run is reproducible). A
//     read of shared memory another warp writes without a barrier in between therefore sees
//     the wrong data in some order, every time that order comes up, instead of by timing luck;
//   * inside a warp, lanes run one after another between two warp-collective operations, in
//     ascending and then descending order, so a lane that reads what another lane of its warp
//     writes without __syncwarp sees the old data in one of the two directions;
//   * warp-collective operations (shuffles, votes, __syncwarp, and the CPU versions of mma and
//     ldmatrix in kernels/common) exchange registers through a per-warp scratch area: every lane
//     publishes, waits until the whole warp has, then reads;
//   * a lane that waits at a warp-collective operation that another lane of its warp never
//     reaches fails the launch (LAUNCH_DEADLOCK) instead of hanging;
//   * atomicAdd is std::atomic_ref.
// Dynamic shared memory is filled with 0xFF (a NaN pattern) before every block, so a kernel that
// reads shared memory it never wrote produces NaN in the tests instead of passing by luck.
// Addresses a GPU would fault on (a cp.async or ldmatrix address that is not 16-byte aligned, a
// paired store that is not aligned to its size) are recorded and fail the launch
// (LAUNCH_MISALIGNED) instead of running as they would on a CPU.
//
// Usage: #include this header (with CUATTN_INTERP defined) before a kernel .cu file, then export
// a launch entry with CUATTN_INTERP_ENTRY(symbol, kernel_name_expression) — see cuattn/backends/interp.py.
#pragma once

#ifndef CUATTN_INTERP
#define CUATTN_INTERP 1
#endif

#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) && !defined(CUATTN_INTERP_UCONTEXT)
#define CUATTN_INTERP_SWITCH_ASM 1
#else
#include <ucontext.h>
#endif

#include "half_types.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define __grid_constant__

struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

struct alignas(8) float2 {
  float x, y;
};
inline float2 make_float2(float x, float y) { return float2{x, y}; }

// One host thread runs a whole launch (launches are serialised), so these are plain globals that
// the scheduler sets before it resumes a lane.
inline uint3 threadIdx;
inline uint3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

#ifdef CUATTN_INTERP_SWITCH_ASM
// cuattn_interp_switch(save, load): pushes the callee-saved registers (System V x86-64) on the
// running stack, stores its stack pointer in *save, loads `load` and pops the registers of the
// context saved there. Everything else a C++ caller may keep across a call lives on its stack.
asm(R"(
  .text
  .weak cuattn_interp_switch
  .hidden cuattn_interp_switch
  .type cuattn_interp_switch, @function
cuattn_interp_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cuattn_interp_switch, .-cuattn_interp_switch
)");
extern "C" __attribute__((visibility("hidden"))) void cuattn_interp_switch(void** save, void* load);
#endif

namespace cuattn_interp {

constexpr int WARP_SIZE = 32;
// 32-bit words each lane may publish in one warp exchange (mma publishes 6: A and B fragments).
constexpr int EXCHANGE_WORDS = 8;
// Address space reserved per lane stack; only the pages a kernel touches are ever committed.
constexpr size_t LANE_STACK_BYTES = size_t(1) << 20;
// An inaccessible page below every stack, so an overflow faults instead of corrupting a neighbour.
constexpr size_t STACK_GUARD_BYTES = 4096;
// Alignment of the dynamic shared memory: the largest a kernel may rely on (the repeat of the
// 128-byte swizzle pattern, kernels/common/tma.cuh), so the swizzle of an address computed from
// its bits matches the GPU's for any offset into the buffer.
constexpr size_t SMEM_ALIGNMENT = 1024;

// A suspended execution context: a lane's, or the scheduler's while a lane runs.
struct Context {
#ifdef CUATTN_INTERP_SWITCH_ASM
  void* sp = nullptr;
#else
  ucontext_t context;
#endif
};

inline void switch_context(Context& save, Context& load) {
#ifdef CUATTN_INTERP_SWITCH_ASM
  cuattn_interp_switch(&save.sp, load.sp);
#else
  swapcontext(&save.context, &load.context);
#endif
}

// Prepares `context` to start `entry` (which never returns) on the stack [stack, stack + bytes).
inline void start_context(Context& context, unsigned char* stack, size_t bytes, void (*entry)()) {
#ifdef CUATTN_INTERP_SWITCH_ASM
  // The frame cuattn_interp_switch pops: six zeroed registers, then `entry` as the return
  // address, then an empty slot where entry finds its own return address; the stack pointer
  // ends 8 bytes below a 16-byte boundary, as at any function's first instruction.
  auto* top = reinterpret_cast<uintptr_t*>(reinterpret_cast<uintptr_t>(stack + bytes) & ~uintptr_t(15));
  uintptr_t* sp = top - 8;
  std::fill(sp, top, uintptr_t(0));
  sp[6] = reinterpret_cast<uintptr_t>(entry);
  context.sp = sp;
#else
  getcontext(&context.context);
  context.context.uc_stack.ss_sp = stack;
  context.context.uc_stack.ss_size = bytes;
  context.context.uc_link = nullptr;
  makecontext(&context.context, entry, 0);
#endif
}

// A cp.async copy issued but not yet landed (kernels/common/ptx.cuh).
struct PendingCopy {
  void* dst;
  const void* src;
  bool valid;
  int group;  // index of the commit group, -1 while not committed yet
};

// An asynchronous-proxy operation of one thread tracked by bulk async-groups (a TMA store,
// kernels/common/tma.cuh): `finish` runs when cp.async.bulk.wait_group retires its group.
struct BulkGroupOp {
  int group;  // index of the commit group, -1 while not committed yet
  std::function<void()> finish;
  // A bulk reduce into global memory: its writes are complete only after a
  // cp.async.bulk.wait_group without .read retires its group (kernels/common/tma.cuh).
  bool writes_global = false;
};

// A wgmma.mma_async of one thread (kernels/common/wgmma.cuh), computed at issue: its
// accumulators hold NaN until wgmma.wait_group retires its group and writes `result`; `check`
// reports operand shared memory that changed in between.
struct WgmmaOp {
  int group;  // index of the commit group, -1 while not committed yet
  float* d;
  std::vector<float> result;
  std::function<void()> check;
};

enum class LaneState : unsigned char {
  READY,            // may run
  AT_WARP_BARRIER,  // published its part of a warp exchange (or reached __syncwarp)
  AT_BLOCK_BARRIER, // reached __syncthreads
  AT_MBARRIER,      // waits for a phase of an mbarrier to complete (ThreadState::waits_on)
  AT_SEMAPHORE,     // waits for a global int to hold a value (ThreadState::waits_on_semaphore)
  YIELDED,          // arrived on an mbarrier: the other warps run before it goes on
  EXITED,
};

// An mbarrier (PTX ISA, "Parallel Synchronization and Communication Instructions: mbarrier"):
// the 8 bytes the kernel reserves in shared memory stand for it; its state lives here, keyed by
// their address, so that the accounting a GPU keeps hidden can be checked. A phase completes
// when its pending arrivals and its pending transaction bytes both reach zero; then the phase
// (and its parity) advances and the arrival count is re-armed.
struct MBarrier {
  int expected = 0;     // arrivals per phase (mbarrier.init's count)
  int pending = 0;      // arrivals still missing in the current phase
  long long tx = 0;     // transaction bytes expected and not yet completed in this phase
  unsigned phase = 0;   // completed phases; a wait for parity P returns once phase % 2 != P
};

// Registers exchanged inside one warp. Two buffers alternate: a lane overwrites buffer p only at
// exchange n+2, after every lane has passed exchange n+1, i.e. after every lane has finished
// reading exchange n.
struct WarpState {
  alignas(64) uint32_t words[2][WARP_SIZE][EXCHANGE_WORDS];
};

// One CUDA thread.
struct ThreadState {
  Context context;
  uint3 thread_idx;
  WarpState* warp = nullptr;
  int warp_index = 0;
  int lane = 0;
  int parity = 0;
  LaneState state = LaneState::READY;
  const void* waits_on = nullptr;  // the mbarrier of an AT_MBARRIER lane
  unsigned wait_parity = 0;        // ... and the parity of the phase it waits to complete
  std::vector<PendingCopy> pending_copies;
  int committed_groups = 0;
  std::vector<BulkGroupOp> bulk_ops;  // TMA stores and bulk reduces still reading shared memory
  int bulk_committed_groups = 0;
  // Groups of bulk reduces retired by wait_group.read only: their global writes may still be
  // in flight on a GPU.
  std::vector<int> bulk_writes_unconfirmed;
  const int* waits_on_semaphore = nullptr;  // the global int of an AT_SEMAPHORE lane
  int semaphore_value = 0;                  // ... and the value it waits for
  std::vector<WgmmaOp> wgmma_ops;  // issued, not yet retired by wgmma.wait_group
  int wgmma_committed_groups = 0;
  bool wgmma_fenced = false;  // a wgmma.fence since the accumulators were last handed back
  // Every wgmma.mma_async this thread issued, folded into one number: the threads of a
  // warpgroup must all issue the same ones (.aligned).
  uint64_t wgmma_digest = 0;
  // Registers per thread this thread's setmaxnreg asked for, in order (kernels/common/
  // warpgroup.cuh): the threads of a warpgroup must all make the same requests (.aligned).
  std::vector<int> register_requests;
};

// Reserved lane stacks, kept for the process (launches are serialised, so one set serves all).
class StackPool {
 public:
  unsigned char* stack(size_t index) {
    while (index >= stacks_.size()) grow();
    return stacks_[index];
  }

 private:
  void grow() {
    void* region = mmap(nullptr, STACK_GUARD_BYTES + LANE_STACK_BYTES, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (region == MAP_FAILED) std::abort();
    mprotect(region, STACK_GUARD_BYTES, PROT_NONE);
    stacks_.push_back(static_cast<unsigned char*>(region) + STACK_GUARD_BYTES);
  }
  std::vector<unsigned char*> stacks_;
};

// A copy into shared memory through the asynchronous proxy (cp.async.bulk, a TMA load). It is
// in flight from its issue until the issuing warp hands control back to the scheduler; then its
// bytes complete on its mbarrier's phase (mbarrier::complete_tx), and `land` writes the data
// when that phase completes. Until then the destination holds the poison of the issue.
struct BulkCopy {
  const void* mbarrier;
  size_t bytes;
  std::function<void()> land;
};

// The grid being run: its lanes, their warps' exchange areas and the scheduler's own context.
struct Launch {
  std::vector<ThreadState> threads;
  std::vector<WarpState> warps;
  std::vector<std::pair<const void*, MBarrier>> mbarriers;  // of the block being run
  std::vector<BulkCopy> in_flight;    // issued, bytes not yet completed on the barrier
  std::vector<BulkCopy> bulk_copies;  // bytes completed, waiting for the phase to land
  // Warps with lanes waiting for a phase that just completed: the scheduler runs them next, so
  // what a completion releases is taken up at once, as a GPU may (the release's hazards show).
  std::vector<int> woken;
  Context scheduler;
  void (*run_kernel)(void*) = nullptr;
  void* kernel = nullptr;
};

inline Launch* active = nullptr;
inline ThreadState* current = nullptr;
// What failed the launch (a hazard, a deadlock), for cuattn_interp_error.
inline std::string launch_error;
inline StackPool stacks;
inline unsigned char* dynamic_smem = nullptr;
inline size_t dynamic_smem_bytes = 0;
// Dynamic shared memory as the asynchronous proxy sees it: as of the last fence.proxy.async,
// plus what the asynchronous proxy itself wrote since (kernels/common/tma.cuh).
inline std::vector<unsigned char> async_view;

inline ThreadState& self() { return *current; }
inline int lane_id() { return current->lane; }

// Suspends the running lane in `state` and returns to the scheduler, which resumes it when the
// warp (AT_WARP_BARRIER), the block (AT_BLOCK_BARRIER) or an mbarrier's phase (AT_MBARRIER) has
// caught up.
inline void suspend(LaneState state) {
  current->state = state;
  switch_context(current->context, active->scheduler);
}

// Every lane starts here, on its own stack.
inline void lane_main() {
  active->run_kernel(active->kernel);
  suspend(LaneState::EXITED);
  std::abort();  // an exited lane is never resumed
}

inline void resume(ThreadState& thread) {
  current = &thread;
  threadIdx = thread.thread_idx;
  thread.state = LaneState::READY;
  switch_context(active->scheduler, thread.context);
}

inline MBarrier* find_mbarrier(const void* address) {
  for (auto& [at, barrier] : active->mbarriers) {
    if (at == address) return &barrier;
  }
  return nullptr;
}

// Whether the phase an AT_MBARRIER lane waits for has completed (its parity is no longer the
// current phase's).
inline bool wait_is_over(const ThreadState& lane) {
  const MBarrier* barrier = find_mbarrier(lane.waits_on);
  return barrier && (barrier->phase & 1u) != lane.wait_parity;
}

// Whether the global int an AT_SEMAPHORE lane spins on holds the value it waits for.
inline bool semaphore_reached(const ThreadState& lane) {
  return std::atomic_ref<const int>(*lane.waits_on_semaphore).load(std::memory_order_acquire) ==
         lane.semaphore_value;
}

enum class WarpRun {
  PARKED,    // every lane waits at the block barrier or has exited
  BLOCKED,   // some lanes wait for an mbarrier phase that has not completed, or yielded
  DEADLOCK,  // lanes wait at a warp exchange the others (parked) never reach
};

// Runs warp `w` until it is parked or blocked; `ran` is set when a lane ran.
inline WarpRun run_warp(Launch& launch, int w, bool& descending, bool& ran) {
  ThreadState* lanes = &launch.threads[size_t(w) * WARP_SIZE];
  for (int i = 0; i < WARP_SIZE; ++i) {
    if (lanes[i].state == LaneState::YIELDED) lanes[i].state = LaneState::READY;
  }
  for (;;) {
    for (int i = 0; i < WARP_SIZE; ++i) {
      ThreadState& lane = lanes[descending ? WARP_SIZE - 1 - i : i];
      if (lane.state == LaneState::AT_MBARRIER && wait_is_over(lane)) lane.state = LaneState::READY;
      if (lane.state == LaneState::AT_SEMAPHORE && semaphore_reached(lane)) {
        lane.state = LaneState::READY;
      }
      if (lane.state == LaneState::READY) {
        resume(lane);
        ran = true;
      }
    }
    descending = !descending;
    int at_warp = 0, blocked = 0, released = 0;
    for (int i = 0; i < WARP_SIZE; ++i) {
      at_warp += lanes[i].state == LaneState::AT_WARP_BARRIER;
      blocked += lanes[i].state == LaneState::YIELDED;
      if (lanes[i].state == LaneState::AT_MBARRIER) {
        ++blocked;
        released += wait_is_over(lanes[i]);
      }
      if (lanes[i].state == LaneState::AT_SEMAPHORE) {
        ++blocked;
        released += semaphore_reached(lanes[i]);
      }
    }
    if (released) continue;  // this warp's own arrivals completed a phase it waits for
    if (blocked) return WarpRun::BLOCKED;
    if (at_warp == 0) return WarpRun::PARKED;
    if (at_warp < WARP_SIZE) return WarpRun::DEADLOCK;
    for (int i = 0; i < WARP_SIZE; ++i) lanes[i].state = LaneState::READY;
  }
}

// The launch's first hazard: kept for cuattn_interp_error, and the launch fails.
inline std::atomic<bool> hazard{false};
inline void report_hazard(const std::string& message) {
  if (!hazard.exchange(true)) launch_error = message;
}

inline long long smem_offset(const void* address) {
  return static_cast<const unsigned char*>(address) - dynamic_smem;
}

// Addresses standing for the CTA's named barriers (bar.sync / bar.arrive with an id,
// kernels/common/warpgroup.cuh), whose state is kept as an mbarrier's is.
constexpr int NAMED_BARRIERS = 16;
inline unsigned char named_barrier_keys[NAMED_BARRIERS];

inline std::string describe(const void* address, const MBarrier& b) {
  const auto* key = static_cast<const unsigned char*>(address);
  if (key >= named_barrier_keys && key < named_barrier_keys + NAMED_BARRIERS) {
    return "named barrier " + std::to_string(key - named_barrier_keys) + " (" +
           std::to_string(b.expected) + " threads per phase, " + std::to_string(b.pending) +
           " still missing, " + std::to_string(b.phase) + " phases completed)";
  }
  return "mbarrier at shared-memory offset " + std::to_string(smem_offset(address)) + " (" +
         std::to_string(b.expected) + " arrivals per phase, " + std::to_string(b.pending) +
         " still missing, " + std::to_string(b.tx) + " transaction bytes pending, " +
         std::to_string(b.phase) + " phases completed)";
}

// The deadlock message: which barrier phases the waiting threads wait for, one entry per
// (barrier, parity) with how many threads wait and the first of them.
inline std::string describe_waits(const Launch& launch) {
  struct Wait {
    const void* barrier;
    unsigned parity;
    size_t first;
    int threads;
  };
  std::vector<Wait> waits;
  for (size_t i = 0; i < launch.threads.size(); ++i) {
    const ThreadState& t = launch.threads[i];
    if (t.state != LaneState::AT_MBARRIER) continue;
    auto same = [&](const Wait& w) { return w.barrier == t.waits_on && w.parity == t.wait_parity; };
    auto found = std::find_if(waits.begin(), waits.end(), same);
    if (found == waits.end()) {
      waits.push_back({t.waits_on, t.wait_parity, i, 1});
    } else {
      ++found->threads;
    }
  }
  std::string semaphores;
  for (size_t i = 0; i < launch.threads.size(); ++i) {
    const ThreadState& t = launch.threads[i];
    if (t.state != LaneState::AT_SEMAPHORE) continue;
    semaphores += (semaphores.empty() ? "" : "; ") + std::string("thread ") + std::to_string(i) +
                  " of block (" + std::to_string(blockIdx.x) + ", " + std::to_string(blockIdx.y) +
                  ", " + std::to_string(blockIdx.z) + ") waits for the semaphore at " +
                  std::to_string(reinterpret_cast<uintptr_t>(t.waits_on_semaphore)) +
                  " to hold " + std::to_string(t.semaphore_value) + "; it holds " +
                  std::to_string(*t.waits_on_semaphore);
  }
  if (!semaphores.empty()) {
    // Blocks run one after another here: a semaphore another block would set is set by an
    // earlier block or never (on a GPU, by a block that may not be resident: a deadlock).
    return "a semaphore wait that no block started before it can satisfy (the order in which "
           "CTAs are claimed must put every CTA after those it waits for): " + semaphores;
  }
  std::string text = "threads wait for mbarrier phases that can never complete: ";
  for (size_t i = 0; i < waits.size(); ++i) {
    const Wait& w = waits[i];
    const MBarrier* b = find_mbarrier(w.barrier);
    text += (i ? "; " : "") + std::to_string(w.threads) + " (the first: thread " +
            std::to_string(w.first) + ") wait for parity " + std::to_string(w.parity) + " of " +
            (b ? describe(w.barrier, *b) : std::string("an mbarrier never initialised"));
  }
  return text;
}

// The first address a GPU would have faulted on in this launch (see the header).
inline std::atomic<bool> misaligned{false};
inline const void* misaligned_address = nullptr;

inline void require_aligned(const void* address, size_t alignment) {
  if (reinterpret_cast<uintptr_t>(address) % alignment == 0) return;
  bool expected = false;
  if (misaligned.compare_exchange_strong(expected, true)) misaligned_address = address;
}

// The order the blocks of a launch run in: their index order, or with CUATTN_INTERP_BLOCK_SEED
// set a permutation seeded by it (a GPU starts blocks in no guaranteed order; a kernel whose
// CTAs wait for each other must claim its work in start order, kernels/common/semaphore.cuh).
inline std::vector<size_t> block_order(size_t num_blocks) {
  std::vector<size_t> order(num_blocks);
  std::iota(order.begin(), order.end(), size_t(0));
  if (const char* text = std::getenv("CUATTN_INTERP_BLOCK_SEED")) {
    std::mt19937 rng(unsigned(std::strtoul(text, nullptr, 10)));
    std::shuffle(order.begin(), order.end(), rng);
  }
  return order;
}

inline unsigned seed_from_environment() {
  const char* text = std::getenv("CUATTN_INTERP_SEED");
  return text ? unsigned(std::strtoul(text, nullptr, 10)) : 0u;
}

// Publish `bytes` of this lane's data, wait for the whole warp, return the base of everyone's
// published words: lane L's data starts at result + L * EXCHANGE_WORDS.
inline const uint32_t* warp_exchange(const void* data, size_t bytes) {
  ThreadState& me = self();
  uint32_t(*buffer)[EXCHANGE_WORDS] = me.warp->words[me.parity];
  std::memcpy(buffer[me.lane], data, bytes);
  suspend(LaneState::AT_WARP_BARRIER);
  me.parity ^= 1;
  return &buffer[0][0];
}

// ---- the generic and the asynchronous proxy --------------------------------------------------
// Plain loads and stores go through the generic proxy; bulk and tensor copies and wgmma operand
// reads through the asynchronous proxy, which need not see a plain store to shared memory until
// a fence.proxy.async orders it (PTX ISA, "Async Proxy"). The interpreter keeps the shared
// memory as of the last fence (async_view) and reports an asynchronous read of bytes that
// differ from it. A fence by any thread covers every store made before it in the interpreter's
// order, so what is caught is a missing fence, not one in the wrong thread; static __shared__
// arrays are not tracked (the Hopper kernels use dynamic shared memory).

// Where `address` lies in dynamic shared memory, or -1 outside it.
inline long long tracked_offset(const void* address, size_t bytes) {
  const long long offset = smem_offset(address);
  if (!dynamic_smem || offset < 0 || size_t(offset) + bytes > dynamic_smem_bytes) return -1;
  return offset;
}

inline void fence_proxy_async() {
  std::memcpy(async_view.data(), dynamic_smem, dynamic_smem_bytes);
}

// A write by the asynchronous proxy: both views see it.
inline void async_proxy_write(void* dst, const void* src, size_t bytes) {
  std::memcpy(dst, src, bytes);
  const long long offset = tracked_offset(dst, bytes);
  if (offset >= 0) std::memcpy(async_view.data() + offset, src, bytes);
}

inline void async_proxy_fill(void* dst, unsigned char value, size_t bytes) {
  std::memset(dst, value, bytes);
  const long long offset = tracked_offset(dst, bytes);
  if (offset >= 0) std::memset(async_view.data() + offset, value, bytes);
}

// A read by the asynchronous proxy (`what`): false, and a hazard, when plain stores changed the
// bytes since the last fence.proxy.async.
inline bool async_proxy_read_ok(const void* src, size_t bytes, const char* what) {
  const long long offset = tracked_offset(src, bytes);
  if (offset < 0) return true;
  const auto* now = static_cast<const unsigned char*>(src);
  const unsigned char* seen = async_view.data() + offset;
  for (size_t i = 0; i < bytes; ++i) {
    if (now[i] == seen[i]) continue;
    report_hazard(std::string(what) + " reads shared-memory offset " +
                  std::to_string(offset + static_cast<long long>(i)) +
                  ", written by plain stores with no fence.proxy.async after them");
    return false;
  }
  return true;
}

// ---- mbarrier and bulk copies (kernels/common/mbarrier.cuh calls these) ----------------------

inline MBarrier& mbarrier_at(const void* address) {
  MBarrier* barrier = find_mbarrier(address);
  if (barrier) return *barrier;
  report_hazard("an mbarrier at shared-memory offset " + std::to_string(smem_offset(address)) +
                " is used before mbarrier.init");
  active->mbarriers.emplace_back(address, MBarrier{});
  return active->mbarriers.back().second;
}

// Completes the phase if nothing is missing: the bulk copies counted against it land, the
// arrival count is re-armed.
inline void complete_phase_if_done(const void* address, MBarrier& b) {
  if (b.pending != 0 || b.tx != 0) return;
  std::vector<BulkCopy> landing, still;
  for (BulkCopy& copy : active->bulk_copies) {
    (copy.mbarrier == address ? landing : still).push_back(std::move(copy));
  }
  active->bulk_copies.swap(still);
  for (const BulkCopy& copy : landing) copy.land();
  ++b.phase;
  b.pending = b.expected;
  for (const ThreadState& t : active->threads) {
    if (t.state == LaneState::AT_MBARRIER && t.waits_on == address &&
        std::find(active->woken.begin(), active->woken.end(), t.warp_index) ==
            active->woken.end()) {
      active->woken.push_back(t.warp_index);
    }
  }
}

inline void mbarrier_init(void* address, int count) {
  if (count < 1) report_hazard("mbarrier.init with count " + std::to_string(count) + " (< 1)");
  if (MBarrier* b = find_mbarrier(address)) {
    *b = MBarrier{count, count, 0, 0};
  } else {
    active->mbarriers.emplace_back(address, MBarrier{count, count, 0, 0});
  }
}

inline void mbarrier_expect_tx(void* address, long long bytes) { mbarrier_at(address).tx += bytes; }

// One arrival on the current phase (the producer's mbarrier.arrive.expect_tx: its copies follow
// at once, so it goes on).
inline void mbarrier_arrive_only(void* address) {
  MBarrier& b = mbarrier_at(address);
  if (b.pending == 0) {
    // every arrival of the phase is in and only transaction bytes are missing
    report_hazard("an arrival past the phase: " + describe(address, b));
    return;
  }
  --b.pending;
  complete_phase_if_done(address, b);
}

// cp.async.mbarrier.arrive.noinc: this thread's cp.async copies (committed or not) leave its
// wait_group accounting and land when the barrier's current phase completes, which this
// arrival counts towards.
inline void cp_async_mbarrier_arrive(void* address) {
  ThreadState& me = self();
  for (const PendingCopy& copy : me.pending_copies) {
    active->bulk_copies.push_back({address, 16, [copy] {
                                     if (copy.valid) {
                                       std::memcpy(copy.dst, copy.src, 16);
                                     } else {
                                       std::memset(copy.dst, 0, 16);
                                     }
                                   }});
  }
  me.pending_copies.clear();
  mbarrier_arrive_only(address);
}

// mbarrier.arrive. What the arrival releases (a stage handed back, a result published) may be
// taken up by another warp at once on a GPU: the other warps run before this one goes on (and
// those it woke first), so a consumer that releases a stage before it is done with it finds
// the stage refilled under it.
inline void mbarrier_arrive(void* address) {
  mbarrier_arrive_only(address);
  suspend(LaneState::YIELDED);
}

// The asynchronous proxy's side of a copy into shared memory (the caller has poisoned the
// destination): in flight until the issuing warp yields.
inline void async_copy_to_shared(void* address, size_t bytes, std::function<void()> land) {
  mbarrier_at(address);
  active->in_flight.push_back({address, bytes, std::move(land)});
}

// The copies in flight complete their bytes on their barriers' phases (the scheduler calls this
// whenever a warp hands control back, so a copy and the expect_tx its thread issues right after
// it count in either order, as on a GPU, and no reader that skips the wait sees the data).
inline void complete_in_flight(Launch& launch) {
  std::vector<BulkCopy> delivered;
  delivered.swap(launch.in_flight);
  for (BulkCopy& copy : delivered) {
    const void* address = copy.mbarrier;
    MBarrier& b = mbarrier_at(address);
    b.tx -= static_cast<long long>(copy.bytes);
    if (b.tx < 0) {
      report_hazard("a bulk copy of " + std::to_string(copy.bytes) + " bytes exceeds the "
                    "transaction bytes its phase expects (too few bytes expected): " +
                    describe(address, b));
      return;
    }
    launch.bulk_copies.push_back(std::move(copy));
    complete_phase_if_done(address, b);
  }
}

// cp.async.bulk: the destination is poisoned (0xFF) until the phase completes.
inline void bulk_copy(void* dst, const void* src, size_t bytes, void* address) {
  require_aligned(dst, 16);
  require_aligned(src, 16);
  async_proxy_fill(dst, 0xFF, bytes);
  async_copy_to_shared(address, bytes, [=] { async_proxy_write(dst, src, bytes); });
}

// Retires every committed bulk async-group of this thread except the `keep` most recent ones:
// their reads of shared memory are over (cp.async.bulk.wait_group.read, READ_ONLY) or their
// writes complete as well (cp.async.bulk.wait_group). The interpreter performs an operation's
// writes when its reads retire; a bulk reduce retired by .read alone is remembered as writes
// not yet confirmed, which a semaphore release must not publish (kernels/common/semaphore.cuh).
inline void bulk_wait_group(int keep, bool read_only = true) {
  ThreadState& me = self();
  const int retired = me.bulk_committed_groups - keep;
  std::vector<BulkGroupOp> still;
  for (BulkGroupOp& op : me.bulk_ops) {
    if (op.group >= 0 && op.group < retired) {
      op.finish();
      if (op.writes_global && read_only) me.bulk_writes_unconfirmed.push_back(op.group);
    } else {
      still.push_back(std::move(op));
    }
  }
  me.bulk_ops.swap(still);
  if (!read_only) {
    std::erase_if(me.bulk_writes_unconfirmed, [&](int group) { return group < retired; });
  }
}

// Closes a thread's current commit group of asynchronous operations (cp.async, bulk, wgmma):
// the operations issued since the last commit get the group's index.
template <typename Op>
inline void commit_group(std::vector<Op>& ops, int& committed_groups) {
  for (Op& op : ops) {
    if (op.group < 0) op.group = committed_groups;
  }
  ++committed_groups;
}

inline void bulk_commit_group() { commit_group(self().bulk_ops, self().bulk_committed_groups); }

// mbarrier.test_wait.parity: whether the phase with that parity (the current one or the one
// before it) has completed.
inline bool mbarrier_phase_completed(void* address, unsigned parity) {
  return (mbarrier_at(address).phase & 1u) != (parity & 1u);
}

inline void mbarrier_wait_parity(void* address, unsigned parity) {
  ThreadState& me = self();
  me.waits_on = address;
  me.wait_parity = parity & 1u;
  if (!wait_is_over(me)) suspend(LaneState::AT_MBARRIER);
  me.waits_on = nullptr;
}

// bar.arrive / bar.sync on named barrier `id` for `threads` threads (PTX ISA, "bar"): a phase
// completes when that many threads have arrived; bar.sync also waits for it. Threads are counted
// one by one here (a GPU counts whole warps, which the .aligned kernels of this project arrive
// with). Ids 1 to 15 (0 is __syncthreads'), counts a multiple of the warp size up to the block;
// one phase with two different counts is a hazard (a GPU may hang or release early).
inline MBarrier* named_barrier(int id, int threads) {
  const int block_threads = int(active->threads.size());
  if (id < 1 || id >= NAMED_BARRIERS || threads <= 0 || threads % WARP_SIZE != 0 ||
      threads > block_threads) {
    report_hazard("named barrier " + std::to_string(id) + " for " + std::to_string(threads) +
                  " threads (ids 1 to 15, a multiple of 32 threads up to the block's " +
                  std::to_string(block_threads) + ")");
    return nullptr;
  }
  const void* key = &named_barrier_keys[id];
  MBarrier* b = find_mbarrier(key);
  if (!b) {
    active->mbarriers.emplace_back(key, MBarrier{threads, threads, 0, 0});
    return &active->mbarriers.back().second;
  }
  if (b->pending == b->expected) {
    b->expected = b->pending = threads;  // a new phase: any count
  } else if (b->expected != threads) {
    report_hazard(describe(key, *b) + " arrived at for " + std::to_string(threads) +
                  " threads in the same phase");
    return nullptr;
  }
  return b;
}

// Once the phase's count is settled, an arrival (and a wait) is an mbarrier's.
inline void named_barrier_arrive(int id, int threads) {
  if (named_barrier(id, threads)) mbarrier_arrive(&named_barrier_keys[id]);
}

inline void named_barrier_sync(int id, int threads) {
  const MBarrier* b = named_barrier(id, threads);
  if (!b) return;
  const unsigned parity = b->phase & 1u;
  mbarrier_arrive_only(&named_barrier_keys[id]);
  mbarrier_wait_parity(&named_barrier_keys[id], parity);
}

template <typename T>
inline T exchanged_value(const uint32_t* all, int lane) {
  static_assert(sizeof(T) <= EXCHANGE_WORDS * sizeof(uint32_t));
  T value;
  std::memcpy(&value, all + lane * EXCHANGE_WORDS, sizeof(T));
  return value;
}

// Calls kernel(*(Arg0*)args[0], *(Arg1*)args[1], ...): args follows cuLaunchKernel's
// kernelParams convention (an array of pointers to the argument values).
template <typename... Args, size_t... I>
inline void call_kernel(void (*kernel)(Args...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_reference_t<Args>*>(args[I])...);
}

enum LaunchStatus : int {
  LAUNCH_OK = 0,
  LAUNCH_BAD_BLOCK = 1,   // block size not a positive multiple of the warp size
  LAUNCH_BAD_GRID = 2,    // empty grid
  LAUNCH_MISALIGNED = 3,  // an address a GPU would fault on (see the header)
  LAUNCH_DEADLOCK = 4,    // lanes wait for what never comes (launch_error says what)
  LAUNCH_HAZARD = 5,      // an mbarrier, bulk-copy or TMA misuse a GPU would not report
                          // (launch_error)
};

inline std::mutex launch_mutex;

// Threads of a warpgroup (wgmma.mma_async runs on four consecutive warps).
constexpr size_t WARPGROUP_THREADS = 128;

// The register file of an SM (sm_90): the pool setmaxnreg moves registers within.
constexpr long long REGISTER_FILE = 65536;
constexpr long long MAX_REGISTERS_PER_THREAD = 255;
constexpr long long REGISTER_GRAIN = 8;

// What is wrong with the block's setmaxnreg requests, or "": a warpgroup whose threads asked
// for different counts (the instruction is .aligned), or last requests the register file
// cannot hold together, which a GPU answers by waiting forever in setmaxnreg.inc. A warpgroup
// that asked nothing keeps the launch's share, the most registers per thread the block size
// allows (what __launch_bounds__ with one block per SM gives ptxas).
inline std::string register_requests_error(const Launch& launch) {
  const size_t threads = launch.threads.size();
  bool any = false;
  for (const ThreadState& t : launch.threads) any = any || !t.register_requests.empty();
  if (!any) return "";
  const long long fair = REGISTER_FILE / static_cast<long long>(threads);
  const long long share =
      std::min(MAX_REGISTERS_PER_THREAD, fair) / REGISTER_GRAIN * REGISTER_GRAIN;
  long long total = 0;
  for (size_t first = 0; first < threads; first += WARPGROUP_THREADS) {
    const ThreadState& leader = launch.threads[first];
    const size_t end = std::min(threads, first + WARPGROUP_THREADS);
    for (size_t i = first; i < end; ++i) {
      if (launch.threads[i].register_requests != leader.register_requests) {
        return "thread " + std::to_string(i) + " made other setmaxnreg requests than thread " +
               std::to_string(first) + " of its warpgroup (.aligned: all 128 threads make the "
               "same ones)";
      }
    }
    const long long last =
        leader.register_requests.empty() ? share : leader.register_requests.back();
    total += last * static_cast<long long>(end - first);
  }
  if (total > REGISTER_FILE) {
    return "the warpgroups' setmaxnreg requests add up to " + std::to_string(total) +
           " registers, more than the register file's " + std::to_string(REGISTER_FILE) +
           ": a GPU waits forever in setmaxnreg.inc";
  }
  return "";
}

// A warp of a block whose warps use mbarriers starts to sit out rounds with one chance in
// HOLD_ODDS a round, for 1 to MAX_HOLD_ROUNDS rounds (launch).
constexpr unsigned HOLD_ODDS = 4;
constexpr unsigned MAX_HOLD_ROUNDS = 8;

// What a block may not leave behind when its threads have all exited: a TMA store still
// reading the shared memory the next block gets, a wgmma never waited for, a wgmma that only
// part of its warpgroup issued.
inline int check_block_end(const Launch& launch) {
  if (const std::string error = register_requests_error(launch); !error.empty()) {
    report_hazard(error);
    return LAUNCH_HAZARD;
  }
  for (size_t i = 0; i < launch.threads.size(); ++i) {
    const ThreadState& t = launch.threads[i];
    std::string left;
    if (!t.bulk_ops.empty()) {
      left = std::to_string(t.bulk_ops.size()) +
             " TMA store(s) still reading shared memory (stores or bulk reduces; no "
             "cp.async.bulk.wait_group.read after them)";
    } else if (!t.wgmma_ops.empty()) {
      left = std::to_string(t.wgmma_ops.size()) +
             " wgmma.mma_async never retired by a wgmma.wait_group";
    } else if (t.wgmma_digest != launch.threads[i - i % WARPGROUP_THREADS].wgmma_digest ||
               (t.wgmma_digest != 0 && i - i % WARPGROUP_THREADS + WARPGROUP_THREADS >
                                           launch.threads.size())) {
      report_hazard("thread " + std::to_string(i) + " issued other wgmma.mma_async than thread " +
                    std::to_string(i - i % WARPGROUP_THREADS) +
                    " of its warpgroup (.aligned: all 128 threads issue the same ones)");
      return LAUNCH_HAZARD;
    }
    if (left.empty()) continue;
    report_hazard("thread " + std::to_string(i) + " exits with " + left);
    return LAUNCH_HAZARD;
  }
  return LAUNCH_OK;
}

// Runs the whole grid: every block's threads as fibers on this host thread, blocks in order.
template <typename... Args>
inline int launch(void (*kernel)(Args...), const unsigned* grid, const unsigned* block,
                  size_t smem_bytes, void** args) {
  const unsigned threads = block[0] * block[1] * block[2];
  if (threads == 0 || threads % WARP_SIZE != 0) return LAUNCH_BAD_BLOCK;
  const size_t num_blocks = size_t(grid[0]) * grid[1] * grid[2];
  if (num_blocks == 0) return LAUNCH_BAD_GRID;
  const int num_warps = int(threads / WARP_SIZE);

  std::lock_guard<std::mutex> guard(launch_mutex);
  gridDim = dim3{grid[0], grid[1], grid[2]};
  blockDim = dim3{block[0], block[1], block[2]};
  const size_t smem_size = std::max<size_t>(smem_bytes, 16);
  std::vector<unsigned char> smem_storage(smem_size + SMEM_ALIGNMENT);
  const auto smem_base = reinterpret_cast<uintptr_t>(smem_storage.data());
  unsigned char* smem = smem_storage.data() + (SMEM_ALIGNMENT - smem_base % SMEM_ALIGNMENT);
  dynamic_smem = smem;
  dynamic_smem_bytes = smem_size;
  misaligned = false;
  misaligned_address = nullptr;
  hazard = false;
  launch_error.clear();

  struct Body {
    void (*kernel)(Args...);
    void** args;
  } body{kernel, args};
  Launch state;
  state.threads.resize(threads);
  state.warps.resize(num_warps);
  state.kernel = &body;
  state.run_kernel = [](void* data) {
    auto* b = static_cast<Body*>(data);
    call_kernel(b->kernel, b->args, std::index_sequence_for<Args...>{});
  };
  active = &state;

  std::mt19937 rng(seed_from_environment());
  std::vector<int> held(num_warps);  // rounds each warp still sits out
  bool release_holds = false;
  std::vector<int> order(num_warps);
  std::iota(order.begin(), order.end(), 0);
  int status = LAUNCH_OK;
  const std::vector<size_t> blocks = block_order(num_blocks);
  for (size_t n = 0; n < num_blocks && status == LAUNCH_OK; ++n) {
    const size_t b = blocks[n];
    std::memset(smem, 0xFF, smem_size);
    async_view.assign(smem, smem + smem_size);
    blockIdx = uint3{unsigned(b % grid[0]), unsigned((b / grid[0]) % grid[1]),
                     unsigned(b / (size_t(grid[0]) * grid[1]))};
    for (unsigned tid = 0; tid < threads; ++tid) {
      ThreadState& t = state.threads[tid];
      t.thread_idx = uint3{tid % block[0], (tid / block[0]) % block[1], tid / (block[0] * block[1])};
      t.warp_index = int(tid / WARP_SIZE);
      t.warp = &state.warps[t.warp_index];
      t.lane = int(tid % WARP_SIZE);
      t.parity = 0;
      t.state = LaneState::READY;
      t.pending_copies.clear();
      t.committed_groups = 0;
      t.bulk_ops.clear();
      t.bulk_committed_groups = 0;
      t.bulk_writes_unconfirmed.clear();
      t.waits_on_semaphore = nullptr;
      t.wgmma_ops.clear();
      t.wgmma_committed_groups = 0;
      t.wgmma_fenced = false;
      t.wgmma_digest = 0;
      t.register_requests.clear();
      start_context(t.context, stacks.stack(tid), LANE_STACK_BYTES, &lane_main);
    }
    state.mbarriers.clear();
    state.woken.clear();
    state.in_flight.clear();
    state.bulk_copies.clear();
    bool descending = false;
    for (;;) {
      // Warps take turns until each is parked at the block barrier (or exited); a warp blocked
      // on an mbarrier hands over, and the order is shuffled again at every round.
      bool parked = false;
      while (!parked && status == LAUNCH_OK && !hazard) {
        std::shuffle(order.begin(), order.end(), rng);
        // Where warps synchronise through mbarriers, a warp may start to sit out 1 to
        // MAX_HOLD_ROUNDS rounds (one chance in HOLD_ODDS a round, seeded; never all warps), so
        // that one warp or warpgroup falls behind the others, as a slow one does on a GPU: a
        // warp that hands a stage back without having waited for it then completes a phase its
        // slower peer is still in. When only held warps could go on, the holds end. (Between
        // block barriers the order alone shows what a GPU punishes.)
        bool holding = false;
        for (int w = 0; w < num_warps; ++w) {
          if (held[w] > 0) {
            --held[w];
          } else if (!state.mbarriers.empty() && !release_holds && rng() % HOLD_ODDS == 0) {
            held[w] = int(1 + rng() % MAX_HOLD_ROUNDS);
          }
          if (release_holds) held[w] = 0;
        }
        held[order[0]] = 0;
        release_holds = false;
        for (int w = 0; w < num_warps; ++w) holding = holding || held[w] > 0;
        parked = true;
        bool ran = false;
        size_t turn = 0;
        while (turn < order.size() || !state.woken.empty()) {
          // the shuffled order, with the warps a completed phase woke cutting in
          int w;
          if (state.woken.empty()) {
            w = order[turn++];
          } else {
            w = state.woken.front();
            state.woken.erase(state.woken.begin());
          }
          if (held[w] > 0) {
            parked = false;
            continue;
          }
          const WarpRun run = run_warp(state, w, descending, ran);
          complete_in_flight(state);
          if (run == WarpRun::DEADLOCK) {
            status = LAUNCH_DEADLOCK;
            launch_error = "lanes wait at a warp shuffle, mma, ldmatrix or __syncwarp that the "
                           "rest of their warp never reaches";
            break;
          }
          parked = parked && run == WarpRun::PARKED;
        }
        if (!parked && !ran && holding) {
          release_holds = true;  // only the held warps can go on: a round without holds next
        } else if (!parked && !ran && status == LAUNCH_OK) {
          status = LAUNCH_DEADLOCK;
          launch_error = describe_waits(state);
        }
      }
      if (hazard) status = LAUNCH_HAZARD;
      if (status != LAUNCH_OK) break;
      // Every lane now waits at the block barrier or has exited: the barrier opens. (Kernels in
      // this project return early only uniformly over the block, before any __syncthreads.)
      bool running = false;
      for (ThreadState& t : state.threads) {
        if (t.state == LaneState::AT_BLOCK_BARRIER) {
          t.state = LaneState::READY;
          running = true;
        }
      }
      if (!running) break;
    }
    if (status == LAUNCH_OK) status = check_block_end(state);
  }
  active = nullptr;
  current = nullptr;
  dynamic_smem = nullptr;
  dynamic_smem_bytes = 0;
  if (status != LAUNCH_OK) return status;
  return misaligned ? LAUNCH_MISALIGNED : LAUNCH_OK;
}

}  // namespace cuattn_interp

// ---- CUDA built-ins used by the kernels -------------------------------------------------------

inline void __syncthreads() { cuattn_interp::suspend(cuattn_interp::LaneState::AT_BLOCK_BARRIER); }
inline void __syncwarp(unsigned = 0xffffffffu) {
  cuattn_interp::suspend(cuattn_interp::LaneState::AT_WARP_BARRIER);
}

template <typename T>
inline T __shfl_xor_sync(unsigned, T value, int lane_mask, int width = cuattn_interp::WARP_SIZE) {
  const uint32_t* all = cuattn_interp::warp_exchange(&value, sizeof(T));
  const int lane = cuattn_interp::lane_id();
  const int src = (lane ^ lane_mask) < ((lane / width) + 1) * width ? lane ^ lane_mask : lane;
  return cuattn_interp::exchanged_value<T>(all, src);
}

template <typename T>
inline T __shfl_sync(unsigned, T value, int src_lane, int width = cuattn_interp::WARP_SIZE) {
  const uint32_t* all = cuattn_interp::warp_exchange(&value, sizeof(T));
  const int lane = cuattn_interp::lane_id();
  return cuattn_interp::exchanged_value<T>(all, (lane / width) * width + src_lane % width);
}

inline unsigned __ballot_sync(unsigned, int predicate) {
  const int vote = predicate != 0;
  const uint32_t* all = cuattn_interp::warp_exchange(&vote, sizeof(vote));
  unsigned votes = 0;
  for (int lane = 0; lane < cuattn_interp::WARP_SIZE; ++lane) {
    if (cuattn_interp::exchanged_value<int>(all, lane)) votes |= 1u << lane;
  }
  return votes;
}

inline int __popc(unsigned x) { return std::popcount(x); }

// The shared-memory window address of a pointer: here its offset into dynamic shared memory,
// the only shared memory whose addresses the interpreter can turn back into pointers (a wgmma
// descriptor holds one).
inline size_t __cvta_generic_to_shared(const void* address) {
  const long long offset = cuattn_interp::tracked_offset(address, 1);
  if (offset < 0) {
    cuattn_interp::report_hazard(
        "a shared-memory window address taken of memory outside dynamic shared memory");
    return 0;
  }
  return size_t(offset);
}

inline float atomicAdd(float* address, float value) {
  return std::atomic_ref<float>(*address).fetch_add(value, std::memory_order_relaxed);
}

inline int atomicAdd(int* address, int value) {
  return std::atomic_ref<int>(*address).fetch_add(value, std::memory_order_relaxed);
}

// Blocks run one after another here, so every write of an earlier block is already visible; a
// sequentially consistent fence keeps this thread's order as the GPU's fence does.
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

inline float __expf(float x) { return std::exp(x); }
inline float __exp2f(float x) { return std::exp2(x); }
// x86-64's baseline (the interpreter's build) has no FMA: a product is never contracted.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }

// What failed the last launch (LAUNCH_DEADLOCK, LAUNCH_HAZARD), for the Python side.
extern "C" const char* cuattn_interp_error() { return cuattn_interp::launch_error.c_str(); }

// Exported launch entry for one kernel instantiation:
//   int SYMBOL(const unsigned grid[3], const unsigned block[3], size_t smem_bytes, void** args)
#define CUATTN_INTERP_ENTRY(symbol, ...)                                                        \
  extern "C" int symbol(const unsigned* grid, const unsigned* block, size_t smem_bytes,        \
                        void** args) {                                                          \
    return cuattn_interp::launch(&__VA_ARGS__, grid, block, smem_bytes, args);                  \
  }
