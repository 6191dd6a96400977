// The kernels' vector code for CPUs with AVX-512 and bfloat16 dot products (included by
// native_kernels.cc, which holds what both instruction sets share; native_avx2.h is the other).

constexpr bool kHasBf16Dot = true;
// The L1 prefetch one unit ahead: for bf16 at 6 rows or more (at 1 row, and for float32, it cost ~5%).
template <int R, typename T>
constexpr bool PrefetchL1() { return sizeof(T) == 2 && R >= 6; }
// Vectors of tj_bias_activation computed side by side: the activations are long chains of dependent
// operations, so four independent ones keep the core busy (a [3072, 8] bf16 tanh-GELU took ~60 us
// one vector at a time on one core).
constexpr int kActivationVectors = 4;

// Lane j of the result = the sum of the lanes of a[j], for 16 vectors.
__attribute__((always_inline)) inline __m512 Transpose16Sum(__m512* a) {
  __m512 b[8], c[4], d[2];
  for (int k = 0; k < 8; ++k)
    b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)
    d[k] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * k], c[2 * k + 1], 0x44),
                         _mm512_shuffle_ps(c[2 * k], c[2 * k + 1], 0xEE));
  // Lane 4j + t now holds the sum of a[4t + j]; put the sum of a[m] in lane m.
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, sums);
}

// Weight rows read together: each load of an activation vector feeds them all. bf16 takes three
// at 5-9 activation rows (15-27 accumulators): with two, the loads and prefetches per dot product
// left it at ~half of the CPU's dot-product rate even with the weight in cache; float32 streams
// best with two. At a few rows (bf16 up to 4, float32 up to 2) the arithmetic is light and one
// weight row per pass reads the weight as one run of memory, which the hardware prefetcher follows
// better than two or three runs 1.5-6 KB apart. AMD Zen 5 host, the 73 products of a GPT-2-small
// step from memory on two threads, against a plain sum over the same weights in the same minute
// (three rounds): bf16 at 1 / 2 / 4 rows 0.81-0.83 / 0.67-0.77 / 0.60-0.72 of the sum's rate ->
// 0.93-0.97 / 0.89-0.96 / 0.67-0.85; float32 at 1 / 2 rows 0.80-0.82 / 0.75-0.77 -> 0.98-1.07 /
// 0.83-0.94. At 6 bf16 rows one weight row per pass was slower (0.60-0.79 against 0.73).
// Above kPassRows activation rows a group takes them in two passes over the same block (the
// second reads the weight vectors from L1): one pass over 16 bf16 rows had to read one weight
// row at a time (16 accumulators), 17 loads per 16 dot products, and ran at ~12 GB/s per core
// with the weight in cache, against ~24 GB/s in two passes of 8 rows over three weight rows each
// (from memory, the step's products on two threads: bf16 at 14 / 16 rows 26-27 / 18-20 -> 31-32
// / 29-36 GB/s, float32 at 13 / 14 / 16 rows 17-18 / 15-16 / 15 -> 24 / 22 / 24-25 GB/s).
template <int R, typename T>
constexpr int GroupRows() {
  if constexpr (sizeof(T) == 2) return R <= 4 ? 1 : (R <= 9 || R > 12 ? 3 : 2);
  return R <= 2 ? 1 : 2;
}
constexpr int kPassRows = 12;

// Accumulator sets a pass over one weight row at up to 4 rows takes in turn, vector by vector, so
// that enough independent sums are in flight to hide the latency of a dot product or FMA (~6
// cycles, two issued per cycle): with a single set, one bf16 row ran at ~2/3 of the three-row
// rate with the weight in cache.
template <int R, int OR>
constexpr int AccumulatorSets() {
  return OR == 1 && R <= 4 ? 4 : 1;
}

// Adds (or, if `first`, writes) a pass's OR * RN accumulator sums, of weight rows o .. o+OR-1 and
// activation rows R0 .. R0+RN-1, into y [O, RT]: acc[q * RN + r] goes to y[(o + q) * RT + R0 + r].
// Reduced 16 accumulators at a time into one vector (a horizontal sum each costs ~4x the
// shuffles), or one by one where there are few. A whole pass (RN == RT) writes them side by side;
// a split one through a small buffer.
template <int RT, int R0, int RN, int OR>
inline void StoreSums(__m512* acc, float* y, int64_t o, bool first) {
  constexpr bool whole = RN == RT;
  float buffer[whole ? 1 : OR * RN];
  float* out = whole ? y + o * RT : buffer;
  const bool add = whole && !first;
  int k0 = 0;
  for (; k0 + 8 <= OR * RN; k0 += 16) {
    const int n = OR * RN - k0 < 16 ? OR * RN - k0 : 16;
    __m512 part[16];
    for (int j = 0; j < 16; ++j) part[j] = j < n ? acc[k0 + j] : _mm512_setzero_ps();
    __m512 sums = Transpose16Sum(part);
    const __mmask16 lanes = (__mmask16)(n >= 16 ? 0xffffu : ((1u << n) - 1u));
    if (add) sums = _mm512_add_ps(sums, _mm512_maskz_loadu_ps(lanes, out + k0));
    _mm512_mask_storeu_ps(out + k0, lanes, sums);
  }
  for (int k = k0; k < OR * RN; ++k) {
    const float sum = _mm512_reduce_add_ps(acc[k]);
    out[k] = add ? out[k] + sum : sum;
  }
  if constexpr (!whole) {
    for (int q = 0; q < OR; ++q) {
      float* row = y + (o + q) * RT + R0;
      for (int r = 0; r < RN; ++r) row[r] = first ? buffer[q * RN + r] : row[r] + buffer[q * RN + r];
    }
  }
}

