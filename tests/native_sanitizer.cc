// Memory-safety and correctness check of the native CPU kernels (transformer_jax/modeling/
// native_kernels.cc), built with AddressSanitizer and UndefinedBehaviorSanitizer by
// tests/test_native_sanitizers.py for each instruction set the CPU runs.
//
// It calls the FFI implementation functions (RowsMatmulImpl, ColsMatmulImpl, CacheAttentionImpl,
// CacheWriteImpl, CacheReorderImpl, GreedyChoiceImpl, BiasActivationImpl, PackedDenseImpl, TrainAttentionFwdImpl,
// TrainAttentionBwdImpl, MaterializeImpl, LayerNormImpl) directly, through an XLA_FFI_Api whose
// thread pool is threads of its own (so ParallelFor runs as in XLA, threads taking each other's
// ranges), on buffers allocated with exactly the bytes their shapes need, and compares every result
// with a scalar reference in double precision (bit for bit on small-integer data, where the sums
// are exact). Outputs start as NaN, so an element left unwritten shows.
//
// Usage: ./drv                       the whole sweep; exit status 1 on any mismatch
//        ./drv KERNEL [key=val ...]  only the cases of KERNEL matching every key (all keys: one case)
//        ./drv selftest [0|1|2|3]    a deliberate overread: 0 must be reported by ASan, 2 must fault;
//                                    3, a data race, by ThreadSanitizer
// With SANITIZER_SWEEP=threads in the environment, only the cases that can run on several threads
// (MayRunOnSeveralThreads; for ThreadSanitizer). The summary line counts the cases whose kernel did.
// Allocation modes (key alloc): 0 = malloc of the exact size (ASan's redzones), 1 = the buffer's
// end flush against a PROT_NONE page, 2 = its start right after one (these catch masked loads,
// stores and gathers, which GCC's ASan does not instrument).
#include "native_kernels.cc"

#include <sanitizer/common_interface_defs.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <cstdarg>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>

using Params = std::map<std::string, int64_t>;

static char g_case[512] = "(none)";
static const char* g_prog = "./drv";
static int64_t g_cases = 0, g_fail = 0;
static int64_t g_parallel = 0;  // cases whose kernel handed work to another thread
static std::atomic<int64_t> g_scheduled{0};  // tasks handed to the pool's threads so far

static void PrintCase(const char* why) {
  fprintf(stderr, "\n*** %s while running: %s\n", why, g_case);
  fflush(stderr);
}
static void DeathCallback() { PrintCase("sanitizer report"); }
static struct sigaction g_old_segv;
static void SegvHandler(int sig, siginfo_t* info, void* uc) {
  char buf[700];
  int n = snprintf(buf, sizeof buf, "\n*** SIGSEGV at %p while running: %s\n", info->si_addr, g_case);
  if (write(2, buf, n) < 0) {}
  sigaction(SIGSEGV, &g_old_segv, nullptr);
  if (g_old_segv.sa_flags & SA_SIGINFO && g_old_segv.sa_sigaction) {
    g_old_segv.sa_sigaction(sig, info, uc);
  } else {
    raise(SIGSEGV);
  }
}

static std::string ParamString(const std::string& kernel, const Params& p) {
  std::string s = kernel;
  for (auto& [k, v] : p) s += " " + k + "=" + std::to_string(v);
  return s;
}

static std::string CaseString(const std::string& kernel, const Params& p) {
  return std::string(g_prog) + " " + ParamString(kernel, p);
}

// ------------------------------------------------------------------------------------------------
// Allocation with exactly `bytes` bytes.
struct Alloc {
  void* p = nullptr;
  void* map = nullptr;
  size_t map_len = 0;
  Alloc() = default;
  Alloc(size_t bytes, int mode) {
    const size_t page = 4096;
    if (mode == 0) {
      p = malloc(bytes);
      if (!p && bytes) abort();
      return;
    }
    const size_t data_pages = (bytes + page - 1) / page;
    map_len = (data_pages + 2) * page;
    map = mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) abort();
    char* base = (char*)map;
    mprotect(base, page, PROT_NONE);                              // front guard
    mprotect(base + (data_pages + 1) * page, page, PROT_NONE);    // back guard
    if (mode == 1) p = base + (data_pages + 1) * page - bytes;    // end flush with back guard
    else p = base + page;                                         // start right after front guard
  }
  ~Alloc() {
    if (map) munmap(map, map_len);
    else free(p);
  }
  Alloc(const Alloc&) = delete;
  Alloc& operator=(const Alloc&) = delete;
};

// ------------------------------------------------------------------------------------------------
// Fake XLA thread pool.
struct Pool {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::pair<XLA_FFI_Task*, void*>> q;
  std::vector<std::thread> th;
  bool stop = false;
  int64_t reported = 2;
  int delay = 0;  // 0: none; 1: random short sleeps before a helper runs (the caller steals)
  std::atomic<uint64_t> rng{12345};
  Pool(int workers) {
    for (int i = 0; i < workers; ++i) th.emplace_back([this] { Loop(); });
  }
  void Loop() {
    for (;;) {
      std::pair<XLA_FFI_Task*, void*> t;
      {
        std::unique_lock<std::mutex> l(mu);
        cv.wait(l, [&] { return stop || !q.empty(); });
        if (q.empty()) return;
        t = q.front();
        q.pop_front();
      }
      if (delay) {
        uint64_t r = rng.fetch_add(0x9E3779B97F4A7C15ull) * 0xBF58476D1CE4E5B9ull;
        if ((r >> 60) & 1) std::this_thread::sleep_for(std::chrono::microseconds((r >> 40) % 300));
      }
      t.first(t.second);
    }
  }
  void Push(XLA_FFI_Task* task, void* data) {
    {
      std::lock_guard<std::mutex> l(mu);
      q.emplace_back(task, data);
    }
    cv.notify_one();
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> l(mu);
      stop = true;
    }
    cv.notify_all();
    for (auto& t : th) t.join();
  }
};
static Pool* g_pool;

static XLA_FFI_Error* FakeSchedule(XLA_FFI_ThreadPool_Schedule_Args* a) {
  g_scheduled.fetch_add(1, std::memory_order_relaxed);
  g_pool->Push(a->task, a->data);
  return nullptr;
}
static XLA_FFI_Error* FakeNumThreads(XLA_FFI_ThreadPool_NumThreads_Args* a) {
  *a->num_threads = g_pool->reported;
  return nullptr;
}
static XLA_FFI_Api g_api;
static ffi::DiagnosticEngine g_diag;

static ffi::ThreadPool MakePool(int64_t threads) {
  g_pool->reported = threads;
  return *ffi::CtxDecoding<ffi::ThreadPool>::Decode(&g_api, nullptr, g_diag);
}

struct Buf {
  XLA_FFI_Buffer b;
  std::vector<int64_t> dims;
  Buf(XLA_FFI_DataType t, void* data, std::vector<int64_t> d) : dims(std::move(d)) {
    b.struct_size = sizeof(XLA_FFI_Buffer);
    b.extension_start = nullptr;
    b.dtype = t;
    b.data = data;
    b.rank = (int64_t)dims.size();
    b.dims = dims.data();
  }
};

// ------------------------------------------------------------------------------------------------
static inline uint16_t ToBf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}
static inline float FromBf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline float RoundBf16(float f) { return FromBf16(ToBf16(f)); }

static uint64_t Fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (char c : s) h = (h ^ (uint8_t)c) * 1099511628211ull;
  return h;
}

static uint64_t Seed(const std::string& kernel, const Params& p) { return Fnv1a(CaseString(kernel, p)); }

// splitmix64's finalizer: FNV-1a's low bits follow the last bytes hashed, all but alike here.
static uint64_t Mixed(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static void Fail(const std::string& kernel, const Params& p, const char* fmt, ...) __attribute__((format(printf, 3, 4)));
static void Fail(const std::string& kernel, const Params& p, const char* fmt, ...) {
  ++g_fail;
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  printf("MISMATCH %s: %s\n   repro: %s\n", kernel.c_str(), msg, CaseString(kernel, p).c_str());
  fflush(stdout);
}

// ------------------------------------------------------------------------------------------------
// n operands from the generator state: small integers (|v| <= 8, or 4 for bf16, whose products and
// sums are exact) or uniform in [-1, 1), rounded to bf16 where asked. Uninstrumented, like
// ReferenceDot and for the same reason; with std::mt19937 drawing them, ThreadSanitizer's product
// sweep took 24.0 s, against 12.8 s with this.
__attribute__((no_sanitize("thread"))) static void ProductOperands(float* out, int64_t n, bool small, bool bf16,
                                                                   uint64_t* state) {
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t z = Mixed(*state += 0x9E3779B97F4A7C15ull);  // splitmix64
    const int span = bf16 ? 4 : 8;
    const float v = small ? (float)((int)(z % (uint64_t)(2 * span + 1)) - span)
                          : (float)((z >> 40) * (1.0 / (double)(1ull << 24))) * 2.0f - 1.0f;
    out[i] = bf16 ? RoundBf16(v) : v;
  }
}

