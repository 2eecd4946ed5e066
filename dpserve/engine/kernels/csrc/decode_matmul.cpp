// The decode step's matrix-vector products on CPU, fp32 (issue 33): out[r, n] = x[r] . w[n]
// (+ bias[n]), then an epilogue, for a few activation rows x against a row-major weight w
// [N, K]. Such a product is bound by how fast the weight streams from memory, so the weight is
// read from memory once for all rows of x:
// - each weight row is read as one sequential stream, one row at a time, every activation row
//   multiplied with it as it passes (measured on Zen 4, bench/decode_matmul.py: one stream read
//   ~1.5x faster than 2-4 rows read side by side, with or without software prefetch, which the
//   hardware prefetcher makes unnecessary for a single stream);
// - at most kGroup activation rows ride one pass (their accumulators stay in registers); more
//   rows are taken kGroup at a time over a tile of weight rows small enough to stay in L2, so
//   that the later groups read the tile from there, not from memory.
// Threads split the output rows (torch's intra-op pool: the engine's thread count).
//
// One source, three instruction paths chosen at run time: AVX-512 and AVX2+FMA, each compiled
// for its own target by function attributes (the file's own target is x86-64-v2, so the AVX2
// path holds no AVX-512 instruction whichever CPU built it: it is the code an AVX2-only CPU
// runs), and portable C++ elsewhere. Built and loaded with the other CPU kernels by
// dpserve/engine/kernels/cpu_kernels.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <optional>

#if defined(__x86_64__)
#include <immintrin.h>
#define DPSERVE_X86 1
#else
#define DPSERVE_X86 0
#endif

namespace {

// What follows the product, element by element (the values match cpu_kernels.py).
enum Epilogue : int64_t { kNone = 0, kSilu = 1, kMul = 2, kAdd = 3 };
// Which code computes the dot products (the values match cpu_kernels.py).
enum Isa : int64_t { kAuto = 0, kPortable = 1, kAvx2 = 2, kAvx512 = 3 };

// Activation rows per pass over a weight row: their accumulators, the weight vector and an
// activation vector fit AVX2's 16 registers.
constexpr int64_t kGroup = 4;
// Output rows per unit of work handed to a thread.
constexpr int64_t kTile = 16;
// The bytes of weight rows a thread takes through all groups of activation rows before it
// moves on: far below any L2 (256 KB and up), beside the activation rows themselves.
constexpr int64_t kL2TileBytes = 64 * 1024;

// One group's operands: x rows `x_stride` floats apart, out rows `out_stride` apart.
struct Problem {
  const float* x;
  int64_t x_stride;
  const float* w;
  int64_t k;
  float* out;
  int64_t out_stride;
};

// exp(x) for x <= 0 (Cephes' expf, as in cpu_kernels.cpp): a simd loop vectorizes it.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(bits);
}

// ---------------------------------------------------------------------------- portable path

template <int R>
void dots_portable(const Problem& p, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const float* w = p.w + n * p.k;
    for (int r = 0; r < R; ++r) {
      const float* x = p.x + r * p.x_stride;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < p.k; ++c) sum += w[c] * x[c];
      p.out[r * p.out_stride + n] = sum;
    }
  }
}

#if DPSERVE_X86

// ------------------------------------------------------------------------------ AVX-512 path

// Weight rows [begin, end) against R activation rows, 16 floats a step.
template <int R>
__attribute__((target("avx512f"))) void dots_avx512(const Problem& p, int64_t begin,
                                                    int64_t end) {
  const int64_t tail = p.k % 16, body = p.k - tail;
  const __mmask16 mask = static_cast<__mmask16>((1u << tail) - 1);
  for (int64_t n = begin; n < end; ++n) {
    const float* w = p.w + n * p.k;
    __m512 acc[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < body; c += 16) {
      const __m512 wv = _mm512_loadu_ps(w + c);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(p.x + r * p.x_stride + c), acc[r]);
      }
    }
    if (tail != 0) {  // the last K % 16 columns, masked
      const __m512 wv = _mm512_maskz_loadu_ps(mask, w + body);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_maskz_loadu_ps(mask, p.x + r * p.x_stride + body);
        acc[r] = _mm512_fmadd_ps(wv, xv, acc[r]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) p.out[r * p.out_stride + n] = _mm512_reduce_add_ps(acc[r]);
  }
}