// One pass of a group: output rows o .. o+OR-1 against activation rows R0 .. R0+R-1 of RT, over
// the input-axis block [i0, i1), adding to y unless `first`. T = uint16_t (bf16 bits) or float.
// `near` and `far` are the starts of the units to prefetch (into L1 and L2) while this one is
// read: their row q, offset along the block as this one's (the first pass of a group only). On AMD
// the far prefetch is non-temporal, as the packed kernel's (PackedTiles): the weights, read once a
// step, do not push the KV cache and the activations out of L2 and L3. Whole GPT-2-small steps on
// AMD Zen 5, the two hints alternated in one process (medians of 8-10 rounds, ms): bf16 batch 8
// 6.78 against 7.04, batch 1 4.76 against 5.06; float32 batch 8 14.21 against 14.54. Elsewhere it
// goes into L2 (FarPrefetchNta, native_kernels.cc: on an Intel Xeon a non-temporal prefetch cost
// these kernels 2-3x). (The column kernel below prefetches in the order it reads instead: ColBlock.)
template <int RT, int R0, int R, int OR, typename T, bool kPrefetch>
inline void RowPass(const T* w, const T* x, float* y, int64_t I, int64_t o, int64_t i0, int64_t i1,
                    bool first, const char* near, const char* far) {
  x += R0 * I;  // this pass's activation rows
  constexpr int64_t kLanes = sizeof(T) == 2 ? 32 : 16;  // elements per 64-byte vector
  const int64_t width = i1 - i0;
  const int64_t full = i0 + (width / kLanes) * kLanes;
  const int64_t tail = i1 - full;
  const __mmask32 tail_mask16 = (__mmask32)((tail >= 32) ? 0xffffffffu : ((1u << tail) - 1u));
  const __mmask16 tail_mask32 = (__mmask16)((tail >= 16) ? 0xffffu : ((1u << tail) - 1u));
  const int64_t stride = I * (int64_t)sizeof(T);
  __m512 acc[OR * R];  // acc[q * R + r]: weight row o + q, activation row r
  for (int k = 0; k < OR * R; ++k) acc[k] = _mm512_setzero_ps();
  const T* row = w + o * I;
  // Sets 1..S-1 of accumulators (set 0 is acc); vector v of the block goes to set v % S, and the
  // vectors after the last whole round of S to set 0.
  constexpr int S = AccumulatorSets<R, OR>();
  __m512 more[(S - 1) * OR * R + 1];
  for (int k = 0; k < (S - 1) * OR * R; ++k) more[k] = _mm512_setzero_ps();
  const bool nta = FarPrefetchNta();
  auto pass = [&](int64_t i, __m512* sums) __attribute__((always_inline)) {
    const int64_t ahead = (i - i0) * (int64_t)sizeof(T);
    for (int q = 0; q < OR && kPrefetch; ++q) {
      if constexpr (PrefetchL1<RT, T>()) _mm_prefetch(near + q * stride + ahead, _MM_HINT_T0);
      FarPrefetch(far + q * stride + ahead, nta);
    }
    if constexpr (sizeof(T) == 2) {
      __m512bh a[OR];
      for (int q = 0; q < OR; ++q) a[q] = (__m512bh)_mm512_loadu_si512(row + q * I + i);
      for (int r = 0; r < R; ++r) {
        const __m512bh b = (__m512bh)_mm512_loadu_si512(x + r * I + i);
        for (int q = 0; q < OR; ++q) sums[q * R + r] = _mm512_dpbf16_ps(sums[q * R + r], a[q], b);
      }
    } else {
      __m512 a[OR];
      for (int q = 0; q < OR; ++q) a[q] = _mm512_loadu_ps(row + q * I + i);
      for (int r = 0; r < R; ++r) {
        __m512 b = _mm512_loadu_ps(x + r * I + i);
        asm("" : "+v"(b));  // one load into a register, not one folded into each row's FMA
        for (int q = 0; q < OR; ++q) sums[q * R + r] = _mm512_fmadd_ps(a[q], b, sums[q * R + r]);
      }
    }
  };
  int64_t i = i0;
  if constexpr (S > 1) {
    for (; i + S * kLanes <= full; i += S * kLanes) {
      pass(i, acc);
      for (int s = 1; s < S; ++s) pass(i + s * kLanes, more + (s - 1) * OR * R);
    }
  }
  for (; i < full; i += kLanes) pass(i, acc);
  for (int s = 1; s < S; ++s)
    for (int k = 0; k < OR * R; ++k) acc[k] = _mm512_add_ps(acc[k], more[(s - 1) * OR * R + k]);
  if (tail) {
    for (int q = 0; q < OR; ++q) {
      for (int r = 0; r < R; ++r) {
        if constexpr (sizeof(T) == 2) {
          acc[q * R + r] = _mm512_dpbf16_ps(acc[q * R + r],
                                            (__m512bh)_mm512_maskz_loadu_epi16(tail_mask16, row + q * I + full),
                                            (__m512bh)_mm512_maskz_loadu_epi16(tail_mask16, x + r * I + full));
        } else {
          acc[q * R + r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail_mask32, row + q * I + full),
                                           _mm512_maskz_loadu_ps(tail_mask32, x + r * I + full), acc[q * R + r]);
        }
      }
    }
  }
  StoreSums<RT, R0, R, OR>(acc, y, o, first);
}

// Output rows o .. o+OR-1 over the input-axis block [i0, i1): all activation rows in one pass,
// or above kPassRows in two, the first with the prefetches.
template <int R, int OR, typename T>
inline void RowGroup(const T* w, const T* x, float* y, int64_t I, int64_t o, int64_t i0, int64_t i1,
                     bool first, const char* near, const char* far) {
  if constexpr (R <= kPassRows) {
    RowPass<R, 0, R, OR, T, true>(w, x, y, I, o, i0, i1, first, near, far);
  } else {
    RowPass<R, 0, R / 2, OR, T, true>(w, x, y, I, o, i0, i1, first, near, far);
    RowPass<R, R / 2, R - R / 2, OR, T, false>(w, x, y, I, o, i0, i1, first, near, far);
  }
}

// The bf16 product widened to float32 (`Bf16Path::kWiden`): on CPUs whose bf16 dot-product
// instruction is slow next to their float32 FMAs (measured on one Intel Xeon: vdpbf16ps at one per
// ~0.8 ns, a float32 FMA at one per ~0.2 ns per core, where a dot product does twice an FMA's
// work; on the AMD Zen 4 host measured, dot products at 8 rows kept pace with memory).
//
// A 64-byte load holds 32 bf16 weights as 16 pairs; a pair's first element widens by a shift of
// its 32-bit lane, the second by clearing the lane's low half (bf16 is float32's top 16 bits, so
// both are exact). The activations are widened once per call (WidenRows) into float32 in the same
// order: each run of 32 inputs as its 16 first-of-pair elements, then its 16 second-of-pair ones,
// the row padded with zeros to a multiple of 32 (the weights' tail loads as zeros).
inline void WidenPairs(__m512i v, __m512* first, __m512* second) {
  *first = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  *second = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}

// Inputs per run of the widened order (a 64-byte load of bf16), and a row length padded to whole runs.
constexpr int64_t kWidenRun = 32;
inline int64_t PaddedWiden(int64_t n) { return (n + kWidenRun - 1) / kWidenRun * kWidenRun; }

// x [R, I] bf16 -> xw [R, PaddedWiden(I)] float32 in the order above.
void WidenRows(const uint16_t* x, float* xw, int64_t R, int64_t I) {
  const int64_t Ip = PaddedWiden(I);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t i = 0; i < Ip; i += 32) {
      const int64_t n = std::min<int64_t>(32, I - i);
      const __mmask32 m = (__mmask32)(n >= 32 ? 0xffffffffu : ((1u << n) - 1u));
      __m512 first, second;
      WidenPairs(_mm512_maskz_loadu_epi16(m, x + r * I + i), &first, &second);
      _mm512_storeu_ps(xw + r * Ip + i, first);
      _mm512_storeu_ps(xw + r * Ip + i + 16, second);
    }
  }
}

