// The decode step's matrix-vector products on CPU, fp32 (issue 33): out[r, n] = x[r] . w[n]
// (+ bias[n]), then an epilogue, for 1 to ~8 activation rows x against a row-major weight w
// [N, K]. Such a product is bound by how fast the weight streams from memory, so each weight
// row is read once for all rows of x (held in L1/L2), a few weight rows at a time so that
// every activation vector loaded serves several of them, and the next rows are prefetched.
// Threads split the output rows (torch's intra-op pool: the engine's thread count).
//
// One source, three instruction paths chosen at run time: AVX-512 and AVX2+FMA, each compiled
// for its own target by function attributes (whatever the build's -march: the AVX2 path
// leaves AVX-512 out, so it is the code an AVX2-only CPU runs), and portable C++ elsewhere.
// Built and loaded with the other CPU kernels by dpserve/engine/kernels/cpu_kernels.py.

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

// Activation rows per pass over the weight: more rows are taken this many at a time (each
// group reads the weight again; the engine sends at most this many).
constexpr int64_t kMaxRows = 8;
// Output rows per unit of work handed to a thread: a multiple of every path's block of rows.
constexpr int64_t kTile = 16;

// Everything one call's threads share. x rows are `x_stride` floats apart; out and other
// are [rows, n] with their own row strides.
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

// How far ahead (in weight rows) the next rows' cache lines are asked for: the rows after the
// block in hand, so that a block's loads find their lines on the way. A thread's weight rows
// are one contiguous range, which the hardware prefetcher follows too; measured on Zen 4
// (bench/decode_matmul.py) the explicit prefetch is worth a few percent at 1-2 rows.
#define DPSERVE_PREFETCH(address) _mm_prefetch(reinterpret_cast<const char*>(address), _MM_HINT_T0)

// ------------------------------------------------------------------------------ AVX-512 path

// B weight rows x R activation rows of 16 floats per step; B * R accumulators of the 32
// registers.
template <int R, int B>
__attribute__((target("avx512f"))) void block_avx512(const Problem& p, int64_t n) {
  const float* w = p.w + n * p.k;
  const float* ahead = w + B * p.k;  // the next block's rows
  __m512 acc[B][R];
#pragma GCC unroll 8
  for (int b = 0; b < B; ++b)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[b][r] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= p.k; c += 16) {
    __m512 wv[B];
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) {
      DPSERVE_PREFETCH(ahead + b * p.k + c);
      wv[b] = _mm512_loadu_ps(w + b * p.k + c);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(p.x + r * p.x_stride + c);
#pragma GCC unroll 8
      for (int b = 0; b < B; ++b) acc[b][r] = _mm512_fmadd_ps(wv[b], xv, acc[b][r]);
    }
  }
  if (c < p.k) {  // the last K % 16 columns, masked
    const __mmask16 mask = static_cast<__mmask16>((1u << (p.k - c)) - 1);
    __m512 wv[B];
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) wv[b] = _mm512_maskz_loadu_ps(mask, w + b * p.k + c);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, p.x + r * p.x_stride + c);
#pragma GCC unroll 8
      for (int b = 0; b < B; ++b) acc[b][r] = _mm512_fmadd_ps(wv[b], xv, acc[b][r]);
    }
  }
#pragma GCC unroll 8
  for (int b = 0; b < B; ++b)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) p.out[r * p.out_stride + n + b] = _mm512_reduce_add_ps(acc[b][r]);
}

template <int R>
__attribute__((target("avx512f"))) void dots_avx512(const Problem& p, int64_t begin,
                                                    int64_t end) {
  constexpr int B = R <= 4 ? 4 : 2;  // at most 16 accumulators, 4 weight rows in flight
  int64_t n = begin;
  for (; n + B <= end; n += B) block_avx512<R, B>(p, n);
  for (; n < end; ++n) block_avx512<R, 1>(p, n);
}

// --------------------------------------------------------------------------------- AVX2 path

// Without AVX-512 (the attribute takes it out even where the build's -march has it), so this
// is the code an AVX2-only CPU runs, and the tests run it on any CPU with AVX2.
#define DPSERVE_AVX2 target("avx2,fma,no-avx512f")

__attribute__((DPSERVE_AVX2)) inline float sum_lanes_avx2(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 0x55)));
}

// The mask for the last K % 8 columns: lanes below `count` loaded, the others zero.
__attribute__((DPSERVE_AVX2)) inline __m256i tail_mask_avx2(int64_t count) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), lanes);
}

