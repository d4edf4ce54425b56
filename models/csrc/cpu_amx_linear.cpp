// bf16 linear layers on Intel AMX tiles, for the few rows of a serving step: out = x @ W^T (+ bias), summed in
// float32 and rounded to bf16 once. The weight is packed once (pack_weight) into the tiles' pair-interleaved
// layout; a call configures the tiles and runs, with none of oneDNN's per-call descriptor, cache lookup and
// scratchpad (30-40 us a call on 2 cores, most of a decode step's product). Loaded by models/cpu_ops.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kRows = 16;      // rows of a tile
constexpr int kCols = 16;      // float32 columns of an output tile
constexpr int kDepth = 32;     // bf16 values of K in a row of an input tile (64 bytes)
constexpr int kBlockRows = 64; // rows run together: four output tiles

// The tile configuration ldtilecfg reads (palette 1): bytes per row and rows of each of the 16 tiles.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: the outputs of rows 0-15, ..., 48-63; 4: a full input tile, 5: the last, short one; 6: weights.
TileConfig config_for(int64_t rows) {
  TileConfig c;
  const int64_t blocks = (rows + kRows - 1) / kRows, tail = rows - (blocks - 1) * kRows;
  for (int64_t i = 0; i < blocks; ++i) {
    c.rows[i] = static_cast<uint8_t>(i + 1 < blocks ? kRows : tail);
    c.colsb[i] = kCols * 4;
  }
  c.rows[4] = kRows;
  c.colsb[4] = kDepth * 2;
  c.rows[5] = static_cast<uint8_t>(tail);
  c.colsb[5] = kDepth * 2;
  c.rows[6] = kDepth / 2;
  c.colsb[6] = kCols * 4;
  return c;
}

// Rows [0, rows) of x (rows <= 64, stride ldx) times one 16-column block of packed weights, into acc [64][16].
template <int kBlocks>
inline void tile_block(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* w, int64_t depth_blocks,
                       float* acc) {
  const int64_t stride = ldx * 2;
  _tile_zero(0);
  if constexpr (kBlocks > 1) _tile_zero(1);
  if constexpr (kBlocks > 2) _tile_zero(2);
  if constexpr (kBlocks > 3) _tile_zero(3);
  for (int64_t kb = 0; kb < depth_blocks; ++kb) {
    _tile_loadd(6, w + kb * kDepth * kCols, kCols * 4);
    const c10::BFloat16* xk = x + kb * kDepth;
    // Every row block but the last loads a full tile (4); the last its own rows (5).
    if constexpr (kBlocks == 1) {
      _tile_loadd(5, xk, stride);
      _tile_dpbf16ps(0, 5, 6);
    } else {
      _tile_loadd(4, xk, stride);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (kBlocks == 2) {
        _tile_loadd(5, xk + kRows * ldx, stride);
        _tile_dpbf16ps(1, 5, 6);
      } else {
        _tile_loadd(4, xk + kRows * ldx, stride);
        _tile_dpbf16ps(1, 4, 6);
        if constexpr (kBlocks == 3) {
          _tile_loadd(5, xk + 2 * kRows * ldx, stride);
          _tile_dpbf16ps(2, 5, 6);
        } else {
          _tile_loadd(4, xk + 2 * kRows * ldx, stride);
          _tile_dpbf16ps(2, 4, 6);
          _tile_loadd(5, xk + 3 * kRows * ldx, stride);
          _tile_dpbf16ps(3, 5, 6);
        }
      }
    }
  }
  _tile_stored(0, acc, kCols * 4);
  if constexpr (kBlocks > 1) _tile_stored(1, acc + kRows * kCols, kCols * 4);
  if constexpr (kBlocks > 2) _tile_stored(2, acc + 2 * kRows * kCols, kCols * 4);
  if constexpr (kBlocks > 3) _tile_stored(3, acc + 3 * kRows * kCols, kCols * 4);
}

// Rounds 16 floats to bf16 to nearest even, as c10::BFloat16 does (NaN to 0x7fc0), in one vector.
inline __m256i round_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(rounded);
}

