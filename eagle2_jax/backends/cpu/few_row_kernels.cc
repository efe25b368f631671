// Few-row float32 matmul (and, at the end, attention) for XLA:CPU, registered
// as XLA FFI custom calls.
//
// Speculative decoding on a CPU verifies a handful of token rows per step.
// XLA:CPU's dot runs 1 row as a memory-bound matrix-vector product but 2-16
// rows through a general GEMM that costs nearly twice as much per weight
// byte.  These kernels stream each weight exactly once for up to kMaxRows
// rows, so checking a small tree costs little more than decoding one token.
//
// Every output element is summed in the same order whatever the number of
// rows, so a row's result does not depend on what else is in the batch.
//
//   y[M, N] = x[M, K] @ w[K, N]      ("nn": a Dense kernel, [in, out])
//   y[M, N] = x[M, K] @ w[N, K]^T    ("nt": a tied embedding as LM head)
//
// Weights and caches may carry a leading layer axis (the model's stacked
// layers): the scalar `layer` operand picks the slice, read in place, so a
// scan over layers never copies a layer's weights out of the stack.
//
// Work is split over column blocks and shared with XLA's intra-op thread
// pool; the calling thread takes blocks too, so the call finishes even when
// no pool thread is free.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>
#include <cstdint>
#include <cstring>
#include <memory>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

// Offset of slice `layer` in a buffer whose rank is `rank` + 1 (stacked) or
// `rank` (one layer, layer must be 0); -1 when the rank or index is wrong.
template <typename Dims>
int64_t LayerOffset(const Dims& dims, size_t rank, int32_t layer, int64_t count) {
  if (dims.size() == rank) return layer == 0 ? 0 : -1;
  if (dims.size() != rank + 1 || layer < 0 || layer >= dims[0] || dims[0] == 0) return -1;
  return count / dims[0] * layer;
}

// Vector width and k-blocking follow the ISA -march=native compiled for:
// 16 floats and 16 k per pass with AVX-512 (32 vector registers); 8 and 8
// with AVX2 (16 registers), where 64-byte vectors split in two and spill
// (measured on an AVX2-only EPYC: 4 rows 66 ms with 16/16, 29 ms with 8/8;
// scripts/bench_few_row_matmul.py).  -DE2_LANES= / -DE2_KB= override.
#if defined(__AVX512F__)
#define E2_DEFAULT_LANES 16
#define E2_DEFAULT_KB 16
#else
#define E2_DEFAULT_LANES 8
#define E2_DEFAULT_KB 8
#endif
#ifndef E2_LANES
#define E2_LANES E2_DEFAULT_LANES
#endif
#ifndef E2_KB
#define E2_KB E2_DEFAULT_KB
#endif
constexpr int kLanes = E2_LANES;  // floats per vector
constexpr int kMaxRows = 8;    // rows per pass over the weights (nn)
constexpr int kMaxRowsNT = 8;  // rows per pass over the weights (nt)
constexpr int kKB = E2_KB;     // k per pass over the nn accumulators
#ifndef E2_KBQ
#define E2_KBQ 8
#endif
constexpr int kKBQ = E2_KBQ;   // k per pass over the q4 accumulators (a divisor of 32)
constexpr int kBlocksPerThread = 1;  // finer blocks measured slower
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof(v)); }
inline vec splat(float s) { return vec{} + s; }

// a * b + c, fused where the ISA has it.  The matmuls accumulate only through
// these, so the float32 and the quantised kernels round alike whatever the
// compiler would contract on its own.
inline vec fmadd(vec a, vec b, vec c) {
#if defined(__AVX512F__) && E2_LANES == 16
  return (vec)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__) && E2_LANES == 8
  return (vec)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}
