// Attention on a CPU for query rows that each see the first seq_len tokens of a block table, read
// straight from the paged KV cache: a decode is one row, a prefill one row per token (its causal
// length), so nothing is gathered into a padded batch or masked. Loaded by backends/cpu_kernels.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "fast_exp.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// The largest of s[0, len): 16 running maxima, so that the loop vectorises (one running maximum is a
// chain of dependent scalar max instructions, which took a sixth of the kernel's time).
inline float row_max(const float* s, int64_t len) {
  float m[16];
  for (int j = 0; j < 16; ++j) m[j] = s[0];
  int64_t t = 0;
  for (; t + 16 <= len; t += 16) {
    for (int j = 0; j < 16; ++j) m[j] = m[j] > s[t + j] ? m[j] : s[t + j];
  }
  float top = s[0];
  for (; t < len; ++t) top = std::max(top, s[t]);
  for (int j = 0; j < 16; ++j) top = std::max(top, m[j]);
  return top;
}

#if defined(__AVX512F__)
// 16 elements of a row as float.
template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

// Lane j of the result: the sum of v[j]'s 16 lanes. One tree of 30 shuffles for 16 sums, where summing
// each vector alone takes 4 shuffles and 4 dependent adds.
inline __m512 sum16(const __m512* v) {
  __m512 w[8], x[4], z[2];
  for (int i = 0; i < 8; ++i) {  // halves: quarters 0-1 hold v[2i]'s sums, 2-3 v[2i+1]'s
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 4; ++i) {  // quarter k: v[4i + k]'s
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  for (int i = 0; i < 2; ++i) {  // in quarter k: two lanes of v[8i + k]'s, two of v[8i + 4 + k]'s
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // lane 4k + m: v[4m + k]'s sum
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

// scores[(h * G + g) * stride + t] = q[h * G + g] . k[t][h] for the first len tokens t of a request's blocks:
// 16 tokens at a time, each K/V head's rows converted once for its G query heads.
template <typename T, int kD>
void key_scores(const float* qf, const T* cache, const int64_t* blocks, int64_t len, int64_t bs, int64_t blk_stride,
                int64_t tok_stride, int64_t head_stride, int64_t KVH, int64_t G, float* scores, int64_t stride) {
  constexpr int kC = kD / 16;
  const int64_t row_bytes = KVH * head_stride * static_cast<int64_t>(sizeof(T));  // a token's rows, all heads
  int64_t block = 0, offset = 0;  // of the next token whose row is looked up
  // The next n tokens' rows (all heads), walking the block table on from where the last call stopped.
  auto look_up = [&](const T** rows, int64_t n) {
    for (int64_t j = 0; j < n; ++j) {
      rows[j] = cache + blocks[block] * blk_stride + offset * tok_stride;
      if (++offset == bs) offset = 0, ++block;
    }
  };
  const T* rows[16];
  const T* ahead[16];
  look_up(rows, std::min<int64_t>(16, len));
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int m = static_cast<int>(std::min<int64_t>(16, len - t0));
    const __mmask16 lanes = static_cast<__mmask16>((1u << m) - 1);
    // The next 16 tokens' rows are asked for now: the hardware's prefetchers stop at each block's edge.
    const int64_t next = std::min<int64_t>(16, len - t0 - m);
    look_up(ahead, next);
    for (int64_t j = 0; j < next; ++j) {
      const char* row = reinterpret_cast<const char*>(ahead[j]);
      for (int64_t byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(row + byte);
    }
    for (int64_t h = 0; h < KVH; ++h) {
      __m512 k[16][kC];
      for (int j = 0; j < m; ++j) {
        for (int c = 0; c < kC; ++c) k[j][c] = load16(rows[j] + h * head_stride + c * 16);
      }
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qf + (h * G + g) * kD;
        __m512 qv[kC];
        for (int c = 0; c < kC; ++c) qv[c] = _mm512_loadu_ps(qg + c * 16);
        __m512 part[16];
        for (int j = 0; j < 16; ++j) {
          if (j >= m) { part[j] = _mm512_setzero_ps(); continue; }
          __m512 s = _mm512_mul_ps(qv[0], k[j][0]);
          for (int c = 1; c < kC; ++c) s = _mm512_fmadd_ps(qv[c], k[j][c], s);
          part[j] = s;
        }
        _mm512_mask_storeu_ps(scores + (h * G + g) * stride + t0, lanes, sum16(part));
      }
    }
    std::copy(ahead, ahead + next, rows);
  }
}
#endif

// A row's fixed work (its query and output) in keys' worth, for cutting rows into equal runs.
constexpr int64_t kRowCost = 8;

// Calls f(t, h, row) for each of a request's first len tokens t and each K/V head h, in cache order,
// row being that head's D values as float: float32 rows are read where they lie, others converted
// into buf.
template <typename T, typename F>
inline void for_each_row(const T* cache, const int64_t* blocks, int64_t len, int64_t bs, int64_t blk_stride,
                         int64_t tok_stride, int64_t head_stride, int64_t KVH, int64_t D, float* buf, F&& f) {
  for (int64_t start = 0; start < len; start += bs) {
    const T* block = cache + blocks[start / bs] * blk_stride;
    const int64_t stop = std::min(bs, len - start);
    for (int64_t i = 0; i < stop; ++i) {
      for (int64_t h = 0; h < KVH; ++h) {
        const T* src = block + i * tok_stride + h * head_stride;
        if constexpr (std::is_same_v<T, float>) {
          f(start + i, h, src);
        } else {
          for (int64_t d = 0; d < D; ++d) buf[d] = to_float(src[d]);
          f(start + i, h, static_cast<const float*>(buf));
        }
      }
    }
  }
}

// out[g][d] = sum over the first len tokens t of p[g * stride + t] * v[t][d], for kG query heads sharing the
// value rows of vh (a K/V head's, in its blocks): each row read and converted once, the sums in registers.
template <typename T, int kD, int kG>
inline void sum_values(const float* p, int64_t stride, const T* vh, const int64_t* blocks, int64_t len, int64_t bs,
                       int64_t v_blk, int64_t v_tok, float* out) {
  float local[kG][kD] = {};
  for (int64_t start = 0; start < len; start += bs) {
    const T* block = vh + blocks[start / bs] * v_blk;
    const int64_t stop = std::min(bs, len - start);
    // The next block's rows are asked for meanwhile: the hardware's prefetchers stop at each block's edge.
    const char* next = reinterpret_cast<const char*>(start + bs < len ? vh + blocks[start / bs + 1] * v_blk : block);
    for (int64_t i = 0; i < stop; ++i) {
      const T* v = block + i * v_tok;
      for (int64_t byte = 0; byte < kD * static_cast<int64_t>(sizeof(T)); byte += 64) {
        __builtin_prefetch(next + i * v_tok * static_cast<int64_t>(sizeof(T)) + byte);
      }
      float converted[kD];
      const float* row = converted;
      if constexpr (std::is_same_v<T, float>) {
        row = v;  // read where it lies
      } else {
        for (int d = 0; d < kD; ++d) converted[d] = to_float(v[d]);
      }
      for (int g = 0; g < kG; ++g) {
        const float pg = p[g * stride + start + i];
        for (int d = 0; d < kD; ++d) local[g][d] += pg * row[d];
      }
    }
  }
  for (int g = 0; g < kG; ++g) std::copy(local[g], local[g] + kD, out + g * kD);
}

// The G query heads sharing a K/V head read each of its key and value rows once.
// kD > 0 fixes head_dim at compile time so the row loops vectorise; 0 reads it at run time.
template <typename T, int kD>
void decode(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
            const torch::Tensor& block_table, const torch::Tensor& table_rows, const torch::Tensor& seq_lens,
            double scale, torch::Tensor& out) {
  const int64_t n = q.size(0), H = q.size(1);
  const int64_t D = kD > 0 ? kD : q.size(2);
  const int64_t bs = k_cache.size(1), KVH = k_cache.size(2), G = H / KVH;
  const int64_t table_width = block_table.size(1);
  const int64_t k_blk = k_cache.stride(0), k_tok = k_cache.stride(1), k_head = k_cache.stride(2);
  const int64_t v_blk = v_cache.stride(0), v_tok = v_cache.stride(1), v_head = v_cache.stride(2);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* table_row = table_rows.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  int64_t max_len = 0;
  for (int64_t r = 0; r < n; ++r) max_len = std::max(max_len, lens[r]);
  const float sc = static_cast<float>(scale);
  // Rows cut into one run per thread of about equal work (a row costs its length plus a fixed part):
  // equal row counts would leave a thread idle when the long rows sit together (a prefill's tail).
  const int64_t runs = std::min<int64_t>(n, at::get_num_threads());
  std::vector<int64_t> cut(runs + 1, n);
  cut[0] = 0;
  int64_t total = 0;
  for (int64_t r = 0; r < n; ++r) total += lens[r] + kRowCost;
  for (int64_t r = 0, done = 0, c = 1; r < n && c < runs; ++r) {
    done += lens[r] + kRowCost;
    while (c < runs && done * runs >= total * c) cut[c++] = r + 1;
  }
  // A row's key and value rows (all heads, contiguous in a block) stream in order.
  at::parallel_for(0, runs, 1, [&](int64_t first_run, int64_t last_run) {
    std::vector<float> qf(H * D), acc(H * D), row(D), scores(H * max_len);
    for (int64_t r = cut[first_run]; r < cut[last_run]; ++r) {
      const int64_t len = lens[r];
      const int64_t* blocks = table + table_row[r] * table_width;
      const T* qr = qp + r * H * D;
      for (int64_t i = 0; i < H * D; ++i) qf[i] = to_float(qr[i]) * sc;
#if defined(__AVX512F__)
      if constexpr (kD > 0 && kD % 16 == 0) {
        key_scores<T, kD>(qf.data(), kp, blocks, len, bs, k_blk, k_tok, k_head, KVH, G, scores.data(), max_len);
      } else
#endif
      {
        for_each_row(kp, blocks, len, bs, k_blk, k_tok, k_head, KVH, D, row.data(),
                     [&](int64_t t, int64_t h, const float* k) {
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = &qf[(h * G + g) * D];
            float dot = 0.f;
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
            scores[(h * G + g) * max_len + t] = dot;
          }
        });
      }
      for (int64_t head = 0; head < H; ++head) {
        float* s = &scores[head * max_len];
        const float top = row_max(s, len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          s[t] = servelab::fast_exp(s[t] - top);
          sum += s[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      // The G query heads of a K/V head together over all of its tokens, their sums in registers where
      // G * D is small and both are constants, so that each value row is read once: summing every head's
      // row into memory per token is bound by the stores. Otherwise one query head at a time.
      for (int64_t h = 0; h < KVH; ++h) {
        const T* vh = vp + h * v_head;
        const float* p = &scores[h * G * max_len];
        float* a = &acc[h * G * D];
        if constexpr (kD > 0 && kD <= 128) {
          if (G == 1) { sum_values<T, kD, 1>(p, max_len, vh, blocks, len, bs, v_blk, v_tok, a); continue; }
          if (G == 2) { sum_values<T, kD, 2>(p, max_len, vh, blocks, len, bs, v_blk, v_tok, a); continue; }
          if constexpr (kD <= 64) {
            if (G == 4) { sum_values<T, kD, 4>(p, max_len, vh, blocks, len, bs, v_blk, v_tok, a); continue; }
          }
          if constexpr (kD <= 32) {
            if (G == 8) { sum_values<T, kD, 8>(p, max_len, vh, blocks, len, bs, v_blk, v_tok, a); continue; }
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          if constexpr (kD > 0) {
            sum_values<T, kD, 1>(p + g * max_len, max_len, vh, blocks, len, bs, v_blk, v_tok, a + g * kD);
          } else {
            float* ag = a + g * D;
            std::fill(ag, ag + D, 0.f);
            for (int64_t start = 0; start < len; start += bs) {
              const T* block = vh + blocks[start / bs] * v_blk;
              const int64_t stop = std::min(bs, len - start);
              for (int64_t i = 0; i < stop; ++i) {
                const float pi = p[g * max_len + start + i];
                const T* v = block + i * v_tok;
                for (int64_t d = 0; d < D; ++d) ag[d] += pi * to_float(v[d]);
              }
            }
          }
        }
      }
      T* orow = op + r * H * D;
      for (int64_t i = 0; i < H * D; ++i) orow[i] = static_cast<T>(acc[i]);
    }
  });
}

template <typename T>
void decode_any_dim(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                    const torch::Tensor& block_table, const torch::Tensor& table_rows,
                    const torch::Tensor& seq_lens, double scale, torch::Tensor& out) {
  switch (q.size(2)) {
    case 32: decode<T, 32>(q, k_cache, v_cache, block_table, table_rows, seq_lens, scale, out); break;
    case 64: decode<T, 64>(q, k_cache, v_cache, block_table, table_rows, seq_lens, scale, out); break;
    case 128: decode<T, 128>(q, k_cache, v_cache, block_table, table_rows, seq_lens, scale, out); break;
    default: decode<T, 0>(q, k_cache, v_cache, block_table, table_rows, seq_lens, scale, out);
  }
}

}  // namespace

// q, out: [n, H, D], a query row each; k_cache, v_cache: [blocks, block_size, KVH, D] (D contiguous);
// block_table: [requests, >= ceil(max seq_len / block_size)] int64; table_rows: [n] int64, the
// block-table row of each query row (a prefill's tokens share their request's); seq_lens: [n] int64,
// each >= 1: query row r attends to tokens [0, seq_lens[r]) of its blocks.
void paged_decode(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  const torch::Tensor& block_table, const torch::Tensor& table_rows, const torch::Tensor& seq_lens,
                  double scale, torch::Tensor out) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous(), "q and out must be contiguous");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "the cache's head_dim must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == torch::kLong && table_rows.scalar_type() == torch::kLong &&
              seq_lens.scalar_type() == torch::kLong, "block_table, table_rows and seq_lens must be int64");
  TORCH_CHECK(block_table.is_contiguous() && table_rows.is_contiguous() && seq_lens.is_contiguous(),
              "block_table, table_rows and seq_lens must be contiguous");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  switch (q.scalar_type()) {
    case torch::kFloat: decode_any_dim<float>(q, k_cache, v_cache, block_table, table_rows, seq_lens, scale, out); break;
    case torch::kBFloat16: decode_any_dim<c10::BFloat16>(q, k_cache, v_cache, block_table, table_rows, seq_lens, scale, out); break;
    case torch::kHalf: decode_any_dim<c10::Half>(q, k_cache, v_cache, block_table, table_rows, seq_lens, scale, out); break;
    default: TORCH_CHECK(false, "paged_decode supports float32, bfloat16 and float16, got ", q.scalar_type());
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "attention of query rows over a paged KV cache (CPU)");
}
