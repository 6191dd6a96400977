// The kernels' vector code for CPUs with AVX2 and FMA but not AVX-512 (included by
// native_kernels.cc, which holds what both instruction sets share; native_avx512.h is the other).
//
// The same algorithms in 8-lane vectors, with these differences:
// - 16 vector registers, not 32: a weight-row group keeps at most 12 accumulators (one weight row
//   at 5-12 activation rows; at 13-16 the rows are taken in two passes over the same block, which
//   the first pass has brought into L1);
// - no bf16 dot product: bf16 products always run widened to float32 (kWiden), the activations in
//   runs of 16 (8 first-of-pair elements, then 8 second-of-pair ones);
// - no mask registers: partial vectors load and store through vector masks (float32) or a small
//   zero-padded copy (bf16), and the 16 logical lanes of the greedy choice are two 8-lane halves;
// - no vcvtneps2bf16: rounding to bf16 is done on the bits (round to nearest even, NaN kept quiet),
//   which is what XLA computes.

constexpr bool kHasBf16Dot = false;
// The L1 prefetch one unit ahead, always: on an AMD Zen 3 host, alternating processes over the 49
// products of a GPT-2-small step (the best of 15 runs each), bf16 at 1 row 14.8-18.8 ms with it
// against 17.6-20.3 without (six pairs), at 8 rows 21.8-25.1 against 21.4-26.9; float32 at 1 row
// 25.7-32.0 against 23.5-34.7, at 8 rows 31.7-37.3 against 32.5-45.9 (four pairs).
template <int R, typename T>
constexpr bool PrefetchL1() { return true; }
constexpr int kActivationVectors = 4;  // as in native_avx512.h, of 8 lanes each

// Lanes 0..n-1 set (n in 0..8), as the mask argument of maskload / maskstore.
inline __m256i FirstLanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Lane j set where bit j of `bits` is.
inline __m256i BitLanes(unsigned bits) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), bit), bit);
}

