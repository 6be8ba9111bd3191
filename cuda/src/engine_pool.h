// engine_pool.h: a small persistent thread pool for the CPU backend's parallel loops.
//
// run(n, fn) calls fn(i) once for every i in [0, n), spread over the workers and the calling
// thread, and returns when all calls are done. Each index is computed entirely by one thread
// with the same code whatever the thread count, so results do not depend on it (engine.h,
// "Determinism"). Threads: KDT_ENGINE_THREADS if set (>= 1), else the hardware concurrency,
// capped at 16.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kdt {
namespace engine {

class ThreadPool {
 public:
  static int default_threads() {
    if (const char* env = std::getenv("KDT_ENGINE_THREADS")) {
      int n = std::atoi(env);
      if (n >= 1) return n < 64 ? n : 64;
    }
    unsigned hw = std::thread::hardware_concurrency();
    return hw == 0 ? 1 : (hw > 16 ? 16 : int(hw));
  }

  explicit ThreadPool(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { loop(); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int threads() const { return int(workers_.size()) + 1; }

  void run(int n, const std::function<void(int)>& fn) {
    if (n <= 0) return;
    if (workers_.empty() || n == 1) {
      for (int i = 0; i < n; ++i) fn(i);
      return;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      fn_ = &fn;
      n_ = n;
      next_.store(0);
      busy_ = int(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
    work();
    std::unique_lock<std::mutex> lk(mu_);
    done_.wait(lk, [this] { return busy_ == 0; });
    fn_ = nullptr;
  }

 private:
  void work() {
    for (int i = next_.fetch_add(1); i < n_; i = next_.fetch_add(1)) (*fn_)(i);
  }
  void loop() {
    long seen = 0;
    while (true) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        wake_.wait(lk, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      work();
      std::lock_guard<std::mutex> lk(mu_);
      if (--busy_ == 0) done_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int)>* fn_ = nullptr;
  int n_ = 0, busy_ = 0;
  long generation_ = 0;
  std::atomic<int> next_{0};
  bool stop_ = false;
};

}  // namespace engine
}  // namespace kdt
