// Flush-to-zero and denormals-are-zero for the optimizer kernels' threads (x86 MXCSR; a no-op elsewhere).
//
// An Adam moment that decays under zero gradients (an expert no token reached: m *= beta1 per step) passes
// through the subnormal range, where every float operation on it takes a microcode assist: 15-45x slower per
// element measured on a Xeon (fp32 and compact kernels). With the modes set, such values (below 1.2e-38)
// read and write as zero; nothing else changes. The mode is per thread: each member of a parallel region
// constructs one (set on entry, restored on exit), so no thread outside the step is affected.

#pragma once

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define RPP_HAVE_MXCSR 1
#endif

namespace rpp {

class FlushDenormals {
 public:
  explicit FlushDenormals(bool on) {
#ifdef RPP_HAVE_MXCSR
    on_ = on;
    if (on_) {
      saved_ = _mm_getcsr();
      _mm_setcsr(saved_ | 0x8040u);  // FTZ (bit 15) | DAZ (bit 6)
    }
#else
    (void)on;
#endif
  }
  ~FlushDenormals() {
#ifdef RPP_HAVE_MXCSR
    if (on_) _mm_setcsr(saved_);
#endif
  }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
#ifdef RPP_HAVE_MXCSR
  bool on_ = false;
  unsigned int saved_ = 0;
#endif
};

}  // namespace rpp