// sum_i w[i * stride] x[i] in double, and the sum of the terms' magnitudes. The references read
// only the test's own copies of the operands, on the calling thread, after the kernel has returned:
// ThreadSanitizer need not watch them (watched, its product sweep took 36.6 s against 24.0).
__attribute__((no_sanitize("thread"))) static void ReferenceDot(const float* w, int64_t stride, const float* x,
                                                                int64_t n, double* sum, double* mag) {
  double s = 0, m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double term = (double)w[i * stride] * x[i];
    s += term;
    m += std::fabs(term);
  }
  *sum = s;
  *mag = m;
}

// A bf16 weight w [O, I] in the packed layout: rows 0 .. O16 - 1 in tiles of 16, in groups of three
// tiles (the last group: the one or two left over), a group of g tiles stored [I / 2, g, 16, 2]; the
// rest (every row where I is odd) as they are.
static void PackWeights(const float* wf, uint16_t* w, int64_t O, int64_t I) {
  const int64_t O16 = I % 2 == 0 ? O / 16 * 16 : 0, tiles = O16 / 16;
  for (int64_t o = 0; o < O; ++o) {
    const int64_t group = o / 48, tile = (o / 16) % 3, g = std::min<int64_t>(3, tiles - 3 * group);
    for (int64_t i = 0; i < I; ++i)
      w[o < O16 ? group * 48 * I + ((i / 2) * g + tile) * 32 + (o % 16) * 2 + i % 2 : o * I + i] = ToBf16(wf[o * I + i]);
  }
}

// The weight products: tj_rows_matmul ("matmul": x [R, I] times w [O, I] -> y [O, R]) and
// tj_cols_matmul ("cols": w [I, O] -> y [R, O]). dtype 0 f32 / 1 bf16; path 1 dot / 2 widen (bf16);
// data 0 small integers (exact), 1 random reals (tolerance).
static void TestProduct(const std::string& kernel, const Params& p) {
  const int64_t dtype = p.at("dtype"), path = p.at("path"), R = p.at("R"), I = p.at("I"), O = p.at("O");
  const int64_t thr = p.at("thr"), data = p.at("data"), alloc = p.at("alloc");
  const bool cols = kernel == "cols", packed = kernel == "packed";
  const size_t es = dtype ? 2 : 4;
  Alloc xa(es * R * I, alloc), wa(es * O * I, alloc), ya(4 * O * R, alloc);
  std::vector<float> xf(R * I), wf(O * I);  // wf in the kernel's layout
  uint64_t state = Seed(kernel, p);
  ProductOperands(xf.data(), R * I, data == 0, dtype != 0, &state);
  ProductOperands(wf.data(), O * I, data == 0, dtype != 0, &state);
  if (dtype) {
    for (int64_t i = 0; i < R * I; ++i) ((uint16_t*)xa.p)[i] = ToBf16(xf[i]);
    for (int64_t i = 0; i < O * I; ++i) ((uint16_t*)wa.p)[i] = ToBf16(wf[i]);
    if (packed) PackWeights(wf.data(), (uint16_t*)wa.p, O, I);
  } else {
    if (R * I) memcpy(xa.p, xf.data(), 4 * R * I);
    if (O * I) memcpy(wa.p, wf.data(), 4 * O * I);
  }
  float* y = (float*)ya.p;
  for (int64_t i = 0; i < O * R; ++i) y[i] = std::numeric_limits<float>::quiet_NaN();
  if (dtype && !packed && tj_set_bf16_products((int)path) != (kHasBf16Dot ? path : 2)) abort();
  const XLA_FFI_DataType t = dtype ? XLA_FFI_DataType_BF16 : XLA_FFI_DataType_F32;
  Buf xb(t, xa.p, {R, I}), wb(t, wa.p, cols ? std::vector<int64_t>{I, O} : std::vector<int64_t>{O, I}),
      yb(XLA_FFI_DataType_F32, ya.p, cols || (packed && R > 16) ? std::vector<int64_t>{R, O} : std::vector<int64_t>{O, R});
  auto impl = cols ? ColsMatmulImpl : (packed ? PackedMatmulImpl : RowsMatmulImpl);
  ffi::Error e = impl(MakePool(thr), ffi::AnyBuffer(&xb.b), ffi::AnyBuffer(&wb.b), ffi::Buffer<ffi::F32>(&yb.b));
  if (e.failure()) return Fail(kernel, p, "returned error: %s", e.message().c_str());
  double worst = 0;
  int64_t wo = -1, wr = -1;
  for (int64_t o = 0; o < O; ++o) {
    for (int64_t r = 0; r < R; ++r) {
      double ref, mag;
      ReferenceDot(wf.data() + (cols ? o : o * I), cols ? O : 1, xf.data() + r * I, I, &ref, &mag);
      const double got = y[cols || (packed && R > 16) ? r * O + o : o * R + r];
      double err = std::fabs(got - ref);
      if (std::isnan(got)) err = INFINITY;
      const double tol = data == 0 ? 0.0 : 2e-5 * mag + 1e-30;
      const double scaled = err <= tol ? 0 : err;
      if (scaled > worst) worst = scaled, wo = o, wr = r;
    }
  }
  if (worst > 0) Fail(kernel, p, "max abs error %.6g (first worst at o=%ld r=%ld)", worst, (long)wo, (long)wr);
}

// ------------------------------------------------------------------------------------------------
// tj_cache_attention. kt 0 f32 / 1 bf16 cache; hm/lm 0 -> mask axis 1, 1 -> full; mask pattern.
static void TestAttention(const Params& p) {
  const int64_t kt = p.at("kt"), B = p.at("B"), L = p.at("L"), H = p.at("H"), N = p.at("N"), S = p.at("S");
  const int64_t Kd = p.at("Kd"), Hm = p.at("hm") ? H : 1, Lm = p.at("lm") ? L : 1, mask = p.at("mask");
  const int64_t thr = p.at("thr"), alloc = p.at("alloc");
  std::mt19937_64 rng(Seed("attention", p));
  std::uniform_real_distribution<float> real(-1.0f, 1.0f);
  const size_t es = kt ? 2 : 4;
  Alloc qa(4 * B * L * H * Kd, alloc), ka(es * B * N * S * Kd, alloc), va(es * B * N * S * Kd, alloc),
      ma(B * Hm * Lm * S, alloc), oa(4 * B * L * H * Kd, alloc);
  std::vector<float> q(B * L * H * Kd), k(B * N * S * Kd), v(B * N * S * Kd);
  const float qs = 3.0f / std::sqrt((float)Kd);
  for (auto& x : q) x = real(rng) * qs;
  for (auto& x : k) x = kt ? RoundBf16(real(rng)) : real(rng);
  for (auto& x : v) x = kt ? RoundBf16(real(rng)) : real(rng);
  if (!q.empty()) memcpy(qa.p, q.data(), 4 * q.size());
  for (size_t i = 0; i < k.size(); ++i) {
    if (kt) {
      ((uint16_t*)ka.p)[i] = ToBf16(k[i]);
      ((uint16_t*)va.p)[i] = ToBf16(v[i]);
    } else {
      ((float*)ka.p)[i] = k[i];
      ((float*)va.p)[i] = v[i];
    }
  }
  bool* m = (bool*)ma.p;
  std::uniform_int_distribution<int64_t> pos(0, S > 0 ? S - 1 : 0);
  for (int64_t row = 0; row < B * Hm * Lm; ++row) {
    int64_t pat = mask == 6 ? (int64_t)(rng() % 6) : mask;
    bool* mr = m + row * S;
    int64_t a = pos(rng), b2 = pos(rng);
    for (int64_t s = 0; s < S; ++s) {
      bool on = true;
      switch (pat) {
        case 0: on = true; break;
        case 1: on = (rng() & 1) != 0; break;
        case 2: on = s >= a; break;          // left padding
        case 3: on = s <= a; break;          // unwritten tail
        case 4: on = false; break;           // fully masked
        case 5: on = s == a; break;          // single position
        case 7: on = s >= std::min(a, b2) && s <= std::max(a, b2) && (rng() % 4 != 0); break;
      }
      mr[s] = on;
    }
  }
  float* out = (float*)oa.p;
  for (int64_t i = 0; i < B * L * H * Kd; ++i) out[i] = std::numeric_limits<float>::quiet_NaN();
  const XLA_FFI_DataType t = kt ? XLA_FFI_DataType_BF16 : XLA_FFI_DataType_F32;
  Buf qb(XLA_FFI_DataType_F32, qa.p, {B, L, H, Kd}), kb(t, ka.p, {B, N, S, Kd}), vb(t, va.p, {B, N, S, Kd}),
      mb(XLA_FFI_DataType_PRED, ma.p, {B, Hm, Lm, S}), ob(XLA_FFI_DataType_F32, oa.p, {B, L, H, Kd});
  ffi::Error e = CacheAttentionImpl(MakePool(thr), ffi::Buffer<ffi::F32>(&qb.b), ffi::AnyBuffer(&kb.b),
                                    ffi::AnyBuffer(&vb.b), ffi::Buffer<ffi::PRED>(&mb.b),
                                    ffi::Buffer<ffi::F32>(&ob.b));
  if (e.failure()) return Fail("attention", p, "returned error: %s", e.message().c_str());
  const int64_t G = H / N;
  double worst = 0;
  std::string where;
  std::vector<double> lg(S), acc(Kd);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t l = 0; l < L; ++l)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t n = h / G;
        const bool* mr = m + ((b * Hm + (Hm == 1 ? 0 : h)) * Lm + (Lm == 1 ? 0 : l)) * S;
        const float* qr = &q[((b * L + l) * H + h) * Kd];
        double mx = -INFINITY;
        for (int64_t s = 0; s < S; ++s) {
          if (!mr[s]) continue;
          double d, mag;
          ReferenceDot(&k[((b * N + n) * S + s) * Kd], 1, qr, Kd, &d, &mag);
          lg[s] = d;
          mx = std::max(mx, d);
        }
        std::fill(acc.begin(), acc.end(), 0.0);
        double tot = 0;
        for (int64_t s = 0; s < S; ++s) {
          if (!mr[s]) continue;
          double w = std::exp(lg[s] - mx);
          tot += w;
          for (int64_t c = 0; c < Kd; ++c) acc[c] += w * v[((b * N + n) * S + s) * Kd + c];
        }
        const float* o = out + ((b * L + l) * H + h) * Kd;
        for (int64_t c = 0; c < Kd; ++c) {
          const double ref = tot > 0 ? acc[c] / tot : 0.0;
          double err = std::fabs(o[c] - ref);
          if (std::isnan(o[c])) err = INFINITY;
          if (err > 5e-5 && err > worst) {
            worst = err;
            where = "b=" + std::to_string(b) + " l=" + std::to_string(l) + " h=" + std::to_string(h) +
                    " d=" + std::to_string(c);
          }
        }
      }
  if (worst > 0) Fail("attention", p, "max abs error %.6g at %s", worst, where.c_str());
}