// RowGroup's bf16 product on widened activations xw [R, Ip]; [i0, i1) starts at a multiple of 32.
template <int R, int OR>
inline void RowGroupWiden(const uint16_t* w, const float* xw, float* y, int64_t I, int64_t Ip, int64_t o,
                          int64_t i0, int64_t i1, bool first, const char* near, const char* far) {
  const int64_t full = i0 + ((i1 - i0) / 32) * 32;
  const int64_t tail = i1 - full;
  const int64_t stride = I * 2;
  __m512 acc[OR * R];
  for (int k = 0; k < OR * R; ++k) acc[k] = _mm512_setzero_ps();
  const uint16_t* row = w + o * I;
  const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
  // One pass over 32 inputs: the OR rows' first-of-pair elements against each activation row,
  // then their second-of-pair ones (at R = 8: two rows, 16 accumulators, 4 widened weight vectors).
  for (int64_t i = i0; i < i1; i += 32) {
    const int64_t ahead = (i - i0) * 2;
    const __mmask32 m = i < full ? (__mmask32)0xffffffffu : (__mmask32)((1u << tail) - 1u);
    if (i < full) {
      for (int q = 0; q < OR; ++q) {
        if constexpr (PrefetchL1<R, uint16_t>()) _mm_prefetch(near + q * stride + ahead, _MM_HINT_T0);
        _mm_prefetch(far + q * stride + ahead, _MM_HINT_T1);
      }
    }
    __m512i v[OR];
    for (int q = 0; q < OR; ++q) v[q] = _mm512_maskz_loadu_epi16(m, row + q * I + i);
    for (int r = 0; r < R; ++r) {
      __m512 xa = _mm512_load_ps(xw + r * Ip + i);
      asm("" : "+v"(xa));  // one load into a register, not one folded into each row's FMA
      for (int q = 0; q < OR; ++q)
        acc[q * R + r] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v[q], 16)), xa, acc[q * R + r]);
    }
    for (int r = 0; r < R; ++r) {
      __m512 xb = _mm512_load_ps(xw + r * Ip + i + 16);
      asm("" : "+v"(xb));
      for (int q = 0; q < OR; ++q)
        acc[q * R + r] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v[q], high)), xb, acc[q * R + r]);
    }
  }
  StoreSums<R, 0, R, OR>(acc, y, o, first);
}

// Weight rows per pass of the widened bf16 product: its accumulators, 2 * OR widened weight
// vectors and the activation vector must stay within the 32 registers (measured in the C++
// harness: two rows at 8 activation rows, 55-59 GMAC/s per core, against 41-43 with three).
template <int R>
constexpr int WidenGroupRows() { return R <= 4 ? 3 : (R <= 12 ? 2 : 1); }

// ---------------------------------------------------------------------------------------------
// Products of weights stored input-major, w [I, O] (tj_cols_matmul; see native_kernels.cc): a
// block of output columns at a time, every input row of the task's run adding its weight vectors,
// each times one activation broadcast, into RN * V accumulators (an activation row by a vector of
// columns). float32 and widened bf16 weights: 16 columns per vector, V = ColVectors<RN>(); bf16
// dot products: two input rows interleaved into pairs (vpunpck{l,h}wd), 32 columns per load pair,
// their accumulators in the unpacked order until the block is stored.

// Column vectors per block at RN activation rows: enough independent sums for the FMA latency at
// one row, at most 24 accumulators at eight.
template <int RN>
constexpr int ColVectors() { return RN <= 1 ? 16 : (RN <= 2 ? 12 : (RN <= 3 ? 8 : (RN <= 4 ? 6 : (RN <= 6 ? 4 : 3)))); }
// Load pairs (32 columns, two accumulators per activation row) per block of the bf16 dot product.
template <int RN>
constexpr int ColPairs() { return RN <= 1 ? 8 : (RN <= 2 ? 6 : (RN <= 3 ? 4 : (RN <= 4 ? 3 : (RN <= 6 ? 2 : 1)))); }
// Activation rows per pass over a block: more are taken in two passes, the second reading the
// block's weights from L1.
constexpr int kColPassRows = 8;

inline __mmask16 Lanes16(int64_t n) {
  return n >= 16 ? (__mmask16)0xffffu : (n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u));
}
inline __mmask32 Lanes32(int64_t n) {
  return n >= 32 ? (__mmask32)0xffffffffu : (n <= 0 ? (__mmask32)0 : (__mmask32)((1u << n) - 1u));
}

