// The AVX2 path of compact_adam.cpp (namespace v8). Not a standalone header: compact_adam.cpp includes
// it inside its anonymous namespace, after the scalar helpers and types it uses (Hyper, Tensor, Ptrs,
// the bf16 and hash helpers), under #ifdef __AVX2__ with <immintrin.h> already included. build.py hashes
// it with the .cpp, so an edit here rebuilds the library.
#pragma once

// The element math on 8 lanes: one IEEE operation per scalar operation in the same order, so each lane is
// the scalar result bit for bit. Written with intrinsics because the step is compute-bound on a few cores
// and the auto-vectorised loops spent most of their time on conversions (32 lanes per iteration with
// register spills, long widening / narrowing shuffle chains, NaN blends on every store):
// * H = 2 (every array 16 or 8 bits wide): groups of 16 elements as two halves, the even and the odd
//   elements (lane k of half e is element 2k + e): a bf16 pair widens with a shift and a mask and narrows
//   with a shift and a word blend, int8 codes widen with one vpmaddwd. H = 1: groups of 8, in order.
// * bf16 nearest even is b + 0x8000, less 1 on a tie with an even result, in the upper 16 bits (the scalar
//   rule for every non-NaN float); NaN lanes get 0x7FC0 on a rare branch.
// * The stochastic-rounding hash keeps its first xor-shift per 2^16 indices (Hash).
// * Software pipelining (pipeline): the sqrt and the divide of a group issue iterations before their
//   results are used, int8 codes are encoded a block late, so the divider overlaps the other work.
namespace v8 {

// The loops are only fast with every helper inlined (values stay in registers).
#define RPP_INLINE __attribute__((always_inline)) inline
#define RPP_INLINE_LAMBDA __attribute__((always_inline))

RPP_INLINE __m256i i32(int32_t x) { return _mm256_set1_epi32(x); }
RPP_INLINE __m256 bits_f(__m256i x) { return _mm256_castsi256_ps(x); }
RPP_INLINE __m256i f_bits(__m256 x) { return _mm256_castps_si256(x); }
RPP_INLINE __m256 hi_mask() { return bits_f(i32(static_cast<int32_t>(0xFFFF0000u))); }
RPP_INLINE __m256 abs_mask() { return bits_f(i32(0x7FFFFFFF)); }
RPP_INLINE __m128i ld128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }

RPP_INLINE void load(const float* p, __m256 (&o)[1]) { o[0] = _mm256_loadu_ps(p); }
RPP_INLINE void load(const uint16_t* p, __m256 (&o)[1]) {
  o[0] = bits_f(_mm256_slli_epi32(_mm256_cvtepu16_epi32(ld128(p)), 16));
}
RPP_INLINE void load(const uint16_t* p, __m256 (&o)[2]) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  o[0] = bits_f(_mm256_slli_epi32(x, 16));
  o[1] = _mm256_and_ps(bits_f(x), hi_mask());
}

// int8 / uint8 codes as floats.
template <typename C>
RPP_INLINE void load_codes(const C* p, __m256 (&o)[1]) {
  const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  o[0] = _mm256_cvtepi32_ps(std::is_signed<C>::value ? _mm256_cvtepi8_epi32(x) : _mm256_cvtepu8_epi32(x));
}
template <typename C>
RPP_INLINE void load_codes(const C* p, __m256 (&o)[2]) {
  const __m256i w = std::is_signed<C>::value ? _mm256_cvtepi8_epi16(ld128(p)) : _mm256_cvtepu8_epi16(ld128(p));
  o[0] = _mm256_cvtepi32_ps(_mm256_madd_epi16(w, i32(1)));        // even words, sign-extended
  o[1] = _mm256_cvtepi32_ps(_mm256_madd_epi16(w, i32(0x10000)));  // odd words
}

// Stores the bf16 in the upper 16 bits of each lane.
RPP_INLINE void store_hi16(uint16_t* p, const __m256i (&r)[1]) {
  const __m256i s = _mm256_srli_epi32(r[0], 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1)));
}
RPP_INLINE void store_hi16(uint16_t* p, const __m256i (&r)[2]) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_blend_epi16(_mm256_srli_epi32(r[0], 16), r[1], 0xAA));
}

