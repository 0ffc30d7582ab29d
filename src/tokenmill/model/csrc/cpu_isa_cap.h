#pragma once
// The most of the CPU's instruction sets a process lets its kernels use: TOKENMILL_CPU_ISA = baseline,
// avx2, avx512 (AVX-512 without AMX) or amx (unset: all the CPU has). Every kernel's run-time ISA choice takes the lower of this
// and what the CPU reports.
//
// Why: most CPUs people run models on have no AVX-512 (Intel's client chips since Alder Lake, AMD
// before Zen 4), and their code paths (the AVX2 blocked kernel, quant_avx2.h; the AVX2 attention
// variants) must be run, tested and measured on machines that do have it, as such a CPU runs them.
// model/kernels/cpu_isa.py reads the same variable for the Python side's choices and rejects a value
// it does not know; here an unknown value means no cap.

#include <strings.h>

#include <cstdlib>

namespace tm_isa {

enum Cap : int { kCapBaseline = 0, kCapAvx2 = 1, kCapAvx512 = 2, kCapAmx = 3 };

inline int cap() {
  static const int value = [] {
    const char* s = std::getenv("TOKENMILL_CPU_ISA");
    if (s == nullptr) return int{kCapAmx};
    if (strcasecmp(s, "baseline") == 0) return int{kCapBaseline};
    if (strcasecmp(s, "avx2") == 0) return int{kCapAvx2};
    if (strcasecmp(s, "avx512") == 0) return int{kCapAvx512};
    return int{kCapAmx};
  }();
  return value;
}

inline bool allows(Cap level) { return cap() >= level; }

}  // namespace tm_isa