// The training attention in double precision: the output, the log-sum-exp (-inf for a query that
// sees no key) and the gradients of sum(out * g). Uninstrumented, like ReferenceDot.
__attribute__((no_sanitize("thread"))) static void TrainAttentionReference(
    const float* q, const float* k, const float* v, const float* g, const int32_t* qs, const int32_t* ks, int64_t B,
    int64_t T, int64_t S, int64_t H, int64_t N, int64_t D, bool causal, float scale, double* ro, double* rlse,
    double* rdq, double* rdk, double* rdv) {
  const int64_t G = H / N;
  std::fill(rdq, rdq + B * T * H * D, 0.0), std::fill(rdk, rdk + B * S * N * D, 0.0);
  std::fill(rdv, rdv + B * S * N * D, 0.0);
  std::vector<double> pr(S);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < T; ++i) {
        const int64_t n = h / G, qi = ((b * T + i) * H + h) * D;
        double mx = -INFINITY;
        for (int64_t j = 0; j < S; ++j) {
          const int32_t kseg = ks[b * S + j];
          const bool on = kseg != 0 && kseg == qs[b * T + i] && (!causal || j <= i);
          double d = -INFINITY;
          if (on) {
            double mag;
            ReferenceDot(&k[((b * S + j) * N + n) * D], 1, &q[qi], D, &d, &mag);
            d *= scale;
          }
          pr[j] = d;
          mx = std::max(mx, d);
        }
        double tot = 0;
        for (int64_t j = 0; j < S; ++j) tot += pr[j] = mx == -INFINITY ? 0.0 : std::exp(pr[j] - mx);
        rlse[(b * H + h) * T + i] = tot == 0 ? -INFINITY : mx + std::log(tot);
        for (int64_t j = 0; j < S; ++j) pr[j] = tot > 0 ? pr[j] / tot : 0.0;  // the probabilities
        double delta = 0;
        for (int64_t c = 0; c < D; ++c) {
          double oc = 0;
          for (int64_t j = 0; j < S; ++j) oc += pr[j] * v[((b * S + j) * N + n) * D + c];
          ro[qi + c] = oc;
          delta += oc * g[qi + c];
        }
        for (int64_t j = 0; j < S; ++j) {
          const double pj = pr[j];
          if (pj == 0) continue;
          const int64_t kj = ((b * S + j) * N + n) * D;
          double dpj, mag;
          ReferenceDot(&v[kj], 1, &g[qi], D, &dpj, &mag);
          const double ds = pj * (dpj - delta) * scale;
          for (int64_t c = 0; c < D; ++c) {
            rdv[kj + c] += pj * g[qi + c];
            rdq[qi + c] += ds * k[kj + c];
            rdk[kj + c] += ds * q[qi + c];
          }
        }
      }
}

// ------------------------------------------------------------------------------------------------
// tj_attention_fwd / tj_attention_bwd (training attention). causal 0/1; mask 0 none, 1 packed
// segments (ids sorted, some 0 = padding), 2 random invalid keys, 3 every key of batch row 0
// invalid (its queries see nothing: zero output, -inf log-sum-exp, zero gradients).
static void TestTrainAttention(const Params& p) {
  const int64_t B = p.at("B"), T = p.at("T"), S = p.at("S"), H = p.at("H"), N = p.at("N"), D = p.at("D");
  const int64_t causal = p.at("causal"), mask = p.at("mask"), thr = p.at("thr"), alloc = p.at("alloc");
  std::mt19937_64 rng(Seed("trainattn", p));
  std::uniform_real_distribution<float> real(-1.0f, 1.0f);
  const int64_t nq = B * T * H * D, nk = B * S * N * D;
  Alloc qa(4 * nq, alloc), ka(4 * nk, alloc), va(4 * nk, alloc), ga(4 * nq, alloc), qsa(4 * B * T, alloc),
      ksa(4 * B * S, alloc), oa(4 * nq, alloc), la(4 * B * H * T, alloc), dqa(4 * nq, alloc), dka(4 * nk, alloc),
      dva(4 * nk, alloc);
  float *q = (float*)qa.p, *k = (float*)ka.p, *v = (float*)va.p, *g = (float*)ga.p;
  for (int64_t i = 0; i < nq; ++i) q[i] = 2.0f * real(rng), g[i] = real(rng);
  for (int64_t i = 0; i < nk; ++i) k[i] = 2.0f * real(rng), v[i] = real(rng);
  int32_t *qs = (int32_t*)qsa.p, *ks = (int32_t*)ksa.p;
  for (int64_t b = 0; b < B; ++b) {
    int32_t seg = 1;
    for (int64_t i = 0; i < std::max(T, S); ++i) {
      if (mask == 1 && rng() % 9 == 0) seg = (seg + 1) % 4;  // 0: padding
      if (i < T) qs[b * T + i] = mask == 1 ? seg : 1;
      const int32_t other = mask == 2 ? (int32_t)(rng() % 3 != 0) : (mask == 3 && b == 0 ? 0 : 1);
      if (i < S) ks[b * S + i] = mask == 1 ? seg : other;
    }
    if (mask == 1 && T != S)
      for (int64_t j = 0; j < S; ++j) ks[b * S + j] = (int32_t)(rng() % 4);
  }
  float *o = (float*)oa.p, *lse = (float*)la.p, *dq = (float*)dqa.p, *dk = (float*)dka.p, *dv = (float*)dva.p;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::fill(o, o + nq, nan), std::fill(lse, lse + B * H * T, nan), std::fill(dq, dq + nq, nan);
  std::fill(dk, dk + nk, nan), std::fill(dv, dv + nk, nan);
  const float scale = 1.0f / std::sqrt((float)D);
  Buf qb(XLA_FFI_DataType_F32, q, {B, T, H, D}), kb(XLA_FFI_DataType_F32, k, {B, S, N, D}),
      vb(XLA_FFI_DataType_F32, v, {B, S, N, D}), gb(XLA_FFI_DataType_F32, g, {B, T, H, D}),
      qsb(XLA_FFI_DataType_S32, qs, {B, T}), ksb(XLA_FFI_DataType_S32, ks, {B, S}),
      ob(XLA_FFI_DataType_F32, o, {B, T, H, D}), lb(XLA_FFI_DataType_F32, lse, {B, H, T}),
      dqb(XLA_FFI_DataType_F32, dq, {B, T, H, D}), dkb(XLA_FFI_DataType_F32, dk, {B, S, N, D}),
      dvb(XLA_FFI_DataType_F32, dv, {B, S, N, D});
  ffi::Error e = TrainAttentionFwdImpl(MakePool(thr), ffi::Buffer<ffi::F32>(&qb.b), ffi::Buffer<ffi::F32>(&kb.b),
                                       ffi::Buffer<ffi::F32>(&vb.b), ffi::Buffer<ffi::S32>(&qsb.b),
                                       ffi::Buffer<ffi::S32>(&ksb.b), ffi::Buffer<ffi::F32>(&ob.b),
                                       ffi::Buffer<ffi::F32>(&lb.b), causal != 0, scale);
  const bool fits = D % kFLanes == 0 && D <= kMaxHeadDim && H % N == 0;
  if (!fits) {
    if (!e.failure()) Fail("trainattn", p, "accepted head dimension %ld", (long)D);
    return;
  }
  if (e.failure()) return Fail("trainattn", p, "forward returned error: %s", e.message().c_str());
  e = TrainAttentionBwdImpl(MakePool(thr), ffi::Buffer<ffi::F32>(&qb.b), ffi::Buffer<ffi::F32>(&kb.b),
                            ffi::Buffer<ffi::F32>(&vb.b), ffi::Buffer<ffi::F32>(&ob.b), ffi::Buffer<ffi::F32>(&gb.b),
                            ffi::Buffer<ffi::F32>(&lb.b), ffi::Buffer<ffi::S32>(&qsb.b), ffi::Buffer<ffi::S32>(&ksb.b),
                            ffi::Buffer<ffi::F32>(&dqb.b), ffi::Buffer<ffi::F32>(&dkb.b), ffi::Buffer<ffi::F32>(&dvb.b),
                            causal != 0, scale);
  if (e.failure()) return Fail("trainattn", p, "backward returned error: %s", e.message().c_str());
  std::vector<double> ro(nq), rlse(B * H * T), rdq(nq), rdk(nk), rdv(nk);
  TrainAttentionReference(q, k, v, g, qs, ks, B, T, S, H, N, D, causal != 0, scale, ro.data(), rlse.data(), rdq.data(),
                          rdk.data(), rdv.data());
  double worst = 0;
  std::string where;
  auto check = [&](const char* what, float got, double ref, int64_t at) {
    double err = std::isnan(got) ? INFINITY : std::fabs(got - ref) / (1.0 + std::fabs(ref));
    if (err > 2e-5 && err > worst) worst = err, where = std::string(what) + " at " + std::to_string(at);
  };
  for (int64_t i = 0; i < B * H * T; ++i)
    if (rlse[i] == -INFINITY) {
      if (!(lse[i] == -INFINITY)) check("lse (no key)", lse[i], -1e30, i);
    } else {
      check("lse", lse[i], rlse[i], i);
    }
  for (int64_t i = 0; i < nq; ++i) check("out", o[i], ro[i], i);
  for (int64_t i = 0; i < nq; ++i) check("dq", dq[i], rdq[i], i);
  for (int64_t i = 0; i < nk; ++i) check("dk", dk[i], rdk[i], i), check("dv", dv[i], rdv[i], i);
  if (worst > 0) Fail("trainattn", p, "max relative error %.6g in %s", worst, where.c_str());
}

