// The model's elementwise steps fused into one pass each over a flat token batch, on a CPU: torch
// runs each as several operators, each a pass over memory and, below its grain size, one thread.
// Arithmetic in float32; each result is rounded to the tensor's dtype where transformers rounds it,
// so float32 runs compute what transformers does up to the order of a sum. Also the sampler's row argmax,
// which torch runs 3-7x slower than a max. Loaded by models/cpu_ops.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "fast_exp.h"

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

// Rows per parallel task: about 16k elements, so a decode step's few rows still split across threads
// only when there is enough work to pay for the wake-up.
inline int64_t grain(int64_t row) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row, 1)); }

using servelab::fast_exp;

template <typename T>
void rms_norm_rows(const T* __restrict__ in, const T* __restrict__ w, T* __restrict__ out, int64_t rows,
                   int64_t n, int64_t in_stride, int64_t out_stride, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = in + r * in_stride;
    float ss = 0.f;
    for (int64_t i = 0; i < n; ++i) ss += to_float(x[i]) * to_float(x[i]);
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    T* y = out + r * out_stride;
    // transformers: weight * (x * rsqrt(...)).to(dtype)
    for (int64_t i = 0; i < n; ++i) y[i] = round_to<T>(to_float(w[i]) * to_float(round_to<T>(to_float(x[i]) * inv)));
  }
}

template <typename T>
void rms_norm_impl(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& out, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    rms_norm_rows(xp + begin * xs, wp, op + begin * os, end - begin, n, xs, os, static_cast<float>(eps));
  });
}

template <typename T>
void add_rms_norm_impl(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& w, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* res = rp + r * rs;
      const T* xr = xp + r * xs;
      for (int64_t i = 0; i < n; ++i) res[i] = round_to<T>(to_float(res[i]) + to_float(xr[i]));
      rms_norm_rows(res, wp, xp + r * xs, 1, n, rs, xs, static_cast<float>(eps));
    }
  });
}

// Sets the calling thread's float results below the normal range to zero while it lives (x86; nothing
// elsewhere). GCC's vectorised SiLU evaluates fast_exp's clamped arm for every lane, g / (1 + e^88), which is
// below the normal range for |g| < 2: an Intel core takes a microcode assist per such result, 5x the loop's time.
class FlushToZero {
 public:
#if defined(__x86_64__) || defined(__i386__)
  FlushToZero() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | _MM_FLUSH_ZERO_ON); }
  ~FlushToZero() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

template <typename T>
void silu_and_mul_impl(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t rows = x.size(0), n = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, grain(2 * n), [&](int64_t begin, int64_t end) {
    // A result below float's normal range comes out 0, where torch's is a denormal.
    const FlushToZero flush;
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * xs;
      const T* up = gate + n;
      T* y = op + r * os;
      // transformers: silu(gate) * up, each rounded to the dtype
      for (int64_t i = 0; i < n; ++i) {
        const float g = to_float(gate[i]);
        y[i] = round_to<T>(to_float(round_to<T>(g / (1.f + fast_exp(-g)))) * to_float(up[i]));
      }
    }
  });
}

// Rotates a row's heads in transformers' "rotate half" convention into out, rounding as it does
// (x * cos and rotate_half(x) * sin each to the dtype, then their sum). kHalf > 0 fixes head_dim / 2 at
// compile time: over a run-time length GCC's bfloat16 loop took 10x float32's.
template <typename T, int kHalf>
inline void rotate_heads(const T* __restrict__ x, T* __restrict__ out, const T* __restrict__ cos,
                         const T* __restrict__ sin, int64_t heads, int64_t run_time_half) {
  const int64_t half = kHalf > 0 ? kHalf : run_time_half;
  for (int64_t h = 0; h < heads; ++h) {
    const T* x1 = x + h * 2 * half;
    const T* x2 = x1 + half;
    T* o1 = out + h * 2 * half;
    T* o2 = o1 + half;
    for (int64_t i = 0; i < half; ++i) {
      const float c = to_float(cos[i]), s = to_float(sin[i]), a = to_float(x1[i]), b = to_float(x2[i]);
      o1[i] = round_to<T>(to_float(round_to<T>(a * c)) + to_float(round_to<T>(-b * s)));
      o2[i] = round_to<T>(to_float(round_to<T>(b * c)) + to_float(round_to<T>(a * s)));
    }
  }
}

// Rotates q into q [T, H, D] and k into kv_rows(r).first, copies v to kv_rows(r).second ([KVH, D] each).
template <typename T, int kHalf, typename KVRows>
void qkv_rotary_rows(const torch::Tensor& qkv, const torch::Tensor& positions, const torch::Tensor& cos,
                     const torch::Tensor& sin, torch::Tensor& q, int64_t KVH, const KVRows& kv_rows) {
  const int64_t rows = qkv.size(0), H = q.size(1), D = q.size(2), half = D / 2;
  const T* xp = qkv.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* qp = q.data_ptr<T>();
  const int64_t xs = qkv.stride(0), cs = cos.stride(0);
  at::parallel_for(0, rows, grain(qkv.size(1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * xs;
      const T* c = cp + pos[r] * cs;
      const T* s = sp + pos[r] * cs;
      const auto [k, v] = kv_rows(r);
      rotate_heads<T, kHalf>(row, qp + r * H * D, c, s, H, half);
      rotate_heads<T, kHalf>(row + H * D, k, c, s, KVH, half);
      std::memcpy(v, row + (H + KVH) * D, KVH * D * sizeof(T));
    }
  });
}