// Lane j of the result = the sum of the lanes of a[j], for 8 vectors.
inline __m256 Transpose8Sum(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  // u0 holds a[0..3]'s sums over lanes 0-3 in its low half and over lanes 4-7 in its high half.
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float SumLanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// ---------------------------------------------------------------------------------------------
// Weight products.

// Weight rows read together (each load of an activation vector feeds them all), within 16
// registers: OR * R accumulators, the weight vectors and one activation vector.
template <int R, typename T>
constexpr int GroupRows() { return R <= 2 ? 4 : (R <= 4 ? 2 : 1); }
template <int R>
constexpr int WidenGroupRows() { return R <= 2 ? 3 : (R <= 4 ? 2 : 1); }
// Activation rows taken in one pass; more are split into two passes over the same block.
constexpr int kPassRows = 12;

// Adds (or, if `first`, writes) the OR * RN accumulator sums of rows R0 .. R0+RN-1 into y [O, RT]
// at output row o: acc[q * RN + r] goes to y[(o + q) * RT + R0 + r], which is contiguous because
// a group of several weight rows takes all the activation rows at once (OR == 1 or RN == RT).
template <int RT, int R0, int RN, int OR>
inline void StoreSums(__m256* acc, float* y, int64_t o, bool first) {
  static_assert(OR == 1 || (R0 == 0 && RN == RT), "a split pass takes one weight row");
  float* out = y + o * RT + R0;
  for (int k0 = 0; k0 < OR * RN; k0 += 8) {
    const int n = OR * RN - k0 < 8 ? OR * RN - k0 : 8;
    __m256 part[8];
    for (int j = 0; j < 8; ++j) part[j] = j < n ? acc[k0 + j] : _mm256_setzero_ps();
    __m256 sums = Transpose8Sum(part);
    if (n == 8) {
      if (!first) sums = _mm256_add_ps(sums, _mm256_loadu_ps(out + k0));
      _mm256_storeu_ps(out + k0, sums);
    } else {
      const __m256i lanes = FirstLanes(n);
      if (!first) sums = _mm256_add_ps(sums, _mm256_maskload_ps(out + k0, lanes));
      _mm256_maskstore_ps(out + k0, lanes, sums);
    }
  }
}

// One pass of a float32 product: weight rows o .. o+OR-1 against activation rows R0 .. R0+RN-1
// over the block [i0, i1) (see RowGroup in native_avx512.h); prefetches once per 64 bytes.
template <int RT, int R0, int RN, int OR>
inline void RowPassF32(const float* w, const float* x, float* y, int64_t I, int64_t o, int64_t i0, int64_t i1,
                       bool first, const char* near, const char* far) {
  const int64_t full = i0 + ((i1 - i0) / 16) * 16;
  const int64_t stride = I * (int64_t)sizeof(float);
  __m256 acc[OR * RN];
  for (int k = 0; k < OR * RN; ++k) acc[k] = _mm256_setzero_ps();
  const float* row = w + o * I;
  auto step = [&](int64_t i, auto load) {
    __m256 a[OR];
    for (int q = 0; q < OR; ++q) a[q] = load(row + q * I + i);
    for (int r = 0; r < RN; ++r) {
      __m256 b = load(x + (R0 + r) * I + i);
      asm("" : "+x"(b));  // one load into a register, not one folded into each row's FMA
      for (int q = 0; q < OR; ++q) acc[q * RN + r] = _mm256_fmadd_ps(a[q], b, acc[q * RN + r]);
    }
  };
  auto whole = [](const float* p) { return _mm256_loadu_ps(p); };
  for (int64_t i = i0; i < full; i += 16) {
    const int64_t ahead = (i - i0) * (int64_t)sizeof(float);
    for (int q = 0; q < OR; ++q) {
      if constexpr (PrefetchL1<RT, float>()) _mm_prefetch(near + q * stride + ahead, _MM_HINT_T0);
      _mm_prefetch(far + q * stride + ahead, _MM_HINT_T1);
    }
    step(i, whole);
    step(i + 8, whole);
  }
  for (int64_t i = full; i < i1; i += 8) {
    const __m256i lanes = FirstLanes(std::min<int64_t>(8, i1 - i));
    step(i, [lanes](const float* p) { return _mm256_maskload_ps(p, lanes); });
  }
  StoreSums<RT, R0, RN, OR>(acc, y, o, first);
}

// Output rows o .. o+OR-1 over the input-axis block [i0, i1), adding to y unless `first`, as in
// native_avx512.h. bf16 (T = uint16_t) never comes here: it runs widened (RowGroupWiden).
template <int R, int OR, typename T>
inline void RowGroup(const T* w, const T* x, float* y, int64_t I, int64_t o, int64_t i0, int64_t i1,
                     bool first, const char* near, const char* far) {
  static_assert(sizeof(T) == 4, "bf16 products run widened on AVX2");
  if constexpr (R <= kPassRows) {
    RowPassF32<R, 0, R, OR>(w, x, y, I, o, i0, i1, first, near, far);
  } else {
    RowPassF32<R, 0, R / 2, 1>(w, x, y, I, o, i0, i1, first, near, far);
    RowPassF32<R, R / 2, R - R / 2, 1>(w, x, y, I, o, i0, i1, first, near, far);
  }
}

// The bf16 product widened to float32: a 32-byte load holds 16 bf16 weights as 8 pairs; a pair's
// first element widens by a shift of its 32-bit lane, the second by clearing the lane's low half
// (exact). The activations are widened once per call (WidenRows) in the same order: each run of 16
// inputs as its 8 first-of-pair elements, then its 8 second-of-pair ones, the row padded with zeros
// to a multiple of 16 (the weights' tail is read through a zero-padded copy).
constexpr int64_t kWidenRun = 16;
inline int64_t PaddedWiden(int64_t n) { return (n + kWidenRun - 1) / kWidenRun * kWidenRun; }

// tj_packed_matmul (see native_kernels.cc) without bf16 arithmetic: each 32-byte half of a tile's
// line (one pair of inputs for 8 outputs) widened exactly to float32, its first elements and its
// second, each multiplied by the activation row's element broadcast. A group's tiles (stored as in
// native_avx512.h: they take their 64-byte lines in turn) are read side by side, as one run, up to
// kPackedPassRows rows at a time: 2 x 3 R accumulators, more than the 16 registers above 2 rows, but
// with the AVX2 build on an AMD Zen 5 host, against tiles stored whole and read one at a time
// (single products, alternate processes), 0.73-1.05 of the time at 1-2 rows, 0.86-1.10 at 4,
// 0.93-1.06 at 6-8; 1.10-1.18 at 12 rows, in two passes that both widen the weights (one pass of 12
// rows, its sums spilled from the registers, was slower still). One tile a pass (the group read
// three times, twice from cache) took up to 1.4x at 4 rows.
constexpr int kPackedPassRows = 8;

// Once: as in native_avx512.h; unused here (AVX2 keeps its plain prefetches: not measured on an AVX2 host).
template <int R, int T, bool Once = true>
inline void PackedTiles(const uint16_t* w, const uint16_t* x, float* y, int64_t I, int64_t o, int64_t O,
                        int64_t r0, int64_t Rt = R) {
  const uint16_t* group = w + o * I;
  const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
  auto widen = [](uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  };
  __m256 acc[2 * R * T];
  for (int k = 0; k < 2 * R * T; ++k) acc[k] = _mm256_setzero_ps();
  for (int64_t p = 0; p < I / 2; ++p) {
    for (int u = 0; u < T; ++u)
      _mm_prefetch(reinterpret_cast<const char*>(group + 32 * (T * p + u)) + T * kPackedPrefetchBytes, _MM_HINT_T0);
    for (int t = 0; t < T; ++t) {
      const uint16_t* line = group + 32 * (T * p + t);
      __m256 first[2], second[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 16 * h));
        first[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        second[h] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      }
      for (int r = 0; r < R; ++r) {
        const __m256 b0 = _mm256_set1_ps(widen(x[r * I + 2 * p])), b1 = _mm256_set1_ps(widen(x[r * I + 2 * p + 1]));
        __m256* a = acc + 2 * (t * R + r);
        for (int h = 0; h < 2; ++h) a[h] = _mm256_fmadd_ps(second[h], b1, _mm256_fmadd_ps(first[h], b0, a[h]));
      }
    }
  }
  alignas(32) float sums[2 * R * T * 8];
  for (int k = 0; k < 2 * R * T; ++k) _mm256_store_ps(sums + 8 * k, acc[k]);
  for (int t = 0; t < T; ++t) {
    const int64_t ot = o + 16 * t;
    const float* s = sums + 16 * R * t;
    for (int j = 0; j < 16; ++j)  // y [O, Rt] from row r0, or from row r0 of y [rows, O] where O >= 0
      for (int r = 0; r < R; ++r)
        y[O < 0 ? (ot + j) * Rt + r0 + r : (r0 + r) * O + ot + j] = s[(2 * r + j / 8) * 8 + j % 8];
  }
}