// An output that must equal its reference byte for byte (the cache kernels only move bytes).
static void CheckBytes(const char* kernel, const Params& p, const void* out, const std::vector<unsigned char>& ref) {
  if (ref.empty() || memcmp(out, ref.data(), ref.size()) == 0) return;
  size_t i = 0;
  while (((const unsigned char*)out)[i] == ref[i]) ++i;
  Fail(kernel, p, "output differs from reference, first at byte %zu", i);
}

// ------------------------------------------------------------------------------------------------
// tj_materialize: the identity; alias 1 = output is the input buffer (as XLA calls it), 0 = a copy.
static void TestMaterialize(const Params& p) {
  const int64_t n = p.at("n"), es = p.at("es"), alias = p.at("alias"), alloc = p.at("alloc");
  std::mt19937_64 rng(Seed("materialize", p));
  Alloc in(n * es, alloc), out(n * es, alloc);
  std::vector<unsigned char> ref(n * es);
  for (auto& c : ref) c = (unsigned char)rng();
  if (n) memcpy(in.p, ref.data(), ref.size());
  void* dst = alias ? in.p : out.p;
  const XLA_FFI_DataType t = es == 2 ? XLA_FFI_DataType_BF16 : XLA_FFI_DataType_F32;
  Buf ib(t, in.p, {n}), ob(t, dst, {n});
  ffi::Error e = MaterializeImpl(ffi::AnyBuffer(&ib.b), ffi::AnyBuffer(&ob.b));
  if (e.failure()) return Fail("materialize", p, "returned error: %s", e.message().c_str());
  CheckBytes("materialize", p, dst, ref);
}

// ------------------------------------------------------------------------------------------------
// tj_cache_write. ct 0 f32 / 1 bf16; idx mode; alias 1 = output is the cache buffer.
static void TestCacheWrite(const Params& p) {
  const int64_t ct = p.at("ct"), B = p.at("B"), N = p.at("N"), S = p.at("S"), L = p.at("L"), Kd = p.at("Kd");
  const int64_t idxm = p.at("idx"), alias = p.at("alias"), alloc = p.at("alloc");
  std::mt19937_64 rng(Seed("cachewrite", p));
  const size_t es = ct ? 2 : 4;
  const size_t cbytes = es * B * N * S * Kd, ubytes = es * B * L * N * Kd;
  Alloc ca(cbytes, alloc), ua(ubytes, alloc), ia(4 * B, alloc);
  Alloc oa(alias ? 0 : cbytes, alloc);
  for (size_t i = 0; i < cbytes; ++i) ((unsigned char*)ca.p)[i] = (unsigned char)rng();
  for (size_t i = 0; i < ubytes; ++i) ((unsigned char*)ua.p)[i] = (unsigned char)rng();
  int32_t* idx = (int32_t*)ia.p;
  for (int64_t b = 0; b < B; ++b) {
    switch (idxm) {
      case 0: idx[b] = 0; break;
      case 1: idx[b] = (int32_t)(rng() % (S + 1)); break;                 // 0..S (S clamps)
      case 2: idx[b] = -(int32_t)(rng() % 5) - 1; break;                   // negative
      case 3: idx[b] = (int32_t)(S + rng() % 100); break;                   // past the end
      case 4: idx[b] = (b & 1) ? std::numeric_limits<int32_t>::max() : std::numeric_limits<int32_t>::min(); break;
      case 5: idx[b] = (int32_t)(S - L); break;
    }
  }
  std::vector<unsigned char> ref(cbytes);
  if (cbytes) memcpy(ref.data(), ca.p, cbytes);
  const size_t row = es * Kd;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t wrapped = idx[b] < 0 ? (int64_t)idx[b] + S : (int64_t)idx[b];  // as JAX takes it
    const int64_t start = std::min<int64_t>(std::max<int64_t>(wrapped, 0), S - L);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t l = 0; l < L; ++l)
        memcpy(&ref[(((b * N + n) * S) + start + l) * row], (char*)ua.p + (((b * L + l) * N) + n) * row, row);
  }
  void* outp = alias ? ca.p : oa.p;
  if (!alias) memset(outp, 0xAB, cbytes);
  const XLA_FFI_DataType t = ct ? XLA_FFI_DataType_BF16 : XLA_FFI_DataType_F32;
  Buf cb(t, ca.p, {B, N, S, Kd}), ub(t, ua.p, {B, L, N, Kd}), ib(XLA_FFI_DataType_S32, ia.p, {B}),
      ob(t, outp, {B, N, S, Kd});
  ffi::Error e = CacheWriteImpl(ffi::AnyBuffer(&cb.b), ffi::AnyBuffer(&ub.b), ffi::Buffer<ffi::S32>(&ib.b),
                                ffi::AnyBuffer(&ob.b));
  if (e.failure()) return Fail("cachewrite", p, "returned error: %s", e.message().c_str());
  CheckBytes("cachewrite", p, outp, ref);
}

// ------------------------------------------------------------------------------------------------
// tj_cache_reorder. es element bytes (1 / 2 / 4); rm rows: 0 permutation, 1 random with repeats,
// 2 identity, 3 out of range (negative and past R); cm counts: 0 random in [0, S], 1 beyond
// [0, S], 2 all S; alias 1 = output is the cache buffer.
static void TestCacheReorder(const Params& p) {
  const int64_t es = p.at("es"), R = p.at("R"), C = p.at("C"), S = p.at("S"), Kd = p.at("Kd");
  const int64_t rm = p.at("rm"), cm = p.at("cm"), alias = p.at("alias"), alloc = p.at("alloc");
  std::mt19937_64 rng(Seed("cachereorder", p));
  const size_t cbytes = es * R * C * S * Kd;
  Alloc ca(cbytes, alloc), ra(4 * R, alloc), na(4 * R, alloc);
  Alloc oa(alias ? 0 : cbytes, alloc);
  for (size_t i = 0; i < cbytes; ++i) ((unsigned char*)ca.p)[i] = (unsigned char)rng();
  int32_t* rows = (int32_t*)ra.p;
  int32_t* counts = (int32_t*)na.p;
  std::vector<int32_t> perm(R);
  for (int64_t i = 0; i < R; ++i) perm[i] = (int32_t)i;
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int64_t i = 0; i < R; ++i) {
    switch (rm) {
      case 0: rows[i] = perm[i]; break;
      case 1: rows[i] = (int32_t)(rng() % R); break;
      case 2: rows[i] = (int32_t)i; break;
      case 3: rows[i] = (int32_t)((int64_t)(rng() % (3 * R + 4)) - 2 * R - 2); break;
    }
    switch (cm) {
      case 0: counts[i] = (int32_t)(rng() % (S + 1)); break;
      case 1: counts[i] = (i & 1) ? (int32_t)(S + 1 + rng() % 5) : -(int32_t)(rng() % 5) - 1; break;
      case 2: counts[i] = (int32_t)S; break;
    }
  }
  std::vector<unsigned char> ref(cbytes);
  if (cbytes) memcpy(ref.data(), ca.p, cbytes);
  const size_t chunk = es * S * Kd;
  for (int64_t i = 0; i < R && cbytes; ++i) {
    int64_t parent = rows[i] < 0 ? (int64_t)rows[i] + R : (int64_t)rows[i];  // as JAX's gather
    parent = std::min<int64_t>(std::max<int64_t>(parent, 0), R - 1);
    const int64_t n = std::min<int64_t>(std::max<int64_t>(counts[i], 0), S);
    if (parent == i) continue;
    for (int64_t c = 0; c < C; ++c)
      memcpy(ref.data() + (i * C + c) * chunk, (char*)ca.p + (parent * C + c) * chunk, es * n * Kd);
  }
  void* outp = alias ? ca.p : oa.p;
  if (!alias) memset(outp, 0xAB, cbytes);
  const XLA_FFI_DataType t = es == 1 ? XLA_FFI_DataType_U8 : es == 2 ? XLA_FFI_DataType_BF16 : XLA_FFI_DataType_F32;
  Buf cb(t, ca.p, {R, C, S, Kd}), rb(XLA_FFI_DataType_S32, ra.p, {R}), nb(XLA_FFI_DataType_S32, na.p, {R}),
      ob(t, outp, {R, C, S, Kd});
  ffi::Error e = CacheReorderImpl(ffi::AnyBuffer(&cb.b), ffi::Buffer<ffi::S32>(&rb.b), ffi::Buffer<ffi::S32>(&nb.b),
                                  ffi::AnyBuffer(&ob.b));
  if (e.failure()) return Fail("cachereorder", p, "returned error: %s", e.message().c_str());
  CheckBytes("cachereorder", p, outp, ref);
}

