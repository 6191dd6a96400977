// CPU kernels for decoding steps, called from JAX through the XLA FFI (see native.py): the
// weight products (tj_rows_matmul), the attention over the KV cache (tj_cache_attention), the
// cache write (tj_cache_write), a feed-forward layer's bias and activation (tj_bias_activation)
// and the greedy token choice (tj_greedy_choice).
//
// tj_rows_matmul: y[o, r] = sum_i w[o, i] * x[r, i] for a weight stored output-major, w [O, I],
// and a few rows of activations x [R, I] (R <= 16), accumulated in float32, y float32 [O, R].
//
// A decoding step multiplies every weight of the model by a handful of rows: the product reads
// each weight element once and does R multiply-adds with it, so at a few rows it is bound by the
// rate at which the weight streams from memory, and at ~8 bf16 rows on a 2-core AVX-512 CPU by
// that and the dot-product rate about equally. Each thread reads one contiguous run of weight
// rows from start to end, two or three rows per pass, with software prefetches a unit of work
// (into L1) and eight units (into L2) ahead; it keeps the activations in L1 (blocks of the input
// axis, if a row of x is long) and one float32 accumulator vector per (weight row, activation
// row), reduced 16 at a time by a transposed sum. Threads come from XLA's own intra-op pool; each
// owns a run of output rows and then takes what is left of the others' from their far end
// (ParallelFor), so a thread that starts late does less. bf16 products run one of two ways,
// whichever this CPU does faster (measured once per process, Bf16Calibrate): bf16 dot products
// (vdpbf16ps, 32 multiply-adds each), or weights and activations widened exactly to float32 and
// multiplied by float32 FMAs (RowGroupWiden).
//
// Built by native.py with -mavx512f -mavx512bw -mavx512vl -mavx512bf16 (AVX-512 with bfloat16
// dot products); native.py runs it only on CPUs that report those features.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRows = 16;
// Software prefetches run ahead of the reads by whole units of work (a group of weight rows over
// one block of the input axis, in the order a thread reads them): eight units ahead into L2 and,
// for bf16 at 6 rows or more, one unit ahead into L1. Measured on a 2-core AVX-512 CPU over the
// products of a GPT-2-small decoding step (248 MB of bf16 weights): at 8 rows, 13.0 ms with the
// previous scheme (2 KB / 8 KB ahead along each row, two rows per pass, one horizontal sum per
// accumulator) and 10.3 ms with this one; at 1 row, and for float32, the L1 prefetch cost ~5%.
constexpr int64_t kPrefetchL1Units = 1;
constexpr int64_t kPrefetchL2Units = 8;
template <int R, typename T>
constexpr bool PrefetchL1() { return sizeof(T) == 2 && R >= 6; }
// Activation bytes kept in L1 at once (all rows of one block of the input axis).
constexpr int64_t kBlockBytes = 24 * 1024;
// Output rows per unit of work handed out to a thread (a multiple of the row groups, 2 and 3).
constexpr int64_t kRowsPerTask = 48;

