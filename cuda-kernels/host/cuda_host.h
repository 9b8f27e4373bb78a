// The CUDA dialect of cuda-kernels/src/ as ordinary C++20, so the kernels run on the host's CPU
// (cuda-kernels/README.md, "The kernels on the CPU"). Include it before a kernel source.
//
// A launch runs the grid's blocks one after another on a pool of blockDim host threads, one per
// CUDA thread:
// - threadIdx, blockIdx, blockDim and gridDim are thread-local values the pool sets per block;
// - __shared__ variables are statics: only one block of one launch runs at a time (launches are
//   serialised by a process-wide lock), so each block has them to itself;
// - __syncthreads() is a barrier over the block's threads that have not returned (threads that
//   returned no longer count, as on the GPU);
// - __shfl_xor_sync() is a per-warp exchange buffer and a barrier over the warp's lanes; reading
//   a lane that has returned, or a mask other than the full warp, is reported as a fault;
// - atomicAdd() is std::atomic_ref's fetch_add.
// What this cannot show: timing, the memory model of a real warp (lanes here are threads that
// meet only at the barriers above), and the GPU's rounding (FMA contraction, its expf and powf).
//
// Supported: what the kernels use, checked by grep (README). Dynamic shared memory (extern
// __shared__) is not used by any kernel, so a launch asking for some bytes is refused.
#pragma once

#include <atomic>
#include <barrier>
#include <bit>
#include <cmath>
#include <cstdint>
#include <latch>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <type_traits>
#include <vector>

#include <math.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

struct uint3 {
    unsigned int x, y, z;
};
typedef uint3 dim3;

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

__device__ __forceinline__ float __int_as_float(int i) {
    return std::bit_cast<float>(i);
}

__device__ __forceinline__ long long min(long long a, long long b) {
    return a < b ? a : b;
}

// The launch geometry the Rust side passes (engine/src/backend/launch.rs `Launch`).
struct LsLaunch {
    unsigned int grid[3];
    unsigned int block;
    unsigned int shared_bytes;
};

// Launch results.
#define LS_HOST_OK 0
#define LS_HOST_BAD_GEOMETRY 1   // an empty grid, or a block of 0 or over 1024 threads
#define LS_HOST_DYNAMIC_SHARED 2 // shared_bytes > 0: no kernel uses dynamic shared memory
#define LS_HOST_NO_THREADS 3     // the pool's host threads could not be started
#define LS_HOST_WARP_FAULT 4     // a shuffle read a lane that had returned, or a partial mask