// 16 weights from p as float32 (bf16 widened exactly), the first `lanes` of them.
inline __m512 LoadWeights(const float* p, __mmask16 lanes, bool whole) {
  return whole ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(lanes, p);
}
inline __m512 LoadWeights(const uint16_t* p, __mmask16 lanes, bool whole) {
  const __m256i v =
      whole ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : _mm256_maskz_loadu_epi16(lanes, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// One block of columns [c0, c0 + 16 V) (fewer at the end: Whole = false) over input rows [i0, i1),
// activation rows R0 .. R0+RN-1 of x (float32 [R, I]), into part [R, O], written if `first`. Kept
// out of line: inlined into its caller's loop, GCC kept the accumulators in memory.
template <int R0, int RN, typename T, bool Whole, bool Once>
__attribute__((noinline)) void ColBlock(const T* w, const float* x, float* part, int64_t I, int64_t O, int64_t c0,
                                        int64_t i0, int64_t i1, bool first, const char*& ahead) {
  constexpr int V = ColVectors<RN>();
  __mmask16 m[V];
  for (int v = 0; v < V; ++v) m[v] = Lanes16(O - c0 - 16 * v);
  __m512 acc[RN * V];
  for (int r = 0; r < RN; ++r)
    for (int v = 0; v < V; ++v)
      acc[r * V + v] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m[v], part + (R0 + r) * O + c0 + 16 * v);
  // float32 weights: each line is prefetched non-temporally kColPrefetchReads reads ahead, in the
  // order the blocks read them (down this block's rows, then the next block's, then the next
  // task's: the thread's next), so that the weights, read once, do not push the KV cache and the
  // activations out of L2 and L3 (a float32 GPT-2-small step on AMD Zen 5, alternated in one process
  // with the prefetch of the next task's run into L2, medians of 8 rounds: batch 8 14.06 against
  // 14.85 ms, batch 1 11.81 against 13.12). NTA along the next task's run instead, 128 KB ahead, was
  // slower: the lines left L1 before they were read. Widened bf16 weights keep that L2 prefetch, as
  // do more than kColPassRows rows (`Once` false), whose second pass reads the task's run again.
  constexpr bool kInOrder = sizeof(T) == 4 && Once;
  const bool in_order = kInOrder && ahead != nullptr;
  const bool nta = FarPrefetchNta();
  const int64_t stride = O * (int64_t)sizeof(T), width = 16 * V * (int64_t)sizeof(T), rows = i1 - i0;
  int64_t next_row = 0, next_col = 0, lo = i0, hi = i1;  // the line kColPrefetchReads reads on
  if (in_order) {
    next_col = c0 * (int64_t)sizeof(T) + kColPrefetchReads / rows * width;
    next_row = i0 + kColPrefetchReads % rows;
    for (; next_col >= stride; next_col -= stride) lo += rows, hi += rows, next_row += rows;
  }
  const char* base = reinterpret_cast<const char*>(w);
  const char* p = kInOrder ? nullptr : ahead;
  for (int64_t i = i0; i < i1; ++i) {
    const T* row = w + i * O + c0;
    __m512 a[V];
    for (int v = 0; v < V; ++v) a[v] = LoadWeights(row + 16 * v, m[v], Whole);
    if (in_order) {
      const char* line = base + next_row * stride + next_col;
      for (int v = 0; v < V; ++v) FarPrefetch(line + 64 * v, nta);
      if (++next_row == hi) {
        next_row = lo;
        next_col += width;
        if (next_col >= stride) next_col = 0, lo = hi, hi += rows, next_row = lo;
      }
    }
    if (p) {
      for (int v = 0; v < V; ++v) _mm_prefetch(p + v * 16 * (int64_t)sizeof(T), _MM_HINT_T1);
      p += V * 16 * (int64_t)sizeof(T);
    }
    for (int r = 0; r < RN; ++r) {
      const __m512 b = _mm512_set1_ps(x[(R0 + r) * I + i]);
      for (int v = 0; v < V; ++v) acc[r * V + v] = _mm512_fmadd_ps(a[v], b, acc[r * V + v]);
    }
  }
  if (p) ahead = p;
  for (int r = 0; r < RN; ++r)
    for (int v = 0; v < V; ++v) _mm512_mask_storeu_ps(part + (R0 + r) * O + c0 + 16 * v, m[v], acc[r * V + v]);
}

// The same for bf16 weights and activations by dot products: columns [c0, c0 + 32 P), input rows
// taken in pairs (i0 even), a last odd row paired with zeros.
template <int R0, int RN, bool Whole>
__attribute__((noinline)) void ColBlockDot(const uint16_t* w, const uint16_t* x, float* part, int64_t I, int64_t O,
                                           int64_t c0, int64_t i0, int64_t i1, bool first, const char*& ahead) {
  constexpr int P = ColPairs<RN>();
  __mmask32 m[P];
  for (int v = 0; v < P; ++v) m[v] = Lanes32(O - c0 - 32 * v);
  __m512 acc[RN * 2 * P];
  for (int k = 0; k < RN * 2 * P; ++k) acc[k] = _mm512_setzero_ps();
  const char* p = ahead;
  int64_t i = i0;
  for (; i + 2 <= i1; i += 2) {
    const uint16_t* row = w + i * O + c0;
    __m512bh a[2 * P];
    for (int v = 0; v < P; ++v) {
      const uint16_t* next = row + O;  // input row i + 1
      const __m512i lo = Whole ? _mm512_loadu_si512(row + 32 * v) : _mm512_maskz_loadu_epi16(m[v], row + 32 * v);
      const __m512i hi = Whole ? _mm512_loadu_si512(next + 32 * v) : _mm512_maskz_loadu_epi16(m[v], next + 32 * v);
      a[2 * v] = (__m512bh)_mm512_unpacklo_epi16(lo, hi);
      a[2 * v + 1] = (__m512bh)_mm512_unpackhi_epi16(lo, hi);
    }
    if (p) {
      for (int v = 0; v < 2 * P; ++v) _mm_prefetch(p + 64 * v, _MM_HINT_T1);
      p += 128 * P;
    }
    for (int r = 0; r < RN; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + (R0 + r) * I + i, sizeof(pair));
      const __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < 2 * P; ++v) acc[r * 2 * P + v] = _mm512_dpbf16_ps(acc[r * 2 * P + v], a[v], b);
    }
  }
  if (i < i1) {
    const uint16_t* row = w + i * O + c0;
    __m512bh a[2 * P];
    for (int v = 0; v < P; ++v) {
      const __m512i lo = _mm512_maskz_loadu_epi16(m[v], row + 32 * v);
      a[2 * v] = (__m512bh)_mm512_unpacklo_epi16(lo, _mm512_setzero_si512());
      a[2 * v + 1] = (__m512bh)_mm512_unpackhi_epi16(lo, _mm512_setzero_si512());
    }
    for (int r = 0; r < RN; ++r) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32((int32_t)x[(R0 + r) * I + i]);
      for (int v = 0; v < 2 * P; ++v) acc[r * 2 * P + v] = _mm512_dpbf16_ps(acc[r * 2 * P + v], a[v], b);
    }
  }
  if (p) ahead = p;
  // Lane 4j + t of the low unpacked half sums column 8j + t, of the high half column 8j + 4 + t.
  const __m512i first16 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i next16 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int r = 0; r < RN; ++r) {
    for (int v = 0; v < P; ++v) {
      const __m512 lo = acc[r * 2 * P + 2 * v], hi = acc[r * 2 * P + 2 * v + 1];
      __m512 s0 = _mm512_permutex2var_ps(lo, first16, hi), s1 = _mm512_permutex2var_ps(lo, next16, hi);
      const int64_t n = O - c0 - 32 * v;
      const __mmask16 m0 = Lanes16(n), m1 = Lanes16(n - 16);
      float* dst = part + (R0 + r) * O + c0 + 32 * v;
      if (!first) {
        s0 = _mm512_add_ps(s0, _mm512_maskz_loadu_ps(m0, dst));
        s1 = _mm512_add_ps(s1, _mm512_maskz_loadu_ps(m1, dst + 16));
      }
      _mm512_mask_storeu_ps(dst, m0, s0);
      _mm512_mask_storeu_ps(dst + 16, m1, s1);
    }
  }
}