inline float fmadd(float a, float b, float c) {
#if defined(__FMA__) || defined(__AVX512F__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// nn: columns [c0, c1) of y for rows [0, R), R <= kMaxRows.  Accumulates
// over k in ascending order (kKB of k per pass over the accumulators).
template <int R>
void nn_cols(const float* x, const float* w, float* y, int64_t K, int64_t N,
             int64_t c0, int64_t c1) {
  const int64_t vend = c0 + (c1 - c0) / kLanes * kLanes;
  for (int r = 0; r < R; ++r) std::memset(y + r * N + c0, 0, (c1 - c0) * sizeof(float));
  int64_t k = 0;
  for (; k + kKB <= K; k += kKB) {
    vec xb[R][kKB];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < kKB; ++i) xb[r][i] = splat(x[r * K + k + i]);
    const float* w0 = w + k * N;
    for (int64_t c = c0; c < vend; c += kLanes) {
      vec a[kKB];
      for (int i = 0; i < kKB; ++i) a[i] = load(w0 + i * N + c);
      for (int r = 0; r < R; ++r) {
        vec acc = load(y + r * N + c);
        for (int i = 0; i < kKB; ++i) acc = fmadd(xb[r][i], a[i], acc);
        store(y + r * N + c, acc);
      }
    }
    for (int64_t c = vend; c < c1; ++c)
      for (int r = 0; r < R; ++r) {
        float acc = y[r * N + c];
        for (int i = 0; i < kKB; ++i) acc = fmadd(x[r * K + k + i], w0[i * N + c], acc);
        y[r * N + c] = acc;
      }
  }
  for (; k < K; ++k)  // the same vector / scalar split of columns as above
    for (int r = 0; r < R; ++r) {
      const vec xr = splat(x[r * K + k]);
      for (int64_t c = c0; c < vend; c += kLanes)
        store(y + r * N + c, fmadd(xr, load(w + k * N + c), load(y + r * N + c)));
      for (int64_t c = vend; c < c1; ++c) y[r * N + c] = fmadd(x[r * K + k], w[k * N + c], y[r * N + c]);
    }
}

