// ThreadPool implementation: one job at a time, blocks handed out under a mutex (blocks are
// large, so contention is negligible next to the matmul work inside them).
#include "backends/cpu/thread_pool.h"

#include <algorithm>

namespace lily::cpu {

namespace {
thread_local bool t_inside_parallel_for = false;
}

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::thread::hardware_concurrency());
  threads = std::max(threads, 1);
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::run_blocks() {
  t_inside_parallel_for = true;
  for (;;) {
    int64_t block;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (next_block_ >= n_blocks_ || error_ || body_ == nullptr) break;
      block = next_block_++;
    }
    int64_t begin = block * block_;
    int64_t end = std::min(n_, begin + block_);
    try {
      (*body_)(begin, end);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
    }
  }
  t_inside_parallel_for = false;
}

void ThreadPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_ready_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      ++busy_;
    }
    run_blocks();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --busy_;
    }
    work_done_.notify_all();
  }
}

void ThreadPool::parallel_for(int64_t n, int64_t grain,
                              const std::function<void(int64_t, int64_t)>& body) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  if (n <= grain || workers_.empty() || t_inside_parallel_for) {
    body(0, n);
    return;
  }
  // About 4 blocks per thread balances uneven blocks without many hand-outs.
  int64_t want_blocks = 4 * static_cast<int64_t>(size());
  int64_t block = std::max(grain, (n + want_blocks - 1) / want_blocks);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    body_ = &body;
    n_ = n;
    block_ = block;
    next_block_ = 0;
    n_blocks_ = (n + block - 1) / block;
    error_ = nullptr;
    ++generation_;
  }
  work_ready_.notify_all();
  run_blocks();
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    // Workers that have not woken yet would find no blocks left; wait only for those inside.
    work_done_.wait(lock, [&] { return busy_ == 0 && (next_block_ >= n_blocks_ || error_); });
    // A worker may still wake for this generation after we return. Leave no blocks to hand
    // out: after an error some were never taken, and clearing error_ alone would let that
    // late worker call the body we are about to drop.
    body_ = nullptr;
    next_block_ = n_blocks_ = 0;
    error = error_;
    error_ = nullptr;
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace lily::cpu
