// The decode step's matrix-vector products on CPU (issue 33): out[r, n] = x[r] . w[n] (+ bias[n]),
// then an epilogue, for a few fp32 activation rows x against a weight w [N, K] held as fp32, as
// bf16 (widened to fp32 in registers by a 16-bit shift) or as int8 with an fp32 scale per output
// row (w[n, k] ~= q[n, k] * scale[n]: x . q summed in fp32, times scale[n], then the bias and the
// epilogue; layers/weight_format.py quantizes). Accumulation is fp32 throughout, so a
// lower-precision weight changes only the bytes streamed: 1/2 or 1/4 of fp32's (bf16_dots,
// below, rounds x too). Such a product
// is bound by how fast the weight streams from memory, so the weight is read from memory once
// for all rows of x:
// - each weight row is read as one sequential stream, one row at a time, every activation row
//   multiplied with it as it passes (measured on Zen 4, bench/decode_matmul.py: one stream read
//   ~1.5x faster than 2-4 rows read side by side, with or without software prefetch); from 3
//   activation rows on, a pass also asks for the stream 32 KB ahead into L2 (kPrefetchBytes:
//   such a pass computes slowly enough per byte that the hardware prefetcher falls behind);
// - at most kGroup activation rows ride one pass (their accumulators stay in registers); more
//   rows are taken kGroup at a time over a tile of weight rows small enough to stay in L2, so
//   that the later groups read the tile from there, not from memory; those later passes are
//   bound by arithmetic, not memory, and run a register-blocked pass (tiles_avx2: three weight
//   rows at a time, tiles_avx512: four), while the first pass asks for the next tile;
// - a weight with wide rows (2048 columns and up: cpu_kernels.column_blocked_copy) is held
//   column-blocked, [chunks, n, width]: every weight row's first `width` columns, then every
//   row's next, each chunk one sequential stream. A pass then re-reads only a chunk of each
//   activation row, which stays in L1 beside the weight's stream; a whole wide row's did not
//   (Zen 4, one thread, Llama-3-8B's 14336x4096: 12-13 GB/s at 2 rows and 9-11 at 4 row-major,
//   25-29 and 22-25 blocked, against oneDNN's 12-13 and 20-22; chunks of a row-major weight,
//   strided, read 11).
// Threads split the output rows (torch's intra-op pool: the engine's thread count).
//
// A bf16 weight can instead meet x rounded to bf16 (`bf16_dots`, on CPUs with AVX-512-BF16): its
// dot-product instruction takes twice an FMA's products and the weight needs no widening (the
// AVX-512-BF16 section below).
//
// One source, three instruction paths chosen at run time, each for the three weight formats:
// AVX-512 and AVX2+FMA, each compiled for its own target by function attributes (the file's own
// target is x86-64-v2, so the AVX2 path holds no AVX-512 instruction whichever CPU built it: it
// is the code an AVX2-only CPU runs), and portable C++ elsewhere. Built and loaded with the
// other CPU kernels by dpserve/engine/kernels/cpu_kernels.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_ops.h"
#include "exp_nonpositive.h"

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
// How the weight is held, from its dtype: fp32, bf16 (as its 16 raw bits), int8 plus scales.
enum Format : int { kF32 = 0, kBf16 = 1, kInt8 = 2, kFormats = 3 };
using Bf16Bits = uint16_t;

// Activation rows per pass over a weight row: their accumulators, the weight vector and an
// activation vector fit AVX2's 16 registers.
constexpr int64_t kGroup = 4;
// Output rows per unit of work handed to a thread.
constexpr int64_t kTile = 16;
// The bytes of weight rows a thread takes through all groups of activation rows before it
// moves on: far below any L2 (256 KB and up), beside the activation rows themselves.
constexpr int64_t kL2TileBytes = 64 * 1024;
// From this many activation rows a pass over a row-major weight asks for the weight this many
// bytes ahead into L2 (prefetcht1), a cache line per line it reads. With a few rows a pass is
// slow enough per byte that the hardware prefetcher no longer keeps the stream ahead of it, and
// the pass waits on memory and computes in turn; reaching ahead overlaps the two. Measured on
// Zen 4, one thread, weights from memory, fp32 (SmolLM2's 1536x576 and an 8192x2048 MLP): 4
// rows 9-16 -> 14-22 GB/s, 8 rows (two passes) 7-11 -> 10-20; at 1-2 rows the hardware
// prefetcher alone is faster (27 against 21 GB/s at one row), so those passes leave it to the
// hardware. 32 KB ahead was as good as 64 KB and better than 0.5-4 KB (the L1 hint, too near:
// no gain). A column-blocked weight's chunks do without (32 KB ahead read 0.85-1.0x as fast
// at 1-4 rows). Where later groups re-read each tile from L2 (more than kGroup rows), a pass
// asks for a whole tile ahead instead: the next tile then streams in while those groups compute
// (SmolLM2-135M's step at 16 rows, 2 threads, AVX2: 33 ms against 36-38 with 32 KB ahead).
// From three groups on, each group's pass asks for its share of the next tile's rows (every
// third or fourth row) rather than every pass for all of them: the tile then streams in over
// all the groups' passes, not in a burst during the first, which waited on memory while the
// later passes left it idle. Measured on Zen 3 (AVX2 only), 2 threads, SmolLM2-135M's
// projections, weights from memory, CPU time, medians of 60 interleaved steps: 16 rows
// 54-68 ms against 65-79 (-15 %), 12 rows 55 against 60; with two groups (5-8 rows) sharing
// was slower (43 against 39 ms), so there both passes ask for every row as before. The
// AVX-512 path's passes ask for every row as before (not measured there).
constexpr int kPrefetchFromRows = 3;
constexpr int64_t kShareAheadFromGroups = 3;
constexpr int64_t kPrefetchBytes = 32 * 1024;
constexpr int64_t kCacheLine = 64;