// 16 bf16 from p, of which the first n (1..16) are read and the rest are zero.
inline __m256i LoadBf16Run(const uint16_t* p, int64_t n) {
  if (n >= 16) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  alignas(32) uint16_t part[16] = {};
  std::memcpy(part, p, n * sizeof(uint16_t));
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(part));
}

inline __m256 FirstOfPairs(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline __m256 SecondOfPairs(__m256i v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

// x [R, I] bf16 -> xw [R, PaddedWiden(I)] float32 in the order above (xw 32-byte aligned).
void WidenRows(const uint16_t* x, float* xw, int64_t R, int64_t I) {
  const int64_t Ip = PaddedWiden(I);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t i = 0; i < Ip; i += 16) {
      const __m256i v = LoadBf16Run(x + r * I + i, I - i);
      _mm256_store_ps(xw + r * Ip + i, FirstOfPairs(v));
      _mm256_store_ps(xw + r * Ip + i + 8, SecondOfPairs(v));
    }
  }
}

template <int RT, int R0, int RN, int OR>
inline void RowPassWiden(const uint16_t* w, const float* xw, float* y, int64_t I, int64_t Ip, int64_t o,
                         int64_t i0, int64_t i1, bool first, const char* near, const char* far) {
  const int64_t full = i0 + ((i1 - i0) / 32) * 32;
  const int64_t stride = I * 2;
  __m256 acc[OR * RN];
  for (int k = 0; k < OR * RN; ++k) acc[k] = _mm256_setzero_ps();
  const uint16_t* row = w + o * I;
  // One run of 16 inputs: the OR rows' first-of-pair elements against each activation row, then
  // their second-of-pair ones.
  auto run = [&](int64_t i, int64_t n) {
    __m256i v[OR];
    for (int q = 0; q < OR; ++q) v[q] = LoadBf16Run(row + q * I + i, n);
    __m256 wv[OR];
    for (int q = 0; q < OR; ++q) wv[q] = FirstOfPairs(v[q]);
    for (int r = 0; r < RN; ++r) {
      __m256 xa = _mm256_load_ps(xw + (R0 + r) * Ip + i);
      asm("" : "+x"(xa));  // one load into a register, not one folded into each row's FMA
      for (int q = 0; q < OR; ++q) acc[q * RN + r] = _mm256_fmadd_ps(wv[q], xa, acc[q * RN + r]);
    }
    for (int q = 0; q < OR; ++q) wv[q] = SecondOfPairs(v[q]);
    for (int r = 0; r < RN; ++r) {
      __m256 xb = _mm256_load_ps(xw + (R0 + r) * Ip + i + 8);
      asm("" : "+x"(xb));
      for (int q = 0; q < OR; ++q) acc[q * RN + r] = _mm256_fmadd_ps(wv[q], xb, acc[q * RN + r]);
    }
  };
  for (int64_t i = i0; i < full; i += 32) {
    const int64_t ahead = (i - i0) * 2;
    for (int q = 0; q < OR; ++q) {
      if constexpr (PrefetchL1<RT, uint16_t>()) _mm_prefetch(near + q * stride + ahead, _MM_HINT_T0);
      _mm_prefetch(far + q * stride + ahead, _MM_HINT_T1);
    }
    run(i, 16);
    run(i + 16, 16);
  }
  for (int64_t i = full; i < i1; i += 16) run(i, i1 - i);
  StoreSums<RT, R0, RN, OR>(acc, y, o, first);
}

