// CPU shim that makes kernels/*.cu valid C++20 under g++ (the cuattn kernel interpreter).
//
// Execution model (docs/design.md §5):
//   * every CUDA thread of a block is a host std::thread; threadIdx/blockIdx are thread_locals;
//   * blocks run one after another: the same host threads walk the grid in order, with a block-wide
//     barrier between blocks, so `__shared__` (a function-local static here) is valid for one block
//     at a time and shared by exactly that block's threads;
//   * warps take turns: between two __syncthreads exactly one warp runs, in an order shuffled
//     at every barrier (seeded by CUATTN_INTERP_SEED, default 0, so a run is reproducible). A
//     read of shared memory another warp writes without a barrier in between therefore sees
//     the wrong data in some order, every time that order comes up, instead of by timing luck;
//   * __syncthreads is that turn-taking barrier, __syncwarp a std::barrier over the warp;
//   * warp-collective operations (shuffles, votes, and the CPU versions of mma/ldmatrix in kernels/common)
//     exchange registers through a per-warp scratch area guarded by the warp barrier;
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

#include <algorithm>
#include <atomic>
#include <barrier>
#include <bit>
#include <condition_variable>
#include <cstdlib>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

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

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

namespace cuattn_interp {

constexpr int WARP_SIZE = 32;
// 32-bit words each lane may publish in one warp exchange (mma publishes 6: A and B fragments).
constexpr int EXCHANGE_WORDS = 8;

// Registers exchanged inside one warp. Two buffers alternate, so one barrier per exchange is
// enough: a lane overwrites buffer p only at exchange n+2, after every lane has passed the
// barrier of exchange n+1, i.e. after every lane has finished reading exchange n.
struct WarpState {
  explicit WarpState() : barrier(WARP_SIZE) {}
  std::barrier<> barrier;
  alignas(64) uint32_t words[2][WARP_SIZE][EXCHANGE_WORDS];
};

struct ThreadState {
  WarpState* warp = nullptr;
  int warp_index = 0;
  int lane = 0;
  int parity = 0;
};

// The block barrier, which also makes warps take turns: between two barriers only the warp whose
// turn it is runs; when all its lanes have arrived the turn passes to the next warp of this
// phase's order, and when every warp has arrived a new phase starts in a freshly shuffled order.
// Kernels reach every barrier with all their threads (early returns are uniform over the block
// and meet at the launch's end-of-block barrier), so a phase always completes.
class WarpTurns {
 public:
  WarpTurns(int num_warps, unsigned seed)
      : order_(num_warps), arrived_(num_warps, 0), wake_(num_warps), rng_(seed) {
    std::iota(order_.begin(), order_.end(), 0);
    std::shuffle(order_.begin(), order_.end(), rng_);
    turn_ = order_[0];
  }

  // Waits for this warp's first turn.
  void enter(int warp) {
    std::unique_lock<std::mutex> lock(mutex_);
    wake_[warp].wait(lock, [&] { return turn_ == warp; });
  }

  // __syncthreads for one thread of `warp`.
  void sync(int warp) {
    std::unique_lock<std::mutex> lock(mutex_);
    const long phase = phase_;
    arrive(warp);
    wake_[warp].wait(lock, [&] { return phase_ != phase && turn_ == warp; });
  }

  // The last barrier of a launch: arrive (the next warp gets its turn) and run on to the exit.
  void leave(int warp) {
    std::unique_lock<std::mutex> lock(mutex_);
    arrive(warp);
  }

 private:
  void arrive(int warp) {
    if (++arrived_[warp] < WARP_SIZE) return;
    arrived_[warp] = 0;
    if (++position_ == int(order_.size())) {
      position_ = 0;
      ++phase_;
      std::shuffle(order_.begin(), order_.end(), rng_);
    }
    turn_ = order_[position_];
    wake_[turn_].notify_all();
  }