// --------------------------------------------------------------------------------- AVX2 path

// Without AVX-512 (the file's own target has none), so this is the code an AVX2-only CPU runs,
// and the tests run it on any CPU with AVX2.
#define DPSERVE_AVX2 target("avx2,fma")

__attribute__((DPSERVE_AVX2)) inline float sum_lanes_avx2(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 0x55)));
}

// Weight rows [begin, end) against R activation rows, 8 floats a step (two per 64-byte line).
template <int R>
__attribute__((DPSERVE_AVX2)) void dots_avx2(const Problem& p, int64_t begin, int64_t end) {
  const int64_t tail = p.k % 8, body = p.k - tail;
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(tail)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int64_t n = begin; n < end; ++n) {
    const float* w = p.w + n * p.k;
    __m256 acc[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < body; c += 8) {
      const __m256 wv = _mm256_loadu_ps(w + c);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(p.x + r * p.x_stride + c), acc[r]);
      }
    }
    if (tail != 0) {  // the last K % 8 columns, masked
      const __m256 wv = _mm256_maskload_ps(w + body, mask);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_maskload_ps(p.x + r * p.x_stride + body, mask);
        acc[r] = _mm256_fmadd_ps(wv, xv, acc[r]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) p.out[r * p.out_stride + n] = sum_lanes_avx2(acc[r]);
  }
}

#endif  // DPSERVE_X86

using Dots = void (*)(const Problem&, int64_t, int64_t);

// A path's instantiations for 1 to kGroup rows.
struct Path {
  Dots rows[kGroup];
};

constexpr Path kPortablePath{{&dots_portable<1>, &dots_portable<2>, &dots_portable<3>,
                              &dots_portable<4>}};
#if DPSERVE_X86
constexpr Path kAvx2Path{{&dots_avx2<1>, &dots_avx2<2>, &dots_avx2<3>, &dots_avx2<4>}};
constexpr Path kAvx512Path{{&dots_avx512<1>, &dots_avx512<2>, &dots_avx512<3>,
                            &dots_avx512<4>}};
#endif