// RowGroup's bf16 product on widened activations xw [R, Ip]; [i0, i1) starts at a multiple of 16.
template <int R, int OR>
inline void RowGroupWiden(const uint16_t* w, const float* xw, float* y, int64_t I, int64_t Ip, int64_t o,
                          int64_t i0, int64_t i1, bool first, const char* near, const char* far) {
  if constexpr (R <= kPassRows) {
    RowPassWiden<R, 0, R, OR>(w, xw, y, I, Ip, o, i0, i1, first, near, far);
  } else {
    RowPassWiden<R, 0, R / 2, 1>(w, xw, y, I, Ip, o, i0, i1, first, near, far);
    RowPassWiden<R, R / 2, R - R / 2, 1>(w, xw, y, I, Ip, o, i0, i1, first, near, far);
  }
}

// ---------------------------------------------------------------------------------------------
// Products of weights stored input-major, w [I, O] (tj_cols_matmul), as in native_avx512.h: a block
// of 8 * V output columns at a time, each input row's weight vectors times one broadcast activation
// into RN * V accumulators; bf16 weights widened on load (the activations arrive widened), passes
// of at most four activation rows within the 16 registers.

template <int RN>
constexpr int ColVectors() { return RN <= 1 ? 6 : (RN <= 2 ? 4 : (RN <= 3 ? 3 : 2)); }
constexpr int kColPassRows = 4;

