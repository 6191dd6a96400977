// CPU kernels for decoding steps, called from JAX through the XLA FFI (see native.py): the
// weight products (tj_rows_matmul for weights stored [O, I], tj_cols_matmul for [I, O]), the
// attention over the KV cache (tj_cache_attention), the cache write (tj_cache_write), a
// feed-forward layer's bias and activation (tj_bias_activation) and the greedy token choice
// (tj_greedy_choice).
//
// tj_rows_matmul: y[o, r] = sum_i w[o, i] * x[r, i] for a weight stored output-major, w [O, I],
// and a few rows of activations x [R, I] (R <= 16), accumulated in float32, y float32 [O, R].
//
// A decoding step multiplies every weight of the model by a handful of rows: the product reads
// each weight element once and does R multiply-adds with it, so at a few rows it is bound by the
// rate at which the weight streams from memory, and at ~8 bf16 rows on a 2-core AVX-512 CPU by
// that and the dot-product rate about equally. Each thread reads one contiguous run of weight
// rows from start to end, one to three rows per pass (one at a few activation rows, so that the
// weight streams as one run of memory), with software prefetches a unit of work
// (into L1) and eight units (into L2) ahead; it keeps the activations in L1 (blocks of the input
// axis, if a row of x is long) and one float32 accumulator vector per (weight row, activation
// row), four taken in turn where one weight row is read at a time, reduced 16 at a time by a
// transposed sum. Threads come from XLA's own intra-op pool; each
// owns a run of output rows and then takes what is left of the others' from their far end
// (ParallelFor), so a thread that starts late does less. bf16 products run one of two ways,
// whichever this CPU does faster (measured once per process, Bf16Calibrate): bf16 dot products
// (vdpbf16ps, 32 multiply-adds each), or weights and activations widened exactly to float32 and
// multiplied by float32 FMAs (RowGroupWiden).
//
// The vector code is written twice, for AVX-512 with bfloat16 dot products (native_avx512.h, built
// with -mavx512f -mavx512bw -mavx512vl -mavx512bf16) and for AVX2 with FMA (native_avx2.h: 8-lane
// vectors, 16 registers, bf16 always widened); this file holds what they share. native.py builds
// the best one the CPU reports the features of.

#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRows = 16;
// Software prefetches run ahead of the reads by whole units of work (a group of weight rows over
// one block of the input axis, in the order a thread reads them): eight units ahead into L2 and,
// where the instruction set's PrefetchL1 says so, one unit ahead into L1. Measured on a 2-core
// AVX-512 CPU over the products of a GPT-2-small decoding step (248 MB of bf16 weights): at 8 rows,
// 13.0 ms with the previous scheme (2 KB / 8 KB ahead along each row, two rows per pass, one
// horizontal sum per accumulator) and 10.3 ms with this one.
constexpr int64_t kPrefetchL1Units = 1;
constexpr int64_t kPrefetchL2Units = 8;
// Activation bytes kept in L1 at once (all rows of one block of the input axis).
constexpr int64_t kBlockBytes = 24 * 1024;
// Output rows per unit of work handed out to a thread (a multiple of the row groups, 2 and 3).
constexpr int64_t kRowsPerTask = 48;
// How far ahead along a packed weight's groups of tiles (tj_packed_matmul) the L1 prefetches reach,
// per tile of the group (a group of three: three times as far): with AVX2 and with AVX-512, whose
// prefetches go on past a group's end into the next group, the thread's next task (native_avx512.h).
constexpr int64_t kPackedPrefetchBytes = 2048;
constexpr int64_t kPackedPrefetchBytes512 = 3072;
// How many weight reads (rows of a block of columns) ahead the AVX-512 column kernel (float32
// weights, tj_cols_matmul) prefetches, in the order it reads them: 16 and 48 were slower than 32.
constexpr int64_t kColPrefetchReads = 32;

// How bf16 products run: 0 not yet decided, else a Bf16Path. Decided on the first bf16 product
// by Bf16Calibrate (or set by tj_set_bf16_products, for tests and measurements).
enum Bf16Path : int { kUndecided = 0, kDot = 1, kWiden = 2 };
std::atomic<int> g_bf16_path{kUndecided};

// Where the far prefetches of weights streamed once a step land (the AVX-512 row, column and
// packed kernels): 1 non-temporal (_MM_HINT_NTA), 2 into L2 (_MM_HINT_T1); 0 not yet decided.
// Decided by the CPU's vendor on first use: NTA on AMD, where it keeps the weights from pushing the
// KV cache and activations out of L2 and L3 (whole GPT-2-small steps on Zen 5: bf16 batch 8 6.78
// against 7.04 ms, float32 batch 8 14.21 against 14.54), T1 elsewhere: on an Intel Xeon (with AMX)
// a non-temporal prefetch fills L1 alone, and lines fetched that far ahead are gone before they are
// read (float32 rows at one activation row 10.7 against 28.7 GB/s; GPT-2-small steps float32
// `out_in` batch 1 52.0 against 17.6 ms, bf16 `packed` batch 1 22.8 against 8.6 ms).
enum FarHint : int { kFarUndecided = 0, kFarNta = 1, kFarT1 = 2 };
std::atomic<int> g_far_hint{kFarUndecided};

int FarHintForCpu() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return kFarT1;
  char vendor[13];
  std::memcpy(vendor, &ebx, 4);
  std::memcpy(vendor + 4, &edx, 4);
  std::memcpy(vendor + 8, &ecx, 4);
  vendor[12] = 0;
  return std::strcmp(vendor, "AuthenticAMD") == 0 ? kFarNta : kFarT1;
}

inline bool FarPrefetchNta() {
  int hint = g_far_hint.load(std::memory_order_relaxed);
  if (hint == kFarUndecided) {
    hint = FarHintForCpu();
    g_far_hint.store(hint, std::memory_order_relaxed);
  }
  return hint == kFarNta;
}

// A far prefetch of the line at p: `nta` from FarPrefetchNta(), read once per call of a kernel.
inline void FarPrefetch(const char* p, bool nta) {
  if (nta) {
    _mm_prefetch(p, _MM_HINT_NTA);
  } else {
    _mm_prefetch(p, _MM_HINT_T1);
  }
}

struct AttentionShape {
  int64_t B, L, H, N, S, Kd, Hm, Lm;
};

constexpr int kMaxHeadDim = 256;

// Prefetches the cache lines of `rows` rows of `row_bytes` bytes from p into L2.
inline void PrefetchRows(const void* p, int64_t rows, int64_t row_bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < rows * row_bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T1);
}

// What one task finds for one column over its rows: the first maximum (best, at), whether it met
// a number (seen) or a NaN, and sum = sum of exp(x - best) over its rows (NaN where x - best is:
// inf - inf, or -inf - -inf for a column of -inf).
struct GreedyPartial {
  float best = -std::numeric_limits<float>::infinity();
  int32_t at = 0;
  bool seen = false, nan = false;
  float sum = 0.0f;
};

// Rows per task, and per block of the sum (a float32 sum of V terms one by one drifts by ~1e-5
// relative at V = 50257; in blocks of 256, then the blocks, it does not).
constexpr int64_t kGreedyRows = 4096;
constexpr int64_t kGreedyBlock = 256;

// Output columns per task of tj_bias_activation (the vectors computed side by side within one are
// kActivationVectors, in the instruction set's header).
constexpr int64_t kActivationColumns = 256;

#if defined(__AVX512F__)
#include "native_avx512.h"
#elif defined(__AVX2__)
#include "native_avx2.h"
#else
#error "the native kernels need AVX-512 or AVX2 (see native.py)"
#endif

