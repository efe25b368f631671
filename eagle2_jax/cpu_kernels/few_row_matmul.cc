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

namespace ffi = xla::ffi;

namespace {

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
constexpr int kMaxRowsNT = 4;  // rows per pass over the weights (nt)
constexpr int kKB = E2_KB;     // k per pass over the nn accumulators
constexpr int kBlocksPerThread = 1;  // finer blocks measured slower
typedef float vec __attribute__((vector_size(kLanes * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof(v)); }
inline vec splat(float s) { return vec{} + s; }

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
        for (int i = 0; i < kKB; ++i) acc += xb[r][i] * a[i];
        store(y + r * N + c, acc);
      }
    }
    for (int64_t c = vend; c < c1; ++c)
      for (int r = 0; r < R; ++r) {
        float acc = y[r * N + c];
        for (int i = 0; i < kKB; ++i) acc += x[r * K + k + i] * w0[i * N + c];
        y[r * N + c] = acc;
      }
  }
  for (; k < K; ++k)  // the same vector / scalar split of columns as above
    for (int r = 0; r < R; ++r) {
      const vec xr = splat(x[r * K + k]);
      for (int64_t c = c0; c < vend; c += kLanes)
        store(y + r * N + c, load(y + r * N + c) + xr * load(w + k * N + c));
      for (int64_t c = vend; c < c1; ++c) y[r * N + c] += x[r * K + k] * w[k * N + c];
    }
}

inline float hsum(vec v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// nt: columns [c0, c1) of y for rows [0, R), w rows are contiguous over K.
// Four weight rows at a time; lane-wise partial sums over k, then a fixed
// horizontal sum, then the scalar tail of K.
template <int R>
void nt_cols(const float* x, const float* w, float* y, int64_t K, int64_t N,
             int64_t c0, int64_t c1) {
  const int64_t kv = K / kLanes * kLanes;
  int64_t c = c0;
  for (; c + 4 <= c1; c += 4) {
    vec acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = vec{};
    const float* wr = w + c * K;
    for (int64_t k = 0; k < kv; k += kLanes) {
      const vec b0 = load(wr + k), b1 = load(wr + K + k), b2 = load(wr + 2 * K + k),
                b3 = load(wr + 3 * K + k);
      for (int r = 0; r < R; ++r) {
        const vec xr = load(x + r * K + k);
        acc[r][0] += xr * b0;
        acc[r][1] += xr * b1;
        acc[r][2] += xr * b2;
        acc[r][3] += xr * b3;
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) {
        float s = hsum(acc[r][j]);
        for (int64_t k = kv; k < K; ++k) s += x[r * K + k] * wr[j * K + k];
        y[r * N + c + j] = s;
      }
  }
  for (; c < c1; ++c)
    for (int r = 0; r < R; ++r) {
      vec acc = vec{};
      for (int64_t k = 0; k < kv; k += kLanes) acc += load(x + r * K + k) * load(w + c * K + k);
      float s = hsum(acc);
      for (int64_t k = kv; k < K; ++k) s += x[r * K + k] * w[c * K + k];
      y[r * N + c] = s;
    }
}

using ColsFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);

template <int R>
struct NN {
  static constexpr ColsFn fn = nn_cols<R>;
  static constexpr int max_rows = kMaxRows;
};
template <int R>
struct NT {
  static constexpr ColsFn fn = nt_cols<R < 4 ? R : 4>;
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
  void work() {
    for (int64_t b; (b = next.fetch_add(1)) < num_blocks;) {
      run_block(b);
      done.fetch_add(1, std::memory_order_release);
    }
  }
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
                        ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y,
                        bool transpose_w) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (wd.size() != 2 || xd.size() < 1)
    return ffi::Error::InvalidArgument("few_row_matmul: w must be 2-D and x at least 1-D");
  const int64_t K = xd.back();
  const int64_t M = K ? static_cast<int64_t>(x.element_count()) / K : 0;
  const int64_t N = transpose_w ? wd[0] : wd[1];
  if ((transpose_w ? wd[1] : wd[0]) != K)
    return ffi::Error::InvalidArgument("few_row_matmul: contraction sizes differ");
  if (static_cast<int64_t>(y->element_count()) != M * N)
    return ffi::Error::InvalidArgument("few_row_matmul: output size is not M x N");
  if (M == 0 || N == 0) return ffi::Error::Success();

  auto job = std::make_shared<Job>();
  job->x = x.typed_data();
  job->w = w.typed_data();
  job->y = y->typed_data();
  job->M = M;
  job->K = K;
  job->N = N;
  job->nt = transpose_w;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // Several blocks per thread (late helpers still get a share), whole vectors (nn) or groups of 4 rows (nt).
  const int64_t unit = transpose_w ? 4 : kLanes;
  const int64_t units = (N + unit - 1) / unit;
  const int64_t want = std::min<int64_t>(units, kBlocksPerThread * threads);
  job->block = (units + want - 1) / want * unit;
  job->num_blocks = (N + job->block - 1) / job->block;
  share_work(pool, job, threads, job->num_blocks);
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------
// Attention of a few new tokens over a KV cache (eagle2_jax.layers.attend).
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
                           ffi::Buffer<ffi::PRED> mask_new, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), cd = kc.dimensions(), nd = kn.dimensions();
  if (qd.size() != 4 || cd.size() != 4 || nd.size() != 4)
    return ffi::Error::InvalidArgument("few_row_attention: q, caches and new keys must be 4-D");
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
  job->q = q.typed_data(); job->kc = kc.typed_data(); job->vc = vc.typed_data();
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
                                  .Ret<ffi::Buffer<ffi::F32>>());