inline float hsum(vec v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// nt: columns [c0, c1) of y for rows [0, R), w rows are contiguous over K.
// G weight rows at a time (R x G accumulators in registers: 4 up to 4 rows,
// fewer past that); lane-wise partial sums over k, then a fixed horizontal
// sum, then the scalar tail of K.  An element's sum does not depend on G or
// R.  W gives the weights: a vector w[c, k..k+kLanes) by wv(c, k) and a
// scalar by ws(c, k); the float32 and the Q8_0 kernels share this code, so
// they add their products the same way.
template <int R>
constexpr int nt_group() {
  return R <= 4 ? 4 : (kLanes == 16 ? 2 : 1);  // AVX-512 has 32 vector registers, AVX2 16
}

template <int R, int G, class W>
inline void nt_group_cols(const float* x, const W& w, float* y, int64_t K, int64_t N, int64_t c) {
  const int64_t kv = K / kLanes * kLanes;
  vec acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < G; ++j) acc[r][j] = vec{};
  for (int64_t k = 0; k < kv; k += kLanes) {
    vec b[G];
    for (int j = 0; j < G; ++j) b[j] = w.wv(c + j, k);
    for (int r = 0; r < R; ++r) {
      const vec xr = load(x + r * K + k);
      for (int j = 0; j < G; ++j) acc[r][j] = fmadd(xr, b[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < G; ++j) {
      float s = hsum(acc[r][j]);
      for (int64_t k = kv; k < K; ++k) s = fmadd(x[r * K + k], w.ws(c + j, k), s);
      y[r * N + c + j] = s;
    }
}

template <int R, class W>
void nt_cols_of(const float* x, const W& w, float* y, int64_t K, int64_t N, int64_t c0, int64_t c1) {
  constexpr int G = nt_group<R>();
  int64_t c = c0;
  for (; c + G <= c1; c += G) nt_group_cols<R, G>(x, w, y, K, N, c);
  for (; c < c1; ++c) nt_group_cols<R, 1>(x, w, y, K, N, c);
}

struct F32Rows {
  const float* w;
  int64_t K;
  vec wv(int64_t c, int64_t k) const { return load(w + c * K + k); }
  float ws(int64_t c, int64_t k) const { return w[c * K + k]; }
};

template <int R>
void nt_cols(const float* x, const float* w, float* y, int64_t K, int64_t N,
             int64_t c0, int64_t c1) {
  nt_cols_of<R>(x, F32Rows{w, K}, y, K, N, c0, c1);
}

using ColsFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);

template <int R>
struct NN {
  static constexpr ColsFn fn = nn_cols<R>;
  static constexpr int max_rows = kMaxRows;
};
template <int R>
struct NT {
  static constexpr ColsFn fn = nt_cols<R>;
  static constexpr int max_rows = kMaxRowsNT;
};

template <template <int> class Kernel>
ColsFn pick(int rows) {
  switch (rows) {
    case 1: return Kernel<1>::fn;
    case 2: return Kernel<2>::fn;
    case 3: return Kernel<3>::fn;
    case 4: return Kernel<4>::fn;
  }
  switch (rows) {
    case 5: return Kernel<5>::fn;
    case 6: return Kernel<6>::fn;
    case 7: return Kernel<7>::fn;
    default: return Kernel<8>::fn;
  }
}

// Takes column blocks until none is left (Job and QJob: caller and pool tasks).
template <class J>
void run_blocks(J& job) {
  for (int64_t b; (b = job.next.fetch_add(1)) < job.num_blocks;) {
    job.run_block(b);
    job.done.fetch_add(1, std::memory_order_release);
  }
}

// Splits N columns into about kBlocksPerThread blocks per thread, each a whole number of `unit`s.
template <class J>
void plan_blocks(J& job, int64_t N, int64_t unit, int64_t threads) {
  const int64_t units = (N + unit - 1) / unit;
  const int64_t want = std::min<int64_t>(units, kBlocksPerThread * threads);
  job.block = (units + want - 1) / want * unit;
  job.num_blocks = (N + job.block - 1) / job.block;
}

// Shared by the caller and the pool tasks; outlives the call if a task
// starts late (it then finds no block left and only drops its reference).
struct Job {
  const float* x;
  const float* w;
  float* y;
  int64_t M, K, N, block;
  bool nt;
  int64_t num_blocks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void run_block(int64_t b) {
    const int64_t c0 = b * block, c1 = std::min(N, c0 + block);
    const int max_rows = nt ? kMaxRowsNT : kMaxRows;
    for (int64_t r0 = 0; r0 < M; r0 += max_rows) {
      const int rows = static_cast<int>(std::min<int64_t>(max_rows, M - r0));
      ColsFn fn = nt ? pick<NT>(rows) : pick<NN>(rows);
      fn(x + r0 * K, w, y + r0 * N, K, N, c0, c1);
    }
  }
  void work() { run_blocks(*this); }
};

// Runs job->work() on the calling thread and on up to threads - 1 pool
// threads, then waits until all `units` are done.  A helper that starts late
// finds no unit left and only drops its reference to the job.
template <class W>
void share_work(ffi::ThreadPool& pool, const std::shared_ptr<W>& job, int64_t threads, int64_t units) {
  const int64_t helpers = std::min<int64_t>(threads, units) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->done.load(std::memory_order_acquire) < units) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
}

ffi::Error FewRowMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                        ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> layer,
                        ffi::ResultBuffer<ffi::F32> y, bool transpose_w) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const int64_t off = LayerOffset(wd, 2, layer.typed_data()[0], w.element_count());
  if (off < 0 || xd.size() < 1)
    return ffi::Error::InvalidArgument("few_row_matmul: w must be 2-D (or stacked 3-D with a valid layer) and x at least 1-D");
  const size_t r = wd.size() - 2;
  const int64_t K = xd.back();
  const int64_t M = K ? static_cast<int64_t>(x.element_count()) / K : 0;
  const int64_t N = transpose_w ? wd[r] : wd[r + 1];
  if ((transpose_w ? wd[r + 1] : wd[r]) != K)
    return ffi::Error::InvalidArgument("few_row_matmul: contraction sizes differ");
  if (static_cast<int64_t>(y->element_count()) != M * N)
    return ffi::Error::InvalidArgument("few_row_matmul: output size is not M x N");
  if (M == 0 || N == 0) return ffi::Error::Success();

  auto job = std::make_shared<Job>();
  job->x = x.typed_data();
  job->w = w.typed_data() + off;
  job->y = y->typed_data();
  job->M = M;
  job->K = K;
  job->N = N;
  job->nt = transpose_w;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // whole vectors (nn) or groups of 4 rows (nt)
  plan_blocks(*job, N, transpose_w ? 4 : kLanes, threads);
  share_work(pool, job, threads, job->num_blocks);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// The same matmuls over weights kept in the GGUF's block quantisation, each