// One group's operands over `k` columns (a whole row, or a column-blocked weight's chunk): x
// rows `x_stride` floats apart, weight rows `w_stride` elements apart, out rows `out_stride`
// apart, x and w at the columns' first; w's elements are of the format's type (float,
// Bf16Bits or int8_t), `scales` int8's [n] (else null). `accumulate`: add to out (a chunk after
// the first), else store. `ahead`: prefetch the weight this many bytes past each line (0: none).
// `ahead_share` of `ahead_shares`: the weight rows n with n % ahead_shares == ahead_share are
// the ones this pass asks for ahead (AVX2 passes; the others ask for every row).
// `x_bf16`: x rounded to bf16 (the bf16 dot-product passes read it instead of x; x_stride is
// its row stride then), else null.
struct Problem {
  const float* x;
  const Bf16Bits* x_bf16;
  int64_t x_stride;
  const void* w;
  int64_t w_stride;
  const float* scales;
  int64_t k;
  float* out;
  int64_t out_stride;
  bool accumulate;
  int64_t ahead;
  int64_t ahead_share;
  int64_t ahead_shares;
};

// Stores, or adds to what the chunks before stored, weight row n's dot product with row r.
inline void put(const Problem& p, int r, int64_t n, float value) {
  float& slot = p.out[r * p.out_stride + n];
  slot = p.accumulate ? slot + value : value;
}

// The finished dot product of weight row n: int8's times its row's scale.
template <typename W>
inline float scaled(const Problem& p, int64_t n, float sum) {
  if constexpr (std::is_same_v<W, int8_t>) {
    return sum * p.scales[n];
  } else {
    return sum;
  }
}

// One weight element as fp32 (the portable path).
inline float widen(float w) { return w; }
inline float widen(Bf16Bits w) { return std::bit_cast<float>(static_cast<uint32_t>(w) << 16); }
inline float widen(int8_t w) { return static_cast<float>(w); }

// The last `tail` weights of a row, zero-padded to a whole vector: a masked load of bf16 or
// int8 elements needs AVX-512BW (or none exists on AVX2), and the copy costs one short memcpy a
// row. x's tail is loaded masked, zeros beyond it, so the padding adds nothing.
template <typename W, int Lanes>
struct PaddedTail {
  alignas(64) W values[Lanes];
  PaddedTail(const W* w, int64_t tail) {
    std::memset(values, 0, sizeof(values));
    std::memcpy(values, w, static_cast<size_t>(tail) * sizeof(W));
  }
};

// Asks for the weight `ahead` bytes past element c of row w into L2, once per cache line, where
// `ahead` is not 0 (Problem::ahead). Past the weight's end it asks for nothing that exists,
// which a prefetch may: it never faults.
template <typename W>
inline void prefetch_ahead(const W* w, int64_t c, int64_t ahead) {
#if DPSERVE_X86
  if (ahead != 0 && ((static_cast<uint64_t>(c) * sizeof(W)) & (kCacheLine - 1)) == 0) {
    _mm_prefetch(reinterpret_cast<const char*>(w + c) + ahead, _MM_HINT_T1);
  }
#endif
}

// How far ahead a pass asks for weight row n's stream (Problem::ahead_share): 0 for a row
// another group's pass asks for.
inline int64_t ahead_for(const Problem& p, int64_t n) {
  return n % p.ahead_shares == p.ahead_share ? p.ahead : 0;
}

// ---------------------------------------------------------------------------- portable path

template <typename W, int R>
void dots_portable(const Problem& p, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const W* w = static_cast<const W*>(p.w) + n * p.w_stride;
    for (int r = 0; r < R; ++r) {
      const float* x = p.x + r * p.x_stride;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t c = 0; c < p.k; ++c) sum += widen(w[c]) * x[c];
      put(p, r, n, scaled<W>(p, n, sum));
    }
  }
}