// Output rows [o0, o1): the units (a group of weight rows over one block of the input axis) in
// the order block by block, group by group, each prefetching the ones kPrefetch*Units after it.
// Past the last unit the prefetches run on into the rows after o1 (the thread's next task, as a
// rule). x is T [R, I], or with Widen the widened activations float32 [R, PaddedWiden(I)].
template <int R, typename T, bool Widen>
void RowsRange(const T* w, const void* x, float* y, int64_t I, int64_t o0, int64_t o1) {
  constexpr int kGroup = Widen ? WidenGroupRows<R>() : GroupRows<R, T>();
  constexpr int64_t kXBytes = Widen ? 4 : sizeof(T);
  int64_t block = std::max<int64_t>(kBlockBytes / (R * kXBytes), 64);
  if constexpr (Widen) block = block / kWidenRun * kWidenRun;
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
      const int64_t Ip = PaddedWiden(I);
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
// front in the high half, back in the low half, each on a cache line of its own (on one line,
// every task a thread took would take the line from the other thread).
class Ranges {
 public:
  Ranges(int64_t tasks, int64_t parts) : parts_(parts), ranges_(new Slot[parts]) {
    for (int64_t p = 0; p < parts; ++p)
      ranges_[p].r.store(Pack(tasks * p / parts, tasks * (p + 1) / parts), std::memory_order_relaxed);
  }
  int64_t parts() const { return parts_; }
  // The next task of range p from the front, or -1.
  int64_t Front(int64_t p) {
    std::atomic<uint64_t>& range = ranges_[p].r;
    uint64_t r = range.load(std::memory_order_relaxed);
    while (Lo(r) > Hi(r)) {
      if (range.compare_exchange_weak(r, Pack(Hi(r) + 1, Lo(r)), std::memory_order_relaxed)) return Hi(r);
    }
    return -1;
  }
  // A task from the back of range p, or -1.
  int64_t Back(int64_t p) {
    std::atomic<uint64_t>& range = ranges_[p].r;
    uint64_t r = range.load(std::memory_order_relaxed);
    while (Lo(r) > Hi(r)) {
      if (range.compare_exchange_weak(r, Pack(Hi(r), Lo(r) - 1), std::memory_order_relaxed)) return Lo(r) - 1;
    }
    return -1;
  }

 private:
  struct alignas(64) Slot {
    std::atomic<uint64_t> r;
  };
  static uint64_t Pack(int64_t front, int64_t back) { return ((uint64_t)front << 32) | (uint64_t)back; }
  static int64_t Hi(uint64_t r) { return (int64_t)(r >> 32); }
  static int64_t Lo(uint64_t r) { return (int64_t)(r & 0xffffffffu); }
  int64_t parts_;
  std::unique_ptr<Slot[]> ranges_;
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

// The threads a parallel loop over `tasks` tasks runs on: the calling one and up to all the pool's.
inline int64_t Workers(ffi::ThreadPool& pool, int64_t tasks) {
  return std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), tasks));
}

// Runs task(0..tasks-1) on the calling thread and the pool's other threads; returns when all are
// done. `task` is copied into each helper, so it must hold only pointers and values that stay
// valid until then.
template <typename Task>
void ParallelFor(ffi::ThreadPool& pool, int64_t tasks, Task task) {
  if (tasks <= 0) return;
  if (tasks >= (int64_t{1} << 31)) std::abort();  // ranges pack two task indices in 64 bits
  const int64_t workers = Workers(pool, tasks);
  auto work = std::make_shared<Work>(tasks, workers);
  // Each thread counts the tasks it ran and adds them to `done` once, at its end: a count shared
  // task by task moved its cache line between the cores for every task.
  auto drain = [task](Work& s) {
    const int64_t own = s.arrived.fetch_add(1, std::memory_order_relaxed) % s.ranges.parts();
    int64_t ran = 0;
    for (int64_t t; (t = s.ranges.Front(own)) >= 0; ++ran) task(t);
    for (int64_t k = 1; k < s.ranges.parts(); ++k) {
      const int64_t other = (own + k) % s.ranges.parts();
      for (int64_t t; (t = s.ranges.Back(other)) >= 0; ++ran) task(t);
    }
    if (ran > 0) s.done.fetch_add(ran, std::memory_order_release);
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

// bf16 products as bf16 dot products, where the instruction set has them (a template, so that
// without them nothing is instantiated).
template <bool Dot>
void RunBf16Dot(ffi::ThreadPool& pool, int rows, const uint16_t* w, const uint16_t* x, float* y, int64_t O,
                int64_t I) {
  if constexpr (Dot) Run<uint16_t>(pool, PickRows<uint16_t, false>(rows, std::make_integer_sequence<int, kMaxRows>{}),
                                    w, x, y, O, I);
}

// What both weight products check: x [R, I] (1 <= R <= kMaxRows) and a 2-axis w of x's dtype whose
// axis `in_axis` is I. Sets R, I and O (w's other axis); `kernel` and `layout` name them in errors.
ffi::Error ProductShape(const char* kernel, const char* layout, ffi::AnyBuffer& x, ffi::AnyBuffer& w, int in_axis,
                        int64_t& R, int64_t& I, int64_t& O) {
  auto xd = x.dimensions(), wd = w.dimensions();
  const std::string name(kernel);
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[in_axis])
    return ffi::Error::InvalidArgument(name + ": expected x [R, I] and w " + layout);
  if (x.element_type() != w.element_type())
    return ffi::Error::InvalidArgument(name + ": x and w differ in dtype");
  R = xd[0], I = xd[1], O = wd[1 - in_axis];
  if (R < 1 || R > kMaxRows) return ffi::Error::InvalidArgument(name + ": 1 to 16 rows supported");
  return ffi::Error::Success();
}

ffi::Error RowsMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                          ffi::Result<ffi::Buffer<ffi::F32>> y) {
  int64_t R, I, O;
  if (ffi::Error e = ProductShape("tj_rows_matmul", "[O, I]", x, w, 1, R, I, O); e.failure()) return e;
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
        widened.resize(R * PaddedWiden(I) + 16);
        float* xw = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(widened.data()) + 63) & ~uintptr_t{63});
        WidenRows(xp, xw, R, I);
        Run<uint16_t>(pool, PickRows<uint16_t, true>((int)R, seq), wp, xw, out, O, I);
      } else {
        RunBf16Dot<kHasBf16Dot>(pool, (int)R, wp, xp, out, O, I);
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
// tj_cols_matmul: y[r, o] = sum_i x[r, i] * w[i, o] for a weight stored input-major, w [I, O] (the
// model's default kernel layout), and a few rows of activations x [R, I] (R <= 16), accumulated in
// float32, y float32 [R, O].
//
// A task is a run of input rows, all columns: a run of contiguous memory, which each thread reads
// front to back as tj_rows_matmul's tasks are read (prefetching the next task's run into L2 as it
// reads its own, one line per line). The tasks form one group per thread, each a contiguous run of
// them with partial sums of its own (the first group's are y itself), which are added up in group
// order at the end: R * O floats per group, against the I * O weights. A thread takes a whole group
// (ParallelFor), so every sum is taken in the same order whichever thread runs which group, and
// the result is the same from call to call. Within a task, a block of columns at a time takes every
// input row (ColsRange, in the instruction set's header). Measured in a C++ harness over the 72
// weight products of a GPT-2-small step at 8 rows from memory (AMD Zen 5, two threads, against a
// plain sum over the same weights in the same round, 67-72 GB/s): float32 41-44 GB/s (0.60-0.62 of
// the sum), as tj_rows_matmul on the same weights stored [O, I] (41-43 GB/s); bf16 28-34 GB/s
// against 48-54 (0.40-0.49 of the sum against 0.67-0.79), with dot products or widened alike.

// Bytes of weight per task (an even number of input rows, at least two).
constexpr int64_t kColTaskBytes = 128 * 1024;

template <typename T>
using ColsFn = void (*)(const T*, const void*, float*, int64_t, int64_t, int64_t, int64_t, bool, const char*);

template <typename T, bool Dot, int... Rs>
ColsFn<T> PickCols(int rows, std::integer_sequence<int, Rs...>) {
  ColsFn<T> fn = nullptr;
  ((rows == Rs + 1 ? (fn = &ColsRange<Rs + 1, T, Dot>, 0) : 0), ...);
  return fn;
}

// x is what ColsRange<Dot> takes: bf16 [R, I] for the dot products, else float32 [R, I].
template <typename T, bool Dot>
void RunCols(ffi::ThreadPool& pool, int R, const T* w, const void* x, float* y, int64_t I, int64_t O) {
  const ColsFn<T> fn = PickCols<T, Dot>(R, std::make_integer_sequence<int, kMaxRows>{});
  const int64_t rows = std::max<int64_t>(1, kColTaskBytes / (2 * O * (int64_t)sizeof(T))) * 2;
  const int64_t tasks = (I + rows - 1) / rows, groups = Workers(pool, tasks);
  // Group g's partial sums (the first group's are y itself), in the calling thread's buffer (it
  // outlives the call).
  thread_local std::vector<float> partial;
  partial.resize((groups - 1) * R * O);
  float* more = partial.data();
  const uintptr_t base = reinterpret_cast<uintptr_t>(w);
  ParallelFor(pool, groups, [=](int64_t g) {
    float* part = g == 0 ? y : more + (g - 1) * R * O;
    for (int64_t t = tasks * g / groups; t < tasks * (g + 1) / groups; ++t) {
      const int64_t i0 = t * rows, i1 = std::min(I, i0 + rows);
      // The next task's run (past the weight after the last task: a prefetch never faults).
      const char* ahead = reinterpret_cast<const char*>(base + i1 * O * (int64_t)sizeof(T));
      fn(w, x, part, I, O, i0, i1, t == tasks * g / groups, ahead);
    }
  });
  const int64_t n = R * O;
  for (int64_t g = 1; g < groups; ++g) {
    const float* p = more + (g - 1) * n;
    for (int64_t k = 0; k < n; ++k) y[k] += p[k];
  }
}

template <bool Dot>
void RunColsDot(ffi::ThreadPool& pool, int R, const uint16_t* w, const uint16_t* x, float* y, int64_t I, int64_t O) {
  if constexpr (Dot) RunCols<uint16_t, true>(pool, R, w, x, y, I, O);
}

ffi::Error ColsMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                          ffi::Result<ffi::Buffer<ffi::F32>> y) {
  int64_t R, I, O;
  if (ffi::Error e = ProductShape("tj_cols_matmul", "[I, O]", x, w, 0, R, I, O); e.failure()) return e;
  float* out = y->typed_data();
  if (O == 0) return ffi::Error::Success();
  if (I == 0) {
    std::memset(out, 0, sizeof(float) * R * O);
    return ffi::Error::Success();
  }
  switch (x.element_type()) {
    case ffi::DataType::BF16: {
      const auto* wp = static_cast<const uint16_t*>(w.untyped_data());
      const auto* xp = static_cast<const uint16_t*>(x.untyped_data());
      if (Bf16Path() == kWiden) {
        // The activations widened exactly to float32 (bf16 is float32's top half), in the calling
        // thread's buffer.
        thread_local std::vector<float> widened;
        widened.resize(R * I);
        for (int64_t k = 0; k < R * I; ++k) {
          const uint32_t bits = (uint32_t)xp[k] << 16;
          std::memcpy(&widened[k], &bits, sizeof(bits));
        }
        RunCols<uint16_t, false>(pool, (int)R, wp, widened.data(), out, I, O);
      } else {
        RunColsDot<kHasBf16Dot>(pool, (int)R, wp, xp, out, I, O);
      }
      return ffi::Error::Success();
    }
    case ffi::DataType::F32:
      RunCols<float, false>(pool, (int)R, static_cast<const float*>(w.untyped_data()), x.untyped_data(), out, I, O);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("tj_cols_matmul: bfloat16 or float32 only");
  }
}