// weight dequantised in registers to exactly the float32 value the loader's
// numpy dequantisation gives, then summed in the order nn_cols / nt_cols use:
// a row's result is bit-identical to the float32 kernel's on the dequantised
// weights, while a pass reads 5-6 bits per weight instead of 32.
//
//   Q4_1, nn  w[k, c] = d[k/32, c] * q[k, c] + m[k/32, c]   (product rounded, then the sum)
//     q4 [K, N/2] uint8: per group of 2L columns c0.., byte c0/2 + i holds
//     column c0 + i (low nibble) and c0 + L + i (high nibble), L = kLanes
//   Q8_0, nt  w[c, k] = d[c, k/32] * q[c, k]                 (exact in float32)
typedef uint8_t bytes __attribute__((vector_size(kLanes)));
typedef int32_t ivec __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef int8_t sbytes __attribute__((vector_size(kLanes)));

// kLanes bytes at p widened to 32-bit lanes (one vpmovzxbd / vpmovsxbd
// where the ISA has it; GCC's generic conversion goes byte by byte).
inline ivec widen(const uint8_t* p) {
#if defined(__AVX512F__) && E2_LANES == 16
  return (ivec)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__) && E2_LANES == 8
  return (ivec)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  bytes b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, ivec);
#endif
}
inline ivec widen(const int8_t* p) {
#if defined(__AVX512F__) && E2_LANES == 16
  return (ivec)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__) && E2_LANES == 8
  return (ivec)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  sbytes b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, ivec);
#endif
}

// d * q + m with the product rounded on its own (no fused multiply-add).
inline vec dq(vec d, vec q, vec m) {
  vec p = d * q;
  asm("" : "+x"(p));
  return p + m;
}

template <int R>
void nn_q4_cols(const float* x, const uint8_t* q4, const float* d, const float* m, float* y,
                int64_t K, int64_t N, int64_t c0, int64_t c1) {
  // c0, c1 multiples of 2 * kLanes; K a multiple of 32 (checked by the caller)
  for (int r = 0; r < R; ++r) std::memset(y + r * N + c0, 0, (c1 - c0) * sizeof(float));
  for (int64_t k = 0; k < K; k += kKBQ) {
    vec xb[R][kKBQ];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < kKBQ; ++i) xb[r][i] = splat(x[r * K + k + i]);
    const float* dk = d + (k / 32) * N;
    const float* mk = m + (k / 32) * N;
    for (int64_t c = c0; c < c1; c += 2 * kLanes) {
      const vec dl = load(dk + c), dh = load(dk + c + kLanes);
      const vec ml = load(mk + c), mh = load(mk + c + kLanes);
      vec lo[kKBQ], hi[kKBQ];
      for (int i = 0; i < kKBQ; ++i) {
        const ivec v = widen(q4 + (k + i) * (N / 2) + c / 2);
        lo[i] = dq(dl, __builtin_convertvector(v & 15, vec), ml);
        hi[i] = dq(dh, __builtin_convertvector(v >> 4, vec), mh);
      }
      for (int r = 0; r < R; ++r) {
        vec al = load(y + r * N + c), ah = load(y + r * N + c + kLanes);
        for (int i = 0; i < kKBQ; ++i) {
          al = fmadd(xb[r][i], lo[i], al);
          ah = fmadd(xb[r][i], hi[i], ah);
        }
        store(y + r * N + c, al);
        store(y + r * N + c + kLanes, ah);
      }
    }
  }
}

// Q8_0 rows for nt_cols_of; the products d * q are exact in float32.
struct Q8Rows {
  const int8_t* q;
  const float* d;
  int64_t K;
  vec wv(int64_t c, int64_t k) const {
    return splat(d[c * (K / 32) + k / 32]) * __builtin_convertvector(widen(q + c * K + k), vec);
  }
  float ws(int64_t c, int64_t k) const { return d[c * (K / 32) + k / 32] * q[c * K + k]; }
};