// All column blocks of input rows [i0, i1) for activation rows R0 .. R0+RN-1; the prefetches
// (from `ahead`, one line per line read) only where `ahead` is set.
template <int R0, int RN, typename T, bool Dot, bool Once>
void ColPass(const T* w, const void* x, float* part, int64_t I, int64_t O, int64_t i0, int64_t i1, bool first,
             const char* ahead) {
  if constexpr (Dot) {
    constexpr int64_t kBlock = 32 * ColPairs<RN>();
    const auto* xb = static_cast<const uint16_t*>(x);
    int64_t c0 = 0;
    for (; c0 + kBlock <= O; c0 += kBlock) ColBlockDot<R0, RN, true>(w, xb, part, I, O, c0, i0, i1, first, ahead);
    if (c0 < O) ColBlockDot<R0, RN, false>(w, xb, part, I, O, c0, i0, i1, first, ahead);
  } else {
    constexpr int64_t kBlock = 16 * ColVectors<RN>();
    const auto* xf = static_cast<const float*>(x);
    int64_t c0 = 0;
    for (; c0 + kBlock <= O; c0 += kBlock) ColBlock<R0, RN, T, true, Once>(w, xf, part, I, O, c0, i0, i1, first, ahead);
    if (c0 < O) ColBlock<R0, RN, T, false, Once>(w, xf, part, I, O, c0, i0, i1, first, ahead);
  }
}

// Input rows [i0, i1) of w [I, O] times x's R rows (bf16 [R, I] for the dot products, else float32
// [R, I]) into part [R, O]: one pass, or two above kColPassRows (the first with the prefetches).
template <int R, typename T, bool Dot>
void ColsRange(const T* w, const void* x, float* part, int64_t I, int64_t O, int64_t i0, int64_t i1, bool first,
               const char* ahead) {
  if constexpr (R <= kColPassRows) {
    ColPass<0, R, T, Dot, true>(w, x, part, I, O, i0, i1, first, ahead);
  } else {
    ColPass<0, R / 2, T, Dot, false>(w, x, part, I, O, i0, i1, first, ahead);
    ColPass<R / 2, R - R / 2, T, Dot, false>(w, x, part, I, O, i0, i1, first, nullptr);
  }
}

// tj_packed_matmul (see native_kernels.cc): the outputs o .. o + 16 T - 1 of R activation rows,
// from one group of T tiles (native.py, PACK_GROUP). A tile is 16 weight rows; a group of T tiles
// is stored [I / 2, T, 16, 2]: each 64-byte line holds one pair of inputs for all 16 outputs of a
// tile, and the group's tiles take their lines in turn, pair by pair, so that the group is one run
// of memory. One bf16 dot product against the pair of an activation row, broadcast, adds to 16
// outputs at once. The accumulators are the outputs themselves (no sums across lanes at the end),
// and each step reads T lines and one 4-byte pair per activation row, where RowPass reads a
// 64-byte activation vector per row. Up to kPackedPassRows rows at a time: three tiles of 8 rows
// are 24 accumulators; more rows (9-16 in a decoding step, a prefill's) go through a group in
// passes (native_kernels.cc).
constexpr int kPackedPassRows = 8;

// Where output-major element f of a group's [16 T, R] outputs lies among its sums (sum k = tile
// k / R, row k % R, 16 outputs each): computed at compile time, as the table the store gathers by.
template <int R, int T>
constexpr std::array<int32_t, 16 * T * R> PackedOutputOrder() {
  std::array<int32_t, 16 * T * R> order{};
  for (int f = 0; f < 16 * T * R; ++f) {
    const int local = f / R, r = f % R;  // output o + local, row r
    order[f] = ((local / 16) * R + r) * 16 + local % 16;
  }
  return order;
}

// Rows r0 .. r0 + R - 1 of the group's outputs: into y [O, Rt] (a decoding step's product, where
// O < 0), or into y [rows, O].
template <int R, int T, bool Once = true>
inline void PackedTiles(const uint16_t* w, const uint16_t* x, float* y, int64_t I, int64_t o, int64_t O,
                        int64_t r0, int64_t Rt = R) {
  // Independent sums enough to keep the dot products' latency hidden: at few accumulators, S sets
  // taken in turn, pair by pair.
  constexpr int S = T * R >= 8 ? 1 : (T * R >= 4 ? 2 : 4);
  __m512 acc[S * T * R];
  for (int k = 0; k < S * T * R; ++k) acc[k] = _mm512_setzero_ps();
  const uint16_t* group = w + o * I;  // T lines (64 bytes each) per pair of inputs
  const int64_t pairs = I / 2;
  // The group's run is prefetched into L1 kPackedPrefetchBytes512 per tile ahead, and on past its
  // end into the next group: the thread's next task. `Once` (a decoding step, which reads each
  // weight once): on AMD the prefetches are non-temporal, so the weight streaming through does not
  // push out of L2 and L3 what the step reads again: the KV cache, the activations, the logits
  // (elsewhere into L2: FarPrefetchNta). A
  // prefill (PackedChunks) reads a group once per chunk of rows, from L2, and keeps plain
  // prefetches, as do a decoding step's passes over more than kPackedPassRows rows.
  const char* ahead = reinterpret_cast<const char*>(group) + T * kPackedPrefetchBytes512;
  const bool nta = FarPrefetchNta();
  auto step = [&](int64_t p, __m512* sums) __attribute__((always_inline)) {
    __m512bh a[T];
    for (int t = 0; t < T; ++t) {
      if constexpr (Once) {
        FarPrefetch(ahead + 64 * (T * p + t), nta);
      } else {
        _mm_prefetch(ahead + 64 * (T * p + t), _MM_HINT_T0);
      }
      a[t] = (__m512bh)_mm512_loadu_si512(group + 32 * (T * p + t));
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * I + 2 * p, sizeof(pair));
      const __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
      for (int t = 0; t < T; ++t) sums[t * R + r] = _mm512_dpbf16_ps(sums[t * R + r], a[t], b);
    }
  };
  int64_t p = 0;
  for (; p + S <= pairs; p += S)
    for (int k = 0; k < S; ++k) step(p + k, acc + k * T * R);
  for (; p < pairs; ++p) step(p, acc);
  for (int k = 1; k < S; ++k)
    for (int j = 0; j < T * R; ++j) acc[j] = _mm512_add_ps(acc[j], acc[k * T * R + j]);
  if (O < 0) {  // y [O, Rt]
    alignas(64) float sums[T * R * 16];
    for (int k = 0; k < T * R; ++k) _mm512_store_ps(sums + 16 * k, acc[k]);
    if (Rt == R) {  // outputs o .. o + 16 T - 1 are 16 T R consecutive floats, output-major
      static constexpr std::array<int32_t, 16 * T * R> kOrder = PackedOutputOrder<R, T>();
      float* out = y + o * R;
      for (int v = 0; v < T * R; ++v)
        _mm512_storeu_ps(out + 16 * v, _mm512_i32gather_ps(_mm512_loadu_si512(kOrder.data() + 16 * v), sums, 4));
    } else {  // a pass over some of the rows
      for (int local = 0; local < 16 * T; ++local)
        for (int r = 0; r < R; ++r) y[(o + local) * Rt + r0 + r] = sums[((local / 16) * R + r) * 16 + local % 16];
    }
  } else {  // y [rows, O], these R rows from row r0: each sum is 16 consecutive outputs of a row
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + (r0 + r) * O + o + 16 * t, acc[t * R + r]);
  }
}