// ------------------------------------------------------------------------------------------------
// tj_greedy_choice. data: 0 random reals, 1 small integers (ties), 2 some -inf, 3 some NaN,
// 4 some columns all -inf / all NaN, 5 some +inf, 6 huge magnitudes.
static void TestGreedy(const Params& p) {
  const int64_t V = p.at("V"), B = p.at("B"), data = p.at("data"), thr = p.at("thr"), alloc = p.at("alloc");
  std::mt19937_64 rng(Seed("greedy", p));
  std::normal_distribution<float> nd(0.0f, 3.0f);
  Alloc la(4 * V * B, alloc), ia(4 * B, alloc), ta(4 * B, alloc);
  float* lg = (float*)la.p;
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<int> colkind(B);
  for (int64_t b = 0; b < B; ++b) colkind[b] = (int)(rng() % 4);
  for (int64_t v = 0; v < V; ++v)
    for (int64_t b = 0; b < B; ++b) {
      float x = nd(rng);
      switch (data) {
        case 1: x = (float)(rng() % 5); break;
        case 2: if (rng() % 3 == 0) x = -inf; break;
        case 3: if (rng() % 50 == 0) x = nan; break;
        case 4: x = colkind[b] == 0 ? -inf : colkind[b] == 1 ? nan : colkind[b] == 2 ? (rng() % 2 ? -inf : nan) : x; break;
        case 5: if (rng() % 200 == 0) x = inf; break;
        case 6: x *= 1e37f; break;
        case 7: x = x * 3.0f - 60.0f; break;  // all negative, as raw GPT-2 logits are
      }
      lg[v * B + b] = x;
    }
  int32_t* idx = (int32_t*)ia.p;
  float* lt = (float*)ta.p;
  for (int64_t b = 0; b < B; ++b) idx[b] = -12345, lt[b] = -12345.0f;
  Buf lb(XLA_FFI_DataType_F32, la.p, {V, B}), ib(XLA_FFI_DataType_S32, ia.p, {B}), tb(XLA_FFI_DataType_F32, ta.p, {B});
  ffi::Error e = GreedyChoiceImpl(MakePool(thr), ffi::Buffer<ffi::F32>(&lb.b), ffi::Buffer<ffi::S32>(&ib.b),
                                  ffi::Buffer<ffi::F32>(&tb.b));
  if (e.failure()) return Fail("greedy", p, "returned error: %s", e.message().c_str());
  int bad_idx = 0;
  double worst = 0;
  int64_t wb = -1;
  std::string note;
  for (int64_t b = 0; b < B; ++b) {
    int64_t at = V - 1;
    float best = -inf;
    bool seen = false, anynan = false;
    for (int64_t v = 0; v < V; ++v) {
      const float x = lg[v * B + b];
      if (std::isnan(x)) { anynan = true; continue; }
      if (!seen || x > best) { if (!seen || x > best) { best = x; at = v; } seen = true; }
    }
    double ref;
    if (anynan || !seen || best == inf || best == -inf) ref = NAN;
    else {
      double s = 0;
      for (int64_t v = 0; v < V; ++v) s += std::exp((double)lg[v * B + b] - best);
      ref = std::log(s);
    }
    if (idx[b] != at) {
      if (!bad_idx) note = "b=" + std::to_string(b) + " index " + std::to_string(idx[b]) + " want " + std::to_string(at);
      ++bad_idx;
    }
    double err;
    if (std::isnan(ref)) err = std::isnan(lt[b]) ? 0 : INFINITY;
    else err = std::isnan(lt[b]) ? INFINITY : std::fabs(lt[b] - ref) / std::max(1.0, std::fabs(ref));
    if (err > 2e-6 && err > worst) worst = err, wb = b;
  }
  if (bad_idx || worst > 0)
    Fail("greedy", p, "%d wrong indices (%s); max rel error of log_total %.6g (b=%ld)", bad_idx, note.c_str(), worst,
         (long)wb);
}

// The activations in double precision (the references of tj_bias_activation and tj_packed_dense).
static double ActivationRef(int64_t act, double h) {
  switch (act) {
    case 1: return h > 0 ? h : 0;
    case 2: return h * 0.5 * (1 + std::tanh(0.7978845608028654 * (h + 0.044715 * h * h * h)));
    case 3: return h / (1 + std::exp(-h));
    default: return h;
  }
}

// ------------------------------------------------------------------------------------------------
// tj_bias_activation. ot 0 f32 / 1 bf16 output; act 0..3.
static void TestBiasAct(const Params& p) {
  const int64_t O = p.at("O"), R = p.at("R"), act = p.at("act"), ot = p.at("ot"), thr = p.at("thr"),
                alloc = p.at("alloc"), rf = p.count("rf") ? p.at("rf") : 0;
  std::mt19937_64 rng(Seed("biasact", p));
  std::uniform_real_distribution<float> real(-6.0f, 6.0f);
  Alloc ya(4 * O * R, alloc), ba(4 * O, alloc), oa((ot ? 2 : 4) * R * O, alloc);
  float* y = (float*)ya.p;
  float* bias = (float*)ba.p;
  for (int64_t i = 0; i < O * R; ++i) y[i] = real(rng);
  for (int64_t i = 0; i < O; ++i) bias[i] = real(rng) * 0.3f;
  if (ot) for (int64_t i = 0; i < R * O; ++i) ((uint16_t*)oa.p)[i] = 0xFFFF;
  else for (int64_t i = 0; i < R * O; ++i) ((float*)oa.p)[i] = std::numeric_limits<float>::quiet_NaN();
  // y[o, r] of y [O, R], or with rf y[r, o] of y [R, O]: at y[o * ys + r * rs].
  const int64_t ys = rf ? 1 : R, rs = rf ? O : 1;
  Buf yb(XLA_FFI_DataType_F32, ya.p, rf ? std::vector<int64_t>{R, O} : std::vector<int64_t>{O, R}),
      bb(XLA_FFI_DataType_F32, ba.p, {O}),
      ob(ot ? XLA_FFI_DataType_BF16 : XLA_FFI_DataType_F32, oa.p, {R, O});
  ffi::Error e = BiasActivationImpl(MakePool(thr), ffi::Buffer<ffi::F32>(&yb.b), ffi::Buffer<ffi::F32>(&bb.b),
                                    ffi::AnyBuffer(&ob.b), (int32_t)act, (int32_t)rf);
  if (e.failure()) return Fail("biasact", p, "returned error: %s", e.message().c_str());
  double worst = 0;
  int64_t wr = -1, wo = -1;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t o = 0; o < O; ++o) {
      float hf = y[o * ys + r * rs] + bias[o];
      if (ot) hf = RoundBf16(hf);
      const double h = hf, ref = ActivationRef(act, h);
      const double got = ot ? FromBf16(((uint16_t*)oa.p)[r * O + o]) : ((float*)oa.p)[r * O + o];
      const double tol = ot ? 0.03 * std::fabs(h) + 0.01 * std::fabs(ref) + 1e-3 : 1e-5 * (std::fabs(h) + std::fabs(ref)) + 1e-6;
      double err = std::fabs(got - ref);
      if (std::isnan(got)) err = INFINITY;
      if (err > tol && err > worst) worst = err, wr = r, wo = o;
    }
  if (worst > 0) Fail("biasact", p, "max abs error beyond tolerance %.6g at r=%ld o=%ld", worst, (long)wr, (long)wo);
}