#if DPSERVE_X86

// A register-blocked pass's dot products of row r with weight rows n to n + count - 1 (count
// <= 4), summed into `sums`' first lanes: stored (or added) as put does, int8's scaled.
template <typename W>
inline void put_sums(const Problem& p, int r, int64_t n, int count, __m128 sums) {
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, sums);
  for (int j = 0; j < count; ++j) put(p, r, n + j, scaled<W>(p, n + j, lanes[j]));
}

// ------------------------------------------------------------------------------ AVX-512 path

#define DPSERVE_AVX512 target("avx512f")

// 16 weights as fp32: loaded, or widened from 16 bf16 (zero-extended to 32 bits, shifted into
// the high half) or 16 int8 (sign-extended, converted).
__attribute__((DPSERVE_AVX512)) inline __m512 widen16(const float* w) {
  return _mm512_loadu_ps(w);
}
__attribute__((DPSERVE_AVX512)) inline __m512 widen16(const Bf16Bits* w) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
__attribute__((DPSERVE_AVX512)) inline __m512 widen16(const int8_t* w) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}

// Weight rows [begin, end) against R activation rows, 16 weights a step.
template <typename W, int R>
__attribute__((DPSERVE_AVX512)) void dots_avx512(const Problem& p, int64_t begin, int64_t end) {
  const int64_t tail = p.k % 16, body = p.k - tail;
  const __mmask16 mask = static_cast<__mmask16>((1u << tail) - 1);
  for (int64_t n = begin; n < end; ++n) {
    const W* w = static_cast<const W*>(p.w) + n * p.w_stride;
    __m512 acc[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < body; c += 16) {
      prefetch_ahead(w, c, p.ahead);
      const __m512 wv = widen16(w + c);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(p.x + r * p.x_stride + c), acc[r]);
      }
    }
    if (tail != 0) {  // the last K % 16 columns: x masked, w zero-padded
      const PaddedTail<W, 16> padded(w + body, tail);
      const __m512 wv = widen16(padded.values);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_maskz_loadu_ps(mask, p.x + r * p.x_stride + body);
        acc[r] = _mm512_fmadd_ps(wv, xv, acc[r]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      put(p, r, n, scaled<W>(p, n, _mm512_reduce_add_ps(acc[r])));
    }
  }
}