// ---------------------------------------------------------------------------------------------
// tj_packed_matmul: y[o, r] = sum_i w[o, i] * x[r, i], as tj_rows_matmul, for a bf16 weight [O, I]
// stored packed (`kernel_layout='packed'`, native.pack_kernel): where I is even, its first O16 =
// 16 * floor(O / 16) rows as tiles of 16 rows, in groups of kPackGroup tiles (the last group holds
// the one or two left over), a group of T tiles from tile g stored [I / 2, T, 16, 2] (element
// (p, t, j, k) is w[16 (g + t) + j, 2 p + k]), then the other O - O16 rows as they are (where I is
// odd, every row as it is). x bf16 [R, I] -> y float32 [O, R] for R <= 16 (a decoding step), [R, O]
// above (a prefill).
//
// A task is one group of tiles, read as one run; the rows after the tiles are the last task.
// Measured on AMD Zen 5 (two threads, bf16): one [1536, 768] weight from cache, 100 calls in a
// chain, 1.44x tj_rows_matmul's rate at 8 rows and 2.0x at 16; a GPT-2-small step's 73 weight
// products from memory, alternated with tj_rows_matmul's in one process, 0.88-0.89 of its time at
// 8 rows, 0.91-0.97 at 4, 0.98-1.01 at 1 (the host reading 50 GB/s), with each tile stored whole
// (three runs read side by side; see native.py, PACK_GROUP, for what one run gained). A single
// thread's loop of the same dot products over a weight in L1 ran at 0.96 of the core's peak,
// RowPass's at 0.70.
constexpr int kPackGroup = 3;

inline int64_t PackedRows(int64_t O, int64_t I) { return I % 2 == 0 ? O / 16 * 16 : 0; }

// The rows after the tiles, [o0, O), stored as they are: few (under 16 where I is even), so plain
// float32 sums in 8 interleaved partials. Into y [O, R], or y [R, O] where `rows_out`.
inline void PackedPlainRows(const uint16_t* w, const uint16_t* x, float* y, int64_t R, int64_t I, int64_t o0,
                            int64_t O, bool rows_out) {
  auto widen = [](uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  };
  for (int64_t o = o0; o < O; ++o) {
    for (int64_t r = 0; r < R; ++r) {
      float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t i = 0; i < I; ++i) part[i % 8] += widen(w[o * I + i]) * widen(x[r * I + i]);
      y[rows_out ? r * O + o : o * R + r] =
          ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    }
  }
}

inline int64_t PackedGroups(int64_t O16) { return (O16 / 16 + kPackGroup - 1) / kPackGroup; }

// Rows r0 .. r0 + R - 1 (x from row r0) through the group of `tiles` tiles (1 .. T) at output o:
// into y [O, Rt] (a decoding step's product, O < 0), or into y [rows, O] (tj_packed_dense's sums
// before its epilogue, a prefill's chunks).
template <int R, int T, bool Once = true>
void PackedGroup(const uint16_t* w, const uint16_t* x, float* y, int64_t I, int64_t o, int tiles, int64_t O,
                 int64_t r0 = 0, int64_t Rt = R) {
  if constexpr (T > 0) {
    if (tiles == T) return PackedTiles<R, T, Once>(w, x, y, I, o, O, r0, Rt);
    PackedGroup<R, T - 1, Once>(w, x, y, I, o, tiles, O, r0, Rt);
  }
}

// A decoding step's R rows through one group: in one pass (non-temporal prefetches: the weight is
// read once), or above kPackedPassRows in two, the second reading the group from cache.
template <int R>
void PackedGroupRows(const uint16_t* w, const uint16_t* x, float* y, int64_t I, int64_t o, int tiles,
                     int64_t O) {
  if constexpr (R <= kPackedPassRows) {
    PackedGroup<R, kPackGroup>(w, x, y, I, o, tiles, O);
  } else {
    constexpr int kFirst = kPackedPassRows, kRest = R - kPackedPassRows;
    static_assert(kRest <= kPackedPassRows, "two passes");
    PackedGroup<kFirst, kPackGroup, false>(w, x, y, I, o, tiles, O, 0, R);
    PackedGroup<kRest, kPackGroup, false>(w, x + kFirst * I, y, I, o, tiles, O, kFirst, R);
  }
}

template <int R>
void PackedRange(ffi::ThreadPool& pool, const uint16_t* w, const uint16_t* x, float* y, int64_t I, int64_t O) {
  const int64_t O16 = PackedRows(O, I), groups = PackedGroups(O16);
  ParallelFor(pool, groups + (O16 < O ? 1 : 0), [=](int64_t g) {
    if (g == groups) return PackedPlainRows(w, x, y, R, I, O16, O, false);
    const int64_t o = g * 16 * kPackGroup;
    PackedGroupRows<R>(w, x, y, I, o, (int)std::min<int64_t>(kPackGroup, (O16 - o) / 16), -1);
  });
}

using PackedFn = void (*)(ffi::ThreadPool&, const uint16_t*, const uint16_t*, float*, int64_t, int64_t);

template <int... Rs>
PackedFn PickPacked(int rows, std::integer_sequence<int, Rs...>) {
  PackedFn fn = nullptr;
  ((rows == Rs + 1 ? (fn = &PackedRange<Rs + 1>, 0) : 0), ...);
  return fn;
}

// More rows than a decoding step's (a prefill): each task a group of tiles, which stays in cache
// while chunks of kPackedChunk rows go through it in turn, into y [R, O]. The weight is read from
// memory once, as a matrix product's blocking would; the chunks' activations come from cache.
constexpr int kPackedChunk = 8;

template <int T, int N = kPackedChunk - 1>
void PackedChunkTail(const uint16_t* w, const uint16_t* x, float* y, int64_t I, int64_t o, int64_t O, int64_t r0,
                     int n) {
  if constexpr (N > 0) {
    if (n == N) return PackedTiles<N, T, false>(w, x + r0 * I, y, I, o, O, r0);
    PackedChunkTail<T, N - 1>(w, x, y, I, o, O, r0, n);
  }
}

template <int T>
void PackedChunks(const uint16_t* w, const uint16_t* x, float* y, int64_t I, int64_t o, int64_t O, int64_t R,
                  int tiles) {
  if constexpr (T > 0) {
    if (tiles != T) return PackedChunks<T - 1>(w, x, y, I, o, O, R, tiles);
    int64_t r0 = 0;
    for (; r0 + kPackedChunk <= R; r0 += kPackedChunk)
      PackedTiles<kPackedChunk, T, false>(w, x + r0 * I, y, I, o, O, r0);
    if (r0 < R) PackedChunkTail<T>(w, x, y, I, o, O, r0, (int)(R - r0));
  }
}

