// A small fixed-size thread pool for the CPU backend: parallel_for splits an index range into
// contiguous blocks and runs them on the workers and the calling thread. Results never depend
// on the number of threads as long as each index is computed independently (the ops guarantee
// that), so the CPU reference stays deterministic across machines.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace lily::cpu {

/// Fixed set of worker threads. Not re-entrant: parallel_for must not be called from inside a
/// parallel_for body (nested calls run inline on the calling thread instead).
class ThreadPool {
 public:
  /// `threads` <= 0 means std::thread::hardware_concurrency() (at least 1). The calling thread
  /// counts as one of them, so `threads - 1` workers are started.
  explicit ThreadPool(int threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  /// Threads that take part in a parallel_for (workers + the caller).
  int size() const { return static_cast<int>(workers_.size()) + 1; }

  /// Calls body(begin, end) on disjoint blocks covering [0, n), each at least `grain` long
  /// (except possibly the last), and returns when all are done. Runs inline when n <= grain,
  /// when the pool has one thread, or when called from inside another parallel_for.
  /// An exception thrown by a body is rethrown here (the first one).
  void parallel_for(int64_t n, int64_t grain,
                    const std::function<void(int64_t begin, int64_t end)>& body);

 private:
  void worker_loop();
  void run_blocks();

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable work_done_;
  // The current job (guarded by mutex_ except the atomic-free counters read under it).
  const std::function<void(int64_t, int64_t)>* body_ = nullptr;
  int64_t n_ = 0;
  int64_t block_ = 0;
  int64_t next_block_ = 0;   // next block index to hand out
  int64_t n_blocks_ = 0;
  int busy_ = 0;             // workers still inside the current job
  uint64_t generation_ = 0;  // bumped for every job so workers wake once per job
  bool stopping_ = false;
  std::exception_ptr error_;
};

}  // namespace lily::cpu