// tj_packed_dense: act(round(x W^T + bias)) for a packed bf16 weight. ot 0 f32 / 1 bf16 output;
// act 0..3; data 0 small integers (exact sums), 1 random reals.
static void TestPackedDense(const Params& p) {
  const int64_t R = p.at("R"), I = p.at("I"), O = p.at("O"), act = p.at("act"), ot = p.at("ot"),
                thr = p.at("thr"), data = p.at("data"), alloc = p.at("alloc");
  Alloc xa(2 * R * I, alloc), wa(2 * O * I, alloc), ba(4 * O, alloc), oa((ot ? 2 : 4) * R * O, alloc);
  std::vector<float> xf(R * I), wf(O * I);
  uint64_t state = Seed("packeddense", p);
  ProductOperands(xf.data(), R * I, data == 0, true, &state);
  ProductOperands(wf.data(), O * I, data == 0, true, &state);
  for (int64_t i = 0; i < R * I; ++i) ((uint16_t*)xa.p)[i] = ToBf16(xf[i]);
  PackWeights(wf.data(), (uint16_t*)wa.p, O, I);
  std::mt19937_64 rng(state);
  float* bias = (float*)ba.p;
  for (int64_t o = 0; o < O; ++o) bias[o] = (float)((int64_t)(rng() % 9) - 4) * (data == 0 ? 1.0f : 0.37f);
  if (ot) for (int64_t i = 0; i < R * O; ++i) ((uint16_t*)oa.p)[i] = 0xFFFF;
  else for (int64_t i = 0; i < R * O; ++i) ((float*)oa.p)[i] = std::numeric_limits<float>::quiet_NaN();
  Buf xb(XLA_FFI_DataType_BF16, xa.p, {R, I}), wb(XLA_FFI_DataType_BF16, wa.p, {O, I}),
      bb(XLA_FFI_DataType_F32, ba.p, {O}), ob(ot ? XLA_FFI_DataType_BF16 : XLA_FFI_DataType_F32, oa.p, {R, O});
  ffi::Error e = PackedDenseImpl(MakePool(thr), ffi::AnyBuffer(&xb.b), ffi::AnyBuffer(&wb.b),
                                 ffi::Buffer<ffi::F32>(&bb.b), ffi::AnyBuffer(&ob.b), (int32_t)act);
  if (e.failure()) return Fail("packeddense", p, "returned error: %s", e.message().c_str());
  double worst = 0;
  int64_t wr = -1, wo = -1;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t o = 0; o < O; ++o) {
      double dot, mag;
      ReferenceDot(wf.data() + o * I, 1, xf.data() + r * I, I, &dot, &mag);
      float hf = (float)dot + bias[o];
      if (ot) hf = RoundBf16(hf);
      const double h = hf, ref = ActivationRef(act, h);
      const double got = ot ? FromBf16(((uint16_t*)oa.p)[r * O + o]) : ((float*)oa.p)[r * O + o];
      const double tol = (ot ? 0.03 * std::fabs(h) + 0.01 * std::fabs(ref) + 1e-3
                             : 1e-5 * (std::fabs(h) + std::fabs(ref)) + 1e-6) + (data == 0 ? 0.0 : 4e-5 * mag);
      double err = std::fabs(got - ref);
      if (std::isnan(got)) err = INFINITY;
      if (err > tol && err > worst) worst = err, wr = r, wo = o;
    }
  if (worst > 0) Fail("packeddense", p, "max abs error beyond tolerance %.6g at r=%ld o=%ld", worst, (long)wr, (long)wo);
}

static void TestLayerNorm(const Params& p) {
  const int64_t R = p.at("R"), D = p.at("D"), rms = p.at("rms"), it = p.at("it"), ot = p.at("ot"),
                alloc = p.at("alloc");
  std::mt19937_64 rng(Seed("layernorm", p));
  std::uniform_real_distribution<float> real(-3.0f, 3.0f);
  Alloc xa((it ? 2 : 4) * R * D, alloc), sa(4 * D, alloc), ba(4 * D, alloc), oa((ot ? 2 : 4) * R * D, alloc);
  std::vector<float> x(R * D);
  for (int64_t i = 0; i < R * D; ++i) {
    x[i] = real(rng) + 0.7f;
    if (it) {
      ((uint16_t*)xa.p)[i] = ToBf16(x[i]);
      x[i] = FromBf16(((uint16_t*)xa.p)[i]);
    } else {
      ((float*)xa.p)[i] = x[i];
    }
  }
  float* scale = (float*)sa.p;
  float* bias = (float*)ba.p;
  for (int64_t j = 0; j < D; ++j) scale[j] = 1.0f + 0.3f * real(rng), bias[j] = 0.2f * real(rng);
  if (ot) for (int64_t i = 0; i < R * D; ++i) ((uint16_t*)oa.p)[i] = 0xFFFF;
  else for (int64_t i = 0; i < R * D; ++i) ((float*)oa.p)[i] = std::numeric_limits<float>::quiet_NaN();
  Buf xb(it ? XLA_FFI_DataType_BF16 : XLA_FFI_DataType_F32, xa.p, {R, D}), sb(XLA_FFI_DataType_F32, sa.p, {D}),
      bb(XLA_FFI_DataType_F32, ba.p, {D}), ob(ot ? XLA_FFI_DataType_BF16 : XLA_FFI_DataType_F32, oa.p, {R, D});
  const float eps = 1e-5f;
  ffi::Error e = LayerNormImpl(ffi::AnyBuffer(&xb.b), ffi::Buffer<ffi::F32>(&sb.b), ffi::Buffer<ffi::F32>(&bb.b),
                               ffi::AnyBuffer(&ob.b), eps, (int32_t)rms);
  if (e.failure()) return Fail("layernorm", p, "returned error: %s", e.message().c_str());
  double worst = 0;
  int64_t wr = -1, wj = -1;
  for (int64_t r = 0; r < R; ++r) {
    double mean = 0, var = 0;
    if (!rms) {
      for (int64_t j = 0; j < D; ++j) mean += x[r * D + j];
      mean /= D;
    }
    for (int64_t j = 0; j < D; ++j) var += (x[r * D + j] - mean) * (x[r * D + j] - mean);
    const double inv = 1.0 / std::sqrt(var / D + eps);
    for (int64_t j = 0; j < D; ++j) {
      const double ref = (x[r * D + j] - mean) * inv * scale[j] + (rms ? 0.0 : bias[j]);
      const double got = ot ? FromBf16(((uint16_t*)oa.p)[r * D + j]) : ((float*)oa.p)[r * D + j];
      // float32: the statistics' rounding; bf16: one rounding step of the result, and that.
      const double tol = (ot ? 8e-3 : 2e-6) * std::fabs(ref) + 1e-5 * (std::fabs(x[r * D + j] - mean) * inv + 1.0);
      double err = std::fabs(got - ref);
      if (std::isnan(got)) err = INFINITY;
      if (err > tol && err > worst) worst = err, wr = r, wj = j;
    }
  }
  if (worst > 0) Fail("layernorm", p, "max abs error beyond tolerance %.6g at r=%ld j=%ld", worst, (long)wr, (long)wj);
}

// ------------------------------------------------------------------------------------------------
struct Case {
  std::string kernel;
  Params p;
};