// v's two halves added: 8 lanes whose sum is v's.
__attribute__((DPSERVE_AVX512)) inline __m256 fold_halves(__m512 v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// The four sums of a, b, c, d's lanes, in that order: each folded to 256 bits, then three
// horizontal adds and one add of the halves.
__attribute__((DPSERVE_AVX512)) inline __m128 sum_lanes4_avx512(__m512 a, __m512 b, __m512 c,
                                                               __m512 d) {
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(fold_halves(a), fold_halves(b)),
                                      _mm256_hadd_ps(fold_halves(c), fold_halves(d)));
  return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

// Weight rows per tile of the register-blocked AVX-512 pass: 4 x 4 accumulators, four weight
// vectors and one activation vector, 21 of AVX-512's 32 registers.
constexpr int kTileWeights512 = 4;

// tiles_avx2 (below) on AVX-512: for a group after the first, four weight rows at a time, 16
// columns a step (8 loads for 16 FMAs at R = 4, where dots_avx512 loads 5 for 4). Measured on
// Zen 4, 2 threads, SmolLM2-135M's projections (a whole step's, weights from memory): 16 rows
// 35-39 ms, against 41-46 with dots_avx512 in every group and oneDNN's 33-36 (Zen 4 runs a
// 512-bit FMA as two 256-bit halves: there the AVX2 path's 33 ms was as fast; issue 33).
template <typename W, int R>
__attribute__((DPSERVE_AVX512)) void tiles_avx512(const Problem& p, int64_t begin, int64_t end) {
  constexpr int B = kTileWeights512;
  const int64_t tail = p.k % 16, body = p.k - tail;
  const __mmask16 mask = static_cast<__mmask16>((1u << tail) - 1);
  int64_t n = begin;
  for (; n + B <= end; n += B) {
    const W* w[B];
#pragma GCC unroll 4
    for (int j = 0; j < B; ++j) w[j] = static_cast<const W*>(p.w) + (n + j) * p.w_stride;
    __m512 acc[R][B];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int j = 0; j < B; ++j) acc[r][j] = _mm512_setzero_ps();
    }
    for (int64_t c = 0; c < body; c += 16) {
      __m512 v[B];
#pragma GCC unroll 4
      for (int j = 0; j < B; ++j) {
        prefetch_ahead(w[j], c, p.ahead);
        v[j] = widen16(w[j] + c);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_loadu_ps(p.x + r * p.x_stride + c);
#pragma GCC unroll 4
        for (int j = 0; j < B; ++j) acc[r][j] = _mm512_fmadd_ps(v[j], xv, acc[r][j]);
      }
    }
    if (tail != 0) {  // the last K % 16 columns: x masked, w zero-padded
      __m512 v[B];
#pragma GCC unroll 4
      for (int j = 0; j < B; ++j) {
        const PaddedTail<W, 16> padded(w[j] + body, tail);
        v[j] = widen16(padded.values);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_maskz_loadu_ps(mask, p.x + r * p.x_stride + body);
#pragma GCC unroll 4
        for (int j = 0; j < B; ++j) acc[r][j] = _mm512_fmadd_ps(v[j], xv, acc[r][j]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      put_sums<W>(p, r, n, B, sum_lanes4_avx512(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    }
  }
  if (n < end) dots_avx512<W, R>(p, n, end);
}

// ------------------------------------------------------------- AVX-512-BF16 dot-product path

// A bf16 weight against activations rounded to bf16 too (decode_matmul's `bf16_dots`), where
// the CPU has AVX-512-BF16 (Zen 4 and 5, Intel from Cooper Lake and Sapphire Rapids): one
// VDPBF16PS multiplies 32 pairs of bf16 and adds them into 16 fp32 lanes, where an FMA of
// widened weights takes 16 products and the widening costs a shuffle more. The product of two
// bf16 is exact in fp32 and the sums stay fp32 (the instruction flushes denormal inputs and
// results to zero: values under 1e-38, nowhere near an activation's or a weight's scale), so
// the activation's rounding to bf16 (as the weight's: relative 2^-9 at most) is the one
// approximation added. The activations are rounded once a call (round_to_bf16), then read as
// 2 bytes a value.
#define DPSERVE_AVX512_BF16 target("avx512f,avx512bw,avx512bf16")

// 32 bf16 as VDPBF16PS's operand: loaded whole, or the first `mask`'s elements, zeros beyond.
__attribute__((DPSERVE_AVX512_BF16)) inline __m512bh load_bf16x32(const Bf16Bits* values) {
  return (__m512bh)_mm512_loadu_si512(values);
}
__attribute__((DPSERVE_AVX512_BF16)) inline __m512bh load_bf16x32(const Bf16Bits* values,
                                                                   __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, values);
}

// The first `count` (at most 32) elements set.
inline __mmask32 first_lanes(int64_t count) {
  return static_cast<__mmask32>((uint64_t{1} << count) - 1);
}

// x [rows, k] (rows `stride` floats apart) rounded to bf16, nearest even, into out [rows, k].
__attribute__((DPSERVE_AVX512_BF16)) void round_to_bf16(const float* x, int64_t stride,
                                                         int64_t rows, int64_t k,
                                                         Bf16Bits* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = x + r * stride;
    Bf16Bits* to = out + r * k;
    for (int64_t c = 0; c < k; c += 32) {
      const int64_t left = std::min<int64_t>(32, k - c);
      const __mmask16 low = static_cast<__mmask16>(first_lanes(std::min<int64_t>(16, left)));
      const __mmask16 high =
          static_cast<__mmask16>(first_lanes(std::max<int64_t>(0, left - 16)));
      const __m512bh rounded = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(high, in + c + 16),
                                                   _mm512_maskz_loadu_ps(low, in + c));
      _mm512_mask_storeu_epi16(to + c, first_lanes(left), (__m512i)rounded);
    }
  }
}

// One vector's lane sum by sum_lanes4_avx512's tree (folded to 256 bits, two horizontal adds,
// the halves added), so that a sum is the same bits whichever of the two computes it.
__attribute__((DPSERVE_AVX512_BF16)) inline float sum_lanes_as4(__m512 v) {
  const __m256 folded = fold_halves(v);
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(folded, folded), folded);
  return _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)));
}

