// The synchronisation of a persistent kernel's task list (decode_program.h): blocks take tasks in
// list order from one fetch counter, wait on counters that earlier tasks signal, and signal their
// own when done. Counters only grow, and a launch finds its number in the fetch counter: with n
// tasks on G blocks every launch makes exactly n + G fetches (each block one past the end), so
// fetch v belongs to launch v / (n + G). Launch e waits for (e + 1) · a counter's producer count.
// Nothing is reset between launches, and a captured graph replays correctly with fixed arguments.
// One instance of a program runs at a time on one set of counters: launches of it follow each
// other on one stream, without programmatic dependent launch between them.
//
// Memory ordering, at GPU scope: a signal is a block barrier and a release reduction by one
// thread, so every global write of the block before it is visible to a block that sees the count;
// a wait is an acquire load by one thread followed by a block barrier. Data written by other
// blocks must then be read past L1 (ld.global.cg, bulk copies), which is not coherent.
#pragma once
#include <cstdint>

namespace lily::cuda {

/// A fetched task: the launch it belongs to and its index in the list (≥ the list's length: past
/// the end, the block is done).
struct TaskTicket {
  uint32_t launch;
  int64_t task;
};

/// The ticket of fetch value `v` in a list of `n_tasks` run by gridDim.x blocks (task_fetch's
/// numbering).
__device__ __forceinline__ TaskTicket task_ticket(unsigned long long v, int64_t n_tasks) {
  const unsigned long long per_launch = static_cast<unsigned long long>(n_tasks) + gridDim.x;
  return TaskTicket{static_cast<uint32_t>(v / per_launch), static_cast<int64_t>(v % per_launch)};
}

/// This block's next task of a list of `n_tasks` run by `gridDim.x` blocks: thread 0 takes it
/// with one atomic add on `next` (zero before the first launch, never reset), the block reads it
/// from `slot` (a __shared__ unsigned long long). All threads of the block call it and get the
/// same ticket.
__device__ __forceinline__ TaskTicket task_fetch(unsigned long long* next, int64_t n_tasks, unsigned long long* slot) {
  __syncthreads();  // every thread has read the last ticket
  if (threadIdx.x == 0) *slot = atomicAdd(next, 1ull);
  __syncthreads();
  return task_ticket(*slot, n_tasks);
}

/// How long counter_wait spins before it gives up with a trap (a missing producer would
/// otherwise hang the device): 5 s, far above any decode step.
constexpr uint64_t kCounterWaitTimeoutNs = 5'000'000'000ull;

/// Waits until counter `c` has reached `target` (compared modulo 2³², so counters may wrap).
/// Acquire: what the signalling blocks wrote before their signals is visible to this block
/// afterwards. Traps after kCounterWaitTimeoutNs. All threads of the block.
__device__ __forceinline__ void counter_wait(const uint32_t* c, uint32_t target) {
  if (threadIdx.x == 0) {
    uint32_t seen = 0;
    uint64_t start = 0, now = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    for (;;) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(c) : "memory");
      if (static_cast<int32_t>(seen - target) >= 0) break;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      if (now - start > kCounterWaitTimeoutNs) __trap();
    }
  }
  __syncthreads();
}

/// Adds this block's one signal to counter `c`. Release: every global write the block made
/// before the call is visible to a block whose counter_wait sees the signal (the barrier orders
/// the block's writes before thread 0's release reduction, which is cumulative). All threads;
/// thread 0 does not wait for the reduction to complete.
__device__ __forceinline__ void counter_signal(uint32_t* c) {
  __syncthreads();
  if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(c) : "memory");
}

/// Takes the ticket after this block's current one: thread 0's atomic add on `next`, whose
/// result is first needed when the current task is done, so its round trip overlaps the task.
/// Holding one ticket ahead keeps the list deadlock-free: the lowest unfinished task's producers
/// are all finished, and its block is running it (a block runs its tickets in the order it took
/// them, so one holding it ahead runs a lower, unfinished task, which contradicts lowest).
/// Thread 0 only.
__device__ __forceinline__ unsigned long long task_take_next(unsigned long long* next) { return atomicAdd(next, 1ull); }

}  // namespace lily::cuda