// B weight rows x R activation rows of 8 floats per step; B * R accumulators of the 16
// registers, with room for the B weight vectors and one activation vector.
template <int R, int B>
__attribute__((DPSERVE_AVX2)) void block_avx2(const Problem& p, int64_t n) {
  const float* w = p.w + n * p.k;
  const float* ahead = w + B * p.k;
  __m256 acc[B][R];
#pragma GCC unroll 8
  for (int b = 0; b < B; ++b)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[b][r] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= p.k; c += 16) {  // two vectors a step: one prefetch per 64-byte line
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) DPSERVE_PREFETCH(ahead + b * p.k + c);
#pragma GCC unroll 2
    for (int half = 0; half < 16; half += 8) {
      __m256 wv[B];
#pragma GCC unroll 8
      for (int b = 0; b < B; ++b) wv[b] = _mm256_loadu_ps(w + b * p.k + c + half);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_loadu_ps(p.x + r * p.x_stride + c + half);
#pragma GCC unroll 8
        for (int b = 0; b < B; ++b) acc[b][r] = _mm256_fmadd_ps(wv[b], xv, acc[b][r]);
      }
    }
  }
  for (; c < p.k; c += 8) {  // at most two more steps, the last one masked
    const __m256i mask = tail_mask_avx2(p.k - c);
    __m256 wv[B];
#pragma GCC unroll 8
    for (int b = 0; b < B; ++b) wv[b] = _mm256_maskload_ps(w + b * p.k + c, mask);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_maskload_ps(p.x + r * p.x_stride + c, mask);
#pragma GCC unroll 8
      for (int b = 0; b < B; ++b) acc[b][r] = _mm256_fmadd_ps(wv[b], xv, acc[b][r]);
    }
  }
#pragma GCC unroll 8
  for (int b = 0; b < B; ++b)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) p.out[r * p.out_stride + n + b] = sum_lanes_avx2(acc[b][r]);
}

template <int R>
__attribute__((DPSERVE_AVX2)) void dots_avx2(const Problem& p, int64_t begin, int64_t end) {
  constexpr int B = R <= 2 ? 4 : R <= 4 ? 2 : 1;  // at most 8 accumulators of 16 registers
  int64_t n = begin;
  for (; n + B <= end; n += B) block_avx2<R, B>(p, n);
  for (; n < end; ++n) block_avx2<R, 1>(p, n);
}

#endif  // DPSERVE_X86

using Dots = void (*)(const Problem&, int64_t, int64_t);

template <int R>
struct Portable {
  static constexpr Dots kDots = &dots_portable<R>;
};
#if DPSERVE_X86
template <int R>
struct Avx2 {
  static constexpr Dots kDots = &dots_avx2<R>;
};
template <int R>
struct Avx512 {
  static constexpr Dots kDots = &dots_avx512<R>;
};
#endif

// The instantiation of `Path` for 1 to kMaxRows rows.
template <template <int> class Path>
Dots for_rows(int64_t rows) {
  switch (rows) {
    case 1: return Path<1>::kDots;
    case 2: return Path<2>::kDots;
    case 3: return Path<3>::kDots;
    case 4: return Path<4>::kDots;
    case 5: return Path<5>::kDots;
    case 6: return Path<6>::kDots;
    case 7: return Path<7>::kDots;
    default: return Path<8>::kDots;
  }
}

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

Dots dots_for(Isa isa, int64_t rows) {
#if DPSERVE_X86
  if (isa == kAvx512) return for_rows<Avx512>(rows);
  if (isa == kAvx2) return for_rows<Avx2>(rows);
#endif
  return for_rows<Portable>(rows);
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
  const Isa path = resolve(isa);
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  const Epilogue kind = static_cast<Epilogue>(epilogue);
  for (int64_t first = 0; first < rows; first += kMaxRows) {
    const int64_t count = std::min(kMaxRows, rows - first);
    const Problem problem{x.data_ptr<float>() + first * x.stride(0), x.stride(0),
                          weight.data_ptr<float>(), k,
                          out.data_ptr<float>() + first * n, n};
    const Dots dots = dots_for(path, count);
    const float* group_other = other_data != nullptr ? other_data + first * other_stride : nullptr;
    const int64_t tiles = (n + kTile - 1) / kTile;
    at::parallel_for(0, tiles, 1, [&](int64_t tile_begin, int64_t tile_end) {
      const int64_t begin = tile_begin * kTile, end = std::min(n, tile_end * kTile);
      dots(problem, begin, end);
      finish(problem.out, n, count, begin, end, bias_data, kind, group_other, other_stride);
    });
  }
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