// Nanoseconds per instruction of 12 independent chains of `op` (the inner loops' mix, without
// memory): the least of five tries of 2048 rounds.
template <typename Op>
double NsPerOp(Op op) {
  double best = 1e30;
  for (int t = 0; t < 5; ++t) {
    __m512 acc[12];
    for (int k = 0; k < 12; ++k) acc[k] = _mm512_set1_ps(1e-3f * k);
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < 2048; ++i) {
      for (int k = 0; k < 12; ++k) acc[k] = op(acc[k]);
      asm volatile("" : : : "memory");
    }
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
    float sum = 0;
    for (int k = 0; k < 12; ++k) sum += _mm512_reduce_add_ps(acc[k]);
    asm volatile("" : : "x"(sum));
    best = std::min(best, ns / (2048.0 * 12));
  }
  return best;
}

// The faster way to multiply bf16 on this CPU, measured: a bf16 dot product does 32 multiply-adds,
// a float32 FMA 16, and widening costs about one more operation per 16 multiply-adds at a few rows.
int Bf16Calibrate() {
  __m512i a = _mm512_set1_epi16(0x3f80), b = _mm512_set1_epi16(0x3a83);
  __m512 fa = _mm512_set1_ps(1.0f), fb = _mm512_set1_ps(1e-3f);
  asm volatile("" : "+v"(a), "+v"(b), "+v"(fa), "+v"(fb));  // not constants the compiler can fold
  double dot = 1e30, fma = 1e30;
  for (int t = 0; t < 3; ++t) {
    dot = std::min(dot, NsPerOp([&](__m512 c) { return _mm512_dpbf16_ps(c, (__m512bh)a, (__m512bh)b); }));
    fma = std::min(fma, NsPerOp([&](__m512 c) { return _mm512_fmadd_ps(fa, fb, c); }));
  }
  return 2.25 * fma < dot ? kWiden : kDot;
}

// exp(x) for x <= 0 (logits minus their maximum), float32 accuracy: 2^(x log2 e) split into an
// integer power of two and a degree-6 polynomial on [-0.5, 0.5].
inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));  // exp(-87) ~ 1.6e-38, and no inf - inf below
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(t, n);  // in [-0.5, 0.5]; 2^f = exp(f ln 2)
  __m512 p = _mm512_set1_ps(1.5353362e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3398874e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6182945e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5503406e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022652e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 16 cache elements from p (float32, or bf16 widened exactly to float32), lanes outside `lanes` 0.
inline __m512 LoadCache(const float* p, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, p); }
inline __m512 LoadCache(const uint16_t* p, __mmask16 lanes) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, p)), 16));
}

// The visible keys among s0 .. s0 + 15 (those before hi: the mask ends at S), one bit each.
inline __mmask16 VisibleKeys(const bool* m, int64_t s0, int64_t hi) {
  const int64_t n = std::min<int64_t>(16, hi - s0);
  const __m128i bytes = _mm_maskz_loadu_epi8((__mmask16)(n >= 16 ? 0xffffu : (1u << n) - 1u), m + s0);
  return _mm_test_epi8_mask(bytes, bytes);
}

// The first visible position of m[S] and one past the last ([S, S] where none is), 64 mask bytes
// at a time: a cache allocated for a long generation is mostly positions not yet written, which a
// byte-by-byte search from the end walked through in every task.
inline void VisibleWindow(const bool* m, int64_t S, int64_t& lo, int64_t& hi) {
  auto bits = [m](int64_t s0, int64_t n) {
    const __m512i bytes = _mm512_maskz_loadu_epi8(n >= 64 ? ~__mmask64{0} : (__mmask64{1} << n) - 1, m + s0);
    return (uint64_t)_mm512_test_epi8_mask(bytes, bytes);
  };
  lo = hi = S;
  for (int64_t s0 = 0; s0 < S; s0 += 64) {
    if (const uint64_t b = bits(s0, std::min<int64_t>(64, S - s0))) {
      lo = s0 + __builtin_ctzll(b);
      break;
    }
  }
  for (int64_t end = S; end > lo; end -= 64) {
    const int64_t s0 = std::max(lo, end - 64);
    if (const uint64_t b = bits(s0, end - s0)) {
      hi = s0 + 64 - __builtin_clzll(b);
      break;
    }
  }
}