// Weight rows [begin, end) against R bf16 activation rows: 32 columns a step into one
// accumulator a row, the last K % 32 masked into the same one, its lanes summed by
// sum_lanes4_avx512's tree. That is tiles_bf16_pairs' arithmetic for every output, so an
// output's bits do not depend on which pass computed it, nor so on how many rows ride the call
// (a prompt chunk's row and a decode step's row of the same activations agree to the bit:
// exact failover rests on it once activations are rounded, weight_format.py). One accumulator
// chain a row waits on the instruction's latency at one row; measured on Zen 4, 2 threads,
// SmolLM2-135M's projections, that step ran as fast as with two chains a row (issue 33).
template <int R>
__attribute__((DPSERVE_AVX512_BF16)) void dots_bf16_pairs(const Problem& p, int64_t begin,
                                                          int64_t end) {
  const int64_t tail = p.k % 32, body = p.k - tail;
  for (int64_t n = begin; n < end; ++n) {
    const Bf16Bits* w = static_cast<const Bf16Bits*>(p.w) + n * p.w_stride;
    __m512 acc[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < body; c += 32) {
      prefetch_ahead(w, c, p.ahead);
      const __m512bh wv = load_bf16x32(w + c);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_dpbf16_ps(acc[r], load_bf16x32(p.x_bf16 + r * p.x_stride + c), wv);
      }
    }
    if (tail != 0) {  // the last K % 32 columns, both operands masked
      const __mmask32 mask = first_lanes(tail);
      const __m512bh wv = load_bf16x32(w + body, mask);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = load_bf16x32(p.x_bf16 + r * p.x_stride + body, mask);
        acc[r] = _mm512_dpbf16_ps(acc[r], xv, wv);
      }
    }
    if constexpr (R == 4) {  // the four rows' sums at once, by the same tree
      alignas(16) float sums[4];
      _mm_store_ps(sums, sum_lanes4_avx512(acc[0], acc[1], acc[2], acc[3]));
      for (int r = 0; r < R; ++r) put(p, r, n, sums[r]);
    } else {
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) put(p, r, n, sum_lanes_as4(acc[r]));
    }
  }
}