// Lane j of the result = the sum of the lanes of a[j], for 16 vectors.
inline __m512 Transpose16Sum(__m512* a) {
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
// at up to 9 activation rows (27 accumulators): with two, the loads and prefetches per dot product
// left it at ~half of the CPU's dot-product rate even with the weight in cache; float32 streams
// best with two.
template <int R, typename T>
constexpr int GroupRows() {
  if constexpr (sizeof(T) == 2) return R <= 9 ? 3 : (R <= 14 ? 2 : 1);
  return R <= 12 ? 2 : 1;
}

// Adds (or, if `first`, writes) a group's OR * R accumulator sums into y [O, R], which holds them
// side by side: y[o * R + k] for k = q * R + r. Reduced 16 accumulators at a time into one vector
// (a horizontal sum each costs ~4x the shuffles), or one by one where there are few.
template <int R, int OR>
inline void StoreSums(__m512* acc, float* y, int64_t o, bool first) {
  float* out = y + o * R;
  int k0 = 0;
  for (; k0 + 8 <= OR * R; k0 += 16) {
    const int n = OR * R - k0 < 16 ? OR * R - k0 : 16;
    __m512 part[16];
    for (int j = 0; j < 16; ++j) part[j] = j < n ? acc[k0 + j] : _mm512_setzero_ps();
    __m512 sums = Transpose16Sum(part);
    const __mmask16 lanes = (__mmask16)(n >= 16 ? 0xffffu : ((1u << n) - 1u));
    if (!first) sums = _mm512_add_ps(sums, _mm512_maskz_loadu_ps(lanes, out + k0));
    _mm512_mask_storeu_ps(out + k0, lanes, sums);
  }
  for (int k = k0; k < OR * R; ++k) {
    const float sum = _mm512_reduce_add_ps(acc[k]);
    out[k] = first ? sum : out[k] + sum;
  }
}

// Output rows o .. o+OR-1 over the input-axis block [i0, i1), adding to y unless `first`.
// T = uint16_t (bf16 bits) or float. `near` and `far` are the starts of the units to prefetch
// (into L1 and L2) while this one is read: their row q, offset along the block as this one's.
template <int R, int OR, typename T>
inline void RowGroup(const T* w, const T* x, float* y, int64_t I, int64_t o, int64_t i0, int64_t i1,
                     bool first, const char* near, const char* far) {
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
  for (int64_t i = i0; i < full; i += kLanes) {
    const int64_t ahead = (i - i0) * (int64_t)sizeof(T);
    for (int q = 0; q < OR; ++q) {
      if constexpr (PrefetchL1<R, T>()) _mm_prefetch(near + q * stride + ahead, _MM_HINT_T0);
      _mm_prefetch(far + q * stride + ahead, _MM_HINT_T1);
    }
    if constexpr (sizeof(T) == 2) {
      __m512bh a[OR];
      for (int q = 0; q < OR; ++q) a[q] = (__m512bh)_mm512_loadu_si512(row + q * I + i);
      for (int r = 0; r < R; ++r) {
        const __m512bh b = (__m512bh)_mm512_loadu_si512(x + r * I + i);
        for (int q = 0; q < OR; ++q) acc[q * R + r] = _mm512_dpbf16_ps(acc[q * R + r], a[q], b);
      }
    } else {
      __m512 a[OR];
      for (int q = 0; q < OR; ++q) a[q] = _mm512_loadu_ps(row + q * I + i);
      for (int r = 0; r < R; ++r) {
        __m512 b = _mm512_loadu_ps(x + r * I + i);
        asm("" : "+v"(b));  // one load into a register, not one folded into each row's FMA
        for (int q = 0; q < OR; ++q) acc[q * R + r] = _mm512_fmadd_ps(a[q], b, acc[q * R + r]);
      }
    }
  }
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
  StoreSums<R, OR>(acc, y, o, first);
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

inline int64_t Padded32(int64_t n) { return (n + 31) / 32 * 32; }

// x [R, I] bf16 -> xw [R, Padded32(I)] float32 in the order above.
void WidenRows(const uint16_t* x, float* xw, int64_t R, int64_t I) {
  const int64_t Ip = Padded32(I);
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
  StoreSums<R, OR>(acc, y, o, first);
}

// Weight rows per pass of the widened bf16 product: its accumulators, 2 * OR widened weight
// vectors and the activation vector must stay within the 32 registers (measured in the C++
// harness: two rows at 8 activation rows, 55-59 GMAC/s per core, against 41-43 with three).
template <int R>
constexpr int WidenGroupRows() { return R <= 4 ? 3 : (R <= 12 ? 2 : 1); }

// Output rows [o0, o1): the units (a group of weight rows over one block of the input axis) in
// the order block by block, group by group, each prefetching the ones kPrefetch*Units after it.
// Past the last unit the prefetches run on into the rows after o1 (the thread's next task, as a
// rule). x is T [R, I], or with Widen the widened activations float32 [R, Padded32(I)].
template <int R, typename T, bool Widen>
void RowsRange(const T* w, const void* x, float* y, int64_t I, int64_t o0, int64_t o1) {
  constexpr int kGroup = Widen ? WidenGroupRows<R>() : GroupRows<R, T>();
  constexpr int64_t kXBytes = Widen ? 4 : sizeof(T);
  int64_t block = std::max<int64_t>(kBlockBytes / (R * kXBytes), 64);
  if constexpr (Widen) block = block / 32 * 32;
  const int64_t blocks = (I + block - 1) / block, groups = (o1 - o0 + kGroup - 1) / kGroup;
  const int64_t units = blocks * groups;
  // Addresses as integers: a prefetch may point past the weight (it never faults).
  const uintptr_t base = reinterpret_cast<uintptr_t>(w);
  auto start = [&](int64_t u) {
    const int64_t element = u < units ? (o0 + (u % groups) * kGroup) * I + (u / groups) * block
                                      : (o1 + (u - units) * kGroup) * I;
    return reinterpret_cast<const char*>(base + element * (int64_t)sizeof(T));
  };
  for (int64_t u = 0; u < units; ++u) {
    const int64_t o = o0 + (u % groups) * kGroup, i0 = (u / groups) * block, i1 = std::min(I, i0 + block);
    const char* near = start(u + kPrefetchL1Units);
    const char* far = start(u + kPrefetchL2Units);
    if constexpr (Widen) {
      const float* xw = static_cast<const float*>(x);
      const int64_t Ip = Padded32(I);
      if (o + kGroup <= o1) {
        RowGroupWiden<R, kGroup>(w, xw, y, I, Ip, o, i0, i1, i0 == 0, near, far);
      } else {
        for (int64_t p = o; p < o1; ++p) RowGroupWiden<R, 1>(w, xw, y, I, Ip, p, i0, i1, i0 == 0, near, far);
      }
    } else {
      const T* xt = static_cast<const T*>(x);
      if (o + kGroup <= o1) {
        RowGroup<R, kGroup, T>(w, xt, y, I, o, i0, i1, i0 == 0, near, far);
      } else {
        for (int64_t p = o; p < o1; ++p) RowGroup<R, 1, T>(w, xt, y, I, p, i0, i1, i0 == 0, near, far);
      }
    }
  }
}

template <typename T>
using RangeFn = void (*)(const T*, const void*, float*, int64_t, int64_t, int64_t);

template <typename T, bool Widen, int... Rs>
RangeFn<T> PickRows(int rows, std::integer_sequence<int, Rs...>) {
  RangeFn<T> fn = nullptr;
  ((rows == Rs + 1 ? (fn = &RowsRange<Rs + 1, T, Widen>, 0) : 0), ...);
  return fn;
}

// How bf16 products run: 0 not yet decided, else a Bf16Path. Decided on the first bf16 product
// by Bf16Calibrate (or set by tj_set_bf16_products, for tests and measurements).
enum Bf16Path : int { kUndecided = 0, kDot = 1, kWiden = 2 };
std::atomic<int> g_bf16_path{kUndecided};

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

int Bf16Path() {
  int path = g_bf16_path.load(std::memory_order_relaxed);
  if (path == kUndecided) {
    int undecided = kUndecided;
    path = Bf16Calibrate();
    if (!g_bf16_path.compare_exchange_strong(undecided, path)) path = undecided;
  }
  return path;
}

// Tasks 0..n-1 split into one contiguous range per thread. Each thread runs its own range front
// to back (so it streams one run of memory), then takes tasks from the back of the others' (so a
// thread that starts late, or not at all, leaves nothing undone). A range is one atomic word:
// front in the high half, back in the low half.
class Ranges {
 public:
  Ranges(int64_t tasks, int64_t parts) : parts_(parts), ranges_(new std::atomic<uint64_t>[parts]) {
    for (int64_t p = 0; p < parts; ++p)
      ranges_[p].store(Pack(tasks * p / parts, tasks * (p + 1) / parts), std::memory_order_relaxed);
  }
  int64_t parts() const { return parts_; }
  // The next task of range p from the front, or -1.
  int64_t Front(int64_t p) {
    uint64_t r = ranges_[p].load(std::memory_order_relaxed);
    while (Lo(r) > Hi(r)) {
      if (ranges_[p].compare_exchange_weak(r, Pack(Hi(r) + 1, Lo(r)), std::memory_order_relaxed)) return Hi(r);
    }
    return -1;
  }
  // A task from the back of range p, or -1.
  int64_t Back(int64_t p) {
    uint64_t r = ranges_[p].load(std::memory_order_relaxed);
    while (Lo(r) > Hi(r)) {
      if (ranges_[p].compare_exchange_weak(r, Pack(Hi(r), Lo(r) - 1), std::memory_order_relaxed)) return Lo(r) - 1;
    }
    return -1;
  }

 private:
  static uint64_t Pack(int64_t front, int64_t back) { return ((uint64_t)front << 32) | (uint64_t)back; }
  static int64_t Hi(uint64_t r) { return (int64_t)(r >> 32); }
  static int64_t Lo(uint64_t r) { return (int64_t)(r & 0xffffffffu); }
  int64_t parts_;
  std::unique_ptr<std::atomic<uint64_t>[]> ranges_;
};

// Work shared between the calling thread and the pool's threads. Held by shared_ptr: a pool
// thread that starts after the work is done finds nothing left and only drops its reference.
struct Work {
  Work(int64_t tasks, int64_t parts) : ranges(tasks, parts), tasks(tasks) {}
  Ranges ranges;
  std::atomic<int64_t> arrived{0};
  std::atomic<int64_t> done{0};
  int64_t tasks;
};

// Runs task(0..tasks-1) on the calling thread and the pool's other threads; returns when all are
// done. `task` is copied into each helper, so it must hold only pointers and values that stay
// valid until then.
template <typename Task>
void ParallelFor(ffi::ThreadPool& pool, int64_t tasks, Task task) {
  if (tasks <= 0) return;
  if (tasks >= (int64_t{1} << 31)) std::abort();  // ranges pack two task indices in 64 bits
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), tasks));
  auto work = std::make_shared<Work>(tasks, workers);
  auto drain = [task](Work& s) {
    const int64_t own = s.arrived.fetch_add(1, std::memory_order_relaxed) % s.ranges.parts();
    for (int64_t t; (t = s.ranges.Front(own)) >= 0;) {
      task(t);
      s.done.fetch_add(1, std::memory_order_release);
    }
    for (int64_t k = 1; k < s.ranges.parts(); ++k) {
      const int64_t other = (own + k) % s.ranges.parts();
      for (int64_t t; (t = s.ranges.Back(other)) >= 0;) {
        task(t);
        s.done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  for (int64_t h = 1; h < workers; ++h) pool.Schedule([work, drain] { drain(*work); });
  drain(*work);
  while (work->done.load(std::memory_order_acquire) < tasks) _mm_pause();
}

template <typename T>
void Run(ffi::ThreadPool& pool, RangeFn<T> fn, const T* w, const void* x, float* y, int64_t O, int64_t I) {
  ParallelFor(pool, (O + kRowsPerTask - 1) / kRowsPerTask, [fn, w, x, y, O, I](int64_t t) {
    int64_t o0 = t * kRowsPerTask;
    fn(w, x, y, I, o0, std::min(O, o0 + kRowsPerTask));
  });
}

ffi::Error RowsMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                          ffi::Result<ffi::Buffer<ffi::F32>> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("tj_rows_matmul: expected x [R, I] and w [O, I]");
  if (x.element_type() != w.element_type())
    return ffi::Error::InvalidArgument("tj_rows_matmul: x and w differ in dtype");
  const int64_t R = xd[0], I = xd[1], O = wd[0];
  if (R < 1 || R > kMaxRows)
    return ffi::Error::InvalidArgument("tj_rows_matmul: 1 to 16 rows supported");
  float* out = y->typed_data();
  if (I == 0) {
    std::memset(out, 0, sizeof(float) * R * O);
    return ffi::Error::Success();
  }
  auto seq = std::make_integer_sequence<int, kMaxRows>{};
  switch (x.element_type()) {
    case ffi::DataType::BF16: {
      const auto* wp = static_cast<const uint16_t*>(w.untyped_data());
      const auto* xp = static_cast<const uint16_t*>(x.untyped_data());
      if (Bf16Path() == kWiden) {
        // The calling thread's buffer: it outlives the call (ParallelFor returns when all is done).
        // 64-byte aligned: a vector load across two cache lines costs two.
        thread_local std::vector<float> widened;
        widened.resize(R * Padded32(I) + 16);
        float* xw = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(widened.data()) + 63) & ~uintptr_t{63});
        WidenRows(xp, xw, R, I);
        Run<uint16_t>(pool, PickRows<uint16_t, true>((int)R, seq), wp, xw, out, O, I);
      } else {
        Run<uint16_t>(pool, PickRows<uint16_t, false>((int)R, seq), wp, xp, out, O, I);
      }
      return ffi::Error::Success();
    }
    case ffi::DataType::F32:
      Run<float>(pool, PickRows<float, false>((int)R, seq), static_cast<const float*>(w.untyped_data()),
                 x.untyped_data(), out, O, I);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("tj_rows_matmul: bfloat16 or float32 only");
  }
}