template <typename T, typename KVRows>
void qkv_rotary_any_dim(const torch::Tensor& qkv, const torch::Tensor& positions, const torch::Tensor& cos,
                        const torch::Tensor& sin, torch::Tensor& q, int64_t KVH, const KVRows& kv_rows) {
  switch (q.size(2)) {
    case 32: qkv_rotary_rows<T, 16>(qkv, positions, cos, sin, q, KVH, kv_rows); break;
    case 64: qkv_rotary_rows<T, 32>(qkv, positions, cos, sin, q, KVH, kv_rows); break;
    case 128: qkv_rotary_rows<T, 64>(qkv, positions, cos, sin, q, KVH, kv_rows); break;
    default: qkv_rotary_rows<T, 0>(qkv, positions, cos, sin, q, KVH, kv_rows);
  }
}

template <typename T>
void qkv_rotary_impl(const torch::Tensor& qkv, const torch::Tensor& positions, const torch::Tensor& cos,
                     const torch::Tensor& sin, torch::Tensor& q, torch::Tensor& k, torch::Tensor& v) {
  T* kp = k.data_ptr<T>();
  T* vp = v.data_ptr<T>();
  const int64_t row = k.size(1) * k.size(2);
  qkv_rotary_any_dim<T>(qkv, positions, cos, sin, q, k.size(1), [=](int64_t r) {
    return std::pair<T*, T*>(kp + r * row, vp + r * row);
  });
}

template <typename T>
void qkv_rotary_into_cache_impl(const torch::Tensor& qkv, const torch::Tensor& positions, const torch::Tensor& cos,
                                const torch::Tensor& sin, torch::Tensor& q, torch::Tensor& k_cache,
                                torch::Tensor& v_cache, const torch::Tensor& slots) {
  T* kp = k_cache.data_ptr<T>();
  T* vp = v_cache.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t bs = k_cache.size(1), blk = k_cache.stride(0), tok = k_cache.stride(1);
  qkv_rotary_any_dim<T>(qkv, positions, cos, sin, q, k_cache.size(2), [=](int64_t r) {
    const int64_t at = slot[r] / bs * blk + slot[r] % bs * tok;
    return std::pair<T*, T*>(kp + at, vp + at);
  });
}

// Vectorisable: a max pass, then a scan for its first occurrence (torch.argmax's tie rule).
void argmax_rows_impl(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0);
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict__ row = xp + r * xs;
      float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
      for (int64_t i = 0; i < n; ++i) m = row[i] > m ? row[i] : m;
      // The first block of 64 holding m (a vector compare each), then its first element that is m.
      int64_t best = 0;
      for (; best < n; best += 64) {
        const int64_t stop = std::min(best + 64, n);
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t i = best; i < stop; ++i) hit |= row[i] == m;
        if (hit) break;
      }
      if (best >= n) {
        best = 0;  // nothing equals m: the row holds NaNs only, and torch picks the first
      } else {
        while (!(row[best] == m)) ++best;  // within the block found
      }
      op[r] = best;
    }
  });
}

template <typename F>
void dispatch(at::ScalarType dtype, const char* op, F&& f) {
  switch (dtype) {
    case torch::kFloat: f(float{}); break;
    case torch::kBFloat16: f(c10::BFloat16{}); break;
    case torch::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, op, " supports float32, bfloat16 and float16, got ", dtype);
  }
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

// What both RoPE operators read: qkv [T, (H + 2 KVH) D] with contiguous rows, q [T, H, D] contiguous, positions
// [T] int64 each a row of cos and sin [max_positions, D / 2], all in qkv's dtype but positions.
void check_rotary(const torch::Tensor& qkv, const torch::Tensor& positions, const torch::Tensor& cos,
                  const torch::Tensor& sin, const torch::Tensor& q, int64_t kv_heads) {
  check_rows(qkv, "qkv");
  const int64_t rows = qkv.size(0);
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.size(0) == rows && q.scalar_type() == qkv.scalar_type() &&
              q.size(2) % 2 == 0, "q must be contiguous [T, H, D] in qkv's dtype, D even");
  TORCH_CHECK(qkv.size(1) == (q.size(1) + 2 * kv_heads) * q.size(2), "qkv must hold q, k and v");
  TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.is_contiguous() && positions.dim() == 1 &&
              positions.size(0) == rows, "positions must be contiguous int64 [T]");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.stride(1) == 1 && sin.stride(1) == 1 &&
              cos.stride(0) == sin.stride(0) && cos.size(1) == q.size(2) / 2 && cos.scalar_type() == qkv.scalar_type() &&
              sin.scalar_type() == qkv.scalar_type(), "cos and sin must be [max_positions, D / 2] with contiguous rows, in qkv's dtype");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos.size(0), "position ", pos[r], " is outside cos and sin's ", cos.size(0), " rows");
  }
}

}  // namespace