template <int R>
void nt_q8_cols(const float* x, const int8_t* q8, const float* d, float* y, int64_t K, int64_t N,
                int64_t c0, int64_t c1) {
  nt_cols_of<R>(x, Q8Rows{q8, d, K}, y, K, N, c0, c1);
}

using Q4Fn = void (*)(const float*, const uint8_t*, const float*, const float*, float*, int64_t,
                      int64_t, int64_t, int64_t);
using Q8Fn = void (*)(const float*, const int8_t*, const float*, float*, int64_t, int64_t, int64_t,
                      int64_t);

template <int R>
struct NNQ4 {
  static constexpr Q4Fn fn = nn_q4_cols<R>;
};
template <int R>
struct NTQ8 {
  static constexpr Q8Fn fn = nt_q8_cols<R>;
};

template <template <int> class Kernel, class Fn>
Fn pick_q(int rows) {
  switch (rows) {
    case 1: return Kernel<1>::fn;
    case 2: return Kernel<2>::fn;
    case 3: return Kernel<3>::fn;
    case 4: return Kernel<4>::fn;
    case 5: return Kernel<5>::fn;
    case 6: return Kernel<6>::fn;
    case 7: return Kernel<7>::fn;
    default: return Kernel<8>::fn;
  }
}

struct QJob {
  const float* x;
  const void* q;
  const float *d, *m;
  float* y;
  int64_t M, K, N, block, num_blocks;
  bool nt;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void run_block(int64_t b) {
    const int64_t c0 = b * block, c1 = std::min(N, c0 + block);
    const int max_rows = nt ? kMaxRowsNT : kMaxRows;
    for (int64_t r0 = 0; r0 < M; r0 += max_rows) {
      const int rows = static_cast<int>(std::min<int64_t>(max_rows, M - r0));
      if (nt)
        pick_q<NTQ8, Q8Fn>(rows)(x + r0 * K, static_cast<const int8_t*>(q), d, y + r0 * N, K, N, c0, c1);
      else
        pick_q<NNQ4, Q4Fn>(rows)(x + r0 * K, static_cast<const uint8_t*>(q), d, m, y + r0 * N, K, N, c0, c1);
    }
  }
  void work() { run_blocks(*this); }
};

ffi::Error QuantMatmul(ffi::ThreadPool& pool, const float* x, const void* q, const float* d,
                       const float* m, float* y, int64_t M, int64_t K, int64_t N, bool nt) {
  if (M == 0 || N == 0) return ffi::Error::Success();
  auto job = std::make_shared<QJob>();
  job->x = x; job->q = q; job->d = d; job->m = m; job->y = y;
  job->M = M; job->K = K; job->N = N; job->nt = nt;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  plan_blocks(*job, N, nt ? 4 : 2 * kLanes, threads);
  share_work(pool, job, threads, job->num_blocks);
  return ffi::Error::Success();
}

// x [..., K] @ w[K, N], w as q4 [K, N/2], d and m [K/32, N]
ffi::Error Q4Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q4,
                    ffi::Buffer<ffi::F32> d, ffi::Buffer<ffi::F32> m, ffi::Buffer<ffi::S32> layer,
                    ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), qd = q4.dimensions();
  const int32_t l = layer.typed_data()[0];
  const int64_t off = LayerOffset(qd, 2, l, q4.element_count());
  const int64_t doff = LayerOffset(d.dimensions(), 2, l, d.element_count());
  const int64_t moff = LayerOffset(m.dimensions(), 2, l, m.element_count());
  if (off < 0 || doff < 0 || moff < 0 || xd.size() < 1)
    return ffi::Error::InvalidArgument("q4_matmul: q4, d, m must be 2-D (or stacked 3-D with a valid layer) and x at least 1-D");
  const size_t r = qd.size() - 2;
  const int64_t K = xd.back(), N = 2 * qd[r + 1];
  const int64_t M = K ? static_cast<int64_t>(x.element_count()) / K : 0;
  const int64_t slices = qd.size() == 3 ? qd[0] : 1;
  if (qd[r] != K || K % 32 || N % (2 * kLanes))
    return ffi::Error::InvalidArgument("q4_matmul: K must match and be a multiple of 32, N of 2 x lanes");
  if (static_cast<int64_t>(d.element_count()) != slices * (K / 32) * N ||
      static_cast<int64_t>(m.element_count()) != slices * (K / 32) * N ||
      static_cast<int64_t>(y->element_count()) != M * N)
    return ffi::Error::InvalidArgument("q4_matmul: scale or output sizes do not agree");
  return QuantMatmul(pool, x.typed_data(), q4.typed_data() + off, d.typed_data() + doff,
                     m.typed_data() + moff, y->typed_data(), M, K, N, false);
}