// 8 weights from p as float32 (bf16 widened exactly), the first n of them (n >= 8: all).
inline __m256 LoadWeights(const float* p, int64_t n) {
  return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, FirstLanes(n));
}
inline __m256 LoadWeights(const uint16_t* p, int64_t n) {
  __m128i v;
  if (n >= 8) {
    v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    alignas(16) uint16_t part[8] = {};
    if (n > 0) std::memcpy(part, p, n * sizeof(uint16_t));
    v = _mm_load_si128(reinterpret_cast<const __m128i*>(part));
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// One block of columns [c0, c0 + 8 V) (fewer at the end: Whole = false) over input rows [i0, i1),
// activation rows R0 .. R0+RN-1 of x (float32 [R, I]), into part [R, O], written if `first`.
template <int R0, int RN, typename T, bool Whole>
__attribute__((noinline)) void ColBlock(const T* w, const float* x, float* part, int64_t I, int64_t O, int64_t c0,
                                        int64_t i0, int64_t i1, bool first, const char*& ahead) {
  constexpr int V = ColVectors<RN>();
  int64_t n[V];
  for (int v = 0; v < V; ++v) n[v] = std::max<int64_t>(0, std::min<int64_t>(8, O - c0 - 8 * v));
  __m256 acc[RN * V];
  for (int r = 0; r < RN; ++r)
    for (int v = 0; v < V; ++v)
      acc[r * V + v] = first ? _mm256_setzero_ps() : LoadWeights(part + (R0 + r) * O + c0 + 8 * v, Whole ? 8 : n[v]);
  const char* p = ahead;
  for (int64_t i = i0; i < i1; ++i) {
    const T* row = w + i * O + c0;
    __m256 a[V];
    for (int v = 0; v < V; ++v) a[v] = LoadWeights(row + 8 * v, Whole ? 8 : n[v]);
    if (p) {
      for (int v = 0; v < V; ++v) _mm_prefetch(p + v * 8 * (int64_t)sizeof(T), _MM_HINT_T1);
      p += V * 8 * (int64_t)sizeof(T);
    }
    for (int r = 0; r < RN; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + (R0 + r) * I + i);
      for (int v = 0; v < V; ++v) acc[r * V + v] = _mm256_fmadd_ps(a[v], b, acc[r * V + v]);
    }
  }
  if (p) ahead = p;
  for (int r = 0; r < RN; ++r) {
    for (int v = 0; v < V; ++v) {
      float* dst = part + (R0 + r) * O + c0 + 8 * v;
      if (Whole) _mm256_storeu_ps(dst, acc[r * V + v]);
      else if (n[v] > 0) _mm256_maskstore_ps(dst, FirstLanes(n[v]), acc[r * V + v]);
    }
  }
}

template <int R0, int RN, typename T>
void ColPass(const T* w, const float* x, float* part, int64_t I, int64_t O, int64_t i0, int64_t i1, bool first,
             const char* ahead) {
  constexpr int64_t kBlock = 8 * ColVectors<RN>();
  int64_t c0 = 0;
  for (; c0 + kBlock <= O; c0 += kBlock) ColBlock<R0, RN, T, true>(w, x, part, I, O, c0, i0, i1, first, ahead);
  if (c0 < O) ColBlock<R0, RN, T, false>(w, x, part, I, O, c0, i0, i1, first, ahead);
}

// Passes P .. NP - 1 of NP over R activation rows (pass P takes rows R P / NP .. R (P + 1) / NP - 1).
template <int R, int P, int NP, typename T>
void ColPasses(const T* w, const float* x, float* part, int64_t I, int64_t O, int64_t i0, int64_t i1, bool first,
               const char* ahead) {
  if constexpr (P < NP) {
    ColPass<R * P / NP, R * (P + 1) / NP - R * P / NP, T>(w, x, part, I, O, i0, i1, first, ahead);
    ColPasses<R, P + 1, NP, T>(w, x, part, I, O, i0, i1, first, nullptr);
  }
}

// Input rows [i0, i1) of w [I, O] times x (float32 [R, I]) into part [R, O], in passes of at most
// kColPassRows activation rows (the first with the prefetches). No bf16 dot products here (Dot is
// never true on AVX2).
template <int R, typename T, bool Dot>
void ColsRange(const T* w, const void* x, float* part, int64_t I, int64_t O, int64_t i0, int64_t i1, bool first,
               const char* ahead) {
  static_assert(!Dot, "no bf16 dot products on AVX2");
  ColPasses<R, 0, (R + kColPassRows - 1) / kColPassRows, T>(w, static_cast<const float*>(x), part, I, O, i0, i1,
                                                            first, ahead);
}

// No bf16 dot product here: bf16 always runs widened.
int Bf16Calibrate() { return kWiden; }

// ---------------------------------------------------------------------------------------------
// Attention over the cache.

// exp(x) for x <= 0, as Exp in native_avx512.h; 2^n (n in [-126, 0]) built from its exponent bits.
inline __m256 Exp(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // (a NaN x becomes -87, as vmaxps does there)
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.5353362e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3398874e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6182945e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5503406e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022652e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

// 8 cache elements from p (float32, or bf16 widened exactly), of which the first n (1..8) are read.
inline __m256 LoadCache(const float* p, int64_t n) {
  return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, FirstLanes(n));
}
inline __m256 LoadCache(const uint16_t* p, int64_t n) {
  __m128i v;
  if (n >= 8) {
    v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    alignas(16) uint16_t part[8] = {};
    std::memcpy(part, p, n * sizeof(uint16_t));
    v = _mm_load_si128(reinterpret_cast<const __m128i*>(part));
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// The first visible position of m[S] and one past the last ([S, S] where none is), as in
// native_avx512.h: 32 mask bytes at a time where they lie within the mask, the rest one by one.
inline void VisibleWindow(const bool* m, int64_t S, int64_t& lo, int64_t& hi) {
  auto bits = [m](int64_t s0) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + s0));
    return ~(uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(bytes, _mm256_setzero_si256()));
  };
  lo = 0;
  for (; lo + 32 <= S; lo += 32) {
    if (const uint32_t b = bits(lo)) {
      lo += __builtin_ctz(b);
      break;
    }
  }
  while (lo < S && !m[lo]) ++lo;
  hi = S;
  for (; hi - 32 >= lo; hi -= 32) {
    if (const uint32_t b = bits(hi - 32)) {
      hi -= __builtin_clz(b);
      return;
    }
  }
  while (hi > lo && !m[hi - 1]) --hi;
}