// One query q[Kd] over keys/values [S, Kd] (T: float, or uint16_t for bf16) with mask m[S] ->
// out[Kd]. `logits` has room for S rounded up to 16. Only the keys and values from the first
// visible position to the last are read: a decoding step's cache is allocated for the whole
// generation, and the positions not yet written (and a left-padded prompt's padding) are masked.
// What lies outside is never loaded, so it cannot change the result, whatever it holds.
// While it reads each key it prefetches the key's value row and, where next_k / next_v are given
// (the next task's keys and values), the same row of those: in a decoding step the cache comes
// from memory (the weights read between two layers' attention push it out of every cache level),
// and a (row, head) task of 64 positions is too short for the hardware prefetcher to get ahead.
// GPT-2 small, bf16 cache, batch 8, 64 visible positions: 175-210 -> 112-117 us per layer.
// N = (Kd + 15) / 16 is a template argument for the common head sizes (AttendVectors; 0: any
// other, counted at run time), so that the query and the output's sums stay in registers: with a
// count known only at run time the compiler kept them on the stack, and each multiply-add waited
// on the store of the one before (GPT-2 small, bf16 cache, batch 8, 64 visible positions, the
// cache in L3: 33 -> 26 us per layer).
template <typename T, int N>
void AttendOne(const float* q, const T* k, const T* v, const bool* m, float* out,
               int64_t S, int64_t Kd, float* logits, const T* next_k, const T* next_v) {
  const int64_t vecs = N > 0 ? N : (Kd + 15) / 16;
  const __mmask16 tail = (Kd % 16) ? (__mmask16)((1u << (Kd % 16)) - 1u) : (__mmask16)0xffff;
  int64_t lo, hi;  // the visible keys lie in [lo, hi)
  VisibleWindow(m, S, lo, hi);
  if (lo == hi) {  // no key is visible: zeros, as on every backend
    for (int64_t d = 0; d < Kd; ++d) out[d] = 0.0f;
    return;
  }
  const int64_t first = lo / 16 * 16;  // blocks of 16 keys, aligned as if they started at 0
  const int64_t row_bytes = Kd * sizeof(T);
  __m512 qv[N > 0 ? N : kMaxHeadDim / 16];
  for (int64_t c = 0; c < vecs; ++c)
    qv[c] = _mm512_maskz_loadu_ps(c == vecs - 1 ? tail : (__mmask16)0xffff, q + c * 16);
  // Logits, 16 keys at a time (keys outside [lo, hi) count as masked), and their maximum lane by lane.
  __m512 best = _mm512_set1_ps(-3.0e38f);
  for (int64_t s0 = first; s0 < hi; s0 += 16) {
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) {
      acc[j] = _mm512_setzero_ps();
      if (s0 + j < lo || s0 + j >= hi) continue;
      // This query's value row, and the next task's key row, start coming from memory.
      PrefetchRows(v + (s0 + j) * Kd, 1, row_bytes);
      if (next_k != nullptr) PrefetchRows(next_k + (s0 + j) * Kd, 1, row_bytes);
      const T* key = k + (s0 + j) * Kd;
      for (int64_t c = 0; c < vecs; ++c)
        acc[j] = _mm512_fmadd_ps(qv[c], LoadCache(key + c * 16, c == vecs - 1 ? tail : (__mmask16)0xffff),
                                 acc[j]);
    }
    const __m512 sums = Transpose16Sum(acc);
    _mm512_storeu_ps(logits + s0, sums);
    // (m is false below lo.) A maximum is exact, so lane by lane and then across the lanes it is
    // the one a loop over the keys finds (up to the sign of a zero, which no exp(x - max) sees).
    best = _mm512_mask_max_ps(best, VisibleKeys(m, s0, hi), sums, best);
  }
  for (int64_t c = 0; c < vecs; ++c) qv[c] = _mm512_setzero_ps();  // now the output accumulator
  // Weights exp(logit - max) on visible keys, 0 elsewhere; their sum. The blocks before `first`
  // would each add zeros: the sums are the same as over all S keys.
  __m512 total = _mm512_setzero_ps();
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
  for (int64_t s0 = first; s0 < hi; s0 += 16) {
    const __mmask16 visible = VisibleKeys(m, s0, hi);
    __m512 p = _mm512_maskz_mov_ps(visible, Exp(_mm512_sub_ps(_mm512_loadu_ps(logits + s0), top)));
    _mm512_storeu_ps(logits + s0, p);
    total = _mm512_add_ps(total, p);
  }
  for (int64_t s = lo; s < hi; ++s) {
    if (!m[s]) continue;
    const __m512 p = _mm512_set1_ps(logits[s]);
    if (next_v != nullptr) PrefetchRows(next_v + s * Kd, 1, row_bytes);
    const T* val = v + s * Kd;
    for (int64_t c = 0; c < vecs; ++c)
      qv[c] = _mm512_fmadd_ps(p, LoadCache(val + c * 16, c == vecs - 1 ? tail : (__mmask16)0xffff), qv[c]);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
  for (int64_t c = 0; c < vecs; ++c)
    _mm512_mask_storeu_ps(out + c * 16, c == vecs - 1 ? tail : (__mmask16)0xffff, _mm512_mul_ps(qv[c], inv));
}

// Lanes of a vector of the attention's head rows, and the vectors per row for which AttendOne is
// compiled with a fixed count (head sizes 32, 64, 80, 96, 128 and 256).
constexpr int kAttendLanes = 16;
using AttendVectors = std::integer_sequence<int, 2, 4, 5, 6, 8, 16>;

// Rows [v0, v1) of columns [b0, b0 + 16) (or of all B columns, P = 16 / B rows per vector, where
// B divides 16): one partial per lane, lane l holding column b0 + l % B' (B' = 16 / P) over rows
// v = l / B' (mod P). `lanes` marks the lanes in use.
void GreedyLanes(const float* l, int64_t B, int64_t b0, int64_t P, __mmask16 lanes, int64_t v0, int64_t v1,
                 GreedyPartial* out) {
  const int64_t Bv = 16 / P;  // columns per vector
  // Row of each lane at the vector for row v: v + lane / Bv.
  const __m512i lane_row = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             (unsigned)__builtin_ctzll((unsigned long long)Bv));
  auto at_row = [&](int64_t v) { return P == 1 ? (const float*)(l + v * B + b0) : l + v * B; };
  // The lanes of the vector at row v that hold rows before v1 (all but in the last, where V is not
  // a multiple of P).
  auto within = [&](int64_t v) {
    return v + P <= v1 ? lanes : (__mmask16)(lanes & ((1u << ((v1 - v) * Bv)) - 1u));
  };
  // Each lane's maximum. max(x, m) returns m where x is NaN (passed over) and where x equals m
  // (a zero keeps the sign of the first), so it is the value a search for the first greater one
  // keeps. Two sets of maxima, vector by vector in turn, halve the chain of dependent operations;
  // their maximum is the same value (a zero's sign aside, which neither x - max nor the merge sees).
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best_a = neg_inf, best_b = neg_inf;
  __mmask16 nan = 0, seen = 0;  // lanes that met a NaN / a value that is not NaN
  auto take = [&](int64_t v, __m512& best) __attribute__((always_inline)) {
    const __mmask16 in = within(v);
    const __m512 x = _mm512_maskz_loadu_ps(in, at_row(v));
    const __mmask16 number = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q) & in;
    nan |= (__mmask16)(in & ~number);
    seen |= number;
    best = _mm512_mask_max_ps(best, number, x, best);
  };
  int64_t v = v0;
  for (; v + P < v1; v += 2 * P) {
    take(v, best_a);
    take(v + P, best_b);
  }
  if (v < v1) take(v, best_a);
  const __m512 best = _mm512_max_ps(best_b, best_a);
  // The sums of exp(x - best), and each lane's first row whose value equals its maximum (a lane
  // of -inf: its first; of NaN: none, and `seen` is false).
  __m512i at = _mm512_setzero_si512();
  __mmask16 found = 0;
  __m512 total = _mm512_setzero_ps();
  for (int64_t s0 = v0; s0 < v1; s0 += kGreedyBlock) {
    __m512 block = _mm512_setzero_ps();
    for (int64_t v = s0; v < std::min(v1, s0 + kGreedyBlock); v += P) {
      const __mmask16 in = within(v);
      const __m512 x = _mm512_maskz_loadu_ps(in, at_row(v));
      const __mmask16 first = _mm512_mask_cmp_ps_mask((__mmask16)(in & ~found), x, best, _CMP_EQ_OQ);
      at = _mm512_mask_mov_epi32(at, first, _mm512_add_epi32(lane_row, _mm512_set1_epi32((int32_t)v)));
      found |= first;
      // (Exp clamps at -87: a logit that far below the maximum adds ~1e-38 instead of 0.)
      const __m512 diff = _mm512_sub_ps(x, best);
      // -inf - -inf and inf - inf are NaN, as in the XLA path's exp(logits - max). A NaN x only
      // sets the lane's nan flag (the column's sum is NaN either way), and lanes past the last
      // row add nothing.
      const __mmask16 number = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q) & in;
      const __mmask16 bad = _mm512_cmp_ps_mask(diff, diff, _CMP_UNORD_Q) & number;
      block = _mm512_add_ps(block, _mm512_maskz_mov_ps(number, _mm512_mask_mov_ps(Exp(diff), bad, diff)));
    }
    total = _mm512_add_ps(total, block);
  }
  alignas(64) float b[16], t[16];
  alignas(64) int32_t a[16];
  _mm512_store_ps(b, best);
  _mm512_store_ps(t, total);
  _mm512_store_si512(a, at);
  for (int j = 0; j < 16; ++j) {
    out[j].best = b[j];
    out[j].at = a[j];
    out[j].seen = (seen >> j) & 1;
    out[j].nan = (nan >> j) & 1;
    out[j].sum = t[j];
  }
}