// ---------------------------------------------------------------------------------------------
// tj_cache_attention: softmax(q k^T) v for a few queries over a heads-first KV cache.
//
// q [B, L, H, Kd] (already divided by sqrt(Kd)), k and v [B, N, S, Kd] (float32, or bfloat16,
// widened exactly) with H = N * G (query head h reads cache head h / G), mask bool [B, Hm, Lm, S]
// with Hm in {1, H} and Lm in {1, L} (True = attend) -> out [B, L, H, Kd] float32. As the
// reference path: logits and softmax in float32, a query that sees no key gets zeros. One task per
// (b, n): its keys and values are read once from memory for all G * L queries that use them.

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

struct AttentionShape {
  int64_t B, L, H, N, S, Kd, Hm, Lm;
};

constexpr int kMaxHeadDim = 256;

// 16 cache elements from p (float32, or bf16 widened exactly to float32), lanes outside `lanes` 0.
inline __m512 LoadCache(const float* p, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, p); }
inline __m512 LoadCache(const uint16_t* p, __mmask16 lanes) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, p)), 16));
}

// Prefetches the cache lines of `rows` rows of `row_bytes` bytes from p into L2.
inline void PrefetchRows(const void* p, int64_t rows, int64_t row_bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < rows * row_bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T1);
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
template <typename T>
void AttendOne(const float* q, const T* k, const T* v, const bool* m, float* out,
               int64_t S, int64_t Kd, float* logits, const T* next_k, const T* next_v) {
  const int64_t vecs = (Kd + 15) / 16;
  const __mmask16 tail = (Kd % 16) ? (__mmask16)((1u << (Kd % 16)) - 1u) : (__mmask16)0xffff;
  int64_t lo = 0, hi = S;  // the visible keys lie in [lo, hi)
  while (lo < S && !m[lo]) ++lo;
  while (hi > lo && !m[hi - 1]) --hi;
  if (lo == hi) {  // no key is visible: zeros, as on every backend
    for (int64_t d = 0; d < Kd; ++d) out[d] = 0.0f;
    return;
  }
  const int64_t first = lo / 16 * 16;  // blocks of 16 keys, aligned as if they started at 0
  const int64_t row_bytes = Kd * sizeof(T);
  __m512 qv[kMaxHeadDim / 16];
  for (int64_t c = 0; c < vecs; ++c)
    qv[c] = _mm512_maskz_loadu_ps(c == vecs - 1 ? tail : (__mmask16)0xffff, q + c * 16);
  // Logits, 16 keys at a time (keys outside [lo, hi) count as masked).
  float best = -3.0e38f;
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
    _mm512_storeu_ps(logits + s0, Transpose16Sum(acc));
    for (int j = 0; j < 16 && s0 + j < hi; ++j) {
      if (m[s0 + j]) best = std::max(best, logits[s0 + j]);  // (m is false below lo)
    }
  }
  for (int64_t c = 0; c < vecs; ++c) qv[c] = _mm512_setzero_ps();  // now the output accumulator
  // Weights exp(logit - max) on visible keys, 0 elsewhere; their sum. The blocks before `first`
  // would each add zeros: the sums are the same as over all S keys.
  __m512 total = _mm512_setzero_ps();
  const __m512 top = _mm512_set1_ps(best);
  for (int64_t s0 = first; s0 < hi; s0 += 16) {
    __mmask16 visible = 0;
    for (int j = 0; j < 16 && s0 + j < hi; ++j) visible |= (__mmask16)((m[s0 + j] ? 1u : 0u) << j);
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

template <typename T>
void CacheAttention(ffi::ThreadPool& pool, const AttentionShape& a, const float* qp, const T* kp,
                    const T* vp, const bool* mp, float* op) {
  ParallelFor(pool, a.B * a.N, [a, qp, kp, vp, mp, op](int64_t t) {
    const int64_t b = t / a.N, n = t % a.N, G = a.H / a.N;
    const T* key = kp + (b * a.N + n) * a.S * a.Kd;
    const T* val = vp + (b * a.N + n) * a.S * a.Kd;
    thread_local std::vector<float> logits;
    logits.resize((a.S + 15) / 16 * 16);
    const bool last = t + 1 == a.B * a.N;
    for (int64_t l = 0; l < a.L; ++l) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = n * G + g;
        const int64_t offset = ((b * a.L + l) * a.H + h) * a.Kd;
        const bool* m = mp + ((b * a.Hm + (a.Hm == 1 ? 0 : h)) * a.Lm + (a.Lm == 1 ? 0 : l)) * a.S;
        const bool ahead = !last && l == 0 && g == 0;
        AttendOne(qp + offset, key, val, m, op + offset, a.S, a.Kd, logits.data(),
                  ahead ? key + a.S * a.Kd : nullptr, ahead ? val + a.S * a.Kd : nullptr);
      }
    }
  });
}

