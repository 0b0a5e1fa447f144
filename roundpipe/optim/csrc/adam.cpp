// Host Adam/AdamW step for fp32 tensors: one pass over memory per parameter, at memory bandwidth.
//
// Built on first use by roundpipe/optim/build.py (plain C ABI, loaded with ctypes: no torch headers,
// so the build takes about a second instead of the ~30 s a torch extension needs). The Python caller
// passes raw data pointers of contiguous fp32 tensors (complex64 as their real view) and keeps the
// tensors alive for the duration of the call.
//
// The element math mirrors torch.optim.Adam's single-tensor path (torch/optim/adam.py) operation by
// operation, in float, with the per-tensor scalars computed in double like Python does:
//   g  = maximize ? -grad : grad
//   decoupled:  p = p * (1 - lr * wd)          coupled:  g = g + wd * p
//   m  = lerp(m, g, 1 - beta1)
//   v  = v * beta2 + (1 - beta2) * g * g
//   vmax = max(vmax, v)                         (amsgrad; the denominator uses vmax)
//   p  = p + (-lr / bc1) * m / (sqrt(v) * (1 / sqrt(bc2)) + eps)
// (torch divides a tensor by a Python scalar as a multiply by the scalar's float reciprocal, so one
// division per element remains, beside one square root: the core's divider is the compute bound.)
// It reads p, g, m, v (and vmax) once and writes p, m, v (and vmax) once: 28 bytes per parameter,
// the memory-traffic floor of Adam in fp32. A gradient may also be bfloat16 (RoundPipe's host gradient
// buffers, read in place instead of copied to fp32 first: 26 bytes per parameter, and no fp32 gradient
// copy in memory); it is widened to float exactly, so the result equals stepping with grad.float().
// A tensor may also name a bfloat16 output (RoundPipe's model weights in a streamed step): the same
// loop then stores each updated parameter there too, rounded to nearest even as torch's copy_ does
// (2 more bytes per parameter, no second pass over the fp32 parameters).
//
// Subnormal floats: with flush_denormals each thread of the step runs its loop with them taken as zero
// (flush_denormals.h: moments that decay under zero gradients would otherwise cost 15-25x per element).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "flush_denormals.h"