// tiles_avx512 with VDPBF16PS: for a group after the first, four weight rows at a time, 32
// columns a step (8 loads for 16 instructions of 32 products each at R = 4).
template <int R>
__attribute__((DPSERVE_AVX512_BF16)) void tiles_bf16_pairs(const Problem& p, int64_t begin,
                                                           int64_t end) {
  constexpr int B = kTileWeights512;
  const int64_t tail = p.k % 32, body = p.k - tail;
  int64_t n = begin;
  for (; n + B <= end; n += B) {
    const Bf16Bits* w[B];
#pragma GCC unroll 4
    for (int j = 0; j < B; ++j) w[j] = static_cast<const Bf16Bits*>(p.w) + (n + j) * p.w_stride;
    __m512 acc[R][B];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int j = 0; j < B; ++j) acc[r][j] = _mm512_setzero_ps();
    }
    for (int64_t c = 0; c < body; c += 32) {
      __m512bh v[B];
#pragma GCC unroll 4
      for (int j = 0; j < B; ++j) {
        prefetch_ahead(w[j], c, p.ahead);
        v[j] = load_bf16x32(w[j] + c);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = load_bf16x32(p.x_bf16 + r * p.x_stride + c);
#pragma GCC unroll 4
        for (int j = 0; j < B; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, v[j]);
      }
    }
    if (tail != 0) {  // the last K % 32 columns, both operands masked
      const __mmask32 mask = first_lanes(tail);
      __m512bh v[B];
#pragma GCC unroll 4
      for (int j = 0; j < B; ++j) v[j] = load_bf16x32(w[j] + body, mask);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = load_bf16x32(p.x_bf16 + r * p.x_stride + body, mask);
#pragma GCC unroll 4
        for (int j = 0; j < B; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, v[j]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      put_sums<Bf16Bits>(p, r, n, B,
                         sum_lanes4_avx512(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
    }
  }
  if (n < end) dots_bf16_pairs<R>(p, n, end);
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

// 8 weights as fp32: loaded, or widened from 8 bf16 or 8 int8 (as widen16, on 256 bits).
__attribute__((DPSERVE_AVX2)) inline __m256 widen8(const float* w) { return _mm256_loadu_ps(w); }
__attribute__((DPSERVE_AVX2)) inline __m256 widen8(const Bf16Bits* w) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
__attribute__((DPSERVE_AVX2)) inline __m256 widen8(const int8_t* w) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

// Weight rows [begin, end) against R activation rows, 16 weights a step into two accumulators a
// row (an FMA's latency is 4 cycles: one accumulator a row held a pass to 8 weights per 4
// cycles, below memory speed at one row on Zen 4: 49 against 73 GB/s from L3), then 8, then
// the tail.
template <typename W, int R>
__attribute__((DPSERVE_AVX2)) void dots_avx2(const Problem& p, int64_t begin, int64_t end) {
  const int64_t tail = p.k % 8, body = p.k - tail, pairs = p.k - p.k % 16;
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(tail)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int64_t n = begin; n < end; ++n) {
    const W* w = static_cast<const W*>(p.w) + n * p.w_stride;
    const int64_t ahead = ahead_for(p, n);
    __m256 acc[R];
    __m256 odd[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = odd[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < pairs; c += 16) {
      prefetch_ahead(w, c, ahead);
      const __m256 even_w = widen8(w + c), odd_w = widen8(w + c + 8);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const float* x = p.x + r * p.x_stride + c;
        acc[r] = _mm256_fmadd_ps(even_w, _mm256_loadu_ps(x), acc[r]);
        odd[r] = _mm256_fmadd_ps(odd_w, _mm256_loadu_ps(x + 8), odd[r]);
      }
    }
    if (pairs != body) {  // one more whole vector
      const __m256 wv = widen8(w + pairs);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(p.x + r * p.x_stride + pairs), acc[r]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = _mm256_add_ps(acc[r], odd[r]);
    if (tail != 0) {  // the last K % 8 columns: x masked, w zero-padded
      const PaddedTail<W, 8> padded(w + body, tail);
      const __m256 wv = widen8(padded.values);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_maskload_ps(p.x + r * p.x_stride + body, mask);
        acc[r] = _mm256_fmadd_ps(wv, xv, acc[r]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      put(p, r, n, scaled<W>(p, n, sum_lanes_avx2(acc[r])));
    }
  }
}

// The four sums of a, b, c, d's lanes, in that order: three horizontal adds and one add of the
// halves, where four sum_lanes_avx2 take twenty operations.
__attribute__((DPSERVE_AVX2)) inline __m128 sum_lanes4_avx2(__m256 a, __m256 b, __m256 c,
                                                           __m256 d) {
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

// Weight rows per tile of the register-blocked AVX2 pass: R activation rows (up to kGroup) by
// kTileWeights weight rows hold 12 accumulators, and the three weight vectors and one activation
// vector fill AVX2's 16 registers.
constexpr int kTileWeights = 3;

// Weight rows [begin, end) against R activation rows, register-blocked, for a group after the
// first (its weight tile in L2): each 8-column step loads three weight vectors and R activation
// vectors for 3R FMAs (7 loads for 12 at R = 4), where dots_avx2 loads R + 1 for R (5 for 4).
// From L2 a pass is bound by its arithmetic, not by the weight's stream, so the loads an FMA
// costs decide its speed. Not for the first group: reading three weight rows side by side from
// memory was slower than dots_avx2's one stream. Measured on Zen 4 held to AVX2, 2 threads,
// SmolLM2-135M's projections (a whole step's, weights from memory, best of 15): 16 rows 33 ms,
// against 40 with dots_avx2 in every group and 43 with oneDNN; 12 rows 29 / 32 / 38; 8 rows
// 24 / 25 / 32 (issue 33). Rows left over from whole tiles go through dots_avx2.
template <typename W, int R>
__attribute__((DPSERVE_AVX2)) void tiles_avx2(const Problem& p, int64_t begin, int64_t end) {
  const int64_t tail = p.k % 8, body = p.k - tail;
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(tail)),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  int64_t n = begin;
  for (; n + kTileWeights <= end; n += kTileWeights) {
    const W* w = static_cast<const W*>(p.w) + n * p.w_stride;
    const W* w1 = w + p.w_stride;
    const W* w2 = w1 + p.w_stride;
    const int64_t a0 = ahead_for(p, n), a1 = ahead_for(p, n + 1), a2 = ahead_for(p, n + 2);
    __m256 acc[R][kTileWeights];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      acc[r][0] = acc[r][1] = acc[r][2] = _mm256_setzero_ps();
    }
    for (int64_t c = 0; c < body; c += 8) {
      prefetch_ahead(w, c, a0);
      prefetch_ahead(w1, c, a1);
      prefetch_ahead(w2, c, a2);
      const __m256 v0 = widen8(w + c), v1 = widen8(w1 + c), v2 = widen8(w2 + c);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_loadu_ps(p.x + r * p.x_stride + c);
        acc[r][0] = _mm256_fmadd_ps(v0, xv, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(v1, xv, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(v2, xv, acc[r][2]);
      }
    }
    if (tail != 0) {  // the last K % 8 columns: x masked, w zero-padded
      const PaddedTail<W, 8> t0(w + body, tail), t1(w1 + body, tail), t2(w2 + body, tail);
      const __m256 v0 = widen8(t0.values), v1 = widen8(t1.values), v2 = widen8(t2.values);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_maskload_ps(p.x + r * p.x_stride + body, mask);
        acc[r][0] = _mm256_fmadd_ps(v0, xv, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(v1, xv, acc[r][1]);
        acc[r][2] = _mm256_fmadd_ps(v2, xv, acc[r][2]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      put_sums<W>(p, r, n, kTileWeights,
                  sum_lanes4_avx2(acc[r][0], acc[r][1], acc[r][2], acc[r][2]));
    }
  }
  if (n < end) dots_avx2<W, R>(p, n, end);
}

#endif  // DPSERVE_X86

using Dots = void (*)(const Problem&, int64_t, int64_t);

// A path's instantiations for each weight format and 1 to kGroup rows: `streamed` for the first
// group of activation rows, which reads each tile of the weight from memory, `cached` for the
// later groups, which re-read it from L2 (the register-blocked pass where the path has one).
struct Path {
  Dots streamed[kFormats][kGroup];
  Dots cached[kFormats][kGroup];
};

// `dots` instantiated for each format (in Format's order) and row count.
#define DPSERVE_TABLE(dots)                                                                 \
  {{&dots<float, 1>, &dots<float, 2>, &dots<float, 3>, &dots<float, 4>},                    \
   {&dots<Bf16Bits, 1>, &dots<Bf16Bits, 2>, &dots<Bf16Bits, 3>, &dots<Bf16Bits, 4>},        \
   {&dots<int8_t, 1>, &dots<int8_t, 2>, &dots<int8_t, 3>, &dots<int8_t, 4>}}

constexpr Path kPortablePath{DPSERVE_TABLE(dots_portable), DPSERVE_TABLE(dots_portable)};
#if DPSERVE_X86
constexpr Path kAvx2Path{DPSERVE_TABLE(dots_avx2), DPSERVE_TABLE(tiles_avx2)};
constexpr Path kAvx512Path{DPSERVE_TABLE(dots_avx512), DPSERVE_TABLE(tiles_avx512)};
// The bf16 dot-product passes for 1 to kGroup rows: streamed, then cached (as Path's).
constexpr Dots kBf16PairsStreamed[kGroup] = {&dots_bf16_pairs<1>, &dots_bf16_pairs<2>,
                                             &dots_bf16_pairs<3>, &dots_bf16_pairs<4>};
constexpr Dots kBf16PairsCached[kGroup] = {&tiles_bf16_pairs<1>, &tiles_bf16_pairs<2>,
                                           &tiles_bf16_pairs<3>, &tiles_bf16_pairs<4>};
#endif

// Whether this CPU runs the bf16 dot-product passes (AVX-512-BF16, with AVX-512BW's masked
// 16-bit loads).
bool cpu_has_bf16_dots() {
#if DPSERVE_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
#else
  return false;
#endif
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

const Path& path_for(Isa isa) {
#if DPSERVE_X86
  if (isa == kAvx512) return kAvx512Path;
  if (isa == kAvx2) return kAvx2Path;
#endif
  return kPortablePath;
}

// The pass for a group of `count` activation rows: the first group's (streamed) or a later
// one's (cached), of `path` for the weight's format, or the bf16 dot-product passes.
Dots pass_for(const Path& path, Format format, bool bf16_dots, bool first, int64_t count) {
#if DPSERVE_X86
  if (bf16_dots) return (first ? kBf16PairsStreamed : kBf16PairsCached)[count - 1];
#endif
  return (first ? path.streamed : path.cached)[format][count - 1];
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

// The weight's format from its dtype; int8 needs its scales, the others take none.
Format weight_format(const at::Tensor& weight, const std::optional<at::Tensor>& scales,
                     int64_t rows_dim) {
  switch (weight.scalar_type()) {
    case at::kFloat:
    case at::kBFloat16:
      TORCH_CHECK(!scales.has_value(), "scales go with an int8 weight only");
      return weight.scalar_type() == at::kFloat ? kF32 : kBf16;
    case at::kChar:
      TORCH_CHECK(scales.has_value() && scales->scalar_type() == at::kFloat &&
                      scales->is_contiguous() && scales->numel() == weight.size(rows_dim),
                  "an int8 weight needs float32 scales [n]");
      return kInt8;
    default:
      TORCH_CHECK(false, "decode_matmul takes a float32, bfloat16 or int8 weight, not ",
                  weight.scalar_type());
  }
  return kF32;  // not reached
}

}  // namespace

namespace dpserve_cpu {

// x [rows, k] float32 (rows may be strided), weight [n, k] or column-blocked [chunks, n,
// width] (chunks * width >= k > (chunks - 1) * width, the last chunk's columns past k unread),
// contiguous (float32, bfloat16, or int8 with float32 scales [n]), bias [n] or none, other
// [rows, n] (rows may be strided) for kMul / kAdd. `bf16_dots`: a bfloat16 weight against x
// rounded to bf16, on the AVX-512 path of a CPU with AVX-512-BF16 (refused elsewhere). Returns
// [rows, n] float32.
at::Tensor decode_matmul(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& other, int64_t epilogue, int64_t isa,
                         const std::optional<at::Tensor>& scales, bool bf16_dots) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "decode_matmul takes float32 activations");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, k] with contiguous rows");
  TORCH_CHECK((weight.dim() == 2 || weight.dim() == 3) && weight.is_contiguous(),
              "weight must be contiguous [n, k] or [chunks, n, width]");
  const bool blocked = weight.dim() == 3;
  const Format format = weight_format(weight, scales, blocked ? 1 : 0);
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(blocked ? 1 : 0);
  // Columns a chunk holds (the whole row where the weight is row-major).
  const int64_t width = weight.size(blocked ? 2 : 1);
  const int64_t chunks = blocked ? weight.size(0) : 1;
  if (blocked) {
    TORCH_CHECK(width > 0 && chunks * width >= k && (chunks - 1) * width < k, "x has ", k,
                " columns, the weight ", chunks, " chunks of ", width);
  } else {
    TORCH_CHECK(width == k, "x has ", k, " columns, the weight ", width);
  }
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
  const Isa resolved = resolve(isa);
  const Path& path = path_for(resolved);
  if (bf16_dots) {
    TORCH_CHECK(format == kBf16, "bf16 dot products take a bfloat16 weight");
    TORCH_CHECK(resolved == kAvx512 && cpu_has_bf16_dots(),
                "bf16 dot products need the AVX-512 path on a CPU with AVX-512-BF16");
  }
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  const Epilogue kind = static_cast<Epilogue>(epilogue);
  const float* x_data = x.data_ptr<float>();
  int64_t x_stride = x.stride(0);
  // x rounded to bf16 for the bf16 dot products, in a buffer this thread keeps (an allocation
  // a call cost more than the rounding on SmolLM2's small projections).
  thread_local std::vector<Bf16Bits> rounded;
  const Bf16Bits* x_bf16 = nullptr;
#if DPSERVE_X86
  if (bf16_dots) {
    rounded.resize(static_cast<size_t>(rows * k));
    round_to_bf16(x_data, x_stride, rows, k, rounded.data());
    x_bf16 = rounded.data();
    x_stride = k;
  }
#endif
  const void* w_data = weight.data_ptr();
  const float* scale_data = format == kInt8 ? scales->data_ptr<float>() : nullptr;
  float* out_data = out.data_ptr<float>();
  const int64_t element = weight.element_size();
  // Weight rows per L2 tile, in the format's bytes of a chunk: every group of activation rows
  // runs over it before the next.
  const int64_t tile_rows = std::max<int64_t>(1, kL2TileBytes / (width * element));
  // Whether later groups re-read each tile from L2 (more rows than one group): the first
  // group's pass then asks for the next tile, a tile ahead, while the later ones compute.
  const bool rereads = rows > kGroup;
  const int64_t ahead_bytes = rereads ? kL2TileBytes : kPrefetchBytes;
  const int64_t tiles = (n + kTile - 1) / kTile;
  // From kShareAheadFromGroups groups the AVX2 passes share the next tile's rows out.
  const int64_t groups = (rows + kGroup - 1) / kGroup;
  const bool share_ahead = resolved == kAvx2 && groups >= kShareAheadFromGroups;
  at::parallel_for(0, tiles, 1, [&](int64_t tile_begin, int64_t tile_end) {
    const int64_t begin = tile_begin * kTile, end = std::min(n, tile_end * kTile);
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      const int64_t column = chunk * width, columns = std::min(width, k - column);
      const char* chunk_data = static_cast<const char*>(w_data) + chunk * n * width * element;
      for (int64_t start = begin; start < end; start += tile_rows) {
        const int64_t stop = std::min(end, start + tile_rows);
        for (int64_t first = 0; first < rows; first += kGroup) {
          const int64_t count = std::min(kGroup, rows - first);
          const int64_t ahead =
              !blocked && (share_ahead || count >= kPrefetchFromRows) ? ahead_bytes : 0;
          const Problem group{x_data + first * x_stride + column,
                              x_bf16 == nullptr ? nullptr : x_bf16 + first * x_stride + column,
                              x_stride,
                              chunk_data,
                              width,
                              scale_data,
                              columns,
                              out_data + first * n,
                              n,
                              chunk > 0,
                              ahead,
                              share_ahead ? first / kGroup : 0,
                              share_ahead ? groups : 1};
          pass_for(path, format, bf16_dots, first == 0, count)(group, start, stop);
        }
      }
    }
    finish(out_data, n, rows, begin, end, bias_data, kind, other_data, other_stride);
  });
  return out;
}

}  // namespace dpserve_cpu

namespace {

// Whether this CPU runs instruction path `isa` (for the tests and the bench).
bool decode_matmul_supports(int64_t isa) {
  return isa >= kAuto && isa <= kAvx512 && (isa == kAuto || cpu_has(static_cast<Isa>(isa)));
}

// Whether decode_matmul takes `bf16_dots` here (the AVX-512 path and AVX-512-BF16).
bool decode_matmul_supports_bf16_dots() { return cpu_has(kAvx512) && cpu_has_bf16_dots(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(dpserve_cpu, m) {
  m.def(
      "decode_matmul(Tensor x, Tensor weight, Tensor? bias, Tensor? other, int epilogue, "
      "int isa, Tensor? scales=None, bool bf16_dots=False) -> Tensor");
  m.def("decode_matmul_supports(int isa) -> bool", &decode_matmul_supports);
  m.def("decode_matmul_supports_bf16_dots() -> bool", &decode_matmul_supports_bf16_dots);
}

TORCH_LIBRARY_IMPL(dpserve_cpu, CPU, m) { m.impl("decode_matmul", &dpserve_cpu::decode_matmul); }