// One query over keys/values [S, Kd] with mask m[S] -> out[Kd], as AttendOne in native_avx512.h
// (the visible window only, the same prefetches, N = (Kd + 7) / 8 as a template argument for the
// common head sizes, 0 for any other), in blocks of 8 keys.
template <typename T, int N>
void AttendOne(const float* q, const T* k, const T* v, const bool* m, float* out,
               int64_t S, int64_t Kd, float* logits, const T* next_k, const T* next_v) {
  const int64_t vecs = N > 0 ? N : (Kd + 7) / 8;
  auto width = [Kd](int64_t c) { return std::min<int64_t>(8, Kd - c * 8); };
  int64_t lo, hi;
  VisibleWindow(m, S, lo, hi);
  if (lo == hi) {
    for (int64_t d = 0; d < Kd; ++d) out[d] = 0.0f;
    return;
  }
  const int64_t first = lo / 8 * 8;
  const int64_t row_bytes = Kd * sizeof(T);
  __m256 qv[N > 0 ? N : kMaxHeadDim / 8];
  for (int64_t c = 0; c < vecs; ++c) qv[c] = LoadCache(q + c * 8, width(c));
  float best = -3.0e38f;
  for (int64_t s0 = first; s0 < hi; s0 += 8) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) {
      acc[j] = _mm256_setzero_ps();
      if (s0 + j < lo || s0 + j >= hi) continue;
      PrefetchRows(v + (s0 + j) * Kd, 1, row_bytes);
      if (next_k != nullptr) PrefetchRows(next_k + (s0 + j) * Kd, 1, row_bytes);
      const T* key = k + (s0 + j) * Kd;
      for (int64_t c = 0; c < vecs; ++c) acc[j] = _mm256_fmadd_ps(qv[c], LoadCache(key + c * 8, width(c)), acc[j]);
    }
    _mm256_storeu_ps(logits + s0, Transpose8Sum(acc));
    for (int j = 0; j < 8 && s0 + j < hi; ++j) {
      if (m[s0 + j]) best = std::max(best, logits[s0 + j]);
    }
  }
  for (int64_t c = 0; c < vecs; ++c) qv[c] = _mm256_setzero_ps();
  __m256 total = _mm256_setzero_ps();
  const __m256 top = _mm256_set1_ps(best);
  for (int64_t s0 = first; s0 < hi; s0 += 8) {
    unsigned visible = 0;
    for (int j = 0; j < 8 && s0 + j < hi; ++j) visible |= (m[s0 + j] ? 1u : 0u) << j;
    const __m256 p = _mm256_and_ps(_mm256_castsi256_ps(BitLanes(visible)),
                                   Exp(_mm256_sub_ps(_mm256_loadu_ps(logits + s0), top)));
    _mm256_storeu_ps(logits + s0, p);
    total = _mm256_add_ps(total, p);
  }
  for (int64_t s = lo; s < hi; ++s) {
    if (!m[s]) continue;
    const __m256 p = _mm256_set1_ps(logits[s]);
    if (next_v != nullptr) PrefetchRows(next_v + s * Kd, 1, row_bytes);
    const T* val = v + s * Kd;
    for (int64_t c = 0; c < vecs; ++c) qv[c] = _mm256_fmadd_ps(p, LoadCache(val + c * 8, width(c)), qv[c]);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / SumLanes(total));
  for (int64_t c = 0; c < vecs; ++c) {
    const __m256 o = _mm256_mul_ps(qv[c], inv);
    if (width(c) == 8) {
      _mm256_storeu_ps(out + c * 8, o);
    } else {
      _mm256_maskstore_ps(out + c * 8, FirstLanes(width(c)), o);
    }
  }
}

// Lanes of a vector of the attention's head rows, and the vectors per row for which AttendOne is
// compiled with a fixed count (head sizes 32, 64, 80, 96 and 128).
constexpr int kAttendLanes = 8;
using AttendVectors = std::integer_sequence<int, 4, 8, 10, 12, 16>;

// ---------------------------------------------------------------------------------------------
// Greedy token choice: GreedyLanes of native_avx512.h, its 16 lanes as two halves of 8.

