#pragma once
// The barrier that ends each phase of a fused decode step (decode_phases.h), and what it costs.
//
// Why its own file: a batch-1 step passes ~8 barriers a layer (240 a token on SmolLM2), a few
// microseconds apart. libgomp's `omp barrier` spins GOMP_SPINCOUNT iterations (the server sets 1000,
// docs/benchmarks.md "Threads") and then sleeps in a futex, so a phase that ends later than that on
// one thread costs the others a wake-up. llama.cpp's threadpool spins on an atomic instead
// (ggml_barrier). Both are here behind one call, chosen per stack at run time, so that one process
// can measure them alternately:
//   - kOmp: `#pragma omp barrier` (the default);
//   - kSpin: an atomic counter; a waiter spins with `pause` for up to `spin_us`, then sleeps in a
//     futex, so a partner that the OS descheduled (another process holds its core) is not starved.
// With a BarrierLog, each barrier's arrival and departure are time-stamped per thread: the stack
// adds up how long threads waited and how much of it came after the last thread had arrived (the
// barrier's own cost, as against the phases' imbalance).

#include <immintrin.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <vector>

namespace tm_step {

enum BarrierKind : int64_t { kOmp = 0, kSpin = 1 };

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A counting barrier over one team: the last thread to arrive bumps the generation; the others
// spin on it, then sleep on it (futex) past the spin budget.
class SpinBarrier {
 public:
  void wait(int team, int64_t spin_ns) {
    const uint32_t gen = gen_.load(std::memory_order_acquire);  // cannot move before this thread arrives
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == team) {
      arrived_.store(0, std::memory_order_relaxed);  // published by the bump below
      gen_.fetch_add(1, std::memory_order_seq_cst);
      // seq_cst on both sides: either a sleeper's count is seen here, or its futex sees the new gen.
      if (sleepers_.load(std::memory_order_seq_cst) > 0) futex(FUTEX_WAKE_PRIVATE, INT_MAX);
      return;
    }
    const int64_t deadline = now_ns() + spin_ns;
    for (int i = 1;; ++i) {
      if (gen_.load(std::memory_order_acquire) != gen) return;
      _mm_pause();
      if ((i & 63) == 0 && now_ns() > deadline) break;  // the clock is read rarely: it costs ~20 ns
    }
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    while (gen_.load(std::memory_order_seq_cst) == gen) futex(FUTEX_WAIT_PRIVATE, gen);
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
  }

 private:
  long futex(int op, uint32_t value) {
    return syscall(SYS_futex, reinterpret_cast<uint32_t*>(&gen_), op, value, nullptr, nullptr, 0);
  }
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "the futex word is the atomic itself");

  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<uint32_t> gen_{0};  // own cache line: the waiters poll it
  alignas(64) std::atomic<int> sleepers_{0};
};

// One thread's time stamps (ns) of every barrier of a step, in order (every thread passes the same
// barriers in the same order, which is what lets the stack line them up).
struct BarrierLog {
  std::vector<int64_t> arrive, depart;
};

// Totals over the steps a stack ran while it kept logs (see StepBarrier::add).
struct BarrierStats {
  int64_t steps = 0, barriers = 0;  // barriers: per step, counted once for the team
  double step_ns = 0;  // wall time of the steps' parallel regions
  double wait_ns = 0;  // summed over threads: departure - arrival
  double late_ns = 0;  // summed over threads: departure - the last thread's arrival

  std::vector<double> values() const {
    return {static_cast<double>(steps), static_cast<double>(barriers), step_ns, wait_ns, late_ns};
  }
};

// A stack's barrier setting and the state it keeps between steps.
struct StepBarrier {
  BarrierKind kind = kOmp;
  int64_t spin_ns = 50'000;
  bool logging = false;
  SpinBarrier spin;
  BarrierStats stats;

  // Adds one step's logs (one per thread) to the totals.
  void add(const std::vector<BarrierLog>& logs, int64_t step_ns) {
    const size_t n = logs.empty() ? 0 : logs[0].arrive.size();
    stats.steps += 1;
    stats.barriers += static_cast<int64_t>(n);
    stats.step_ns += static_cast<double>(step_ns);
    for (size_t b = 0; b < n; ++b) {
      int64_t last = 0;
      for (const BarrierLog& l : logs) last = std::max(last, l.arrive[b]);
      for (const BarrierLog& l : logs) {
        stats.wait_ns += static_cast<double>(l.depart[b] - l.arrive[b]);
        stats.late_ns += static_cast<double>(std::max<int64_t>(0, l.depart[b] - last));
      }
    }
  }
};

// What a thread of the team needs to pass the step's barriers.
struct Sync {
  StepBarrier* barrier;
  BarrierLog* log;  // nullptr: not logging
  int team;

  void operator()() {
    const int64_t t0 = log != nullptr ? now_ns() : 0;
    if (barrier->kind == kSpin) {
      barrier->spin.wait(team, barrier->spin_ns);
    } else {
#pragma omp barrier
    }
    if (log != nullptr) {
      log->arrive.push_back(t0);
      log->depart.push_back(now_ns());
    }
  }
};

}  // namespace tm_step
