// Host Adam/AdamW step with a compact state: bf16 or blockwise-int8 moments, fp32 or bf16 masters.
//
// Built on first use by roundpipe/optim/build.py like adam.cpp (plain C ABI, ctypes, OpenMP). The
// element math mirrors roundpipe/optim/compact.py::torch_step and roundpipe/optim/quant.py operation by
// operation in float (the build disables fp contraction, so no hidden fmas on either side):
//   g  = (maximize ? -grad : grad) + cwd * p          (cwd: coupled weight decay, else 0)
//   x  = p * decay                                    (decay = 1 - lr * wd when decoupled, else 1)
//   m  = m0 + (g - m0) * (1 - beta1)
//   v  = v0 * beta2 + ((1 - beta2) * g) * g,  r = sqrt(v)
//   p' = x + (-lr / bc1) * m / (r * (1 / sqrt(bc2)) + eps)  written as the master wants it:
//        fp32; bf16 nearest-even; bf16 stochastic (16 hashed random bits added below the cut);
//        bf16 Kahan (y = (x - p) + upd + c; t = rne(p + y); c = rne(y - (t - p))).
//   state: fp32 / bf16 (nearest even) m and v, or int8: per block of `block_size` elements the absmax
//        A of m and R of r; codes round(127 sign(m) sqrt(|m| / A)) and round(255 sqrt(r / R)) (a positive
//        r never gets code 0); decoded m = q |q| A / 127^2, r = q^2 R / 255^2, v = r^2.
// Bytes per parameter of the int8 / bf16-master step: read g (2), p (2), m (1), v (1); write p, m, v
// (4), plus 16 bytes of scales per block: 10 bytes against 26-28 for the fp32 step.
//
// Two implementations of the same arithmetic: the scalar loops (tails, and CPUs without AVX2, where the
// compiler vectorises them) and, with AVX2, 8-lane intrinsics (namespace v8) giving the same bits in every
// lane (checked against the scalar build on NaN, infinite, subnormal and tie inputs). An element costs one
// sqrt and one divide, as in the fp32 step, plus two square roots to encode int8 codes; all share the
// core's one unpipelined divider (Zen 3: ~1.7 ns a ymm sqrt, ~1.1 ns a divide), so a compute-bound int8
// step spends ~0.7 ns an element in the divider alone, more than the whole fp32 step takes in cache.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "flush_denormals.h"