void GreedyLanes(const float* l, int64_t B, int64_t b0, int64_t P, __mmask16 lanes, int64_t v0, int64_t v1,
                 GreedyPartial* out) {
  const int64_t Bv = 16 / P;
  const int shift = __builtin_ctzll((unsigned long long)Bv);
  auto at_row = [&](int64_t v) { return P == 1 ? (const float*)(l + v * B + b0) : l + v * B; };
  auto within = [&](int64_t v) {
    return v + P <= v1 ? (unsigned)lanes : (unsigned)(lanes & ((1u << ((v1 - v) * Bv)) - 1u));
  };
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 best[2] = {neg_inf, neg_inf};
  __m256i at[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  __m256i lane_row[2];
  __m256 nan[2], seen[2];  // all-ones lanes: met a NaN / a number
  for (int h = 0; h < 2; ++h) {
    lane_row[h] = _mm256_srli_epi32(_mm256_setr_epi32(8 * h, 8 * h + 1, 8 * h + 2, 8 * h + 3, 8 * h + 4, 8 * h + 5,
                                                      8 * h + 6, 8 * h + 7), shift);
    nan[h] = seen[h] = _mm256_setzero_ps();
  }
  for (int64_t v = v0; v < v1; v += P) {
    const unsigned bits = within(v);
    for (int h = 0; h < 2; ++h) {
      const __m256i in = BitLanes((bits >> (8 * h)) & 0xffu);
      const __m256 x = _mm256_maskload_ps(at_row(v) + 8 * h, in);
      const __m256 number = _mm256_and_ps(_mm256_cmp_ps(x, x, _CMP_ORD_Q), _mm256_castsi256_ps(in));
      // (Only lanes in use: past the last row the masked load leaves 0, which would beat a
      // negative maximum and name a row past V.)
      const __m256 more = _mm256_or_ps(
          _mm256_and_ps(_mm256_cmp_ps(x, best[h], _CMP_GT_OQ), _mm256_castsi256_ps(in)),
          _mm256_andnot_ps(seen[h], number));
      nan[h] = _mm256_or_ps(nan[h], _mm256_andnot_ps(number, _mm256_castsi256_ps(in)));
      seen[h] = _mm256_or_ps(seen[h], number);
      best[h] = _mm256_blendv_ps(best[h], x, more);
      at[h] = _mm256_castps_si256(_mm256_blendv_ps(
          _mm256_castsi256_ps(at[h]),
          _mm256_castsi256_ps(_mm256_add_epi32(lane_row[h], _mm256_set1_epi32((int32_t)v))), more));
    }
  }
  __m256 total[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t s0 = v0; s0 < v1; s0 += kGreedyBlock) {
    __m256 block[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t v = s0; v < std::min(v1, s0 + kGreedyBlock); v += P) {
      const unsigned bits = within(v);
      for (int h = 0; h < 2; ++h) {
        const __m256i in = BitLanes((bits >> (8 * h)) & 0xffu);
        const __m256 x = _mm256_maskload_ps(at_row(v) + 8 * h, in);
        const __m256 diff = _mm256_sub_ps(x, best[h]);
        const __m256 number = _mm256_and_ps(_mm256_cmp_ps(x, x, _CMP_ORD_Q), _mm256_castsi256_ps(in));
        const __m256 bad = _mm256_and_ps(_mm256_cmp_ps(diff, diff, _CMP_UNORD_Q), number);
        block[h] = _mm256_add_ps(block[h], _mm256_and_ps(number, _mm256_blendv_ps(Exp(diff), diff, bad)));
      }
    }
    for (int h = 0; h < 2; ++h) total[h] = _mm256_add_ps(total[h], block[h]);
  }
  for (int h = 0; h < 2; ++h) {
    alignas(32) float b[8], t[8];
    alignas(32) int32_t a[8];
    _mm256_store_ps(b, best[h]);
    _mm256_store_ps(t, total[h]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(a), at[h]);
    const int seen_bits = _mm256_movemask_ps(seen[h]), nan_bits = _mm256_movemask_ps(nan[h]);
    for (int j = 0; j < 8; ++j) {
      GreedyPartial& p = out[8 * h + j];
      p.best = b[j];
      p.at = a[j];
      p.seen = (seen_bits >> j) & 1;
      p.nan = (nan_bits >> j) & 1;
      p.sum = t[j];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// A feed-forward layer's bias and activation.

// float32 -> bf16 (round to nearest even; a NaN stays a quiet NaN), as float32 again.
inline __m256 RoundToBf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v), high = _mm256_set1_epi32((int)0xffff0000u);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), high);
  const __m256i quiet = _mm256_and_si256(_mm256_or_si256(bits, _mm256_set1_epi32(0x00400000)), high);
  return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

// exp(v) for any float32 v, as ExpAny in native_avx512.h; 2^n (n in [-150, 128]) applied as two
// powers of two, each a normal number, so the result rounds once, as a scaling instruction's.
inline __m256 ExpAny(__m256 v) {
  v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-104.0f)), _mm256_set1_ps(89.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), v);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i half = _mm256_srai_epi32(ni, 1), rest = _mm256_sub_epi32(ni, half);
  auto pow2 = [](__m256i e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
  };
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(half)), pow2(rest));
}