void PackedManyRows(ffi::ThreadPool& pool, const uint16_t* w, const uint16_t* x, float* y, int64_t R, int64_t I,
                    int64_t O) {
  const int64_t O16 = PackedRows(O, I), groups = PackedGroups(O16);
  ParallelFor(pool, groups + (O16 < O ? 1 : 0), [=](int64_t g) {
    if (g == groups) return PackedPlainRows(w, x, y, R, I, O16, O, true);
    const int64_t o = g * 16 * kPackGroup;
    PackedChunks<kPackGroup>(w, x, y, I, o, O, R, (int)std::min<int64_t>(kPackGroup, (O16 - o) / 16));
  });
}

// tj_bias_activation's columns o0 .. o1-1 (see below), by activation code and output dtype.
using ActivationFn = void (*)(const float*, const float*, void*, int64_t, int64_t, int64_t, int64_t, bool);

template <bool Bf16>
ActivationFn PickActivation(int act) {
  switch (act) {
    case 1: return BiasActivationColumns<1, Bf16>;
    case 2: return BiasActivationColumns<2, Bf16>;
    case 3: return BiasActivationColumns<3, Bf16>;
    default: return BiasActivationColumns<0, Bf16>;
  }
}

// tj_packed_dense: out[r, o] = act(round(sum_i w[o, i] x[r, i] + bias[o])), tj_packed_matmul's
// product for a decoding step's R <= 16 rows with tj_bias_activation's epilogue (the same rounding
// and activations) in the same task: each group of tiles writes its sums [R, 16 T] into a scratch
// [R, O] and turns them into its outputs while they are in cache. One call instead of two (or of
// the product and XLA's bias-and-rounding fusion), and no [O, R] product to read back in another
// order.
template <int R>
void PackedDenseRange(ffi::ThreadPool& pool, const uint16_t* w, const uint16_t* x, float* scratch, const float* bias,
                      void* out, int64_t I, int64_t O, ActivationFn epilogue) {
  const int64_t O16 = PackedRows(O, I), groups = PackedGroups(O16);
  ParallelFor(pool, groups + (O16 < O ? 1 : 0), [=](int64_t g) {
    if (g == groups) {
      PackedPlainRows(w, x, scratch, R, I, O16, O, true);
      return epilogue(scratch, bias, out, O, R, O16, O, true);
    }
    const int64_t o = g * 16 * kPackGroup;
    const int tiles = (int)std::min<int64_t>(kPackGroup, (O16 - o) / 16);
    PackedGroupRows<R>(w, x, scratch, I, o, tiles, O);
    epilogue(scratch, bias, out, O, R, o, o + 16 * tiles, true);
  });
}

using PackedDenseFn = void (*)(ffi::ThreadPool&, const uint16_t*, const uint16_t*, float*, const float*, void*,
                               int64_t, int64_t, ActivationFn);

template <int... Rs>
PackedDenseFn PickPackedDense(int rows, std::integer_sequence<int, Rs...>) {
  PackedDenseFn fn = nullptr;
  ((rows == Rs + 1 ? (fn = &PackedDenseRange<Rs + 1>, 0) : 0), ...);
  return fn;
}