namespace {

constexpr int64_t kChunk = int64_t{1} << 15;
constexpr int64_t kParallelThreshold = int64_t{1} << 16;

enum StateKind { kStateF32 = 0, kStateBF16 = 1, kStateI8 = 2 };
enum MasterKind { kMasterF32 = 0, kMasterNearest = 1, kMasterStochastic = 2, kMasterKahan = 3 };
enum GradKind { kGradF32 = 0, kGradBF16 = 1 };

struct Hyper {
  float lerp_weight;  // 1 - beta1
  float beta2;
  float one_minus_beta2;
  float eps;
  float coupled_wd;  // coupled weight decay (0 when decoupled)
  float decay;       // decoupled: 1 - lr * wd, else 1
  float gsign;       // -1 with maximize
  int64_t block;
};

struct Tensor {
  void* p;
  const void* g;
  void* m;
  void* v;
  float* m_scale;
  float* v_scale;
  uint16_t* comp;
  int grad_kind;
  float neg_step_size;  // -lr / bc1
  float inv_bc2_sqrt;   // 1 / sqrt(bc2) (torch divides by a scalar as a multiply by its reciprocal)
  uint32_t sr_base;
};

struct WorkItem {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

inline float bf16_to_f32(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline uint32_t f32_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
}

// Round to nearest even, as c10::BFloat16 (NaN -> 0x7FC0).
inline uint16_t f32_to_bf16(float x) {
  const uint32_t b = f32_bits(x);
  const uint32_t r = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  return x != x ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(r);
}

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// As roundpipe/optim/quant.py::sr_base.
uint32_t sr_base(uint64_t seed, uint64_t step, uint64_t pid) {
  uint32_t h = mix32(static_cast<uint32_t>(pid + 0x9E3779B9u));
  h = mix32(h ^ static_cast<uint32_t>(step));
  return mix32(h ^ static_cast<uint32_t>(seed) ^ mix32(static_cast<uint32_t>(seed >> 32)));
}

inline uint16_t f32_to_bf16_sr(float x, uint32_t rnd) {
  const uint32_t b = f32_bits(x);
  const uint32_t r = (b + (rnd & 0xFFFFu)) >> 16;
  return x != x ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(r);
}

// Raw pointers of one tensor for one range (offset to the range's first element: the loops index with
// 32-bit locals, ranges being at most a work item long).
template <int M, int G>
struct Ptrs {
  using P = typename std::conditional<M == kMasterF32, float, uint16_t>::type;
  using GT = typename std::conditional<G == kGradBF16, uint16_t, float>::type;
  P* __restrict p;
  const GT* __restrict g;
  uint16_t* __restrict comp;
  Ptrs(const Tensor& t, int64_t begin)
      : p(static_cast<P*>(t.p) + begin), g(static_cast<const GT*>(t.g) + begin), comp(t.comp == nullptr ? nullptr : t.comp + begin) {}
};

inline float widen(float x) { return x; }
inline float widen(uint16_t x) { return bf16_to_f32(x); }

// The update of element i of the range (element base + i of the tensor, ``base`` its index mod 2^32 for
// the rounding hash): writes the parameter (and Kahan compensation); returns new m, v, r.
template <int M, int G>
inline void update_element(const Ptrs<M, G>& q, const Tensor& t, const Hyper& h, int32_t i, uint32_t base, float m0,
                           float v0, float& mo, float& vo, float& ro) {
  const float gr = widen(q.g[i]);
  const float pf = widen(q.p[i]);
  const float g = (h.gsign < 0.0f ? -gr : gr) + h.coupled_wd * pf;
  const float x = pf * h.decay;
  const float m = m0 + (g - m0) * h.lerp_weight;
  const float v = v0 * h.beta2 + (h.one_minus_beta2 * g) * g;
  const float r = std::sqrt(v);
  const float upd = (t.neg_step_size * m) / (r * t.inv_bc2_sqrt + h.eps);
  if constexpr (M == kMasterF32) {
    q.p[i] = x + upd;
  } else if constexpr (M == kMasterNearest) {
    q.p[i] = f32_to_bf16(x + upd);
  } else if constexpr (M == kMasterStochastic) {
    q.p[i] = f32_to_bf16_sr(x + upd, mix32((base + static_cast<uint32_t>(i)) ^ t.sr_base));
  } else {
    const float y = ((x - pf) + upd) + bf16_to_f32(q.comp[i]);
    const uint16_t nt = f32_to_bf16(pf + y);
    q.comp[i] = f32_to_bf16(y - (bf16_to_f32(nt) - pf));
    q.p[i] = nt;
  }
  mo = m;
  vo = v;
  ro = r;
}

// int8 codes of a block's new m and r (minv, rinv: 1 / the block's absmax, or 0).
inline int8_t m_code(float m, float minv) {
  const float a = std::nearbyint(std::sqrt(std::fabs(m) * minv) * 127.0f);
  return static_cast<int8_t>(static_cast<int32_t>(m < 0.0f ? -a : a));
}

inline uint8_t r_code(float r, float rinv) {
  float c = std::nearbyint(std::sqrt(r * rinv) * 255.0f);
  c = (c == 0.0f && r > 0.0f) ? 1.0f : c;
  return static_cast<uint8_t>(static_cast<int32_t>(c));
}

// An int8 block whose codes are still to write: its new m and r (in mb, rb) and absmax inverses.
struct Pending {
  int32_t b0 = 0, nb = 0;
  float minv = 0.0f, rinv = 0.0f;
  const float* mb = nullptr;
  const float* rb = nullptr;
};

// Writes the codes of a pending int8 block from element j on (the vector path did those before j).
inline void finish_codes(const Pending& pb, int32_t j, int8_t* mq_range, uint8_t* vq_range) {
  const float* __restrict mb = pb.mb;
  const float* __restrict rb = pb.rb;
  int8_t* __restrict mq = mq_range + pb.b0;
  uint8_t* __restrict vq = vq_range + pb.b0;
  const float minv = pb.minv, rinv = pb.rinv;
#pragma omp simd
  for (int32_t e = j; e < pb.nb; ++e) {
    mq[e] = m_code(mb[e], minv);
    vq[e] = r_code(rb[e], rinv);
  }
}

#ifdef __AVX2__
#include "compact_adam_avx2.h"  // namespace v8: the same arithmetic on 8 lanes
#endif  // __AVX2__

template <int S, int M, int G>
void step_range(const Tensor& t_in, const Hyper& h_in, int64_t begin, int64_t end) {
  // Local copies of the scalars: the state stores (float m, v, scales) could otherwise alias the
  // caller's structs, and the compiler would reload every scalar for every element.
  const Tensor t = t_in;
  const Hyper h = h_in;
  const Ptrs<M, G> q(t, begin);
  const int32_t n = static_cast<int32_t>(end - begin);  // at most one work item
  const uint32_t base = static_cast<uint32_t>(begin);
  // Groups of W = 8 H elements; two halves when every array is 16 or 8 bits wide (see v8).
  constexpr int H = S != kStateF32 && M != kMasterF32 && G == kGradBF16 ? 2 : 1;
  [[maybe_unused]] constexpr int32_t W = 8 * H;
  if constexpr (S != kStateI8) {
    using T = typename std::conditional<S == kStateF32, float, uint16_t>::type;
    T* __restrict m = static_cast<T*>(t.m) + begin;
    T* __restrict v = static_cast<T*>(t.v) + begin;
    int32_t i = 0;
#ifdef __AVX2__
    i = v8::run<M, G, H>(q, t, h, base, n, m, v);
#endif
#pragma omp simd  // the tail, or the whole range without AVX2 (vectorised for the ISA at hand)
    for (int32_t e = i; e < n; ++e) {
      float mo, vo, ro;
      update_element<M, G>(q, t, h, e, base, widen(m[e]), widen(v[e]), mo, vo, ro);
      if constexpr (S == kStateF32) m[e] = mo, v[e] = vo;
      if constexpr (S == kStateBF16) m[e] = f32_to_bf16(mo), v[e] = f32_to_bf16(vo);
    }
  } else {
    // int8: whole blocks (work items start on block boundaries). Pass 1 steps a block and keeps its new m
    // and r (in cache); pass 2 encodes them against the block's new absmaxes, here when the next block
    // is stepped (the vector path interleaves the two).
    static thread_local std::vector<float> buf;
    if (static_cast<int64_t>(buf.size()) < 4 * h.block) buf.resize(static_cast<size_t>(4 * h.block));
    int8_t* __restrict mq = static_cast<int8_t*>(t.m) + begin;
    uint8_t* __restrict vq = static_cast<uint8_t*>(t.v) + begin;
    const int32_t block = static_cast<int32_t>(h.block);
    int64_t blk = begin / h.block;
    Pending pb;  // the previous block, its codes still to write
    for (int32_t b0 = 0; b0 < n; b0 += block, ++blk) {
      float* __restrict mb = buf.data() + (pb.mb == buf.data() ? 2 * h.block : 0);  // not the pending pair
      float* __restrict rb = mb + h.block;
      const int32_t nb = std::min(block, n - b0);
      const float dm = t.m_scale[blk] * static_cast<float>(1.0 / (127.0 * 127.0));
      const float dr = t.v_scale[blk] * static_cast<float>(1.0 / (255.0 * 255.0));
      float amax = 0.0f, rmax = 0.0f;
      int32_t j = 0, jp = 0;
#ifdef __AVX2__
      j = v8::run_i8<M, G, H>(q, t, h, base, b0, nb, mq, vq, dm, dr, mb, rb, amax, rmax, pb);
      jp = pb.nb / W * W;
#endif
      finish_codes(pb, jp, mq, vq);
#pragma omp simd reduction(max : amax, rmax)
      for (int32_t e = j; e < nb; ++e) {
        const float qm = static_cast<float>(mq[b0 + e]);
        const float qr = static_cast<float>(vq[b0 + e]);
        const float r0 = (qr * qr) * dr;
        float mo, vo, ro;
        update_element<M, G>(q, t, h, b0 + e, base, (qm * std::fabs(qm)) * dm, r0 * r0, mo, vo, ro);
        mb[e] = mo;
        rb[e] = ro;
        amax = std::max(amax, std::fabs(mo));
        rmax = std::max(rmax, ro);
      }
      pb = {b0, nb, amax > 0.0f ? 1.0f / amax : 0.0f, rmax > 0.0f ? 1.0f / rmax : 0.0f, mb, rb};
      t.m_scale[blk] = amax;
      t.v_scale[blk] = rmax;
    }
    int32_t jp = 0;
#ifdef __AVX2__
    jp = v8::Codes<H>(pb, mq, vq).drain();
#endif
    finish_codes(pb, jp, mq, vq);
  }
}

using RangeFn = void (*)(const Tensor&, const Hyper&, int64_t, int64_t);

template <int S, int M>
RangeFn pick_grad(int g) {
  return g == kGradBF16 ? &step_range<S, M, kGradBF16> : &step_range<S, M, kGradF32>;
}

template <int S>
RangeFn pick_master(int m, int g) {
  switch (m) {
    case kMasterNearest:
      return pick_grad<S, kMasterNearest>(g);
    case kMasterStochastic:
      return pick_grad<S, kMasterStochastic>(g);
    case kMasterKahan:
      return pick_grad<S, kMasterKahan>(g);
    default:
      return pick_grad<S, kMasterF32>(g);
  }
}

RangeFn pick(int s, int m, int g) {
  if (s == kStateI8) return pick_master<kStateI8>(m, g);
  if (s == kStateBF16) return pick_master<kStateBF16>(m, g);
  return pick_master<kStateF32>(m, g);
}

}  // namespace

extern "C" {

// Bumped whenever the signature below changes; optim/build.py refuses a library of another version.
int32_t rpp_abi_version() { return 4; }

// One compact Adam step over the n_tensors tensors of one parameter group.
//   params: fp32 (master_kind 0) or bf16 data; grads: fp32 or bf16 per grad_kinds (0 / 1)
//   exp_avgs, exp_avg_sqs: fp32 / bf16 (p's numel) or int8 / uint8 codes; *_scales: fp32 per block
//   (int8 only); kahan_comps: bf16 (master_kind 3 only); steps: float32 counters, incremented here
//   param_ids: each tensor's position in the optimizer (stochastic-rounding stream)
//   flush_denormals: run the loops with subnormal inputs and results taken as zero (flush_denormals.h)
// Returns 0.
int32_t rpp_compact_adam(int64_t n_tensors, const uint64_t* params, const uint64_t* grads, const uint64_t* exp_avgs,
                         const uint64_t* exp_avg_sqs, const uint64_t* exp_avg_scales,
                         const uint64_t* exp_avg_sq_scales, const uint64_t* kahan_comps, const uint64_t* steps,
                         const int32_t* grad_kinds, const int64_t* numels, const int64_t* param_ids, double lr,
                         double beta1, double beta2, double eps, double weight_decay, int32_t maximize,
                         int32_t decoupled, int32_t state_kind, int32_t master_kind, int32_t block_size,
                         int32_t num_threads, int64_t seed, int32_t flush_denormals) {
  Hyper h;
  h.lerp_weight = static_cast<float>(1.0 - beta1);
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  h.eps = static_cast<float>(eps);
  h.coupled_wd = decoupled ? 0.0f : static_cast<float>(weight_decay);
  h.decay = decoupled ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  h.gsign = maximize ? -1.0f : 1.0f;
  h.block = block_size;
  const RangeFn fns[2] = {pick(state_kind, master_kind, kGradF32), pick(state_kind, master_kind, kGradBF16)};
  // Work items of whole blocks for int8 (a block's scale is written by one thread).
  const int64_t chunk = state_kind == kStateI8 ? std::max<int64_t>(block_size, kChunk / block_size * block_size) : kChunk;

  std::vector<Tensor> ts(static_cast<size_t>(n_tensors));
  std::vector<WorkItem> items;
  int64_t total = 0;
  for (int64_t k = 0; k < n_tensors; ++k) {
    float* step = reinterpret_cast<float*>(steps[k]);
    *step += 1.0f;
    const double st = static_cast<double>(*step);
    Tensor& t = ts[k];
    t.p = reinterpret_cast<void*>(params[k]);
    t.g = reinterpret_cast<const void*>(grads[k]);
    t.m = reinterpret_cast<void*>(exp_avgs[k]);
    t.v = reinterpret_cast<void*>(exp_avg_sqs[k]);
    t.m_scale = reinterpret_cast<float*>(exp_avg_scales[k]);
    t.v_scale = reinterpret_cast<float*>(exp_avg_sq_scales[k]);
    t.comp = reinterpret_cast<uint16_t*>(kahan_comps[k]);
    t.grad_kind = grad_kinds[k];
    t.neg_step_size = static_cast<float>(-(lr / (1.0 - std::pow(beta1, st))));
    t.inv_bc2_sqrt = static_cast<float>(1.0 / std::pow(1.0 - std::pow(beta2, st), 0.5));
    t.sr_base = sr_base(static_cast<uint64_t>(seed), static_cast<uint64_t>(st), static_cast<uint64_t>(param_ids[k]));
    for (int64_t b = 0; b < numels[k]; b += chunk) items.push_back({k, b, std::min(numels[k], b + chunk)});
    total += numels[k];
  }
  const int64_t n_items = static_cast<int64_t>(items.size());
  const bool parallel = num_threads > 1 && total >= kParallelThreshold;
#pragma omp parallel num_threads(num_threads) if (parallel)
  {
    const rpp::FlushDenormals ftz(flush_denormals != 0);  // per thread: each member sets its own mode
#pragma omp for schedule(static)
    for (int64_t k = 0; k < n_items; ++k) {
      const WorkItem& w = items[k];
      const Tensor& t = ts[w.tensor];
      fns[t.grad_kind == kGradBF16 ? 1 : 0](t, h, w.begin, w.end);
    }
  }
  return 0;
}

}  // extern "C"