// The activation of h, as Activation in native_avx512.h.
template <int Act, typename Round>
inline __m256 Activation(__m256 h, Round round) {
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  if constexpr (Act == 1) {
    return _mm256_max_ps(zero, h);  // h where h is NaN (the second operand), as max(h, 0) in XLA
  } else if constexpr (Act == 2) {
    const __m256 c = round(_mm256_set1_ps(0.7978845608028654f)), k = round(_mm256_set1_ps(0.044715f));
    const __m256 h3 = round(_mm256_mul_ps(round(_mm256_mul_ps(h, h)), h));
    const __m256 u = round(_mm256_mul_ps(round(_mm256_add_ps(h, round(_mm256_mul_ps(h3, k)))), c));
    const __m256 abs_u = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), u);
    const __m256 e = Exp(_mm256_mul_ps(_mm256_set1_ps(-2.0f), abs_u));
    __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    t = round(_mm256_blendv_ps(t, _mm256_sub_ps(zero, t), _mm256_cmp_ps(u, zero, _CMP_LT_OQ)));
    const __m256 cdf = round(_mm256_mul_ps(round(_mm256_add_ps(t, one)), _mm256_set1_ps(0.5f)));
    return round(_mm256_mul_ps(h, cdf));
  } else if constexpr (Act == 3) {
    const __m256 d = round(_mm256_add_ps(round(ExpAny(round(_mm256_sub_ps(zero, h)))), one));
    return round(_mm256_mul_ps(h, round(_mm256_div_ps(one, d))));
  } else {
    return h;
  }
}

// Output columns o0 .. o1-1 of every row, kActivationVectors vectors of 8 side by side.
template <int Act, bool Bf16>
void BiasActivationColumns(const float* yp, const float* bp, void* outp, int64_t O, int64_t R, int64_t o0,
                           int64_t o1, bool rows_first) {
  const __m256i lanes = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int32_t)R));
  auto round = [](__m256 v) { return Bf16 ? RoundToBf16(v) : v; };
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t o = o0; o < o1; o += 8 * kActivationVectors) {
      __m256 h[kActivationVectors];
      int64_t n[kActivationVectors];
      for (int j = 0; j < kActivationVectors; ++j) {
        const int64_t oj = std::min<int64_t>(o + 8 * j, o1);
        n[j] = std::min<int64_t>(8, o1 - oj);
        const __m256i m = FirstLanes(n[j]);
        h[j] = rows_first
                   ? _mm256_maskload_ps(yp + r * O + oj, m)
                   : _mm256_mask_i32gather_ps(_mm256_setzero_ps(), yp + oj * R + r, lanes, _mm256_castsi256_ps(m), 4);
        h[j] = round(_mm256_add_ps(h[j], _mm256_maskload_ps(bp + oj, m)));
      }
      for (int j = 0; j < kActivationVectors; ++j) h[j] = Activation<Act>(h[j], round);
      for (int j = 0; j < kActivationVectors; ++j) {
        if (n[j] <= 0) continue;
        const int64_t oj = o + 8 * j;
        if (Bf16) {
          const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(RoundToBf16(h[j])), 16);
          const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
          uint16_t* dst = static_cast<uint16_t*>(outp) + r * O + oj;
          if (n[j] == 8) {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), packed);
          } else {
            alignas(16) uint16_t part[8];
            _mm_store_si128(reinterpret_cast<__m128i*>(part), packed);
            std::memcpy(dst, part, n[j] * sizeof(uint16_t));
          }
        } else {
          _mm256_maskstore_ps(static_cast<float*>(outp) + r * O + oj, FirstLanes(n[j]), h[j]);
        }
      }
    }
  }
}

// The vector operations of the training attention, as in native_avx512.h (8 lanes).
using FVec = __m256;
constexpr int kFLanes = 8;
constexpr int kGemmRows = 4;
constexpr int kGemmVecs = 2;  // 8 accumulators of 16 registers
inline FVec FLoad(const float* p) { return _mm256_loadu_ps(p); }
inline void FStore(float* p, FVec v) { _mm256_storeu_ps(p, v); }
inline FVec FSet(float x) { return _mm256_set1_ps(x); }
inline FVec FFma(FVec a, FVec b, FVec c) { return _mm256_fmadd_ps(a, b, c); }
inline FVec FMul(FVec a, FVec b) { return _mm256_mul_ps(a, b); }
inline FVec FSub(FVec a, FVec b) { return _mm256_sub_ps(a, b); }
inline FVec FMax(FVec a, FVec b) { return _mm256_max_ps(a, b); }
inline float FSum(FVec v) { return SumLanes(v); }
inline float FMaxLanes(FVec v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
inline FVec FNaNLanes(FVec x) { return _mm256_and_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q), _mm256_set1_ps(1.0f)); }
inline FVec ExpOrZero(FVec x) {
  const __m256 finite = _mm256_cmp_ps(x, _mm256_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ);
  return _mm256_and_ps(finite, Exp(x));
}