ffi::Error PackedDenseImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> bias,
                           ffi::Result<ffi::AnyBuffer> out, int32_t activation) {
  auto xd = x.dimensions(), wd = w.dimensions();
  // out is [R, O] in memory, in any shape of R * O elements (the model's next reshape of it).
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || bias.dimensions().size() != 1 ||
      bias.dimensions()[0] != wd[0] || (int64_t)out->element_count() != xd[0] * wd[0])
    return ffi::Error::InvalidArgument("tj_packed_dense: expected x [R, I], w [O, I] (packed), bias [O], out of R * O");
  if (x.element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("tj_packed_dense: x and w bfloat16 only");
  const bool bf16 = out->element_type() == ffi::DataType::BF16;
  if (!bf16 && out->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("tj_packed_dense: output float32 or bfloat16");
  if (activation < 0 || activation > 3)
    return ffi::Error::InvalidArgument("tj_packed_dense: activation code must be 0-3");
  const int64_t R = xd[0], I = xd[1], O = wd[0];
  if (R < 1 || R > kMaxRows) return ffi::Error::InvalidArgument("tj_packed_dense: x must have 1 to 16 rows");
  if (O == 0) return ffi::Error::Success();
  // The sums, kept by the calling thread from call to call (up to 16 x O floats: a fresh
  // allocation above malloc's mmap threshold would cost page faults every call).
  thread_local std::vector<float> sums;
  if (sums.size() < (size_t)(R * O)) sums.resize(R * O);
  float* scratch = sums.data();
  const auto* wp = static_cast<const uint16_t*>(w.untyped_data());
  const auto* xp = static_cast<const uint16_t*>(x.untyped_data());
  const ActivationFn epilogue = bf16 ? PickActivation<true>(activation) : PickActivation<false>(activation);
  if (I == 0) {  // no products to run: the bias alone
    std::fill(scratch, scratch + R * O, 0.0f);
    epilogue(scratch, bias.typed_data(), out->untyped_data(), O, R, 0, O, true);
    return ffi::Error::Success();
  }
  PickPackedDense((int)R, std::make_integer_sequence<int, kMaxRows>{})(pool, wp, xp, scratch, bias.typed_data(),
                                                                        out->untyped_data(), I, O, epilogue);
  return ffi::Error::Success();
}

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                            ffi::Result<ffi::Buffer<ffi::F32>> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || yd.size() != 2)
    return ffi::Error::InvalidArgument("tj_packed_matmul: expected x [R, I] and w [O, I] (packed)");
  if (x.element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("tj_packed_matmul: bfloat16 only");
  const int64_t R = xd[0], I = xd[1], O = wd[0];
  // Up to kMaxRows rows y is [O, R] (a decoding step's logits stay vocabulary-major), above [R, O].
  const bool rows_out = R > kMaxRows;
  if (R < 1 || (rows_out ? yd[0] != R || yd[1] != O : yd[0] != O || yd[1] != R))
    return ffi::Error::InvalidArgument("tj_packed_matmul: y must be [O, R] up to 16 rows, else [R, O]");
  float* out = y->typed_data();
  const auto* wp = static_cast<const uint16_t*>(w.untyped_data());
  const auto* xp = static_cast<const uint16_t*>(x.untyped_data());
  if (I == 0 || O == 0) {
    std::memset(out, 0, sizeof(float) * R * O);
    return ffi::Error::Success();
  }
  if (rows_out) {
    PackedManyRows(pool, wp, xp, out, R, I, O);
  } else {
    PickPacked((int)R, std::make_integer_sequence<int, kMaxRows>{})(pool, wp, xp, out, I, O);
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// tj_cache_attention: softmax(q k^T) v for a few queries over a heads-first KV cache.
//
// q [B, L, H, Kd] (already divided by sqrt(Kd)), k and v [B, N, S, Kd] (float32, or bfloat16,
// widened exactly) with H = N * G (query head h reads cache head h / G), mask bool [B, Hm, Lm, S]
// with Hm in {1, H} and Lm in {1, L} (True = attend) -> out [B, L, H, Kd] float32. As the
// reference path: logits and softmax in float32, a query that sees no key gets zeros. One task per
// (b, n): its keys and values are read once from memory for all G * L queries that use them.

template <typename T>
using AttendFn = void (*)(const float*, const T*, const T*, const bool*, float*, int64_t, int64_t, float*,
                          const T*, const T*);

// AttendOne with its vector count fixed where the instruction set's header compiles one for Kd
// (AttendVectors), else counted at run time.
template <typename T, int... Ns>
AttendFn<T> PickAttend(int64_t kd, std::integer_sequence<int, Ns...>) {
  AttendFn<T> fn = &AttendOne<T, 0>;
  ((kAttendLanes * (Ns - 1) < kd && kd <= kAttendLanes * Ns ? (fn = &AttendOne<T, Ns>, 0) : 0), ...);
  return fn;
}

template <typename T>
void CacheAttention(ffi::ThreadPool& pool, const AttentionShape& a, const float* qp, const T* kp,
                    const T* vp, const bool* mp, float* op) {
  const AttendFn<T> attend = PickAttend<T>(a.Kd, AttendVectors{});
  ParallelFor(pool, a.B * a.N, [a, qp, kp, vp, mp, op, attend](int64_t t) {
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
        attend(qp + offset, key, val, m, op + offset, a.S, a.Kd, logits.data(),
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
// (plus S if negative) brought into [0, S - L], as JAX's dynamic_update_slice takes it. The
// output is the cache's own buffer (input_output_aliases in native.py): only B * N * L rows of Kd
// elements are written. XLA:CPU writes a bfloat16 cache by converting all of it to float32 and
// back, every layer, every step.

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
    const int64_t wrapped = idx[b] < 0 ? (int64_t)idx[b] + S : (int64_t)idx[b];  // as JAX takes it
    const int64_t start = std::min<int64_t>(std::max<int64_t>(wrapped, 0), S - L);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t l = 0; l < L; ++l)
        std::memcpy(dst + (((b * N + n) * S) + start + l) * row, src + (((b * L + l) * N) + n) * row, row);
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// tj_cache_reorder: beam search's cache reordering in place. Row i of the cache [R, C, S, Kd]
// (R = batch x beams; C = heads, or layers x heads for a scanned cache) takes row rows[i]'s first
// counts[i] positions of every chunk c; rows whose parent is themselves are not touched, nor are
// positions at or past counts[i] (no decoding step reads them before writing them). A row index
// is taken as JAX's gather takes it: a negative one counted from the end, then clamped to
// [0, R - 1]. XLA gathers every row's whole allocated cache, every layer, every step.
//
// Order of the copies: a row may be overwritten once no pending row still reads it, so rows that
// no other row reads go first; each copy may free its parent. What is left are cycles (beams that
// swap parents); one row of each is first saved to a buffer and then read from there.

ffi::Error CacheReorderImpl(ffi::AnyBuffer cache, ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> counts,
                            ffi::Result<ffi::AnyBuffer> out) {
  auto cd = cache.dimensions(), rd = rows.dimensions(), nd = counts.dimensions();
  if (cd.size() != 4 || rd.size() != 1 || nd.size() != 1 || rd[0] != cd[0] || nd[0] != cd[0])
    return ffi::Error::InvalidArgument("tj_cache_reorder: expected cache [R, C, S, K], rows [R], counts [R]");
  if (out->element_type() != cache.element_type())
    return ffi::Error::InvalidArgument("tj_cache_reorder: the output differs from the cache in dtype");
  const int64_t R = cd[0], C = cd[1], S = cd[2], Kd = cd[3];
  const size_t bytes = ffi::ByteWidth(cache.element_type());
  char* data = static_cast<char*>(out->untyped_data());
  if (R * C * S * Kd == 0) return ffi::Error::Success();
  if (data != cache.untyped_data()) std::memcpy(data, cache.untyped_data(), bytes * R * C * S * Kd);
  const size_t position = bytes * Kd, chunk = position * S;
  std::vector<int64_t> parent(R), count(R), readers(R, 0);
  std::vector<char> pending(R);
  for (int64_t i = 0; i < R; ++i) {
    int64_t p = rows.typed_data()[i];
    if (p < 0) p += R;
    parent[i] = std::min<int64_t>(std::max<int64_t>(p, 0), R - 1);
    count[i] = std::min<int64_t>(std::max<int64_t>(counts.typed_data()[i], 0), S);
    pending[i] = parent[i] != i;
    if (pending[i]) ++readers[parent[i]];
  }
  // Where each row's data is read from: its place in the cache, or a saved copy ([C, S, Kd] too).
  std::vector<const char*> source(R);
  for (int64_t i = 0; i < R; ++i) source[i] = data + i * C * chunk;
  std::vector<std::unique_ptr<char[]>> saved;
  std::vector<int64_t> ready;
  for (int64_t i = 0; i < R; ++i)
    if (pending[i] && readers[i] == 0) ready.push_back(i);
  for (int64_t remaining = std::count(pending.begin(), pending.end(), 1); remaining > 0;) {
    if (ready.empty()) {  // only cycles are left: save one of their rows
      int64_t i = 0;
      while (!(pending[i] && readers[i] > 0)) ++i;
      int64_t longest = 0;
      for (int64_t j = 0; j < R; ++j)
        if (pending[j] && parent[j] == i) longest = std::max(longest, count[j]);
      saved.emplace_back(new char[C * chunk]);
      for (int64_t c = 0; c < C; ++c)
        std::memcpy(saved.back().get() + c * chunk, source[i] + c * chunk, longest * position);
      source[i] = saved.back().get();
      readers[i] = 0;
      ready.push_back(i);
    }
    const int64_t i = ready.back();
    ready.pop_back();
    const int64_t p = parent[i];
    char* dst = data + i * C * chunk;
    for (int64_t c = 0; c < C; ++c) std::memcpy(dst + c * chunk, source[p] + c * chunk, count[i] * position);
    pending[i] = 0;
    --remaining;
    if (source[p] == data + p * C * chunk && --readers[p] == 0 && pending[p]) ready.push_back(p);
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
    // Column b's lanes: b, b + B, ... (P of them) where a vector holds P rows, else lane b % 16 of
    // group b / 16; merged in lane order, chunk by chunk.
    const int64_t g = P > 1 ? 0 : b / 16, first = P > 1 ? b : b % 16, step = P > 1 ? 16 / P : 16;
    for (int64_t c = 0; c < chunks; ++c) {
      for (int64_t j = first; j < 16; j += step) MergeGreedy(total, parts[(g * chunks + c) * 16 + j]);
    }
    idx[b] = total.at;
    lt[b] = total.nan ? std::numeric_limits<float>::quiet_NaN() : std::log(total.sum);
  }
  return ffi::Error::Success();
}


// ---------------------------------------------------------------------------------------------
// tj_bias_activation: out[r, o] = act(round(y[o, r] + bias[o])) for a product's output as
// tj_rows_matmul leaves it, y float32 [O, R] (or, with rows_first, y[r, o] of y [R, O] as
// tj_cols_matmul leaves it) -> out [R, O] in float32 or bfloat16, where `round`
// is the rounding to the output dtype (a bf16 projection's output is rounded before its
// activation, as in the XLA path) and act is none (0), relu (1), the tanh form of GELU (2) or
// SiLU (3). XLA:CPU's tanh-GELU over a [8, 3072] step took ~50 us, one
// twentieth of the weight product before it.

ffi::Error BiasActivationImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> y, ffi::Buffer<ffi::F32> bias,
                              ffi::Result<ffi::AnyBuffer> out, int32_t activation, int32_t rows_first) {
  auto d = y.dimensions();
  if (d.size() != 2 || bias.dimensions().size() != 1 || bias.dimensions()[0] != d[rows_first ? 1 : 0])
    return ffi::Error::InvalidArgument("tj_bias_activation: expected y [O, R] (rows_first: [R, O]) and bias [O]");
  if (activation < 0 || activation > 3)
    return ffi::Error::InvalidArgument("tj_bias_activation: activation code must be 0-3");
  const bool bf16 = out->element_type() == ffi::DataType::BF16;
  if (!bf16 && out->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("tj_bias_activation: output float32 or bfloat16");
  const int64_t O = d[rows_first ? 1 : 0], R = d[rows_first ? 0 : 1];
  const float* yp = y.typed_data();
  const float* bp = bias.typed_data();
  void* outp = out->untyped_data();
  const ActivationFn fn = bf16 ? PickActivation<true>(activation) : PickActivation<false>(activation);
  ParallelFor(pool, (O + kActivationColumns - 1) / kActivationColumns, [=](int64_t t) {
    const int64_t o0 = t * kActivationColumns;
    fn(yp, bp, outp, O, R, o0, std::min(O, o0 + kActivationColumns), rows_first != 0);
  });
  return ffi::Error::Success();
}


// ---------------------------------------------------------------------------------------------
// tj_layer_norm: a few rows of x [R, D] (float32 or bfloat16) normalised over D -> out [R, D]
// (float32 or bfloat16), as the model's XLA path computes it in float32:
//   LayerNorm (rms = 0): m = sum(x) / D, c = x - m, v = sum(c^2) / D,
//                        out = round(c * (rsqrt(v + eps) * scale) + bias);
//   RMSNorm (rms = 1):   out = round((x * rsqrt(sum(x^2) / D + eps)) * scale)  (bias unused);
// the division by D as a product with the float32 reciprocal of D, as XLA:CPU compiles it, and
// each sum in 16 lanes, then the lanes pairwise (XLA's reduction order differs: the last bits of
// a statistic can, and a bf16 result then by one rounding step, ~2 in 100,000 in the tests). In a
// decoding step XLA:CPU made five operations of each norm (two reductions, ~2.5 us each on
// [8, 768]); here one call computes it on the calling thread (~1.7 us on [8, 768] in a chain of
// calls, less than the ~5.6 us a pool thread took to start on a task in a decoding step).

constexpr int kNormLanes = 16;

inline float SumLanes16(const float* acc) {
  float t[kNormLanes];
  for (int k = 0; k < kNormLanes; ++k) t[k] = acc[k];
  for (int width = kNormLanes / 2; width >= 1; width /= 2)
    for (int k = 0; k < width; ++k) t[k] += t[k + width];
  return t[0];
}

// float32 -> bfloat16 bits, round to nearest even; a NaN stays a quiet NaN.
inline uint16_t Bf16Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

template <bool Rms>
void NormRow(const float* x, const float* scale, const float* bias, float* y, int64_t D, float eps) {
  const float inv_d = 1.0f / (float)D;
  float acc[kNormLanes] = {};
  const int64_t whole = D / kNormLanes * kNormLanes;
  float mean = 0.0f;
  if constexpr (!Rms) {
    for (int64_t j = 0; j < whole; j += kNormLanes)
      for (int k = 0; k < kNormLanes; ++k) acc[k] += x[j + k];
    for (int64_t j = whole; j < D; ++j) acc[j - whole] += x[j];
    mean = SumLanes16(acc) * inv_d;
    for (int k = 0; k < kNormLanes; ++k) acc[k] = 0.0f;
  }
  for (int64_t j = 0; j < whole; j += kNormLanes)
    for (int k = 0; k < kNormLanes; ++k) {
      const float c = x[j + k] - mean;
      acc[k] += c * c;
    }
  for (int64_t j = whole; j < D; ++j) {
    const float c = x[j] - mean;
    acc[j - whole] += c * c;
  }
  const float inv = 1.0f / std::sqrt(SumLanes16(acc) * inv_d + eps);
  for (int64_t j = 0; j < D; ++j) {
    if constexpr (Rms) {
      y[j] = (x[j] * inv) * scale[j];
    } else {
      y[j] = (x[j] - mean) * (inv * scale[j]) + bias[j];
    }
  }
}

ffi::Error LayerNormImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> bias,
                         ffi::Result<ffi::AnyBuffer> out, float eps, int32_t rms) {
  auto d = x.dimensions();
  if (d.size() != 2 || scale.dimensions().size() != 1 || scale.dimensions()[0] != d[1] ||
      bias.dimensions().size() != 1 || bias.dimensions()[0] != d[1])
    return ffi::Error::InvalidArgument("tj_layer_norm: expected x [R, D], scale [D] and bias [D]");
  const bool in_bf16 = x.element_type() == ffi::DataType::BF16;
  const bool out_bf16 = out->element_type() == ffi::DataType::BF16;
  if ((!in_bf16 && x.element_type() != ffi::DataType::F32) ||
      (!out_bf16 && out->element_type() != ffi::DataType::F32))
    return ffi::Error::InvalidArgument("tj_layer_norm: x and out must be float32 or bfloat16");
  const int64_t R = d[0], D = d[1];
  if (R == 0 || D == 0) return ffi::Error::Success();
  // A bf16 row is widened (exactly) into xr, a bf16 result rounded from yr; float32 is read and
  // written in place.
  thread_local std::vector<float> row;
  row.resize(2 * D);
  float* xr = row.data();
  float* yr = row.data() + D;
  for (int64_t r = 0; r < R; ++r) {
    const float* xi = static_cast<const float*>(x.untyped_data()) + r * D;
    if (in_bf16) {
      const uint16_t* xb = static_cast<const uint16_t*>(x.untyped_data()) + r * D;
      for (int64_t j = 0; j < D; ++j) {
        const uint32_t u = (uint32_t)xb[j] << 16;
        std::memcpy(xr + j, &u, 4);
      }
      xi = xr;
    }
    float* yo = out_bf16 ? yr : static_cast<float*>(out->untyped_data()) + r * D;
    if (rms) {
      NormRow<true>(xi, scale.typed_data(), bias.typed_data(), yo, D, eps);
    } else {
      NormRow<false>(xi, scale.typed_data(), bias.typed_data(), yo, D, eps);
    }
    if (out_bf16) {
      uint16_t* ob = static_cast<uint16_t*>(out->untyped_data()) + r * D;
      for (int64_t j = 0; j < D; ++j) ob[j] = Bf16Bits(yr[j]);
    }
  }
  return ffi::Error::Success();
}


// ---------------------------------------------------------------------------------------------
// Training attention: softmax(q k^T * scale) v over whole sequences, forward and backward, float32.
// XLA:CPU runs attention's batched [T, d] x [d, S] products at ~0.1-0.2 of its matmul peak and
// makes ~10 passes over the [B, H, T, S] logits between them; here one task takes a (batch row,
// KV head) and, at training lengths, keeps every block it touches in L2. A NaN logit a query sees
// makes its output (and the gradients through it) NaN, as XLA's softmax does. Causal masking skips
// the keys after a query block's last query. Layouts: q, o, dq [B, T, H, D]; k, v, dk, dv [B, S, N, D] (H = N * G);
// lse [B, H, T]. Key j is visible to query i when kv_seg[b, j] != 0, q_seg[b, i] == kv_seg[b, j]
// and, if causal, j <= i.

// Query rows per block: a block's logits, probabilities and their gradient are [kAttnBlock, S].
constexpr int64_t kAttnBlock = 64;
constexpr int64_t kGemmWidth = kGemmVecs * kFLanes;

inline int64_t RoundUp(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// C[kGemmRows, NV * kFLanes] += A(i, k) B[k, :] over k < K: A(i, k) = a[i * ai + k * ak], row k of
// B at b + k * ldb, row i of C at c + i * ldc.
template <int NV>
inline void GemmBlock(const float* a, int64_t ai, int64_t ak, const float* b, int64_t ldb, float* c,
                      int64_t ldc, int64_t K) {
  FVec acc[kGemmRows][NV];
  for (int r = 0; r < kGemmRows; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = FLoad(c + r * ldc + v * kFLanes);
  for (int64_t k = 0; k < K; ++k) {
    FVec bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = FLoad(b + k * ldb + v * kFLanes);
    for (int r = 0; r < kGemmRows; ++r) {
      const FVec s = FSet(a[r * ai + k * ak]);
      for (int v = 0; v < NV; ++v) acc[r][v] = FFma(s, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < kGemmRows; ++r)
    for (int v = 0; v < NV; ++v) FStore(c + r * ldc + v * kFLanes, acc[r][v]);
}

// C[M, N] += A B as above; M a multiple of kGemmRows, N of kFLanes.
inline void Gemm(int64_t M, int64_t N, int64_t K, const float* a, int64_t ai, int64_t ak, const float* b,
                 int64_t ldb, float* c, int64_t ldc) {
  for (int64_t i = 0; i < M; i += kGemmRows) {
    int64_t j = 0;
    for (; j + kGemmWidth <= N; j += kGemmWidth)
      GemmBlock<kGemmVecs>(a + i * ai, ai, ak, b + j, ldb, c + i * ldc + j, ldc, K);
    for (; j < N; j += kFLanes) GemmBlock<1>(a + i * ai, ai, ak, b + j, ldb, c + i * ldc + j, ldc, K);
  }
}

struct TrainAttentionShape {
  int64_t B, T, H, N, S, D;
  bool causal;
  float scale;
  int64_t G() const { return H / N; }
  int64_t Tp() const { return RoundUp(T, kGemmRows); }
  int64_t Sp() const { return RoundUp(S, kGemmWidth); }
  // Keys a block of queries from i0 can see: all, or with causal masking up to its last query.
  int64_t KeyEnd(int64_t i0) const {
    return causal ? std::min(Sp(), RoundUp(std::min(i0 + kAttnBlock, T), kGemmWidth)) : Sp();
  }
};

// Rows [0, rows) of x (row stride `stride`, D floats each) times `scale` into dst [padded, D],
// the rows after them zero.
inline void CopyRows(const float* x, int64_t stride, int64_t rows, int64_t padded, int64_t D, float scale,
                     float* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; ++d) dst[r * D + d] = x[r * stride + d] * scale;
  std::fill(dst + rows * D, dst + padded * D, 0.0f);
}

// The transpose of rows [0, rows) of x into dst [D, padded], the columns after them zero.
inline void CopyTransposed(const float* x, int64_t stride, int64_t rows, int64_t padded, int64_t D,
                           float* dst) {
  for (int64_t d = 0; d < D; ++d) {
    for (int64_t r = 0; r < rows; ++r) dst[d * padded + r] = x[r * stride + d];
    std::fill(dst + d * padded + rows, dst + (d + 1) * padded, 0.0f);
  }
}

// Logits row s[0, end) of query i: masked keys set to -inf. Returns whether any key is visible.
// `uniform` is the segment id of every key of the row when they all share one, else 0: then a query
// of that id sees every key up to the limit, and no key needs a look.
inline bool MaskRow(const TrainAttentionShape& a, float* s, int64_t i, int64_t end, int32_t q_seg,
                    const int32_t* kv_seg, int32_t uniform) {
  const float masked = -std::numeric_limits<float>::infinity();
  const int64_t limit = std::min(end, a.causal ? std::min(i + 1, a.S) : a.S);
  bool any = false;
  if (uniform != 0 && q_seg == uniform) {
    any = limit > 0;
  } else {
    for (int64_t j = 0; j < limit; ++j) {
      const bool visible = kv_seg[j] != 0 && kv_seg[j] == q_seg;
      any |= visible;
      s[j] = visible ? s[j] : masked;
    }
  }
  std::fill(s + limit, s + end, masked);
  return any;
}

// The segment id all S keys share (`MaskRow`), or 0.
inline int32_t UniformSegment(const int32_t* kv_seg, int64_t S) {
  for (int64_t j = 1; j < S; ++j)
    if (kv_seg[j] != kv_seg[0]) return 0;
  return S > 0 ? kv_seg[0] : 0;
}

// Per-thread scratch of a task, reused from task to task: O((S + T) D + kAttnBlock S) floats, a few
// hundred KB at training lengths. Buffers of more than kScratchKeepBytes in all are freed after the
// task, so that a long sequence leaves no memory behind in each of the pool's threads.
constexpr size_t kScratchKeepBytes = size_t{8} << 20;

struct AttentionScratch {
  std::vector<float> kt, vt, kh, vh, qh, gh, oh, dkh, dvh, s, ds, delta;
  void ReleaseIfLarge() {
    std::vector<float>* all[] = {&kt, &vt, &kh, &vh, &qh, &gh, &oh, &dkh, &dvh, &s, &ds, &delta};
    size_t bytes = 0;
    for (auto* v : all) bytes += v->capacity() * sizeof(float);
    if (bytes > kScratchKeepBytes)
      for (auto* v : all) std::vector<float>().swap(*v);
  }
};

void TrainAttentionForward(ffi::ThreadPool& pool, const TrainAttentionShape& a, const float* qp,
                           const float* kp, const float* vp, const int32_t* q_seg, const int32_t* kv_seg,
                           float* op, float* lsep) {
  ParallelFor(pool, a.B * a.N, [a, qp, kp, vp, q_seg, kv_seg, op, lsep](int64_t t) {
    const int64_t b = t / a.N, n = t % a.N, D = a.D, Tp = a.Tp(), Sp = a.Sp();
    thread_local AttentionScratch w;
    w.kt.resize(D * Sp);
    w.vh.resize(Sp * D);
    w.qh.resize(Tp * D);
    w.oh.resize(Tp * D);
    w.s.resize(kAttnBlock * Sp);
    const int64_t kv_stride = a.N * D, q_stride = a.H * D;
    CopyTransposed(kp + (b * a.S * a.N + n) * D, kv_stride, a.S, Sp, D, w.kt.data());
    CopyRows(vp + (b * a.S * a.N + n) * D, kv_stride, a.S, Sp, D, 1.0f, w.vh.data());
    const int32_t* ks = kv_seg + b * a.S;
    const int32_t uniform = UniformSegment(ks, a.S);
    for (int64_t g = 0; g < a.G(); ++g) {
      const int64_t h = n * a.G() + g;
      CopyRows(qp + (b * a.T * a.H + h) * D, q_stride, a.T, Tp, D, a.scale, w.qh.data());
      std::fill(w.oh.begin(), w.oh.end(), 0.0f);
      float* lse = lsep + (b * a.H + h) * a.T;
      for (int64_t i0 = 0; i0 < Tp; i0 += kAttnBlock) {
        const int64_t rows = std::min(kAttnBlock, Tp - i0), end = a.KeyEnd(i0);
        float* s = w.s.data();
        std::fill(s, s + rows * end, 0.0f);
        Gemm(rows, end, D, w.qh.data() + i0 * D, D, 1, w.kt.data(), Sp, s, end);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = i0 + r;
          float* row = s + r * end;
          if (i >= a.T || !MaskRow(a, row, i, end, q_seg[b * a.T + i], ks, uniform)) {
            std::fill(row, row + end, 0.0f);
            if (i < a.T) lse[i] = -std::numeric_limits<float>::infinity();
            continue;
          }
          FVec top = FSet(-std::numeric_limits<float>::infinity()), nan = FSet(0.0f);
          for (int64_t j = 0; j < end; j += kFLanes) {
            const FVec x = FLoad(row + j);
            top = FMax(top, x);
            nan = FMax(nan, FNaNLanes(x));
          }
          if (FMaxLanes(nan) > 0.0f) {  // a NaN logit: the row's output is NaN, as XLA's softmax gives
            std::fill(row, row + end, std::numeric_limits<float>::quiet_NaN());
            lse[i] = std::numeric_limits<float>::quiet_NaN();
            continue;
          }
          const float m = FMaxLanes(top);
          FVec sum = FSet(0.0f);
          for (int64_t j = 0; j < end; j += kFLanes) {
            const FVec e = ExpOrZero(FSub(FLoad(row + j), FSet(m)));
            FStore(row + j, e);
            sum = FFma(e, FSet(1.0f), sum);
          }
          const float total = FSum(sum);
          const FVec inv = FSet(1.0f / total);
          for (int64_t j = 0; j < end; j += kFLanes) FStore(row + j, FMul(FLoad(row + j), inv));
          lse[i] = m + std::log(total);
        }
        Gemm(rows, D, end, s, end, 1, w.vh.data(), D, w.oh.data() + i0 * D, D);
      }
      float* out = op + (b * a.T * a.H + h) * D;
      for (int64_t i = 0; i < a.T; ++i) std::memcpy(out + i * q_stride, w.oh.data() + i * D, D * sizeof(float));
    }
    w.ReleaseIfLarge();
  });
}

void TrainAttentionBackward(ffi::ThreadPool& pool, const TrainAttentionShape& a, const float* qp,
                            const float* kp, const float* vp, const float* op, const float* gp,
                            const float* lsep, const int32_t* q_seg, const int32_t* kv_seg, float* dqp,
                            float* dkp, float* dvp) {
  ParallelFor(pool, a.B * a.N, [=](int64_t t) {
    const int64_t b = t / a.N, n = t % a.N, D = a.D, Tp = a.Tp(), Sp = a.Sp();
    thread_local AttentionScratch w;
    w.kt.resize(D * Sp);
    w.vt.resize(D * Sp);
    w.kh.resize(Sp * D);
    w.qh.resize(Tp * D);
    w.gh.resize(Tp * D);
    w.oh.resize(Tp * D);
    w.dkh.assign(Sp * D, 0.0f);
    w.dvh.assign(Sp * D, 0.0f);
    w.s.resize(kAttnBlock * Sp);
    w.ds.resize(kAttnBlock * Sp);
    w.delta.resize(Tp);
    const int64_t kv_stride = a.N * D, q_stride = a.H * D;
    const float* key = kp + (b * a.S * a.N + n) * D;
    const float* val = vp + (b * a.S * a.N + n) * D;
    CopyTransposed(key, kv_stride, a.S, Sp, D, w.kt.data());
    CopyTransposed(val, kv_stride, a.S, Sp, D, w.vt.data());
    CopyRows(key, kv_stride, a.S, Sp, D, 1.0f, w.kh.data());
    const int32_t* ks = kv_seg + b * a.S;
    const int32_t uniform = UniformSegment(ks, a.S);
    for (int64_t g = 0; g < a.G(); ++g) {
      const int64_t h = n * a.G() + g;
      const int64_t offset = (b * a.T * a.H + h) * D;
      CopyRows(qp + offset, q_stride, a.T, Tp, D, a.scale, w.qh.data());
      CopyRows(gp + offset, q_stride, a.T, Tp, D, 1.0f, w.gh.data());
      const float* lse = lsep + (b * a.H + h) * a.T;
      for (int64_t i = 0; i < a.T; ++i) {  // delta_i = sum_d dO[i, d] O[i, d]
        const float* o = op + offset + i * q_stride;
        float sum = 0.0f;
        for (int64_t d = 0; d < D; ++d) sum += w.gh[i * D + d] * o[d];
        w.delta[i] = sum;
      }
      std::fill(w.oh.begin(), w.oh.end(), 0.0f);  // dq of this head, before the scale
      for (int64_t i0 = 0; i0 < Tp; i0 += kAttnBlock) {
        const int64_t rows = std::min(kAttnBlock, Tp - i0), end = a.KeyEnd(i0);
        float* s = w.s.data();
        float* ds = w.ds.data();
        std::fill(s, s + rows * end, 0.0f);
        std::fill(ds, ds + rows * end, 0.0f);
        Gemm(rows, end, D, w.qh.data() + i0 * D, D, 1, w.kt.data(), Sp, s, end);        // logits
        Gemm(rows, end, D, w.gh.data() + i0 * D, D, 1, w.vt.data(), Sp, ds, end);       // dP = dO V^T
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = i0 + r;
          float* p = s + r * end;
          float* dp = ds + r * end;
          if (i < a.T && std::isnan(lse[i])) {  // a NaN in the forward pass: NaN gradients
            std::fill(p, p + end, std::numeric_limits<float>::quiet_NaN());
            std::fill(dp, dp + end, std::numeric_limits<float>::quiet_NaN());
            continue;
          }
          if (i >= a.T || lse[i] == -std::numeric_limits<float>::infinity() ||
              !MaskRow(a, p, i, end, q_seg[b * a.T + i], ks, uniform)) {
            std::fill(p, p + end, 0.0f);
            std::fill(dp, dp + end, 0.0f);
            continue;
          }
          const FVec top = FSet(lse[i]), delta = FSet(w.delta[i]);
          for (int64_t j = 0; j < end; j += kFLanes) {
            const FVec pj = ExpOrZero(FSub(FLoad(p + j), top));  // P = exp(logit - lse)
            FStore(p + j, pj);
            FStore(dp + j, FMul(pj, FSub(FLoad(dp + j), delta)));  // dS = P (dP - delta)
          }
        }
        // dV += P^T dO, dK += dS^T (scale Q), dQ += dS K (scaled below).
        Gemm(end, D, rows, s, 1, end, w.gh.data() + i0 * D, D, w.dvh.data(), D);
        Gemm(end, D, rows, ds, 1, end, w.qh.data() + i0 * D, D, w.dkh.data(), D);
        Gemm(rows, D, end, ds, end, 1, w.kh.data(), D, w.oh.data() + i0 * D, D);
      }
      float* dq = dqp + offset;
      for (int64_t i = 0; i < a.T; ++i)
        for (int64_t d = 0; d < D; ++d) dq[i * q_stride + d] = w.oh[i * D + d] * a.scale;
    }
    float* dk = dkp + (b * a.S * a.N + n) * D;
    float* dv = dvp + (b * a.S * a.N + n) * D;
    for (int64_t j = 0; j < a.S; ++j) {
      std::memcpy(dk + j * kv_stride, w.dkh.data() + j * D, D * sizeof(float));
      std::memcpy(dv + j * kv_stride, w.dvh.data() + j * D, D * sizeof(float));
    }
    w.ReleaseIfLarge();
  });
}

// Shapes of q [B, T, H, D], k and v [B, S, N, D], q_seg [B, T], kv_seg [B, S]; an error names
// what does not fit.
using Dims = ffi::Span<const int64_t>;

ffi::Error TrainAttentionCheck(const char* name, Dims qd, Dims kd, Dims vd, Dims qs, Dims ks, TrainAttentionShape& a) {
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || qs.size() != 2 || ks.size() != 2)
    return ffi::Error::InvalidArgument(std::string(name) + ": expected 4-axis q, k, v and 2-axis segment ids");
  a.B = qd[0], a.T = qd[1], a.H = qd[2], a.D = qd[3], a.S = kd[1], a.N = kd[2];
  if (kd[0] != a.B || kd[3] != a.D || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] || vd[3] != kd[3] ||
      a.N == 0 || a.H % a.N != 0 || a.D % kFLanes != 0 || a.D > kMaxHeadDim || qs[0] != a.B || qs[1] != a.T ||
      ks[0] != a.B || ks[1] != a.S)
    return ffi::Error::InvalidArgument(std::string(name) + ": shapes do not fit");
  return ffi::Error::Success();
}

ffi::Error TrainAttentionFwdImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                                 ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> q_seg,
                                 ffi::Buffer<ffi::S32> kv_seg, ffi::Result<ffi::Buffer<ffi::F32>> out,
                                 ffi::Result<ffi::Buffer<ffi::F32>> lse, bool causal, float scale) {
  TrainAttentionShape a{};
  ffi::Error error = TrainAttentionCheck("tj_attention_fwd", q.dimensions(), k.dimensions(), v.dimensions(),
                                         q_seg.dimensions(), kv_seg.dimensions(), a);
  if (error.failure()) return error;
  auto qd = q.dimensions(), od = out->dimensions(), ld = lse->dimensions();
  if (od.size() != 4 || ld.size() != 3 || ld[0] != a.B || ld[1] != a.H || ld[2] != a.T ||
      od[0] != qd[0] || od[1] != qd[1] || od[2] != qd[2] || od[3] != qd[3])
    return ffi::Error::InvalidArgument("tj_attention_fwd: out or lse do not fit q");
  a.causal = causal;
  a.scale = scale;
  TrainAttentionForward(pool, a, q.typed_data(), k.typed_data(), v.typed_data(), q_seg.typed_data(),
                        kv_seg.typed_data(), out->typed_data(), lse->typed_data());
  return ffi::Error::Success();
}

ffi::Error TrainAttentionBwdImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                                 ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> o, ffi::Buffer<ffi::F32> g,
                                 ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::S32> q_seg,
                                 ffi::Buffer<ffi::S32> kv_seg, ffi::Result<ffi::Buffer<ffi::F32>> dq,
                                 ffi::Result<ffi::Buffer<ffi::F32>> dk, ffi::Result<ffi::Buffer<ffi::F32>> dv,
                                 bool causal, float scale) {
  TrainAttentionShape a{};
  ffi::Error error = TrainAttentionCheck("tj_attention_bwd", q.dimensions(), k.dimensions(), v.dimensions(),
                                         q_seg.dimensions(), kv_seg.dimensions(), a);
  if (error.failure()) return error;
  auto qd = q.dimensions(), od = o.dimensions(), gd = g.dimensions(), ld = lse.dimensions();
  if (od.size() != 4 || gd.size() != 4 || ld.size() != 3 || ld[0] != a.B || ld[1] != a.H || ld[2] != a.T)
    return ffi::Error::InvalidArgument("tj_attention_bwd: out, its gradient or lse do not fit q");
  for (int d = 0; d < 4; ++d)
    if (od[d] != qd[d] || gd[d] != qd[d])
      return ffi::Error::InvalidArgument("tj_attention_bwd: out, its gradient or lse do not fit q");
  a.causal = causal;
  a.scale = scale;
  TrainAttentionBackward(pool, a, q.typed_data(), k.typed_data(), v.typed_data(), o.typed_data(),
                         g.typed_data(), lse.typed_data(), q_seg.typed_data(), kv_seg.typed_data(),
                         dq->typed_data(), dk->typed_data(), dv->typed_data());
  return ffi::Error::Success();
}

// The identity, in place (the output aliases the input): XLA cannot fuse an operation into a custom
// call, so the value reaches the next operation as an array of its own (see native.materialize).
ffi::Error MaterializeImpl(ffi::AnyBuffer a, ffi::Result<ffi::AnyBuffer> b) {
  if (a.element_type() != b->element_type() || a.size_bytes() != b->size_bytes())
    return ffi::Error::InvalidArgument("tj_materialize: the output must be the input's shape and dtype");
  if (a.untyped_data() != b->untyped_data()) std::memcpy(b->untyped_data(), a.untyped_data(), a.size_bytes());
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjCacheReorder, CacheReorderImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjRowsMatmul, RowsMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjPackedMatmul, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjPackedDense, PackedDenseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("activation"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjColsMatmul, ColsMatmulImpl,
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
                                  .Attr<int32_t>("activation")
                                  .Attr<int32_t>("rows_first"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjAttentionFwd, TrainAttentionFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("causal")
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjAttentionBwd, TrainAttentionBwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("causal")
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjLayerNorm, LayerNormImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("rms"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(TjMaterialize, MaterializeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

// How bf16 products run (1: bf16 dot products, 2: widened to float32), deciding it by measurement
// if not yet decided; and setting it (0: measure again, 1 or 2) for tests and measurements. Called
// through ctypes.
// Where the AVX-512 kernels' far prefetches land (1: non-temporal, 2: L2), deciding it by the
// CPU's vendor if not yet decided; and setting it (0: by the vendor again, 1 or 2).
extern "C" int tj_far_prefetch() { return FarPrefetchNta() ? kFarNta : kFarT1; }
extern "C" int tj_set_far_prefetch(int hint) {
  g_far_hint.store(hint == kFarNta || hint == kFarT1 ? hint : FarHintForCpu());
  return g_far_hint.load();
}

extern "C" int tj_bf16_products() { return Bf16Path(); }
extern "C" int tj_set_bf16_products(int path) {
  if (path == kDot && !kHasBf16Dot) path = kWiden;
  g_bf16_path.store(path == kDot || path == kWiden ? path : Bf16Calibrate());
  return g_bf16_path.load();
}