inline __m512 RoundToBf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// exp(v) for any float32 v, within about an ulp, overflowing to inf and underflowing to 0 where
// exp does: v = n ln 2 + r with |r| <= ln 2 / 2 (ln 2 in two parts, so n ln 2 is exact), then
// e^r by its Taylor series to r^7 / 7! and scaled by 2^n. Exp above (for the softmax's v <= 0)
// reduces v * log2(e) in one rounding, which costs ~5 ulp at |v| ~ 7: enough for a sum of
// probabilities, not for SiLU in bf16, where XLA's exp decides between two bf16 neighbours.
inline __m512 ExpAny(__m512 v) {
  v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), v);  // exact: 9 bits of ln 2
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// The activation of h, each operation rounded as `round` says: in a bf16 model to bf16 after
// every step, in the order jax.nn.gelu / jax.nn.silu take them, as XLA computes those functions
// on bf16 arrays (the tanh and logistic themselves in float32); in float32 not at all.
template <int Act, typename Round>
inline __m512 Activation(__m512 h, Round round) {
  const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
  if constexpr (Act == 1) {
    return _mm512_max_ps(zero, h);  // h where h is NaN (the second operand), as max(h, 0) in XLA
  } else if constexpr (Act == 2) {
    // h * (0.5 (1 + tanh(c (h + k h^3)))); tanh(|u|) = (1 - e) / (1 + e) with e = exp(-2 |u|) <= 1.
    // In bf16 the constants are bf16 too.
    const __m512 c = round(_mm512_set1_ps(0.7978845608028654f)), k = round(_mm512_set1_ps(0.044715f));
    const __m512 h3 = round(_mm512_mul_ps(round(_mm512_mul_ps(h, h)), h));
    const __m512 u = round(_mm512_mul_ps(round(_mm512_add_ps(h, round(_mm512_mul_ps(h3, k)))), c));
    const __m512 e = Exp(_mm512_mul_ps(_mm512_set1_ps(-2.0f), _mm512_abs_ps(u)));
    __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    t = round(_mm512_mask_sub_ps(t, _mm512_cmp_ps_mask(u, zero, _CMP_LT_OQ), zero, t));
    const __m512 cdf = round(_mm512_mul_ps(round(_mm512_add_ps(t, one)), _mm512_set1_ps(0.5f)));
    return round(_mm512_mul_ps(h, cdf));
  } else if constexpr (Act == 3) {  // h * (1 / (1 + exp(-h)))
    const __m512 d = round(_mm512_add_ps(round(ExpAny(round(_mm512_sub_ps(zero, h)))), one));
    return round(_mm512_mul_ps(h, round(_mm512_div_ps(one, d))));
  } else {
    return h;
  }
}

template <int Act, bool Bf16>
void BiasActivationColumns(const float* yp, const float* bp, void* outp, int64_t O, int64_t R, int64_t o0,
                           int64_t o1, bool rows_first) {
  const __m512i lanes = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int32_t)R));
  auto round = [](__m512 v) { return Bf16 ? RoundToBf16(v) : v; };
  auto mask = [o1](int64_t o) {
    const int64_t n = std::min<int64_t>(16, o1 - o);
    return (__mmask16)(n >= 16 ? 0xffffu : ((1u << n) - 1u));
  };
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t o = o0; o < o1; o += 16 * kActivationVectors) {
      __m512 h[kActivationVectors];
      __mmask16 m[kActivationVectors];
      for (int j = 0; j < kActivationVectors; ++j) {
        const int64_t oj = std::min<int64_t>(o + 16 * j, o1);
        m[j] = oj < o1 ? mask(oj) : (__mmask16)0;
        h[j] = rows_first ? _mm512_maskz_loadu_ps(m[j], yp + r * O + oj)
                          : _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m[j], lanes, yp + oj * R + r, 4);
        h[j] = round(_mm512_add_ps(h[j], _mm512_maskz_loadu_ps(m[j], bp + oj)));
      }
      for (int j = 0; j < kActivationVectors; ++j) h[j] = Activation<Act>(h[j], round);
      for (int j = 0; j < kActivationVectors; ++j) {
        const int64_t oj = std::min<int64_t>(o + 16 * j, o1);
        if (Bf16) {
          _mm256_mask_storeu_epi16(static_cast<uint16_t*>(outp) + r * O + oj, m[j], (__m256i)_mm512_cvtneps_pbh(h[j]));
        } else {
          _mm512_mask_storeu_ps(static_cast<float*>(outp) + r * O + oj, m[j], h[j]);
        }
      }
    }
  }
}


// The vector operations of the training attention (TrainAttention* in native_kernels.cc), which
// is written once for both instruction sets in terms of these.
using FVec = __m512;
constexpr int kFLanes = 16;
// The block of its products: kGemmRows rows by kGemmVecs vectors of accumulators (16 of 32
// registers), each loaded vector of the right operand feeding kGemmRows FMAs.
constexpr int kGemmRows = 4;
constexpr int kGemmVecs = 4;
inline FVec FLoad(const float* p) { return _mm512_loadu_ps(p); }
inline void FStore(float* p, FVec v) { _mm512_storeu_ps(p, v); }
inline FVec FSet(float x) { return _mm512_set1_ps(x); }
inline FVec FFma(FVec a, FVec b, FVec c) { return _mm512_fmadd_ps(a, b, c); }
inline FVec FMul(FVec a, FVec b) { return _mm512_mul_ps(a, b); }
inline FVec FSub(FVec a, FVec b) { return _mm512_sub_ps(a, b); }
inline FVec FMax(FVec a, FVec b) { return _mm512_max_ps(a, b); }
inline float FSum(FVec v) { return _mm512_reduce_add_ps(v); }
inline float FMaxLanes(FVec v) { return _mm512_reduce_max_ps(v); }
// 1 in the lanes where x is NaN, else 0.
inline FVec FNaNLanes(FVec x) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_ps(1.0f));
}
// exp(x) for x <= 0, and exactly 0 where x is -inf (a masked logit).
inline FVec ExpOrZero(FVec x) {
  const __mmask16 finite = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                              _CMP_NEQ_OQ);
  return _mm512_maskz_mov_ps(finite, Exp(x));
}