static void Sweep(std::vector<Case>& cs) {
  int64_t n = 0;
  auto thr = [&]() { return (int64_t)(1 + (n++ % 4)); };
  // --- matmul ---
  const std::vector<int64_t> Is = {1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65, 95, 96, 97, 100, 127, 128, 129, 768, 770, 1000};
  const std::vector<int64_t> Os = {1, 2, 3, 4, 5, 7, 47, 48, 49, 97};
  // bf16 as dot products (path 1) only where the instruction set has them: elsewhere path 1 runs
  // widened, which path 2 already covers.
  std::vector<std::pair<int64_t, int64_t>> paths = {{0, 0}, {1, 2}};
  if (kHasBf16Dot) paths.push_back({1, 1});
  for (auto [dt, path] : paths)
    for (int64_t R = 1; R <= 16; ++R) {
      for (int64_t I : Is)
        for (int64_t O : Os)
          for (int64_t data = 0; data < 2; ++data)
            cs.push_back({"matmul", {{"dtype", dt}, {"path", path}, {"R", R}, {"I", I}, {"O", O}, {"thr", thr()}, {"data", data}, {"alloc", 0}}});
      // guard-page allocations on a subset
      for (int64_t I : {1, 3, 17, 31, 33, 63, 65, 100, 770})
        for (int64_t O : {1, 2, 5, 7, 49, 97})
          for (int64_t alloc = 1; alloc <= 2; ++alloc)
            cs.push_back({"matmul", {{"dtype", dt}, {"path", path}, {"R", R}, {"I", I}, {"O", O}, {"thr", thr()}, {"data", 0}, {"alloc", alloc}}});
      // several blocks along the input axis
      for (int64_t I : {2457, 3001, 4100, 6145, 12289, 12353})
        for (int64_t O : {1, 2, 5, 49})
          cs.push_back({"matmul", {{"dtype", dt}, {"path", path}, {"R", R}, {"I", I}, {"O", O}, {"thr", thr()}, {"data", 0}, {"alloc", (int64_t)(n % 3)}}});
      for (int64_t I : {33, 770})
        for (int64_t O : {145, 300})
          cs.push_back({"matmul", {{"dtype", dt}, {"path", path}, {"R", R}, {"I", I}, {"O", O}, {"thr", thr()}, {"data", 1}, {"alloc", 0}}});
      // empty axes
      for (auto [I, O] : std::vector<std::pair<int64_t, int64_t>>{{0, 5}, {0, 0}, {17, 0}})
        cs.push_back({"matmul", {{"dtype", dt}, {"path", path}, {"R", R}, {"I", I}, {"O", O}, {"thr", thr()}, {"data", 0}, {"alloc", 0}}});
    }
  // --- products of [I, O] weights ---
  for (auto [dt, path] : paths)
    for (int64_t R = 1; R <= 16; ++R) {
      for (int64_t I : {1, 2, 3, 17, 33, 100})
        for (int64_t O : {1, 2, 3, 5, 7, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 97, 193, 257})
          cs.push_back({"cols", {{"dtype", dt}, {"path", path}, {"R", R}, {"I", I}, {"O", O}, {"thr", thr()},
                                 {"data", (int64_t)(n % 5 == 0)}, {"alloc", (int64_t)(n % 3)}}});
      // several tasks (128 KB of weight each), so several threads' partial sums
      for (auto [I, O] : std::vector<std::pair<int64_t, int64_t>>{{1000, 97}, {3001, 49}, {770, 300}, {129, 1025}, {4099, 17}})
        cs.push_back({"cols", {{"dtype", dt}, {"path", path}, {"R", R}, {"I", I}, {"O", O}, {"thr", thr()},
                               {"data", (int64_t)(n % 2)}, {"alloc", (int64_t)(n % 3)}}});
      for (auto [I, O] : std::vector<std::pair<int64_t, int64_t>>{{0, 5}, {0, 0}, {17, 0}})
        cs.push_back({"cols", {{"dtype", dt}, {"path", path}, {"R", R}, {"I", I}, {"O", O}, {"thr", thr()}, {"data", 0}, {"alloc", 0}}});
    }
  // --- products of packed bf16 weights: groups of 1, 2 or 3 tiles of 16 rows, rows after them ---
  for (int64_t R = 1; R <= 16; ++R) {
    for (int64_t I : {1, 2, 3, 8, 30, 31, 64, 98, 770})
      for (int64_t O : {1, 5, 15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 80, 97, 113, 145})
        cs.push_back({"packed", {{"dtype", 1}, {"path", 0}, {"R", R}, {"I", I}, {"O", O}, {"thr", thr()},
                                 {"data", (int64_t)(n % 4 == 0)}, {"alloc", (int64_t)(n % 3)}}});
    for (auto [I, O] : std::vector<std::pair<int64_t, int64_t>>{{0, 5}, {0, 0}, {18, 0}, {3072, 49}, {768, 771}})
      cs.push_back({"packed", {{"dtype", 1}, {"path", 0}, {"R", R}, {"I", I}, {"O", O}, {"thr", thr()}, {"data", 0}, {"alloc", 0}}});
  }
  // more rows than a decoding step's (y [R, O]): chunks of 8 rows through each group of tiles
  for (int64_t R : {17, 23, 24, 31, 40, 65})
    for (int64_t I : {2, 8, 31, 98})
      for (int64_t O : {1, 15, 16, 33, 48, 49, 97})
        cs.push_back({"packed", {{"dtype", 1}, {"path", 0}, {"R", R}, {"I", I}, {"O", O}, {"thr", thr()},
                                 {"data", (int64_t)(n % 4 == 0)}, {"alloc", (int64_t)(n % 3)}}});
  // the same products with a bias, a rounding and an activation after them (tj_packed_dense)
  for (int64_t R = 1; R <= 16; ++R)
    for (int64_t I : {1, 2, 8, 31, 98})
      for (int64_t O : {1, 16, 17, 48, 49, 97}) {
        ++n;
        cs.push_back({"packeddense", {{"R", R}, {"I", I}, {"O", O}, {"act", n % 4}, {"ot", (n / 4) % 2},
                                      {"thr", thr()}, {"data", (int64_t)(n % 3 == 0)}, {"alloc", (int64_t)(n % 3)}}});
      }
  for (auto [I, O] : std::vector<std::pair<int64_t, int64_t>>{{0, 5}, {0, 0}, {18, 0}, {768, 771}})
    cs.push_back({"packeddense", {{"R", 8}, {"I", I}, {"O", O}, {"act", 2}, {"ot", 1}, {"thr", thr()}, {"data", 0}, {"alloc", 0}}});
  // --- attention ---
  const std::vector<int64_t> Kds = {1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65, 100, 127, 128, 129, 200, 240, 255, 256};
  const std::vector<int64_t> Ss = {1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100};
  const std::vector<std::array<int64_t, 4>> bshapes = {{1, 1, 1, 1}, {2, 1, 2, 2}, {1, 3, 3, 1}, {2, 2, 6, 2}, {1, 16, 2, 1}, {3, 1, 4, 4}, {1, 13, 3, 3}};
  int64_t k = 0;
  for (int64_t kt = 0; kt < 2; ++kt)
    for (int64_t Kd : Kds)
      for (int64_t S : Ss)
        for (int rep = 0; rep < 2; ++rep) {
          auto bs = bshapes[k % bshapes.size()];
          ++k;
          cs.push_back({"attention", {{"kt", kt}, {"B", bs[0]}, {"L", bs[1]}, {"H", bs[2]}, {"N", bs[3]}, {"S", S}, {"Kd", Kd},
                                      {"hm", (k / 2) % 2}, {"lm", (k / 3) % 2}, {"mask", rep == 0 ? 6 : (k % 8)}, {"thr", thr()},
                                      {"alloc", (k / 5) % 3}}});
        }
  for (int64_t kt = 0; kt < 2; ++kt)
    for (int64_t mask = 0; mask < 8; ++mask)
      for (int64_t Kd : {1, 17, 64, 100, 256})
        for (int64_t S : {1, 2, 5, 16, 17, 300})
          for (int64_t alloc = 0; alloc < 3; ++alloc) {
            auto bs = bshapes[k++ % bshapes.size()];
            cs.push_back({"attention", {{"kt", kt}, {"B", bs[0]}, {"L", bs[1]}, {"H", bs[2]}, {"N", bs[3]}, {"S", S}, {"Kd", Kd},
                                        {"hm", 1}, {"lm", 1}, {"mask", mask}, {"thr", thr()}, {"alloc", alloc}}});
          }
  // S = 0 (empty cache axis)
  for (int64_t kt = 0; kt < 2; ++kt)
    cs.push_back({"attention", {{"kt", kt}, {"B", 2}, {"L", 2}, {"H", 2}, {"N", 1}, {"S", 0}, {"Kd", 17}, {"hm", 1}, {"lm", 1}, {"mask", 0}, {"thr", 2}, {"alloc", 0}}});
  // --- training attention ---
  {
    int64_t t = 0;
    const std::vector<std::array<int64_t, 3>> heads = {{1, 1, 1}, {2, 3, 3}, {1, 4, 2}, {3, 2, 1}};
    for (int64_t D : {8, 16, 32, 48, 64, 128, 256, 17})
      for (int64_t T : {1, 3, 4, 5, 63, 64, 65, 130})
        for (int64_t causal = 0; causal < 2; ++causal)
          for (int64_t mask = 0; mask < 4; ++mask) {
            auto hs = heads[t % heads.size()];
            const int64_t S = causal ? T : std::vector<int64_t>{1, 7, 64, 65, 100}[t % 5];
            ++t;
            if (D >= 128 && T > 64 && t % 3) continue;  // the scalar reference is slow
            cs.push_back({"trainattn", {{"B", hs[0]}, {"T", T}, {"S", S}, {"H", hs[1]}, {"N", hs[2]}, {"D", D},
                                        {"causal", causal}, {"mask", mask}, {"thr", thr()}, {"alloc", t % 3}}});
          }
  }
  // --- materialize ---
  for (int64_t es : {2, 4})
    for (int64_t n : {0, 1, 7, 1000})
      for (int64_t alias = 0; alias < 2; ++alias)
        cs.push_back({"materialize", {{"n", n}, {"es", es}, {"alias", alias}, {"alloc", n % 3}}});
  // --- cache write ---
  for (int64_t ct = 0; ct < 2; ++ct)
    for (int64_t S : {1, 2, 3, 5, 17})
      for (int64_t L : {1, 2, 3, 5, 16})
        for (int64_t Kd : {1, 3, 16, 17, 64})
          for (int64_t idx = 0; idx < 6; ++idx) {
            if (L > S) continue;
            const int64_t B = 1 + (k % 3), N = 1 + ((k / 3) % 3);
            ++k;
            cs.push_back({"cachewrite", {{"ct", ct}, {"B", B}, {"N", N}, {"S", S}, {"L", L}, {"Kd", Kd}, {"idx", idx},
                                         {"alias", (int64_t)(k % 4 != 0)}, {"alloc", (k / 2) % 3}}});
          }
  // --- cache reorder ---
  for (int64_t es : {1, 2, 4})
    for (int64_t R : {1, 2, 3, 4, 8, 12, 16})
      for (int64_t rm = 0; rm < 4; ++rm)
        for (int64_t cm = 0; cm < 3; ++cm)
          for (int64_t rep = 0; rep < 3; ++rep) {
            const int64_t S = std::vector<int64_t>{1, 2, 5, 17}[k % 4], Kd = std::vector<int64_t>{1, 3, 16, 64}[(k / 4) % 4];
            const int64_t C = 1 + (k / 16) % 3;
            ++k;
            cs.push_back({"cachereorder", {{"es", es}, {"R", R}, {"C", C}, {"S", S}, {"Kd", Kd}, {"rm", rm}, {"cm", cm},
                                           {"alias", (int64_t)(k % 4 != 0)}, {"alloc", (k / 2) % 3}}});
          }
  for (int64_t rm = 0; rm < 4; ++rm)  // an empty position axis
    cs.push_back({"cachereorder", {{"es", 4}, {"R", 3}, {"C", 2}, {"S", 0}, {"Kd", 4}, {"rm", rm}, {"cm", 0}, {"alias", 1}, {"alloc", 0}}});
  // --- greedy ---
  for (int64_t V : {1, 2, 3, 15, 16, 17, 31, 255, 256, 257, 4095, 4096, 4097, 8193})
    for (int64_t B = 1; B <= 18; ++B) {
      if (B == 18) B = 33;
      for (int64_t data = 0; data < 7; ++data) {
        if (V > 300 && data % 2 == 1 && B > 4) continue;
        cs.push_back({"greedy", {{"V", V}, {"B", B}, {"data", data}, {"thr", thr()}, {"alloc", (int64_t)((k++) % 3)}}});
      }
    }
  for (int64_t B : {1, 2, 3, 8, 16})
    cs.push_back({"greedy", {{"V", 50257}, {"B", B}, {"data", 0}, {"thr", thr()}, {"alloc", (int64_t)((k++) % 3)}}});
  for (int64_t V : {3, 17, 31, 4097, 50257})
    for (int64_t B : {1, 2, 3, 4, 5, 8, 16})
      cs.push_back({"greedy", {{"V", V}, {"B", B}, {"data", 7}, {"thr", 2}, {"alloc", 0}}});
  cs.push_back({"greedy", {{"V", 5}, {"B", 0}, {"data", 0}, {"thr", 2}, {"alloc", 0}}});
  // --- bias + activation ---
  for (int64_t O : {1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 63, 64, 65, 255, 256, 257, 300, 513, 770})
    for (int64_t R = 1; R <= 16; ++R)
      for (int64_t act = 0; act < 4; ++act)
        for (int64_t ot = 0; ot < 2; ++ot)
          for (int64_t rf = 0; rf < 2; ++rf)
            cs.push_back({"biasact", {{"O", O}, {"R", R}, {"act", act}, {"ot", ot}, {"rf", rf}, {"thr", thr()},
                                      {"alloc", (int64_t)((k++) % 3)}}});
  for (int64_t ot = 0; ot < 2; ++ot)
    for (int64_t rf = 0; rf < 2; ++rf)
      cs.push_back({"biasact", {{"O", 0}, {"R", 3}, {"act", 2}, {"ot", ot}, {"rf", rf}, {"thr", 2}, {"alloc", 0}}});
  // --- layer norm (on the calling thread: thr 1) ---
  for (int64_t D : {1, 2, 7, 15, 16, 17, 31, 33, 64, 100, 768, 1025})
    for (int64_t R : {0, 1, 2, 3, 8, 16})
      for (int64_t rms = 0; rms < 2; ++rms)
        for (int64_t it = 0; it < 2; ++it)
          for (int64_t ot = 0; ot < 2; ++ot)
            cs.push_back({"layernorm", {{"R", R}, {"D", D}, {"rms", rms}, {"it", it}, {"ot", ot}, {"thr", 1},
                                        {"alloc", (int64_t)((k++) % 3)}}});
}