// acc's first rows [rows][16] (+ bias, 16 bf16 or null) rounded into out's rows (stride ld).
inline void store_rows(const float* acc, int64_t rows, const c10::BFloat16* bias, c10::BFloat16* out, int64_t ld) {
  __m512 b = _mm512_setzero_ps();
  if (bias != nullptr) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias));
    b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  for (int64_t r = 0; r < rows; ++r) {
    __m512 v = _mm512_load_ps(acc + r * kCols);
    if (bias != nullptr) v = _mm512_add_ps(v, b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ld), round_to_bf16(v));
  }
}

bool request_tiles() {
  // Linux hands out the tiles' register state only to a process that asks (ARCH_REQ_XCOMP_PERM, XTILEDATA).
  constexpr int kReqXcompPerm = 0x1023, kXtileData = 18;
  static const bool granted = syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  return granted;
}

}  // namespace

// weight [N, K] bf16, N a multiple of 16 and K of 32 -> [N / 16, K / 32, 16, 16, 2]: each 16 x 32 block as
// 16 rows of K pairs, each pair's two values side by side per output column (the tiles' VNNI layout).
torch::Tensor pack_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16, "weight must be a 2-D bf16 tensor");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kCols == 0 && k % kDepth == 0, "weight must have a multiple of 16 rows and of 32 columns, got ",
              n, " x ", k);
  return weight.reshape({n / kCols, kCols, k / kDepth, kDepth / 2, 2}).permute({0, 2, 3, 1, 4}).contiguous();
}

// x [M, K] bf16 (rows contiguous), packed from pack_weight, bias [N] bf16 or None, out [M, N] bf16 (contiguous).
void amx_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                torch::Tensor out) {
  TORCH_CHECK(request_tiles(), "the kernel did not grant this process the AMX tiles");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1, "x must be 2-D bf16 rows");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() &&
              packed.size(2) == kDepth / 2 && packed.size(3) == kCols && packed.size(4) == 2,
              "packed must come from pack_weight");
  const int64_t m = x.size(0), k = x.size(1), col_blocks = packed.size(0), depth_blocks = packed.size(1);
  TORCH_CHECK(depth_blocks * kDepth == k, "x has ", k, " columns, the weight ", depth_blocks * kDepth);
  TORCH_CHECK(out.scalar_type() == torch::kBFloat16 && out.is_contiguous() && out.size(0) == m &&
              out.size(1) == col_blocks * kCols, "out must be a contiguous bf16 [M, N]");
  const c10::BFloat16* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kBFloat16 && bias->is_contiguous() && bias->numel() == out.size(1),
                "bias must be a contiguous bf16 [N]");
    bp = bias->data_ptr<c10::BFloat16>();
  }
  if (m == 0) return;
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = packed.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int64_t ldx = x.stride(0), n = out.size(1), block_elems = depth_blocks * kDepth * kCols;
  // A block's multiply-adds, in units of a 16 x 16 x 32 tile product: below about 64 of them waking a second
  // thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, 64 / (((m + kRows - 1) / kRows) * depth_blocks));
  at::parallel_for(0, col_blocks, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kBlockRows * kCols];
    for (int64_t m0 = 0; m0 < m; m0 += kBlockRows) {
      const int64_t rows = std::min<int64_t>(kBlockRows, m - m0);
      const TileConfig config = config_for(rows);
      _tile_loadconfig(&config);
      const int64_t blocks = (rows + kRows - 1) / kRows;
      for (int64_t cb = begin; cb < end; ++cb) {
        const c10::BFloat16* w = wp + cb * block_elems;
        const c10::BFloat16* xr = xp + m0 * ldx;
        switch (blocks) {
          case 1: tile_block<1>(xr, ldx, w, depth_blocks, acc); break;
          case 2: tile_block<2>(xr, ldx, w, depth_blocks, acc); break;
          case 3: tile_block<3>(xr, ldx, w, depth_blocks, acc); break;
          default: tile_block<4>(xr, ldx, w, depth_blocks, acc);
        }
        store_rows(acc, rows, bp == nullptr ? nullptr : bp + cb * kCols, op + m0 * n + cb * kCols, n);
      }
    }
    _tile_release();
  });
}

bool available() { return request_tiles(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &pack_weight, "a bf16 weight [N, K] in the AMX tiles' layout");
  m.def("amx_linear", &amx_linear, "out = x @ W^T (+ bias) on AMX tiles, W from pack_weight");
  m.def("available", &available, "whether this process may use the AMX tiles");
}