// out = rms_norm(x) * weight; x, out: [T, n] with contiguous rows; weight: [n].
void rms_norm(const torch::Tensor& x, const torch::Tensor& weight, torch::Tensor out, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type(), "weight must be contiguous, x's dtype");
  dispatch(x.scalar_type(), "rms_norm", [&](auto t) { rms_norm_impl<decltype(t)>(x, weight, out, eps); });
}

// In place: residual += x, then x = rms_norm(residual) * weight.
void add_rms_norm(torch::Tensor x, torch::Tensor residual, const torch::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type(), "weight must be contiguous, x's dtype");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), "residual must have x's dtype");
  dispatch(x.scalar_type(), "add_rms_norm", [&](auto t) { add_rms_norm_impl<decltype(t)>(x, residual, weight, eps); });
}

// out[:, :n] = silu(x[:, :n]) * x[:, n:]; x: [T, 2n], out: [T, n].
void silu_and_mul(const torch::Tensor& x, torch::Tensor out) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(x.size(1) == 2 * out.size(1) && x.size(0) == out.size(0), "x must be [T, 2n] for out [T, n]");
  dispatch(x.scalar_type(), "silu_and_mul", [&](auto t) { silu_and_mul_impl<decltype(t)>(x, out); });
}

// Splits qkv [T, (H + 2 KVH) D] into contiguous q [T, H, D], k, v [T, KVH, D], rotating q and k at
// positions [T] (int64) with cos, sin [max_positions, D / 2].
void qkv_rotary(const torch::Tensor& qkv, const torch::Tensor& positions, const torch::Tensor& cos,
                const torch::Tensor& sin, torch::Tensor q, torch::Tensor k, torch::Tensor v) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.is_contiguous() && v.is_contiguous() &&
              k.size(0) == qkv.size(0) && k.size(2) == q.size(2) && k.scalar_type() == qkv.scalar_type() &&
              v.scalar_type() == qkv.scalar_type(), "k and v must be contiguous [T, KVH, D] in qkv's dtype");
  check_rotary(qkv, positions, cos, sin, q, k.size(1));
  dispatch(qkv.scalar_type(), "qkv_rotary", [&](auto t) { qkv_rotary_impl<decltype(t)>(qkv, positions, cos, sin, q, k, v); });
}

// qkv_rotary with k and v written into a layer's paged caches k_cache, v_cache [blocks, block_size, KVH, D]
// (one layout, each token's heads contiguous) at slots [T] (int64, block * block_size + offset).
void qkv_rotary_into_cache(const torch::Tensor& qkv, const torch::Tensor& positions, const torch::Tensor& cos,
                           const torch::Tensor& sin, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           const torch::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
              k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3) && k_cache.size(3) == q.size(2),
              "k_cache and v_cache must be [blocks, block_size, KVH, D] of one layout, each token's heads contiguous");
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type(),
              "the caches must have qkv's dtype");
  check_rotary(qkv, positions, cos, sin, q, k_cache.size(2));
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.size(0) == qkv.size(0), "slot_mapping must be contiguous int64 [T]");
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  for (int64_t r = 0; r < slot_mapping.size(0); ++r) {
    TORCH_CHECK(slot[r] >= 0 && slot[r] < capacity, "slot ", slot[r], " is outside the cache's ", capacity, " slots");
  }
  dispatch(qkv.scalar_type(), "qkv_rotary_into_cache", [&](auto t) {
    qkv_rotary_into_cache_impl<decltype(t)>(qkv, positions, cos, sin, q, k_cache, v_cache, slot_mapping);
  });
}

// out[r] = the index of row r's largest value, the first of equal ones; x: float32 [R, n], out: int64 [R].
// A NaN is skipped (torch.argmax would pick it): NaN logits give no meaningful token either way.
void argmax_rows(const torch::Tensor& x, torch::Tensor out) {
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.size(1) > 0, "x must be float32 with at least one column");
  TORCH_CHECK(out.scalar_type() == torch::kLong && out.is_contiguous() && out.size(0) == x.size(0),
              "out must be contiguous int64 [R]");
  argmax_rows_impl(x, out);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "out = rms_norm(x) * weight (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "residual += x; x = rms_norm(residual) * weight, in place (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "out = silu(x[:, :n]) * x[:, n:] (CPU)");
  m.def("argmax_rows", &argmax_rows, "out[r] = argmax of row r of float32 x (CPU)");
  m.def("qkv_rotary", &qkv_rotary, "split qkv into q, k, v, rotating q and k (CPU)");
  m.def("qkv_rotary_into_cache", &qkv_rotary_into_cache,
        "qkv_rotary with k and v written into a layer's paged caches at slot_mapping (CPU)");
}