static void RunCase(const Case& c) {
  snprintf(g_case, sizeof g_case, "%s", CaseString(c.kernel, c.p).c_str());
  ++g_cases;
  const int64_t scheduled = g_scheduled.load();
  if (c.kernel == "matmul" || c.kernel == "cols" || c.kernel == "packed") TestProduct(c.kernel, c.p);
  else if (c.kernel == "attention") TestAttention(c.p);
  else if (c.kernel == "trainattn") TestTrainAttention(c.p);
  else if (c.kernel == "materialize") TestMaterialize(c.p);
  else if (c.kernel == "cachewrite") TestCacheWrite(c.p);
  else if (c.kernel == "cachereorder") TestCacheReorder(c.p);
  else if (c.kernel == "greedy") TestGreedy(c.p);
  else if (c.kernel == "biasact") TestBiasAct(c.p);
  else if (c.kernel == "packeddense") TestPackedDense(c.p);
  else if (c.kernel == "layernorm") TestLayerNorm(c.p);
  if (g_scheduled.load() != scheduled) ++g_parallel;
}

// The cases in which a kernel can split its work over several threads, for ThreadSanitizer (which
// slows every case and finds nothing where one thread does all the work): a pool of
// one thread runs ParallelFor inline, and the values in a product's operands do not change how its
// work is split (its sweep repeats each shape with two kinds of data).
static bool MayRunOnSeveralThreads(const Case& c) {
  const auto thr = c.p.find("thr");
  if (thr != c.p.end() && thr->second < 2) return false;
  // A product of [out, in] weights splits its output rows into tasks of kRowsPerTask: one task or
  // none runs on the calling thread.
  if (c.kernel == "matmul" && c.p.at("O") <= kRowsPerTask) return false;
  const auto data = c.p.find("data");
  return !((c.kernel == "matmul" || c.kernel == "cols" || c.kernel == "packed" || c.kernel == "packeddense") &&
           data != c.p.end() &&
           data->second != 0);
}

int main(int argc, char** argv) {
  g_prog = argv[0];
  __sanitizer_set_death_callback(DeathCallback);
  struct sigaction sa = {};
  sa.sa_sigaction = SegvHandler;
  sa.sa_flags = SA_SIGINFO;
  sigaction(SIGSEGV, &sa, &g_old_segv);
  g_api.struct_size = sizeof(XLA_FFI_Api);
  g_api.XLA_FFI_ThreadPool_Schedule = FakeSchedule;
  g_api.XLA_FFI_ThreadPool_NumThreads = FakeNumThreads;
  g_pool = new Pool(3);
  if (getenv("POOL_DELAY")) g_pool->delay = 1;
  if (argc > 1 && std::string(argv[1]) == "selftest") {
    // selftest [0|1|2]: 0 = unmasked vector overread of a malloc'd buffer (ASan must report);
    // 1 = masked load with one lane past the end, malloc (GCC's ASan does not see it);
    // 2 = the same on a guard-page allocation (must SIGSEGV).
    // 3 = two threads write one int unsynchronised (ThreadSanitizer must report).
    const int mode = argc > 2 ? atoi(argv[2]) : 0;
    if (mode == 3) {
      static int shared = 0;
      std::thread other([] { shared = 1; });
      shared = 2;
      other.join();
      printf("selftest: no report (%d)\n", shared);
      return 0;
    }
    Alloc a(4 * 17, mode == 2 ? 1 : 0);
    float* p = (float*)a.p;
#if defined(__AVX512F__)
    __m512 v = mode == 0 ? _mm512_loadu_ps(p + 8) : _mm512_maskz_loadu_ps((__mmask16)0x3ff, p + 8);
#else
    __m256 v = mode == 0 ? _mm256_loadu_ps(p + 12) : _mm256_maskload_ps(p + 12, FirstLanes(6));
#endif
    asm volatile("" : : "x"(v));
    printf("selftest: no report\n");
    return 0;
  }
  std::vector<Case> cs;
  Sweep(cs);
  std::string kernel = argc > 1 ? argv[1] : "";
  Params want;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    auto eq = a.find('=');
    if (eq == std::string::npos) { fprintf(stderr, "bad arg %s\n", a.c_str()); return 2; }
    want[a.substr(0, eq)] = std::stoll(a.substr(eq + 1));
  }
  bool exact = false;
  const char* sweep = getenv("SANITIZER_SWEEP");
  const bool threads_only = sweep != nullptr && std::string(sweep) == "threads";
  // SANITIZER_STRIDE=k: one case in k, for the secondary runs, which check code the full run
  // covers with other instructions or for races alone. Picked by a hash of the case's kernel and
  // parameters (not of the program's path, which its operands' seed includes: the same cases
  // wherever the binary runs), not every k-th case: the sweep's innermost loops have periods of 2
  // and 4 (the operands' data, the thread count), which a fixed stride would leave out whole.
  const char* stride_env = getenv("SANITIZER_STRIDE");
  const uint64_t stride = stride_env != nullptr && atol(stride_env) > 1 ? (uint64_t)atol(stride_env) : 1;
  for (const Case& c : cs) {
    if (!kernel.empty() && c.kernel != kernel) continue;
    if (threads_only && !MayRunOnSeveralThreads(c)) continue;
    if (kernel.empty() && stride > 1 && Mixed(Fnv1a(ParamString(c.kernel, c.p))) % stride != 0) continue;
    bool ok = true;
    for (auto& [k, v] : want) {
      auto it = c.p.find(k);
      if (it == c.p.end() || it->second != v) { ok = false; break; }
    }
    if (!ok) continue;
    if (want.size() == c.p.size()) exact = true;
    RunCase(c);
  }
  // A fully specified case not in the sweep: run it as given.
  if (!kernel.empty() && !exact && !want.empty() && g_cases == 0) RunCase({kernel, want});
  delete g_pool;
  printf("%s: %ld cases, %ld mismatches, %ld on several threads, bf16 path now %d\n", argv[0], (long)g_cases,
         (long)g_fail, (long)g_parallel, g_bf16_path.load());
  return g_fail ? 1 : 0;
}