ffi::Error CacheAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k,
                              ffi::AnyBuffer v, ffi::Buffer<ffi::PRED> mask,
                              ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto qd = q.dimensions(), kd = k.dimensions(), md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || md.size() != 4 || v.dimensions().size() != 4)
    return ffi::Error::InvalidArgument("tj_cache_attention: expected 4-axis q, k, v and mask");
  AttentionShape a{qd[0], qd[1], qd[2], kd[1], kd[2], qd[3], md[1], md[2]};
  if (kd[0] != a.B || kd[3] != a.Kd || a.N == 0 || a.H % a.N != 0 || md[0] != a.B || md[3] != a.S ||
      (a.Hm != 1 && a.Hm != a.H) || (a.Lm != 1 && a.Lm != a.L) || a.Kd > kMaxHeadDim || a.Kd < 1)
    return ffi::Error::InvalidArgument("tj_cache_attention: shapes do not fit");
  auto vd = v.dimensions();
  if (k.element_type() != v.element_type() || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] || vd[3] != kd[3])
    return ffi::Error::InvalidArgument("tj_cache_attention: k and v differ in dtype or shape");
  const float* qp = q.typed_data();
  const bool* mp = mask.typed_data();
  float* op = out->typed_data();
  switch (k.element_type()) {
    case ffi::DataType::F32:
      CacheAttention(pool, a, qp, static_cast<const float*>(k.untyped_data()),
                     static_cast<const float*>(v.untyped_data()), mp, op);
      break;
    case ffi::DataType::BF16:
      CacheAttention(pool, a, qp, static_cast<const uint16_t*>(k.untyped_data()),
                     static_cast<const uint16_t*>(v.untyped_data()), mp, op);
      break;
    default:
      return ffi::Error::InvalidArgument("tj_cache_attention: a float32 or bfloat16 cache only");
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// tj_cache_write: a decoding step's new keys (or values) new [B, L, N, Kd] written into the cache
// [B, N, S, Kd] at positions start[b] .. start[b] + L - 1 of each row b, where start[b] is index[b]
// brought into [0, S - L] (as dynamic_update_slice does). The output is the cache's own buffer
// (input_output_aliases in native.py): only B * N * L rows of Kd elements are written. XLA:CPU
// writes a bfloat16 cache by converting all of it to float32 and back, every layer, every step.

ffi::Error CacheWriteImpl(ffi::AnyBuffer cache, ffi::AnyBuffer update, ffi::Buffer<ffi::S32> index,
                          ffi::Result<ffi::AnyBuffer> out) {
  auto cd = cache.dimensions(), ud = update.dimensions(), id = index.dimensions();
  if (cd.size() != 4 || ud.size() != 4 || id.size() != 1 || ud[0] != cd[0] || ud[2] != cd[1] ||
      ud[3] != cd[3] || id[0] != cd[0] || ud[1] > cd[2])
    return ffi::Error::InvalidArgument("tj_cache_write: expected cache [B, N, S, K], new [B, L, N, K] "
                                       "with L <= S, index [B]");
  if (cache.element_type() != update.element_type() || out->element_type() != cache.element_type())
    return ffi::Error::InvalidArgument("tj_cache_write: the cache and the new entries differ in dtype");
  const int64_t B = cd[0], N = cd[1], S = cd[2], Kd = cd[3], L = ud[1];
  const size_t bytes = ffi::ByteWidth(cache.element_type());
  char* dst = static_cast<char*>(out->untyped_data());
  const char* src = static_cast<const char*>(update.untyped_data());
  // Aliased, the output is the cache; should XLA ever hand over two buffers, copy it first.
  if (dst != cache.untyped_data()) std::memcpy(dst, cache.untyped_data(), bytes * B * N * S * Kd);
  const int32_t* idx = index.typed_data();
  const size_t row = bytes * Kd;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t start = std::min<int64_t>(std::max<int64_t>(idx[b], 0), S - L);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t l = 0; l < L; ++l)
        std::memcpy(dst + (((b * N + n) * S) + start + l) * row, src + (((b * L + l) * N) + n) * row, row);
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// tj_greedy_choice: for logits stored vocabulary-major, [V, B] (the layout tj_rows_matmul leaves
// them in), each column's first index of its maximum and log(sum(exp(logit - max))), the
// quantities greedy decoding needs (its token and that token's log-probability, -the second), in
// one pass for the maximum and one for the sum: XLA:CPU runs them as several reductions, each
// with its own pass. Same results as the XLA path (decoding/sampling.py) for finite logits, and
// its NaN for the sum wherever a value is NaN, the maximum is +inf or all values are -inf. A NaN
// is passed over in the search for the maximum (V-1 for a column of NaN); XLA:CPU's own maximum
// passes over it or not depending on the array's size. The rows are split into tasks of 4096 on
// every core, whose partial maxima and sums are merged at the end; a batch of 1, 2, 4 or 8 columns
// reads 16 / B rows per vector. [50257, 8]: ~300 -> 120-160 us; [50257, 1]: ~300 -> 20-26 us.

// What one task finds for one column over its rows: the first maximum (best, at), whether it met
// a number (seen) or a NaN, and sum = sum of exp(x - best) over its rows (NaN where x - best is:
// inf - inf, or -inf - -inf for a column of -inf).
struct GreedyPartial {
  float best = -std::numeric_limits<float>::infinity();
  int32_t at = 0;
  bool seen = false, nan = false;
  float sum = 0.0f;
};

// s = sum of exp(x - m), rescaled to sum of exp(x - top) for top >= m.
inline float Rescaled(float s, float m, float top) {
  if (m == top) return s;
  if (m == -std::numeric_limits<float>::infinity()) return 0.0f;  // exp(-inf - top) terms
  return s * std::exp(m - top);
}

// a and b cover disjoint rows; a becomes their union's partial (ties go to the lower row).
inline void MergeGreedy(GreedyPartial& a, const GreedyPartial& b) {
  a.nan = a.nan || b.nan;
  if (!b.seen) return;
  if (!a.seen) {
    const bool nan = a.nan;
    a = b;
    a.nan = nan;
    return;
  }
  const float top = std::max(a.best, b.best);
  if (b.best > a.best || (b.best == a.best && b.at < a.at)) a.at = b.at;
  a.sum = Rescaled(a.sum, a.best, top) + Rescaled(b.sum, b.best, top);
  a.best = top;
}

// Rows per task, and per block of the sum (a float32 sum of V terms one by one drifts by ~1e-5
// relative at V = 50257; in blocks of 256, then the blocks, it does not).
constexpr int64_t kGreedyRows = 4096;
constexpr int64_t kGreedyBlock = 256;

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
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i at = _mm512_setzero_si512();
  __mmask16 nan = 0, seen = 0;  // lanes that met a NaN / a value that is not NaN
  for (int64_t v = v0; v < v1; v += P) {
    const __mmask16 in = within(v);
    const __m512 x = _mm512_maskz_loadu_ps(in, at_row(v));
    const __mmask16 number = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q) & in;
    // Greater, or the first number of the lane (a -inf equals the starting maximum).
    const __mmask16 more = _mm512_cmp_ps_mask(x, best, _CMP_GT_OQ) | (number & (__mmask16)~seen);
    nan |= (__mmask16)(in & ~number);
    seen |= number;
    best = _mm512_mask_mov_ps(best, more, x);
    at = _mm512_mask_mov_epi32(at, more, _mm512_add_epi32(lane_row, _mm512_set1_epi32((int32_t)v)));
  }
  __m512 total = _mm512_setzero_ps();
  for (int64_t s0 = v0; s0 < v1; s0 += kGreedyBlock) {
    __m512 block = _mm512_setzero_ps();
    for (int64_t v = s0; v < std::min(v1, s0 + kGreedyBlock); v += P) {
      const __mmask16 in = within(v);
      const __m512 x = _mm512_maskz_loadu_ps(in, at_row(v));
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

ffi::Error GreedyChoiceImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                            ffi::Result<ffi::Buffer<ffi::S32>> index, ffi::Result<ffi::Buffer<ffi::F32>> log_total) {
  auto d = logits.dimensions();
  if (d.size() != 2 || d[0] < 1) return ffi::Error::InvalidArgument("tj_greedy_choice: expected logits [V, B], V >= 1");
  const int64_t V = d[0], B = d[1];
  const float* l = logits.typed_data();
  int32_t* idx = index->typed_data();
  float* lt = log_total->typed_data();
  if (B == 0) return ffi::Error::Success();
  // A few columns (a decoding batch of 1, 2, 4 or 8) share a vector: 16 / B rows at a time.
  const int64_t P = (B <= 8 && 16 % B == 0) ? 16 / B : 1;
  const int64_t groups = P > 1 ? 1 : (B + 15) / 16;
  const int64_t chunks = (V + kGreedyRows - 1) / kGreedyRows;
  std::vector<GreedyPartial> parts(groups * chunks * 16);
  GreedyPartial* pp = parts.data();
  ParallelFor(pool, groups * chunks, [=](int64_t t) {
    const int64_t g = t / chunks, c = t % chunks;
    const int64_t b0 = g * 16, n = P > 1 ? 16 : std::min<int64_t>(16, B - b0);
    const __mmask16 lanes = (__mmask16)(n >= 16 ? 0xffffu : ((1u << n) - 1u));
    GreedyLanes(l, B, b0, P, lanes, c * kGreedyRows, std::min(V, (c + 1) * kGreedyRows), pp + t * 16);
  });
  for (int64_t b = 0; b < B; ++b) {
    GreedyPartial total;
    total.at = (int32_t)(V - 1);  // a column of NaN
    const int64_t g = P > 1 ? 0 : b / 16;
    for (int64_t c = 0; c < chunks; ++c) {
      for (int64_t j = 0; j < 16; ++j) {
        const bool mine = P > 1 ? j % (16 / P) == b : g * 16 + j == b;
        if (mine) MergeGreedy(total, parts[(g * chunks + c) * 16 + j]);
      }
    }
    idx[b] = total.at;
    lt[b] = total.nan ? std::numeric_limits<float>::quiet_NaN() : std::log(total.sum);
  }
  return ffi::Error::Success();
}


// ---------------------------------------------------------------------------------------------
// tj_bias_activation: out[r, o] = act(round(y[o, r] + bias[o])) for a product's output as
// tj_rows_matmul leaves it, y float32 [O, R] -> out [R, O] in float32 or bfloat16, where `round`
// is the rounding to the output dtype (a bf16 projection's output is rounded before its
// activation, as in the XLA path) and act is none (0), relu (1), the tanh form of GELU (2) or
// SiLU (3). XLA:CPU's tanh-GELU over a [8, 3072] step took ~50 us, one
// twentieth of the weight product before it.

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

// Output columns per task of tj_bias_activation, and vectors of 16 computed side by side: the
// activations are long chains of dependent operations, so four independent ones keep the core busy
// (a [3072, 8] bf16 tanh-GELU took ~60 us one vector at a time on one core).
constexpr int64_t kActivationColumns = 256;
constexpr int kActivationVectors = 4;

template <int Act, bool Bf16>
void BiasActivationColumns(const float* yp, const float* bp, void* outp, int64_t O, int64_t R, int64_t o0,
                           int64_t o1) {
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
        h[j] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m[j], lanes, yp + oj * R + r, 4);
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

using ActivationFn = void (*)(const float*, const float*, void*, int64_t, int64_t, int64_t, int64_t);

template <bool Bf16>
ActivationFn PickActivation(int act) {
  switch (act) {
    case 1: return BiasActivationColumns<1, Bf16>;
    case 2: return BiasActivationColumns<2, Bf16>;
    case 3: return BiasActivationColumns<3, Bf16>;
    default: return BiasActivationColumns<0, Bf16>;
  }
}

ffi::Error BiasActivationImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> y, ffi::Buffer<ffi::F32> bias,
                              ffi::Result<ffi::AnyBuffer> out, int32_t activation) {
  auto d = y.dimensions();
  if (d.size() != 2 || bias.dimensions().size() != 1 || bias.dimensions()[0] != d[0])
    return ffi::Error::InvalidArgument("tj_bias_activation: expected y [O, R] and bias [O]");
  if (activation < 0 || activation > 3)
    return ffi::Error::InvalidArgument("tj_bias_activation: activation code must be 0-3");
  const bool bf16 = out->element_type() == ffi::DataType::BF16;
  if (!bf16 && out->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("tj_bias_activation: output float32 or bfloat16");
  const int64_t O = d[0], R = d[1];
  const float* yp = y.typed_data();
  const float* bp = bias.typed_data();
  void* outp = out->untyped_data();
  const ActivationFn fn = bf16 ? PickActivation<true>(activation) : PickActivation<false>(activation);
  ParallelFor(pool, (O + kActivationColumns - 1) / kActivationColumns, [=](int64_t t) {
    const int64_t o0 = t * kActivationColumns;
    fn(yp, bp, outp, O, R, o0, std::min(O, o0 + kActivationColumns));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjGreedyChoice, GreedyChoiceImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjCacheAttention, CacheAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjCacheWrite, CacheWriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjRowsMatmul, RowsMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjBiasActivation, BiasActivationImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("activation"));

// How bf16 products run (1: bf16 dot products, 2: widened to float32), deciding it by measurement
// if not yet decided; and setting it (0: measure again, 1 or 2) for tests and measurements. Called
// through ctypes.
extern "C" int tj_bf16_products() { return Bf16Path(); }
extern "C" int tj_set_bf16_products(int path) {
  g_bf16_path.store(path == kDot || path == kWiden ? path : Bf16Calibrate());
  return g_bf16_path.load();
}