namespace {

// Elements per work item: 32K floats = 128 KiB per stream. Large enough to amortise scheduling, small
// enough that two threads split even a single 1M-element tensor evenly.
constexpr int64_t kChunk = int64_t{1} << 15;
// Below this many elements in total the step runs on the calling thread: waking a thread team costs
// more than the work.
constexpr int64_t kParallelThreshold = int64_t{1} << 17;

enum WeightDecay { kNone = 0, kCoupled = 1, kDecoupled = 2 };

struct TensorScalars {
  float neg_step_size;  // -lr / (1 - beta1^step)
  float inv_bc2_sqrt;   // 1 / float(sqrt(1 - beta2^step)), as torch's tensor / scalar computes it
};

struct Hyper {
  float lerp_weight;    // 1 - beta1
  float beta2;
  float one_minus_beta2;
  float eps;
  float weight_decay;   // coupled: alpha of grad.add(param, alpha=wd)
  float decay;          // decoupled: 1 - lr * wd
};

struct WorkItem {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

// Gradient element types: fp32, or bfloat16 (the upper 16 bits of an fp32; widening is exact).
enum GradKind { kGradF32 = 0, kGradBF16 = 1 };

inline float load_grad(const float* g, int64_t i) { return g[i]; }

inline float load_grad(const uint16_t* g, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(g[i]) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// fp32 -> bfloat16, round to nearest even (c10::BFloat16's conversion; NaN -> 0x7FC0).
inline uint16_t to_bf16(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  const uint32_t r = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  return x != x ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(r);
}

struct Ptrs {
  float* p;
  const void* g;
  float* m;
  float* v;
  float* vmax;
  uint16_t* out;  // bf16 copy of the updated parameters, or null
};

template <typename G, bool kAmsgrad, bool kMaximize, int kWd, bool kSmallWeight, bool kOut>
void adam_range(const Ptrs t, int64_t begin, int64_t end, const Hyper h, const TensorScalars s) {
  float* __restrict p = t.p;
  const G* __restrict g_in = static_cast<const G*>(t.g);
  float* __restrict m = t.m;
  float* __restrict v = t.v;
  float* __restrict vmax = t.vmax;
  uint16_t* __restrict out = t.out;
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float g_raw_i = load_grad(g_in, i);
    float g = kMaximize ? -g_raw_i : g_raw_i;
    float param = p[i];
    if (kWd == kCoupled) g = std::fma(h.weight_decay, param, g);
    if (kWd == kDecoupled) param = param * h.decay;
    // torch's vectorised lerp: fmadd(weight, end - start, start), or from the end for weight >= 0.5.
    const float diff = g - m[i];
    const float mi = kSmallWeight ? std::fma(h.lerp_weight, diff, m[i]) : std::fma(h.lerp_weight - 1.0f, diff, g);
    // torch's addcmul: fmadd(value * t1, t2, self).
    const float vi = std::fma(h.one_minus_beta2 * g, g, v[i] * h.beta2);
    m[i] = mi;
    v[i] = vi;
    float vd = vi;
    if (kAmsgrad) {
      vd = std::max(vmax[i], vi);
      vmax[i] = vd;
    }
    const float denom = std::sqrt(vd) * s.inv_bc2_sqrt + h.eps;
    const float pi = param + s.neg_step_size * mi / denom;
    p[i] = pi;
    if (kOut) out[i] = to_bf16(pi);
  }
}

using RangeFn = void (*)(Ptrs, int64_t, int64_t, Hyper, TensorScalars);

// One function per combination of flags, so the loop carries no branch: [grad kind][bf16 output].
template <typename G, bool kAmsgrad, bool kMaximize, int kWd, bool kSmallWeight>
RangeFn pick_out(bool out) {
  return out ? &adam_range<G, kAmsgrad, kMaximize, kWd, kSmallWeight, true>
             : &adam_range<G, kAmsgrad, kMaximize, kWd, kSmallWeight, false>;
}

template <typename G, bool kAmsgrad, bool kMaximize, int kWd>
RangeFn pick_lerp(bool small_weight, bool out) {
  return small_weight ? pick_out<G, kAmsgrad, kMaximize, kWd, true>(out)
                      : pick_out<G, kAmsgrad, kMaximize, kWd, false>(out);
}

template <typename G, bool kAmsgrad, bool kMaximize>
RangeFn pick_wd(int wd, bool small_weight, bool out) {
  switch (wd) {
    case kCoupled:
      return pick_lerp<G, kAmsgrad, kMaximize, kCoupled>(small_weight, out);
    case kDecoupled:
      return pick_lerp<G, kAmsgrad, kMaximize, kDecoupled>(small_weight, out);
    default:
      return pick_lerp<G, kAmsgrad, kMaximize, kNone>(small_weight, out);
  }
}

template <typename G>
RangeFn pick_flags(bool amsgrad, bool maximize, int wd, bool small_weight, bool out) {
  if (amsgrad) {
    return maximize ? pick_wd<G, true, true>(wd, small_weight, out) : pick_wd<G, true, false>(wd, small_weight, out);
  }
  return maximize ? pick_wd<G, false, true>(wd, small_weight, out) : pick_wd<G, false, false>(wd, small_weight, out);
}

RangeFn pick(int grad_kind, bool amsgrad, bool maximize, int wd, bool small_weight, bool out) {
  if (grad_kind == kGradBF16) return pick_flags<uint16_t>(amsgrad, maximize, wd, small_weight, out);
  return pick_flags<float>(amsgrad, maximize, wd, small_weight, out);
}

}  // namespace

extern "C" {

// Bumped whenever the signature below changes; optim/build.py refuses a library of another version.
int32_t rpp_abi_version() { return 4; }

// One Adam step over n_tensors fp32 tensors of one parameter group.
//   params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs: data pointers (max_* read only if amsgrad)
//   grad_kinds: per tensor, 0 = fp32 gradient, 1 = bfloat16 gradient
//   steps: pointers to each tensor's float32 step counter, incremented here (as torch does first)
//   numels: float elements per tensor (2x the element count for complex64)
//   bf16_outs: per tensor, 0 or a bfloat16 buffer of numels elements that receives the updated
//     parameters (fp32 tensors only); may be null (no outputs)
//   flush_denormals: run the loops with subnormal inputs and results taken as zero (see the header)
// Returns 0.
int32_t rpp_adam_f32(int64_t n_tensors, const uint64_t* params, const uint64_t* grads, const int32_t* grad_kinds,
                     const uint64_t* exp_avgs, const uint64_t* exp_avg_sqs, const uint64_t* max_exp_avg_sqs,
                     const uint64_t* steps, const int64_t* numels, double lr, double beta1, double beta2, double eps,
                     double weight_decay, int32_t amsgrad, int32_t maximize, int32_t decoupled, int32_t num_threads,
                     const uint64_t* bf16_outs, int32_t flush_denormals) {
  // Scalars are computed in double and rounded to float once, as the Python expressions in
  // torch.optim.Adam are before the float kernels see them.
  Hyper h;
  const double lerp_weight = 1.0 - beta1;
  h.lerp_weight = static_cast<float>(lerp_weight);
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  h.eps = static_cast<float>(eps);
  h.weight_decay = static_cast<float>(weight_decay);
  h.decay = static_cast<float>(1.0 - lr * weight_decay);
  const int wd = weight_decay == 0.0 ? kNone : (decoupled ? kDecoupled : kCoupled);
  const bool small_weight = std::abs(h.lerp_weight) < 0.5f;
  RangeFn fns[2][2];  // [bf16 gradient][bf16 output]
  for (int gk = 0; gk < 2; ++gk) {
    for (int o = 0; o < 2; ++o) fns[gk][o] = pick(gk, amsgrad != 0, maximize != 0, wd, small_weight, o != 0);
  }

  std::vector<TensorScalars> scalars(static_cast<size_t>(n_tensors));
  std::vector<WorkItem> items;
  int64_t total = 0;
  for (int64_t t = 0; t < n_tensors; ++t) {
    float* step = reinterpret_cast<float*>(steps[t]);
    *step += 1.0f;
    const double st = static_cast<double>(*step);
    const double bc1 = 1.0 - std::pow(beta1, st);
    const double bc2 = 1.0 - std::pow(beta2, st);
    scalars[t].neg_step_size = static_cast<float>(-(lr / bc1));
    scalars[t].inv_bc2_sqrt = 1.0f / static_cast<float>(std::pow(bc2, 0.5));
    for (int64_t b = 0; b < numels[t]; b += kChunk) items.push_back({t, b, std::min(numels[t], b + kChunk)});
    total += numels[t];
  }

  const int64_t n_items = static_cast<int64_t>(items.size());
  const bool parallel = num_threads > 1 && total >= kParallelThreshold;
#pragma omp parallel num_threads(num_threads) if (parallel)
  {
    // The floating-point mode is per thread: each member of the team sets (and restores) its own.
    const rpp::FlushDenormals ftz(flush_denormals != 0);
    // Static schedule: equal-sized items in address order, so each thread streams one contiguous run.
#pragma omp for schedule(static)
    for (int64_t k = 0; k < n_items; ++k) {
      const WorkItem& w = items[k];
      const int64_t t = w.tensor;
      uint16_t* out = bf16_outs != nullptr ? reinterpret_cast<uint16_t*>(bf16_outs[t]) : nullptr;
      const Ptrs ptrs{reinterpret_cast<float*>(params[t]), reinterpret_cast<const void*>(grads[t]),
                      reinterpret_cast<float*>(exp_avgs[t]), reinterpret_cast<float*>(exp_avg_sqs[t]),
                      amsgrad ? reinterpret_cast<float*>(max_exp_avg_sqs[t]) : nullptr, out};
      fns[grad_kinds[t] == kGradBF16 ? 1 : 0][out != nullptr ? 1 : 0](ptrs, w.begin, w.end, h, scalars[t]);
    }
  }
  return 0;
}

}  // extern "C"