// x [..., K] @ w[N, K]^T, w as q8 [N, K] int8 and d [N, K/32]
ffi::Error Q8MatmulNT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q8,
                      ffi::Buffer<ffi::F32> d, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), qd = q8.dimensions();
  if (qd.size() != 2 || xd.size() < 1)
    return ffi::Error::InvalidArgument("q8_matmul_nt: q8 must be 2-D and x at least 1-D");
  const int64_t K = xd.back(), N = qd[0];
  const int64_t M = K ? static_cast<int64_t>(x.element_count()) / K : 0;
  if (qd[1] != K || K % 32 || K % kLanes)
    return ffi::Error::InvalidArgument("q8_matmul_nt: K must match and be a multiple of 32 and of lanes");
  if (static_cast<int64_t>(d.element_count()) != N * (K / 32) ||
      static_cast<int64_t>(y->element_count()) != M * N)
    return ffi::Error::InvalidArgument("q8_matmul_nt: scale or output sizes do not agree");
  return QuantMatmul(pool, x.typed_data(), q8.typed_data(), d.typed_data(), nullptr,
                     y->typed_data(), M, K, N, true);
}

// ---------------------------------------------------------------------------
// Attention of a few new tokens over a KV cache (eagle2_jax.cpu.ops.CpuOps.attend).
//
//   q    [B, K, M, Dh]  M = G * T query rows per KV head, row m = g * T + t
//   kc/vc [B, K, S, Dh] the cache as it was; mask [B, T, S]
//   kn/vn [B, K, T, Dh] this call's keys/values; mask_new [B, T, T]
//   out  [B, K, M, Dh]
//
// Only unmasked slots are read.  Each row's scores, maximum, exponentials
// and sums run over its unmasked keys in one fixed order (cache slots
// ascending, then the new keys ascending), so a row's result depends on
// which keys it sees and never on how many other rows or padded slots the
// call holds.  A row that sees no key gets zeros.
struct AttnJob {
  const float *q, *kc, *vc, *kn, *vn;
  const bool *mask, *mask_new;
  float* out;
  int64_t B, K, M, S, T, Dh, G;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  static float dot(const float* a, const float* b, int64_t n) {
    const int64_t nv = n / kLanes * kLanes;
    vec acc = vec{};
    for (int64_t i = 0; i < nv; i += kLanes) acc += load(a + i) * load(b + i);
    float s = hsum(acc);
    for (int64_t i = nv; i < n; ++i) s += a[i] * b[i];
    return s;
  }
  static void axpy(float p, const float* x, float* y, int64_t n) {
    const int64_t nv = n / kLanes * kLanes;
    const vec pv = splat(p);
    for (int64_t i = 0; i < nv; i += kLanes) store(y + i, load(y + i) + pv * load(x + i));
    for (int64_t i = nv; i < n; ++i) y[i] += p * x[i];
  }