namespace ls_host {

constexpr unsigned warp_size = 32;

constexpr unsigned running = ~0u;

// One warp of the current block: the exchange buffer of __shfl_xor_sync (two slots, used in
// turn, so one barrier per shuffle suffices) and, per lane, how many shuffles it had made when
// it returned (`running` until then).
struct Warp {
    explicit Warp(unsigned lanes) : lanes(lanes), bar(lanes) {
        for (auto& r : returned_after) r.store(running);
    }
    unsigned lanes;
    std::barrier<> bar;
    std::uint32_t slots[2][warp_size] = {};
    std::atomic<unsigned> returned_after[warp_size];
};

// The synchronisation state of one block, made anew for each block of the grid.
struct Block {
    explicit Block(unsigned threads) : sync(threads) {
        for (unsigned first = 0; first < threads; first += warp_size)
            warps.push_back(std::make_unique<Warp>(std::min(warp_size, threads - first)));
    }
    std::barrier<> sync;
    std::vector<std::unique_ptr<Warp>> warps;
};

// Per host thread: the block it is running and the shuffles it has made in it.
inline thread_local Block* current = nullptr;
inline thread_local unsigned shuffles = 0;
inline std::atomic<int> fault{LS_HOST_OK};

inline std::mutex& launch_lock() {
    static std::mutex m;
    return m;
}

// Runs before each block (the completion step of the pool's block barrier, on one thread while
// the others wait): the next block's synchronisation state.
struct NextBlock {
    std::unique_ptr<Block>* block;
    unsigned threads;
    void operator()() noexcept { *block = std::make_unique<Block>(threads); }
};

// Runs `body` (the kernel call) for every thread of every block of the grid `g`.
template <class Body> int launch(const LsLaunch& g, Body body) {
    const unsigned n = g.block;
    const unsigned long long blocks = (unsigned long long)g.grid[0] * g.grid[1] * g.grid[2];
    if (n == 0 || n > 1024 || blocks == 0) return LS_HOST_BAD_GEOMETRY;
    if (g.shared_bytes != 0) return LS_HOST_DYNAMIC_SHARED;

    std::lock_guard<std::mutex> serial(launch_lock());
    fault.store(LS_HOST_OK);
    std::unique_ptr<Block> block;
    std::barrier<NextBlock> next(n, NextBlock{&block, n});
    std::latch start(1);
    std::atomic<bool> abandon{false};

    auto thread = [&](unsigned t) {
        start.wait();
        if (abandon.load()) return;
        threadIdx = {t, 0, 0};
        blockDim = {n, 1, 1};
        gridDim = {g.grid[0], g.grid[1], g.grid[2]};
        for (unsigned long long b = 0; b < blocks; b++) {
            next.arrive_and_wait(); // every thread has left the previous block
            blockIdx = {(unsigned)(b % g.grid[0]), (unsigned)(b / g.grid[0] % g.grid[1]),
                        (unsigned)(b / g.grid[0] / g.grid[1])};
            current = block.get();
            shuffles = 0;
            body();
            // Returned: no longer part of the block's or the warp's barriers.
            Warp& w = *current->warps[t / warp_size];
            w.returned_after[t % warp_size].store(shuffles);
            w.bar.arrive_and_drop();
            current->sync.arrive_and_drop();
        }
        current = nullptr;
    };

    std::vector<std::thread> pool;
    pool.reserve(n);
    try {
        for (unsigned t = 0; t < n; t++) pool.emplace_back(thread, t);
    } catch (const std::system_error&) {
        abandon.store(true);
    }
    start.count_down();
    for (auto& p : pool) p.join();
    if (abandon.load()) return LS_HOST_NO_THREADS;
    return fault.load();
}

inline void report(int code) {
    int ok = LS_HOST_OK;
    fault.compare_exchange_strong(ok, code);
}

} // namespace ls_host

__device__ __forceinline__ void __syncthreads() {
    ls_host::current->sync.arrive_and_wait();
}

// v from lane (this lane ^ lane_mask) of the warp; every lane of `mask` must call it.
template <class T> __device__ __forceinline__ T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
    static_assert(sizeof(T) == 4 && std::is_trivially_copyable_v<T>, "32-bit shuffles only");
    using namespace ls_host;
    Warp& w = *current->warps[threadIdx.x / warp_size];
    const unsigned lane = threadIdx.x % warp_size;
    const unsigned src = lane ^ (unsigned)lane_mask;
    const unsigned k = shuffles++;
    std::uint32_t(&slot)[warp_size] = w.slots[k % 2];
    slot[lane] = std::bit_cast<std::uint32_t>(v);
    w.bar.arrive_and_wait();
    // Written before the barrier, and not overwritten before the next one: a lane writes this
    // slot again two shuffles later, after every lane has passed the barrier in between. A lane
    // that returned before making shuffle k wrote nothing for it.
    if (mask != 0xffffffffu || w.lanes != warp_size || src >= warp_size ||
        w.returned_after[src].load() <= k) {
        report(LS_HOST_WARP_FAULT);
        return v;
    }
    return std::bit_cast<T>(slot[src]);
}

__device__ __forceinline__ unsigned atomicAdd(unsigned* address, unsigned v) {
    return std::atomic_ref<unsigned>(*address).fetch_add(v);
}

__device__ __forceinline__ float atomicAdd(float* address, float v) {
    return std::atomic_ref<float>(*address).fetch_add(v);
}