// Stores the low byte of each lane (truncation, as the scalar int32 -> int8 cast). bytes(a, b, c, d): a
// shuffle moving byte 0 of each 32-bit lane to bytes a..d of its 128-bit half (-1: zero).
RPP_INLINE __m256i bytes(char a, char b, char c, char d, char e, char f, char g, char h) {
  return _mm256_setr_epi8(a, b, c, d, e, f, g, h, -1, -1, -1, -1, -1, -1, -1, -1, a, b, c, d, e, f, g, h, -1, -1, -1, -1,
                          -1, -1, -1, -1);
}
template <typename C>
RPP_INLINE void store_codes(C* p, const __m256i (&c)[1]) {
  const __m256i s = _mm256_shuffle_epi8(c[0], bytes(0, 4, 8, 12, -1, -1, -1, -1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_unpacklo_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1)));
}
template <typename C>
RPP_INLINE void store_codes(C* p, const __m256i (&c)[2]) {
  const __m256i e = _mm256_shuffle_epi8(c[0], bytes(0, -1, 4, -1, 8, -1, 12, -1));
  const __m256i o = _mm256_shuffle_epi8(c[1], bytes(-1, 0, -1, 4, -1, 8, -1, 12));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_or_si256(e, o), 8)));
}

// bf16 nearest even in the upper 16 bits (non-NaN lanes); nan_fix gives NaN lanes 0x7FC0 as the scalar.
RPP_INLINE __m256i rne_hi(__m256 x) {
  const __m256i b = f_bits(x);
  const __m256i tie_even = _mm256_cmpeq_epi32(_mm256_and_si256(b, i32(0x1FFFF)), i32(0x8000));
  return _mm256_add_epi32(_mm256_add_epi32(b, i32(0x8000)), tie_even);
}
RPP_INLINE __m256i nan_fix(__m256i r, __m256 x) {
  return _mm256_blendv_epi8(r, i32(0x7FC00000), f_bits(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}

// The stochastic-rounding bits of the groups, in order. mix32's first step x ^ (x >> 16) of x = i ^ base
// is i ^ K with K = base ^ ((i ^ base) >> 16), the same for all i with the same upper 16 bits: each lane's
// K is recomputed only when the group's first or last index enters another 2^16 indices.
template <int H>
struct Hash {
  __m256i idx[H], key[H], base;
  uint32_t first, span = 0;
  Hash(uint32_t start, uint32_t sr_base) : base(i32(static_cast<int32_t>(sr_base))), first(start) {
    const __m256i s = i32(static_cast<int32_t>(start));
    if constexpr (H == 1) idx[0] = _mm256_add_epi32(s, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    if constexpr (H == 2) idx[0] = _mm256_add_epi32(s, _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    if constexpr (H == 2) idx[1] = _mm256_add_epi32(idx[0], i32(1));
    refresh();
  }
  uint32_t upper() const { return (first & 0xFFFF0000u) | ((first + 8 * H - 1) >> 16); }
  RPP_INLINE void refresh() {
    span = upper();
    for (int k = 0; k < H; ++k) key[k] = _mm256_xor_si256(base, _mm256_srli_epi32(_mm256_xor_si256(idx[k], base), 16));
  }
  // Random bits (low 16 of each lane) of the next group.
  RPP_INLINE void next(__m256i (&rnd)[H]) {
    if (__builtin_expect(upper() != span, 0)) refresh();
    for (int k = 0; k < H; ++k) {
      __m256i x = _mm256_mullo_epi32(_mm256_xor_si256(idx[k], key[k]), i32(0x7FEB352D));
      x = _mm256_mullo_epi32(_mm256_xor_si256(x, _mm256_srli_epi32(x, 15)), i32(static_cast<int32_t>(0x846CA68Bu)));
      rnd[k] = _mm256_and_si256(_mm256_xor_si256(x, _mm256_srli_epi32(x, 16)), i32(0xFFFF));
      idx[k] = _mm256_add_epi32(idx[k], i32(8 * H));
    }
    first += 8 * H;
  }
};

// The tensor's scalars, broadcast once per range (maximize flips the gradient's sign bit, as -g does).
struct Consts {
  __m256 gneg, cwd, decay, lw, b2, omb2, eps, inv_bc2, nss;
  Consts(const Tensor& t, const Hyper& h)
      : gneg(bits_f(i32(h.gsign < 0.0f ? static_cast<int32_t>(0x80000000u) : 0))), cwd(_mm256_set1_ps(h.coupled_wd)),
        decay(_mm256_set1_ps(h.decay)), lw(_mm256_set1_ps(h.lerp_weight)), b2(_mm256_set1_ps(h.beta2)),
        omb2(_mm256_set1_ps(h.one_minus_beta2)), eps(_mm256_set1_ps(h.eps)), inv_bc2(_mm256_set1_ps(t.inv_bc2_sqrt)),
        nss(_mm256_set1_ps(t.neg_step_size)) {}
};

// Stage A of update_element: the new moments and the numerator of the update.
RPP_INLINE void stage_a(const Consts& c, __m256 gin, __m256 pf, __m256 m0, __m256 v0, __m256& m, __m256& v, __m256& num) {
  const __m256 g = _mm256_add_ps(_mm256_xor_ps(gin, c.gneg), _mm256_mul_ps(c.cwd, pf));
  m = _mm256_add_ps(m0, _mm256_mul_ps(_mm256_sub_ps(g, m0), c.lw));
  v = _mm256_add_ps(_mm256_mul_ps(v0, c.b2), _mm256_mul_ps(_mm256_mul_ps(c.omb2, g), g));
  num = _mm256_mul_ps(c.nss, m);
}

// Stage S: r = sqrt(v) and the denominator of the update.
RPP_INLINE __m256 stage_s(const Consts& c, __m256 v, __m256& r) {
  r = _mm256_sqrt_ps(v);
  return _mm256_add_ps(_mm256_mul_ps(r, c.inv_bc2), c.eps);
}

// Stage D of one half: the update and the master's result (bf16 bits in p, Kahan compensation in cb).
struct Half {
  __m256 pf, comp, y, s, cf;
  __m256i rnd, p, cb;
};
template <int M>
RPP_INLINE void stage_d(const Consts& c, Half& e, __m256 num, __m256 den, bool nan) {
  if (!nan) {  // the common case; nan: the rare rerun of the rounding with the NaN rule
    const __m256 upd = _mm256_div_ps(num, den);
    const __m256 x = _mm256_mul_ps(e.pf, c.decay);
    e.y = M == kMasterKahan ? _mm256_add_ps(_mm256_add_ps(_mm256_sub_ps(x, e.pf), upd), e.comp) : _mm256_add_ps(x, upd);
    if constexpr (M == kMasterKahan) e.s = _mm256_add_ps(e.pf, e.y);
  }
  if constexpr (M == kMasterKahan) {
    e.p = nan ? nan_fix(e.p, e.s) : rne_hi(e.s);
    e.cf = _mm256_sub_ps(e.y, _mm256_sub_ps(_mm256_and_ps(bits_f(e.p), hi_mask()), e.pf));
    e.cb = nan ? nan_fix(rne_hi(e.cf), e.cf) : rne_hi(e.cf);
  } else if constexpr (M == kMasterNearest) {
    e.p = nan ? nan_fix(e.p, e.y) : rne_hi(e.y);
  } else if constexpr (M == kMasterStochastic) {
    e.p = nan ? nan_fix(e.p, e.y) : _mm256_add_epi32(f_bits(e.y), e.rnd);
  }
}

// Stage D of the group at i: the parameter (and compensation) from the group's numerators and denominators.
// Returns true (rarely) when a lane is NaN, so that the caller can round its own NaNs: a NaN m or v makes
// y (Kahan: s) NaN, so these probes find every lane that needs the NaN rule, the moments' included.
template <int M, int G, int H>
RPP_INLINE bool finish(const Ptrs<M, G>& q, const Consts& c, int32_t i, Hash<H>& hash, const __m256 (&num)[H],
                       const __m256 (&den)[H]) {
  Half e[H];
  __m256 pf[H], cp[H];
  __m256i rnd[H];
  load(q.p + i, pf);
  if constexpr (M == kMasterKahan) load(q.comp + i, cp);
  if constexpr (M == kMasterStochastic) hash.next(rnd);
  for (int k = 0; k < H; ++k) {
    e[k].pf = pf[k];
    if constexpr (M == kMasterKahan) e[k].comp = cp[k];
    if constexpr (M == kMasterStochastic) e[k].rnd = rnd[k];
    stage_d<M>(c, e[k], num[k], den[k], false);
  }
  __m256 nan = _mm256_cmp_ps(e[0].y, e[H - 1].y, _CMP_UNORD_Q);
  if constexpr (M == kMasterKahan) {
    nan = _mm256_or_ps(_mm256_cmp_ps(e[0].s, e[0].cf, _CMP_UNORD_Q), _mm256_cmp_ps(e[H - 1].s, e[H - 1].cf, _CMP_UNORD_Q));
  }
  const bool any = __builtin_expect(_mm256_movemask_ps(nan) != 0, 0);
  if (any) {
    for (int k = 0; k < H; ++k) stage_d<M>(c, e[k], num[k], den[k], true);
  }
  if constexpr (M == kMasterF32) {
    static_assert(H == 1, "fp32 masters use the in-order layout");
    _mm256_storeu_ps(q.p + i, e[0].y);
  } else {
    __m256i b[H], cb[H];
    for (int k = 0; k < H; ++k) b[k] = e[k].p, cb[k] = e[k].cb;
    store_hi16(q.p + i, b);
    if constexpr (M == kMasterKahan) store_hi16(q.comp + i, cb);
  }
  return any;
}

// Rounds and stores a group's new bf16 moments (fix: with the NaN rule).
template <int H>
RPP_INLINE void store_moments(uint16_t* m, uint16_t* v, const __m256 (&mo)[H], const __m256 (&vo)[H], bool fix) {
  __m256i bm[H], bv[H];
  for (int k = 0; k < H; ++k) {
    bm[k] = fix ? nan_fix(rne_hi(mo[k]), mo[k]) : rne_hi(mo[k]);
    bv[k] = fix ? nan_fix(rne_hi(vo[k]), vo[k]) : rne_hi(vo[k]);
  }
  store_hi16(m, bm);
  store_hi16(v, bv);
}

// Software prefetch distance (elements): ahead of the hardware prefetcher's ramp, within L1/L2.
constexpr int32_t kPrefetch = 512;
RPP_INLINE void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// A software pipeline over `groups` groups: iteration k runs stage D of group k - 3, S of k - 1 and A of k
// (d(k, slot), s(k, slot), a(k, slot); slot = k mod 4 indexes the caller's ring of per-group values, in L1).
// Issued in program order, a load -> sqrt -> divide -> round chain would stall the core for its latency
// (the vector registers of all later work wait on it); here each divider op has its inputs long before.
template <typename A, typename S, typename D>
RPP_INLINE void pipeline(int32_t groups, A a, S s, D d) {
  constexpr int32_t kS = 1, kD = 3;
  auto edge = [&](int32_t k) RPP_INLINE_LAMBDA {  // an iteration of the fill or drain: some stages idle
    if (k >= kD) d(k - kD, (k - kD) & 3);
    if (k >= kS && k - kS < groups) s(k - kS, (k - kS) & 3);
    if (k < groups) a(k, k & 3);
  };
  int32_t k = 0;
  for (; k < std::min(kD, groups); ++k) edge(k);
  for (; k < groups; ++k) {  // the steady state: all three stages, no branches
    d(k - kD, (k - kD) & 3);
    s(k - kS, (k - kS) & 3);
    a(k, k & 3);
  }
  for (; k < groups + kD; ++k) edge(k);
}

// An fp32 / bf16 state range in whole groups of 8 H elements; returns the elements done.
template <int M, int G, int H, typename T>
int32_t run(const Ptrs<M, G>& q_in, const Tensor& t, const Hyper& h, uint32_t base, int32_t n, T* __restrict m,
            T* __restrict v) {
  constexpr int32_t W = 8 * H;
  const Ptrs<M, G> q = q_in;  // a local copy stays in registers
  const Consts c(t, h);
  Hash<H> hash(base, t.sr_base);
  __m256 rnum[4][H], rv[4][H], rden[4][H], rm[4][H];  // ring: numerator, v, denominator, m
  auto a = [&](int32_t k, int32_t slot) RPP_INLINE_LAMBDA {
    const int32_t i = k * W;
    __m256 g[H], pf[H], m0[H], v0[H];
    for (const void* p : {static_cast<const void*>(q.g + i), static_cast<const void*>(q.p + i),
                          static_cast<const void*>(m + i), static_cast<const void*>(v + i)}) {
      prefetch(static_cast<const char*>(p) + kPrefetch * sizeof(T));
    }
    load(q.g + i, g);
    load(q.p + i, pf);
    load(m + i, m0);
    load(v + i, v0);
    for (int j = 0; j < H; ++j) stage_a(c, g[j], pf[j], m0[j], v0[j], rm[slot][j], rv[slot][j], rnum[slot][j]);
    if constexpr (std::is_same<T, float>::value) {
      _mm256_storeu_ps(m + i, rm[slot][0]);
      _mm256_storeu_ps(v + i, rv[slot][0]);
    } else {
      store_moments(m + i, v + i, rm[slot], rv[slot], false);  // NaN lanes are redone in stage D
    }
  };
  auto s = [&](int32_t, int32_t slot) RPP_INLINE_LAMBDA {
    __m256 r;
    for (int j = 0; j < H; ++j) rden[slot][j] = stage_s(c, rv[slot][j], r);
  };
  auto d = [&](int32_t k, int32_t slot) RPP_INLINE_LAMBDA {
    const bool nan = finish<M, G, H>(q, c, k * W, hash, rnum[slot], rden[slot]);
    if constexpr (!std::is_same<T, float>::value) {
      if (nan) store_moments(m + k * W, v + k * W, rm[slot], rv[slot], true);
    }
  };
  const int32_t groups = n / W;
  pipeline(groups, a, s, d);
  return groups * W;
}

// The codes of a pending block, group by group (m_code, r_code on 8 lanes), in two steps so that nothing
// waits on the divider: roots() takes a group's square roots, store() the rest one group later. cvtps
// rounds to nearest even as nearbyint does and gives 0x80000000 for NaN as the scalar cast does; negating
// by m's sign bit gives the scalar code for -0 and -NaN too; code 0 of a positive r becomes 1 by an
// unsigned max (0x80000000 stays).
template <int H>
struct Codes {
  const Pending& pb;
  int8_t* __restrict mq;
  uint8_t* __restrict vq;
  __m256 sm[H], sr[H];
  int32_t next = 0, held = -1;  // the next group to take roots of; the group whose roots are held (or -1)
  Codes(const Pending& p, int8_t* m, uint8_t* v) : pb(p), mq(m), vq(v) {}
  RPP_INLINE void roots(int32_t j) {
    for (int k = 0; k < H; ++k) {
      const __m256 mv = _mm256_and_ps(_mm256_loadu_ps(pb.mb + j + 8 * k), abs_mask());
      sm[k] = _mm256_sqrt_ps(_mm256_mul_ps(mv, _mm256_set1_ps(pb.minv)));
      sr[k] = _mm256_sqrt_ps(_mm256_mul_ps(_mm256_loadu_ps(pb.rb + j + 8 * k), _mm256_set1_ps(pb.rinv)));
    }
  }
  RPP_INLINE void store(int32_t j) {
    __m256i a[H], cr[H];
    for (int k = 0; k < H; ++k) {
      const __m256i mv = f_bits(_mm256_loadu_ps(pb.mb + j + 8 * k));
      const __m256 rv = _mm256_loadu_ps(pb.rb + j + 8 * k);
      a[k] = _mm256_sign_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(sm[k], _mm256_set1_ps(127.0f))), mv);
      const __m256i cv = _mm256_cvtps_epi32(_mm256_mul_ps(sr[k], _mm256_set1_ps(255.0f)));
      cr[k] = _mm256_max_epu32(cv, _mm256_and_si256(f_bits(_mm256_cmp_ps(rv, _mm256_setzero_ps(), _CMP_GT_OQ)), i32(1)));
    }
    store_codes(mq + pb.b0 + j, a);
    store_codes(vq + pb.b0 + j, cr);
  }
  // Stores the held group's codes and takes the roots of the next whole group, if any.
  RPP_INLINE void step() {
    if (held >= 0) store(held);
    held = -1;
    if (next + 8 * H <= pb.nb) roots(next), held = next, next += 8 * H;
  }
  // Encodes the rest of the whole groups; returns the elements encoded.
  RPP_INLINE int32_t drain() {
    do step();
    while (held >= 0);
    return next;
  }
};

// Pass 1 of an int8 block (elements b0 .. b0 + nb of the range) in whole groups, with the codes of the
// pending (previous) block written meanwhile: steps the parameters, keeps the new m and r in mb, rb (group
// by group in the lane layout) and their maxima in amax, rmax (NaNs skipped, as std::max(acc, x) does).
// Returns the elements done; all of the pending block's whole groups are encoded.
template <int M, int G, int H>
int32_t run_i8(const Ptrs<M, G>& q_in, const Tensor& t, const Hyper& h, uint32_t base, int32_t b0, int32_t nb,
               int8_t* __restrict mq, uint8_t* __restrict vq, float dm, float dr, float* __restrict mb,
               float* __restrict rb, float& amax, float& rmax, const Pending& pb) {
  constexpr int32_t W = 8 * H;
  const Ptrs<M, G> q = q_in;
  const Consts c(t, h);
  const __m256 vdm = _mm256_set1_ps(dm), vdr = _mm256_set1_ps(dr);
  __m256 va = _mm256_setzero_ps(), vr = _mm256_setzero_ps();
  Hash<H> hash(base + static_cast<uint32_t>(b0), t.sr_base);
  Codes<H> codes(pb, mq, vq);
  __m256 rnum[4][H], rv[4][H], rden[4][H];
  auto a = [&](int32_t k, int32_t slot) RPP_INLINE_LAMBDA {
    codes.step();
    const int32_t j = k * W, i = b0 + j;
    __m256 g[H], pf[H], qm[H], qr[H];
    prefetch(q.g + i + kPrefetch);
    prefetch(q.p + i + kPrefetch);
    prefetch(mq + i + 2 * kPrefetch);
    prefetch(vq + i + 2 * kPrefetch);
    load(q.g + i, g);
    load(q.p + i, pf);
    load_codes(mq + i, qm);
    load_codes(vq + i, qr);
    for (int e = 0; e < H; ++e) {
      const __m256 m0 = _mm256_mul_ps(_mm256_mul_ps(qm[e], _mm256_and_ps(qm[e], abs_mask())), vdm);
      const __m256 r0 = _mm256_mul_ps(_mm256_mul_ps(qr[e], qr[e]), vdr);
      __m256 mo;
      stage_a(c, g[e], pf[e], m0, _mm256_mul_ps(r0, r0), mo, rv[slot][e], rnum[slot][e]);
      _mm256_storeu_ps(mb + j + 8 * e, mo);
      va = _mm256_max_ps(_mm256_and_ps(mo, abs_mask()), va);  // keeps va where m is NaN
    }
  };
  auto s = [&](int32_t k, int32_t slot) RPP_INLINE_LAMBDA {
    for (int e = 0; e < H; ++e) {
      __m256 r;
      rden[slot][e] = stage_s(c, rv[slot][e], r);
      _mm256_storeu_ps(rb + k * W + 8 * e, r);
      vr = _mm256_max_ps(r, vr);
    }
  };
  auto d = [&](int32_t k, int32_t slot) RPP_INLINE_LAMBDA { finish<M, G, H>(q, c, b0 + k * W, hash, rnum[slot], rden[slot]); };
  const int32_t groups = nb / W;
  pipeline(groups, a, s, d);
  codes.drain();
  alignas(32) float xs[8], ys[8];
  _mm256_store_ps(xs, va);
  _mm256_store_ps(ys, vr);
  for (int k = 0; k < 8; ++k) amax = std::max(amax, xs[k]), rmax = std::max(rmax, ys[k]);
  return groups * W;
}

}  // namespace v8