  // item = (b, k, t): the G query rows of token t on KV head k
  void run_item(int64_t item, std::vector<float>& sc, std::vector<float>& acc) {
    const int64_t t = item % T, bk = item / T, b = bk / K;
    const bool* mrow = mask + (b * T + t) * S;
    const bool* nrow = mask_new + (b * T + t) * T;
    const float* kcb = kc + bk * S * Dh;
    const float* vcb = vc + bk * S * Dh;
    const float* knb = kn + bk * T * Dh;
    const float* vnb = vn + bk * T * Dh;
    const int64_t L = S + T;
    sc.assign(G * L, 0.f);
    acc.assign(G * Dh, 0.f);
    for (int64_t g = 0; g < G; ++g) {
      const float* qr = q + (bk * M + g * T + t) * Dh;
      float* o = out + (bk * M + g * T + t) * Dh;
      float* s = sc.data() + g * L;
      float* a = acc.data() + g * Dh;
      float mx = -INFINITY;
      bool any = false;
      for (int64_t j = 0; j < S; ++j)
        if (mrow[j]) { s[j] = dot(qr, kcb + j * Dh, Dh); mx = std::max(mx, s[j]); any = true; }
      for (int64_t u = 0; u < T; ++u)
        if (nrow[u]) { s[S + u] = dot(qr, knb + u * Dh, Dh); mx = std::max(mx, s[S + u]); any = true; }
      if (!any) {
        std::memset(o, 0, Dh * sizeof(float));
        continue;
      }
      float sum = 0.f;
      for (int64_t j = 0; j < S; ++j)
        if (mrow[j]) { const float p = std::exp(s[j] - mx); sum += p; axpy(p, vcb + j * Dh, a, Dh); }
      for (int64_t u = 0; u < T; ++u)
        if (nrow[u]) { const float p = std::exp(s[S + u] - mx); sum += p; axpy(p, vnb + u * Dh, a, Dh); }
      for (int64_t d = 0; d < Dh; ++d) o[d] = a[d] / sum;
    }
  }
  void work() {
    std::vector<float> sc, acc;
    const int64_t items = B * K * T;
    for (int64_t i; (i = next.fetch_add(1)) < items;) {
      run_item(i, sc, acc);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error FewRowAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kc,
                           ffi::Buffer<ffi::F32> vc, ffi::Buffer<ffi::PRED> mask,
                           ffi::Buffer<ffi::F32> kn, ffi::Buffer<ffi::F32> vn,
                           ffi::Buffer<ffi::PRED> mask_new, ffi::Buffer<ffi::S32> layer,
                           ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), cdl = kc.dimensions(), nd = kn.dimensions();
  const int64_t off = LayerOffset(cdl, 4, layer.typed_data()[0], kc.element_count());
  if (qd.size() != 4 || off < 0 || nd.size() != 4 || vc.dimensions().size() != cdl.size())
    return ffi::Error::InvalidArgument("few_row_attention: q and new keys must be 4-D, caches 4-D or stacked 5-D with a valid layer");
  const int64_t cd[4] = {cdl[cdl.size() - 4], cdl[cdl.size() - 3], cdl[cdl.size() - 2], cdl[cdl.size() - 1]};
  auto job = std::make_shared<AttnJob>();
  job->B = qd[0]; job->K = qd[1]; job->M = qd[2]; job->Dh = qd[3];
  job->S = cd[2]; job->T = nd[2];
  if (job->T == 0 || job->M % job->T)
    return ffi::Error::InvalidArgument("few_row_attention: query rows are not a multiple of new tokens");
  job->G = job->M / job->T;
  if (cd[0] != job->B || cd[1] != job->K || cd[3] != job->Dh || nd[0] != job->B || nd[1] != job->K ||
      nd[3] != job->Dh || static_cast<int64_t>(mask.element_count()) != job->B * job->T * job->S ||
      static_cast<int64_t>(mask_new.element_count()) != job->B * job->T * job->T ||
      vc.element_count() != kc.element_count() || vn.element_count() != kn.element_count())
    return ffi::Error::InvalidArgument("few_row_attention: shapes do not agree");
  job->q = q.typed_data(); job->kc = kc.typed_data() + off; job->vc = vc.typed_data() + off;
  job->kn = kn.typed_data(); job->vn = vn.typed_data();
  job->mask = mask.typed_data(); job->mask_new = mask_new.typed_data();
  job->out = out->typed_data();
  const int64_t items = job->B * job->K * job->T;
  if (items == 0) return ffi::Error::Success();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  share_work(pool, job, threads, items);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(eagle2_few_row_matmul, FewRowMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("transpose_w"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(eagle2_few_row_attention, FewRowAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(eagle2_q4_matmul, Q4Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(eagle2_q8_matmul_nt, Q8MatmulNT,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The vector width this build packs Q4 columns by (eagle2_jax.cpu.packed).
extern "C" int eagle2_lanes() { return kLanes; }