  std::mutex mutex_;
  std::vector<int> order_;
  std::vector<int> arrived_;
  std::vector<std::condition_variable> wake_;
  std::mt19937 rng_;
  int position_ = 0;
  long phase_ = 0;
  int turn_ = 0;
};

inline thread_local ThreadState current_thread;
inline WarpTurns* block_barrier = nullptr;
inline unsigned char* dynamic_smem = nullptr;

// The first address a GPU would have faulted on in this launch (see the header).
inline std::atomic<bool> misaligned{false};
inline const void* misaligned_address = nullptr;

inline void require_aligned(const void* address, size_t alignment) {
  if (reinterpret_cast<uintptr_t>(address) % alignment == 0) return;
  bool expected = false;
  if (misaligned.compare_exchange_strong(expected, true)) misaligned_address = address;
}

inline unsigned seed_from_environment() {
  const char* text = std::getenv("CUATTN_INTERP_SEED");
  return text ? unsigned(std::strtoul(text, nullptr, 10)) : 0u;
}

inline int lane_id() { return current_thread.lane; }

// Publish `bytes` of this lane's data, wait for the whole warp, return the base of everyone's
// published words: lane L's data starts at result + L * EXCHANGE_WORDS.
inline const uint32_t* warp_exchange(const void* data, size_t bytes) {
  ThreadState& self = current_thread;
  uint32_t(*buffer)[EXCHANGE_WORDS] = self.warp->words[self.parity];
  std::memcpy(buffer[self.lane], data, bytes);
  self.warp->barrier.arrive_and_wait();
  self.parity ^= 1;
  return &buffer[0][0];
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
};

inline std::mutex launch_mutex;

// Runs the whole grid: one host thread per CUDA thread of a block, blocks in order.
template <typename... Args>
inline int launch(void (*kernel)(Args...), const unsigned* grid, const unsigned* block,
                  size_t smem_bytes, void** args) {
  const unsigned threads = block[0] * block[1] * block[2];
  if (threads == 0 || threads % WARP_SIZE != 0) return LAUNCH_BAD_BLOCK;
  const size_t num_blocks = size_t(grid[0]) * grid[1] * grid[2];
  if (num_blocks == 0) return LAUNCH_BAD_GRID;

  std::lock_guard<std::mutex> guard(launch_mutex);
  gridDim = dim3{grid[0], grid[1], grid[2]};
  blockDim = dim3{block[0], block[1], block[2]};
  std::vector<unsigned char> smem(std::max<size_t>(smem_bytes, 16));
  dynamic_smem = smem.data();
  WarpTurns barrier(int(threads / WARP_SIZE), seed_from_environment());
  block_barrier = &barrier;
  misaligned = false;
  misaligned_address = nullptr;
  std::vector<std::unique_ptr<WarpState>> warps;
  for (unsigned w = 0; w < threads / WARP_SIZE; ++w) warps.push_back(std::make_unique<WarpState>());
  auto body = [&](unsigned tid) {
    threadIdx = uint3{tid % block[0], (tid / block[0]) % block[1], tid / (block[0] * block[1])};
    const int warp = int(tid / WARP_SIZE);
    current_thread = ThreadState{warps[warp].get(), warp, int(tid % WARP_SIZE), 0};
    barrier.enter(warp);
    for (size_t b = 0; b < num_blocks; ++b) {
      if (tid == 0) std::memset(smem.data(), 0xFF, smem.size());
      barrier.sync(warp);
      blockIdx = uint3{unsigned(b % grid[0]), unsigned((b / grid[0]) % grid[1]),
                       unsigned(b / (size_t(grid[0]) * grid[1]))};
      call_kernel(kernel, args, std::index_sequence_for<Args...>{});
      // Threads that returned early still meet here; kernels in this project only return early
      // uniformly across the block, before any __syncthreads.
      if (b + 1 < num_blocks) {
        barrier.sync(warp);
      } else {
        barrier.leave(warp);
      }
    }
  };
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (unsigned t = 0; t < threads; ++t) pool.emplace_back(body, t);
  for (auto& t : pool) t.join();
  block_barrier = nullptr;
  dynamic_smem = nullptr;
  return misaligned ? LAUNCH_MISALIGNED : LAUNCH_OK;
}

}  // namespace cuattn_interp

// ---- CUDA built-ins used by the kernels -------------------------------------------------------

inline void __syncthreads() {
  cuattn_interp::block_barrier->sync(cuattn_interp::current_thread.warp_index);
}
inline void __syncwarp(unsigned = 0xffffffffu) {
  cuattn_interp::current_thread.warp->barrier.arrive_and_wait();
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

inline float atomicAdd(float* address, float value) {
  return std::atomic_ref<float>(*address).fetch_add(value, std::memory_order_relaxed);
}

inline int atomicAdd(int* address, int value) {
  return std::atomic_ref<int>(*address).fetch_add(value, std::memory_order_relaxed);
}

inline float __expf(float x) { return std::exp(x); }
inline float __exp2f(float x) { return std::exp2(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline int __float_as_int(float x) { return std::bit_cast<int>(x); }

// Exported launch entry for one kernel instantiation:
//   int SYMBOL(const unsigned grid[3], const unsigned block[3], size_t smem_bytes, void** args)
#define CUATTN_INTERP_ENTRY(symbol, ...)                                                        \
  extern "C" int symbol(const unsigned* grid, const unsigned* block, size_t smem_bytes,        \
                        void** args) {                                                          \
    return cuattn_interp::launch(&__VA_ARGS__, grid, block, smem_bytes, args);                  \
  }