bool cpu_has(Isa isa) {
#if DPSERVE_X86
  __builtin_cpu_init();
  if (isa == kAvx512) return __builtin_cpu_supports("avx512f");
  if (isa == kAvx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return isa == kPortable;
}

// The fastest path this CPU runs (kAuto), else the one asked for, refused if the CPU lacks it.
Isa resolve(int64_t requested) {
  TORCH_CHECK(requested >= kAuto && requested <= kAvx512, "unknown instruction path ", requested);
  if (requested != kAuto) {
    TORCH_CHECK(cpu_has(static_cast<Isa>(requested)), "this CPU cannot run instruction path ",
                requested);
    return static_cast<Isa>(requested);
  }
  static const Isa best = cpu_has(kAvx512) ? kAvx512 : cpu_has(kAvx2) ? kAvx2 : kPortable;
  return best;
}

const Path& path_for(Isa isa) {
#if DPSERVE_X86
  if (isa == kAvx512) return kAvx512Path;
  if (isa == kAvx2) return kAvx2Path;
#endif
  return kPortablePath;
}

// Bias and epilogue over out[:rows, begin:end), just written (still in cache).
void finish(float* out, int64_t out_stride, int64_t rows, int64_t begin, int64_t end,
            const float* bias, Epilogue epilogue, const float* other, int64_t other_stride) {
  for (int64_t r = 0; r < rows; ++r) {
    float* y = out + r * out_stride;
    const float* o = other != nullptr ? other + r * other_stride : nullptr;
    if (bias != nullptr) {
#pragma omp simd
      for (int64_t n = begin; n < end; ++n) y[n] += bias[n];
    }
    switch (epilogue) {
      case kSilu:
        // silu(v) = v * sigmoid(v), sigmoid from exp(-|v|) so that exp never overflows.
#pragma omp simd
        for (int64_t n = begin; n < end; ++n) {
          const float v = y[n];
          const float e = exp_nonpositive(-std::fabs(v));
          y[n] = v * (v >= 0.f ? 1.f : e) / (1.f + e);
        }
        break;
      case kMul:
#pragma omp simd
        for (int64_t n = begin; n < end; ++n) y[n] *= o[n];
        break;
      case kAdd:
#pragma omp simd
        for (int64_t n = begin; n < end; ++n) y[n] += o[n];
        break;
      case kNone:
        break;
    }
  }
}

// x [rows, k] (rows may be strided), weight [n, k] contiguous, bias [n] or none, other
// [rows, n] (rows may be strided) for kMul / kAdd. Returns [rows, n].
at::Tensor decode_matmul(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& other, int64_t epilogue, int64_t isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "decode_matmul takes float32");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, k] with contiguous rows");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be contiguous [n, k]");
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k, "x has ", k, " columns, the weight ", weight.size(1));
  TORCH_CHECK(epilogue >= kNone && epilogue <= kAdd, "unknown epilogue ", epilogue);
  const float* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == n,
                "bias must be float32 [n]");
    bias_data = bias->data_ptr<float>();
  }
  const float* other_data = nullptr;
  int64_t other_stride = 0;
  if (epilogue == kMul || epilogue == kAdd) {
    TORCH_CHECK(other.has_value(), "this epilogue needs the other operand");
    TORCH_CHECK(other->scalar_type() == at::kFloat && other->dim() == 2 &&
                    other->size(0) == rows && other->size(1) == n && other->stride(1) == 1,
                "other must be float32 [rows, n] with contiguous rows");
    other_data = other->data_ptr<float>();
    other_stride = other->stride(0);
  }
  const Path& path = path_for(resolve(isa));
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  const Epilogue kind = static_cast<Epilogue>(epilogue);
  const float* x_data = x.data_ptr<float>();
  const float* w_data = weight.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  // Weight rows per L2 tile: every group of activation rows runs over it before the next.
  const int64_t tile_rows = std::max<int64_t>(1, kL2TileBytes / (k * int64_t{sizeof(float)}));
  const int64_t tiles = (n + kTile - 1) / kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t tile_begin, int64_t tile_end) {
    const int64_t begin = tile_begin * kTile, end = std::min(n, tile_end * kTile);
    for (int64_t start = begin; start < end; start += tile_rows) {
      const int64_t stop = std::min(end, start + tile_rows);
      for (int64_t first = 0; first < rows; first += kGroup) {
        const int64_t count = std::min(kGroup, rows - first);
        const Problem group{x_data + first * x.stride(0), x.stride(0), w_data, k,
                            out_data + first * n, n};
        path.rows[count - 1](group, start, stop);
      }
    }
    finish(out_data, n, rows, begin, end, bias_data, kind, other_data, other_stride);
  });
  return out;
}

// Whether this CPU runs instruction path `isa` (for the tests and the bench).
bool decode_matmul_supports(int64_t isa) {
  return isa >= kAuto && isa <= kAvx512 && (isa == kAuto || cpu_has(static_cast<Isa>(isa)));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dpserve_cpu, m) {
  m.def(
      "decode_matmul(Tensor x, Tensor weight, Tensor? bias, Tensor? other, int epilogue, "
      "int isa) -> Tensor");
  m.def("decode_matmul_supports(int isa) -> bool", &decode_matmul_supports);
}

TORCH_LIBRARY_IMPL(dpserve_cpu, CPU, m) { m.impl("decode_matmul", &decode_matmul); }
