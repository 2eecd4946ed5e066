// The paged engine's glue on CPU, fp32: what torch runs as several operations with a tensor
// written and read back between them, here one loop each (issue 16). Built and loaded by
// dpserve/engine/cpu_kernels.py, which says when they are used and what they replace.
//
// Every kernel works on rows of floats whose last dimension is contiguous; the wrapper in
// cpu_kernels.py checks shapes and dtypes, so the checks here only guard the invariants a
// wrong call would turn into out-of-bounds reads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "cpu_ops.h"
#include "exp_nonpositive.h"

// Every function here is in dpserve_cpu (not file-local), so that decode_layers.cpp runs the
// same kernels a layer at a time (cpu_ops.h declares the ones it calls).
namespace dpserve_cpu {

// transformers' LlamaRMSNorm in fp32: x * rsqrt(mean(x^2) + eps) * weight, a row at a time.
at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat);
  TORCH_CHECK(input.dim() == 2 && input.stride(1) == 1 && weight.is_contiguous());
  const int64_t rows = input.size(0), cols = input.size(1), stride = input.stride(0);
  TORCH_CHECK(weight.numel() == cols);
  at::Tensor out = at::empty({rows, cols}, input.options());
  const float* in = input.data_ptr<float>();
  const float* gain = weight.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* x = in + row * stride;
      float* y = dst + row * cols;
      float squares = 0.f;
      for (int64_t c = 0; c < cols; ++c) squares += x[c] * x[c];
      const float inverse = 1.f / std::sqrt(squares / static_cast<float>(cols) + epsilon);
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) y[c] = x[c] * inverse * gain[c];
    }
  });
  return out;
}

// RoPE on the query and key heads of each token's qkv row, in place, then the token's key and
// value copied to its slot of the layer's pool. Heads are in RoPE-pair order (dimension 2i and
// 2i + 1 rotate together); rotation[position] holds (cos, sin) per pair.
// With q_norm and k_norm (Qwen3's per-head RMSNorm, weights [head_dim] in RoPE pair order),
// each query and key head is normalised first, in the same pass: as torch's rms_norm in fp32,
// x * (1 / sqrt(mean(x^2) + eps)) then times the weight.
void rotate_and_write_kv(at::Tensor qkv, const at::Tensor& rotation, const at::Tensor& positions,
                         const at::Tensor& slots, at::Tensor kv_pair, int64_t num_heads,
                         int64_t num_kv_heads, const std::optional<at::Tensor>& q_norm,
                         const std::optional<at::Tensor>& k_norm, double eps) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && kv_pair.scalar_type() == at::kFloat);
  TORCH_CHECK(rotation.scalar_type() == at::kFloat && rotation.is_contiguous());
  TORCH_CHECK(positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && kv_pair.is_contiguous());
  TORCH_CHECK(kv_pair.dim() == 5 && kv_pair.size(0) == 2 && kv_pair.size(3) == num_kv_heads);
  const int64_t tokens = qkv.size(0), head_dim = kv_pair.size(4), half = head_dim / 2;
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim);
  TORCH_CHECK(rotation.dim() == 3 && rotation.size(1) == half && rotation.size(2) == 2);
  TORCH_CHECK(positions.numel() == tokens && slots.numel() == tokens);
  const int64_t row_stride = qkv.stride(0), max_position = rotation.size(0);
  const int64_t slot_width = num_kv_heads * head_dim;
  const int64_t pool_slots = kv_pair.size(1) * kv_pair.size(2);
  float* rows = qkv.data_ptr<float>();
  const float* table = rotation.data_ptr<float>();
  const int64_t* position = positions.contiguous().data_ptr<int64_t>();
  const int64_t* slot = slots.contiguous().data_ptr<int64_t>();
  float* keys = kv_pair.data_ptr<float>();
  float* values = keys + pool_slots * slot_width;
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm come together");
  const float* query_weight = nullptr;
  const float* key_weight = nullptr;
  if (q_norm.has_value()) {
    for (const at::Tensor* weight : {&*q_norm, &*k_norm}) {
      TORCH_CHECK(weight->scalar_type() == at::kFloat && weight->is_contiguous() &&
                  weight->numel() == head_dim);
    }
    query_weight = q_norm->data_ptr<float>();
    key_weight = k_norm->data_ptr<float>();
  }
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t token = begin; token < end; ++token) {
      TORCH_CHECK(position[token] >= 0 && position[token] < max_position, "position out of range");
      TORCH_CHECK(slot[token] >= 0 && slot[token] < pool_slots, "slot out of range");
      float* row = rows + token * row_stride;
      const float* turn = table + position[token] * half * 2;
      for (int64_t head = 0; head < num_heads + num_kv_heads; ++head) {
        float* pairs = row + head * head_dim;
        if (query_weight != nullptr) {
          const float* weight = head < num_heads ? query_weight : key_weight;
          float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
          for (int64_t i = 0; i < head_dim; ++i) squares += pairs[i] * pairs[i];
          const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(head_dim) + epsilon);
#pragma omp simd
          for (int64_t i = 0; i < head_dim; ++i) pairs[i] = pairs[i] * inverse * weight[i];
        }
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = pairs[2 * i], x2 = pairs[2 * i + 1];
          const float cos = turn[2 * i], sin = turn[2 * i + 1];
          pairs[2 * i] = x1 * cos - x2 * sin;
          pairs[2 * i + 1] = x1 * sin + x2 * cos;
        }
      }
      const float* key = row + num_heads * head_dim;
      std::copy(key, key + slot_width, keys + slot[token] * slot_width);
      std::copy(key + slot_width, key + 2 * slot_width, values + slot[token] * slot_width);
    }
  });
}

constexpr int64_t kMaxHeads = 1024;

// Asks for the cache lines of [data, data + count) ahead of use. A sequence's blocks lie
// anywhere in a pool far larger than the caches, so the hardware prefetcher, which follows
// one address stream, starts every block cold; a block ahead is ~1 us of work, enough to hide
// the memory's latency.
inline void prefetch(const float* data, int64_t count) {
  constexpr int64_t kLine = 64 / sizeof(float);
  for (int64_t i = 0; i < count; i += kLine) __builtin_prefetch(data + i, 0, 3);
}

// The same into L2, for the blocks after the first: spread over the reads of the block before
// (a slot's worth per slot), where a block's 190-odd prefetches at once into L1 had stalled on
// the core's few outstanding misses. One sequence of 1,024 tokens (SmolLM2's heads, AMD EPYC Zen
// 4, KV from memory) took 224 -> 107 us a layer on one thread (issue 33).
inline void prefetch_to_l2(const float* data, int64_t count) {
  constexpr int64_t kLine = 64 / sizeof(float);
  for (int64_t i = 0; i < count; i += kLine) __builtin_prefetch(data + i, 0, 2);
}

// One vector register of floats: sixteen with AVX-512, else eight (AVX2's). A 16-float vector
// on a target without AVX-512 is two registers to GCC, but a scalar times it (a weight times a
// value row, below) was built by storing the scalar 16 times to the stack and reloading: decode
// attention ran 6.5x the AVX-512 build's time on the AVX2 build until its vectors were 8 wide.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

// out[:dim] += sum over r < count of weights[r] * rows[r * stride :][:dim]. With Dim a
// compile-time constant the sum stays in vector registers, written to memory once; a float
// array would be stored and reloaded for every row, a chain of store-to-load latencies.
template <int64_t Dim>
void add_weighted_rows(const float* __restrict rows, int64_t stride,
                       const float* __restrict weights, int64_t count, int64_t dim,
                       float* __restrict out) {
  if constexpr (Dim > 0) {
    Lanes sum[Dim / kLanes] = {};
    for (int64_t r = 0; r < count; ++r) {
      const float weight = weights[r];
      for (int64_t chunk = 0; chunk < Dim / kLanes; ++chunk) {
        Lanes lanes;
        std::memcpy(&lanes, rows + r * stride + chunk * kLanes, sizeof(lanes));
        sum[chunk] += weight * lanes;
      }
    }
    for (int64_t chunk = 0; chunk < Dim / kLanes; ++chunk) {
      Lanes lanes;
      std::memcpy(&lanes, out + chunk * kLanes, sizeof(lanes));
      lanes += sum[chunk];
      std::memcpy(out + chunk * kLanes, &lanes, sizeof(lanes));
    }
  } else {
    for (int64_t r = 0; r < count; ++r) {
      const float weight = weights[r];
      const float* row = rows + r * stride;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) out[d] += weight * row[d];
    }
  }
}

// a[:dim] . b[:dim]. With Dim a compile-time constant (a head's 64 or 128) the products are
// summed in Dim / kLanes vectors and reduced once, inlined into the scores' loop.
template <int64_t Dim>
inline float dot_product(const float* __restrict a, const float* __restrict b, int64_t dim) {
  if constexpr (Dim > 0) {
    Lanes sum = {};
    for (int64_t chunk = 0; chunk < Dim / kLanes; ++chunk) {
      Lanes x, y;
      std::memcpy(&x, a + chunk * kLanes, sizeof(x));
      std::memcpy(&y, b + chunk * kLanes, sizeof(y));
      sum += x * y;
    }
    float total = 0.f;
    for (int64_t lane = 0; lane < kLanes; ++lane) total += sum[lane];
    return total;
  } else {
    float total = 0.f;
    for (int64_t d = 0; d < dim; ++d) total += a[d] * b[d];
    return total;
  }
}

// One sequence's new token against its cached tokens [begin, end) (begin a multiple of the
// block size), every query head: the scores, the softmax over those tokens, the values weighted
// and summed into out [heads, dim]. Where a sequence's tokens are split over threads
// (decode_attention), each part also reports per head its highest score and the sum of its
// exponentials (highest and total, else null), from which the parts are merged. The keys and
// values are read once, a slot at a time in block order: the pool is far larger than the
// caches, so these reads are most of the time, and they run at memory speed only as long
// contiguous streams (all KV heads of a slot are contiguous). Dim: the head size where it is 64
// or 128, so that the dot products and sums stay in registers (else 0).
template <int64_t Dim>
void attend(const float* __restrict q, const float* __restrict keys,
            const float* __restrict values, const int32_t* table, int64_t begin, int64_t end,
            int64_t block_size, int64_t num_kv_heads, int64_t group, int64_t dim, float scale,
            float* __restrict scores, float* __restrict out, float* __restrict highest_of,
            float* __restrict total_of) {
  const int64_t heads = num_kv_heads * group, slot_width = num_kv_heads * dim;
  const int64_t block_width = block_size * slot_width, length = end - begin;
  const int64_t first = begin / block_size, last = (end + block_size - 1) / block_size;
  int64_t kv_head_of[kMaxHeads];  // an integer division per head and token costs more than it
  for (int64_t head = 0; head < heads; ++head) kv_head_of[head] = head / group;
  prefetch(keys + static_cast<int64_t>(table[first]) * block_width, block_width);
  for (int64_t index = first; index < last; ++index) {
    const int64_t start = index * block_size - begin;
    const float* block_keys = keys + static_cast<int64_t>(table[index]) * block_width;
    const int64_t stop = std::min(block_size, length - start);
    // The next block's keys, or after the last the first block's values (the V pass), a
    // slot's lines per slot read, into L2.
    const float* following = (index + 1 < last ? keys : values) +
        static_cast<int64_t>(table[index + 1 < last ? index + 1 : first]) * block_width;
    for (int64_t offset = 0; offset < stop; ++offset) {
      const float* slot = block_keys + offset * slot_width;
      prefetch_to_l2(following + offset * slot_width, slot_width);
      for (int64_t head = 0; head < heads; ++head) {
        const float dot = dot_product<Dim>(q + head * dim, slot + kv_head_of[head] * dim, dim);
        scores[head * length + start + offset] = dot * scale;
      }
    }
  }
  for (int64_t head = 0; head < heads; ++head) {
    float* s = scores + head * length;
    float highest = -std::numeric_limits<float>::infinity();
    for (int64_t token = 0; token < length; ++token) highest = std::max(highest, s[token]);
    float total = 0.f;
    for (int64_t token = 0; token < length; ++token) {
      s[token] = exp_nonpositive(s[token] - highest);
      total += s[token];
    }
    const float inverse = 1.f / total;
#pragma omp simd
    for (int64_t token = 0; token < length; ++token) s[token] *= inverse;
    if (highest_of != nullptr) {
      highest_of[head] = highest;
      total_of[head] = total;
    }
  }
  std::fill(out, out + heads * dim, 0.f);
  for (int64_t index = first; index < last; ++index) {
    const int64_t start = index * block_size - begin;
    const float* block_values = values + static_cast<int64_t>(table[index]) * block_width;
    const int64_t stop = std::min(block_size, length - start);
    // The next block's values, a head's share of its lines per head.
    const float* next = values + static_cast<int64_t>(table[std::min(index + 1, last - 1)]) *
                                     block_width;
    const int64_t share = index + 1 < last ? (block_width + heads - 1) / heads : 0;
    // Head by head over the block, which stays in L1 between heads.
    for (int64_t head = 0; head < heads; ++head) {
      prefetch_to_l2(next + head * share, std::min(share, block_width - head * share));
      add_weighted_rows<Dim>(block_values + kv_head_of[head] * dim, slot_width,
                             scores + head * length + start, stop, dim, out + head * dim);
    }
  }
}

// The fewest blocks a part of a split sequence takes: below it the merge and the threads'
// start cost more than the split saves.
constexpr int64_t kMinSplitBlocks = 4;
// The most parts a batch-invariant call splits a sequence into.
constexpr int64_t kMaxInvariantParts = 16;

// A sequence's parts where they may depend on its length alone (decode_attention's
// `batch_invariant`): a power of two (balanced over a power-of-two thread count), one part per
// kMinSplitBlocks blocks at most. At one sequence on two threads that splits from 8 blocks, as
// the thread-count rule does from 4; with more sequences than threads it splits where that rule
// does not, for a merge that costs a few multiplies a head.
int64_t invariant_parts(int64_t blocks) {
  int64_t parts = 1;
  while (parts * 2 <= std::min(kMaxInvariantParts, blocks / kMinSplitBlocks)) parts *= 2;
  return parts;
}

// One new token per sequence attending to its cached tokens in the pool (nothing gathered, no
// mask): query [batch, heads, head_dim] (rows may be strided), kv_pair [2, blocks, block_size,
// kv_heads, head_dim], int32 block tables [batch, width] and lengths [batch] (the new token's
// key included). Returns [batch, heads * head_dim]. `batch_invariant`: a row's result depends
// on its own query, table and length alone, not on the other rows nor the thread count (its
// parts: invariant_parts), so that a prompt chunk's rows, each attending to its own prefix
// (attention.invariant_prefill_attention), agree to the bit with the decode steps that would
// have computed them.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& kv_pair,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale, bool batch_invariant) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && kv_pair.scalar_type() == at::kFloat);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt);
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2));
  TORCH_CHECK(kv_pair.dim() == 5 && kv_pair.size(0) == 2 && kv_pair.is_contiguous());
  const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = kv_pair.size(2), num_kv_heads = kv_pair.size(3);
  TORCH_CHECK(kv_pair.size(4) == head_dim && num_heads % num_kv_heads == 0);
  TORCH_CHECK(num_heads <= kMaxHeads, "more than ", kMaxHeads, " attention heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch);
  TORCH_CHECK(seq_lens.numel() == batch);
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lengths = seq_lens.contiguous();
  const int64_t group = num_heads / num_kv_heads, width = tables.size(1);
  const int64_t num_blocks = kv_pair.size(1), slot_width = num_kv_heads * head_dim;
  const int32_t* table_data = tables.data_ptr<int32_t>();
  const int32_t* length_data = lengths.data_ptr<int32_t>();
  for (int64_t row = 0; row < batch; ++row) {
    const int64_t length = length_data[row];
    TORCH_CHECK(length >= 1 && length <= width * block_size, "sequence length out of range");
    for (int64_t index = 0; index * block_size < length; ++index) {
      const int32_t block = table_data[row * width + index];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id out of range");
    }
  }
  const float* queries = query.data_ptr<float>();
  const float* keys = kv_pair.data_ptr<float>();
  const float* values = keys + num_blocks * block_size * slot_width;
  at::Tensor out = at::empty({batch, num_heads * head_dim}, query.options());
  float* out_data = out.data_ptr<float>();
  const auto attend_heads = head_dim == 64    ? &attend<64>
                            : head_dim == 128 ? &attend<128>
                                              : &attend<0>;
  // A unit of work is a sequence; with fewer sequences than threads (a decode step of one
  // sequence) a sequence's tokens are split into parts of whole blocks, every head in each, so
  // that no thread idles and each reads one contiguous run of slots. SmolLM2-135M at c=1 on two
  // threads spent 6-14 % of its step in attention on one thread; its KV heads split instead
  // (3 over 2 threads) balanced poorly and read every slot in pieces (issue 33).
  const int64_t threads = at::get_num_threads();
  const int64_t wanted = batch < threads ? (threads + batch - 1) / batch : 1;
  // Sequence row's parts are units [part_of[row], part_of[row + 1]).
  std::vector<int64_t> part_of(batch + 1, 0);
  for (int64_t row = 0; row < batch; ++row) {
    const int64_t blocks = (length_data[row] + block_size - 1) / block_size;
    const int64_t parts = batch_invariant ? invariant_parts(blocks)
                                          : std::min(wanted, blocks / kMinSplitBlocks);
    part_of[row + 1] = part_of[row] + std::max<int64_t>(1, parts);
  }
  const int64_t units = part_of[batch];
  if (units == batch) {
    at::parallel_for(0, batch, 1, [&](int64_t first, int64_t last) {
      std::vector<float> scores;
      for (int64_t row = first; row < last; ++row) {
        const int64_t length = length_data[row];
        scores.resize(num_heads * length);
        attend_heads(queries + row * query.stride(0), keys, values, table_data + row * width, 0,
                     length, block_size, num_kv_heads, group, head_dim,
                     static_cast<float>(scale), scores.data(),
                     out_data + row * num_heads * head_dim, nullptr, nullptr);
      }
    });
    return out;
  }
  // Each part's softmax-weighted values over its own tokens, with its highest score and total
  // per head; merged below into the softmax over all of a sequence's tokens.
  std::vector<float> partial(units * num_heads * head_dim);
  std::vector<float> highest(units * num_heads), total(units * num_heads);
  std::vector<int64_t> row_of(units);
  for (int64_t row = 0; row < batch; ++row) {
    for (int64_t unit = part_of[row]; unit < part_of[row + 1]; ++unit) row_of[unit] = row;
  }
  at::parallel_for(0, units, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores;
    for (int64_t unit = first; unit < last; ++unit) {
      const int64_t row = row_of[unit], parts = part_of[row + 1] - part_of[row];
      const int64_t part = unit - part_of[row], length = length_data[row];
      const int64_t blocks = (length + block_size - 1) / block_size;
      const int64_t begin = blocks * part / parts * block_size;
      const int64_t end = std::min(length, blocks * (part + 1) / parts * block_size);
      scores.resize(num_heads * (end - begin));
      // A sequence of one part is written whole, as the branch above writes it.
      const bool whole = parts == 1;
      attend_heads(queries + row * query.stride(0), keys, values, table_data + row * width,
                   begin, end, block_size, num_kv_heads, group, head_dim,
                   static_cast<float>(scale), scores.data(),
                   whole ? out_data + row * num_heads * head_dim
                         : partial.data() + unit * num_heads * head_dim,
                   whole ? nullptr : highest.data() + unit * num_heads,
                   whole ? nullptr : total.data() + unit * num_heads);
    }
  });
  for (int64_t row = 0; row < batch; ++row) {
    if (part_of[row + 1] - part_of[row] == 1) continue;  // written whole
    for (int64_t head = 0; head < num_heads; ++head) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t unit = part_of[row]; unit < part_of[row + 1]; ++unit) {
        top = std::max(top, highest[unit * num_heads + head]);
      }
      float* merged = out_data + (row * num_heads + head) * head_dim;
      std::fill(merged, merged + head_dim, 0.f);
      float sum = 0.f;
      for (int64_t unit = part_of[row]; unit < part_of[row + 1]; ++unit) {
        const int64_t at = unit * num_heads + head;
        const float weight = total[at] * exp_nonpositive(highest[at] - top);
        const float* values_sum = partial.data() + at * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) merged[d] += weight * values_sum[d];
        sum += weight;
      }
      const float inverse = 1.f / sum;
      for (int64_t d = 0; d < head_dim; ++d) merged[d] *= inverse;
    }
  }
  return out;
}

// The LoRA delta of a step's adapted rows (issue 34; lora/sorted_rows.py says when it runs):
// out[row] += (x[row] @ a[adapter]) @ b[adapter] for each adapted row, a [adapters, in, rank]
// holding each adapter's A^T and b [adapters, rank, width] its scaled B^T, ranks zero-padded to
// the largest, a multiple of 16. rows [n] lists the adapted rows adapter by adapter, starts
// [adapters + 1] where each adapter's run begins, and spans [adapters, blocks, 2] for each
// block of kLoraSpanColumns columns the rank rows [first, end) of b that are not all zero
// there: q/k/v's and gate/up's B are block-diagonal, so the expand skips 2/3 and 1/2 of it.
//
// A unit of work is up to kLoraRows rows of one adapter, their sums held in registers: the
// shrink reads each row of A once for all of them, the expand each row of B once per block of
// columns for all of them. Units write disjoint rows of out, so threads share nothing. torch's
// bmm on the same padded batch ran bench/lora.py's shapes at ~24 GMAC/s on one Zen 4 thread
// (oneDNN ~55 on the base projection); plain loops with the sums in memory were slower still.
constexpr int64_t kLoraRows = 4;
constexpr int64_t kLoraSpanColumns = 64;  // cpu_kernels.LORA_SPAN_COLUMNS
constexpr int64_t kLoraVectors = kLoraSpanColumns / kLanes;

inline Lanes load_lanes(const float* from) {
  Lanes lanes;
  std::memcpy(&lanes, from, sizeof(lanes));
  return lanes;
}

inline void store_lanes(float* to, Lanes lanes) { std::memcpy(to, &lanes, sizeof(lanes)); }

// sums[j][first, first + vectors * 16) = x_rows[j] . a's columns there, for the unit's rows.
template <int64_t Rows>
void lora_shrink_chunk(const float* const* x_rows, const float* a, int64_t in, int64_t rank,
                       int64_t first, int64_t vectors, float* sums) {
  Lanes acc[Rows][kLoraVectors] = {};
  for (int64_t k = 0; k < in; ++k) {
    const float* a_row = a + k * rank + first;
    Lanes column[kLoraVectors];
    for (int64_t v = 0; v < vectors; ++v) column[v] = load_lanes(a_row + v * kLanes);
    for (int64_t j = 0; j < Rows; ++j) {
      const float value = x_rows[j][k];
      for (int64_t v = 0; v < vectors; ++v) acc[j][v] += value * column[v];
    }
  }
  for (int64_t j = 0; j < Rows; ++j) {
    for (int64_t v = 0; v < vectors; ++v) {
      store_lanes(sums + j * rank + first + v * kLanes, acc[j][v]);
    }
  }
}

// out_rows[j][column, column + vectors * 16) += sums[j][t] * b[t] there, for t in [t0, t1).
template <int64_t Rows>
void lora_expand_block(const float* sums, const float* b, int64_t rank, int64_t width,
                       int64_t column, int64_t vectors, int64_t t0, int64_t t1,
                       float* const* out_rows) {
  Lanes acc[Rows][kLoraVectors] = {};
  for (int64_t t = t0; t < t1; ++t) {
    const float* b_row = b + t * width + column;
    Lanes row[kLoraVectors];
    for (int64_t v = 0; v < vectors; ++v) row[v] = load_lanes(b_row + v * kLanes);
    for (int64_t j = 0; j < Rows; ++j) {
      const float value = sums[j * rank + t];
      for (int64_t v = 0; v < vectors; ++v) acc[j][v] += value * row[v];
    }
  }
  for (int64_t j = 0; j < Rows; ++j) {
    for (int64_t v = 0; v < vectors; ++v) {
      float* target = out_rows[j] + column + v * kLanes;
      store_lanes(target, load_lanes(target) + acc[j][v]);
    }
  }
}

template <int64_t Rows>
void lora_unit(const float* const* x_rows, float* const* out_rows, const float* a,
               const float* b, const int64_t* spans, int64_t in, int64_t rank, int64_t width,
               float* sums) {
  for (int64_t first = 0; first < rank; first += kLoraSpanColumns) {
    const int64_t vectors = std::min(kLoraVectors, (rank - first) / kLanes);
    lora_shrink_chunk<Rows>(x_rows, a, in, rank, first, vectors, sums);
  }
  const int64_t full = width - width % kLanes;
  for (int64_t column = 0; column < full; column += kLoraSpanColumns) {
    const int64_t vectors = std::min(kLoraVectors, (full - column) / kLanes);
    const int64_t* span = spans + 2 * (column / kLoraSpanColumns);
    lora_expand_block<Rows>(sums, b, rank, width, column, vectors, span[0], span[1], out_rows);
  }
  const int64_t* span = spans + 2 * (full / kLoraSpanColumns);
  for (int64_t j = 0; j < Rows; ++j) {  // the last width % 16 columns
    for (int64_t n = full; n < width; ++n) {
      float total = 0.f;
      for (int64_t t = span[0]; t < span[1]; ++t) total += sums[j * rank + t] * b[t * width + n];
      out_rows[j][n] += total;
    }
  }
}

void lora_delta(const at::Tensor& x, at::Tensor out, const at::Tensor& a, const at::Tensor& b,
                const at::Tensor& spans, const at::Tensor& rows, const at::Tensor& starts) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat);
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat);
  TORCH_CHECK(spans.scalar_type() == at::kLong && rows.scalar_type() == at::kLong &&
              starts.scalar_type() == at::kLong);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1);
  TORCH_CHECK(a.dim() == 3 && a.is_contiguous() && b.dim() == 3 && b.is_contiguous());
  TORCH_CHECK(spans.is_contiguous() && rows.is_contiguous() && starts.is_contiguous());
  const int64_t adapters = a.size(0), in = a.size(1), rank = a.size(2), width = b.size(2);
  const int64_t blocks = (width + kLoraSpanColumns - 1) / kLoraSpanColumns;
  TORCH_CHECK(x.size(1) == in && out.size(1) == width && rank % kLanes == 0);
  TORCH_CHECK(b.size(0) == adapters && b.size(1) == rank && starts.numel() == adapters + 1);
  TORCH_CHECK(spans.dim() == 3 && spans.size(0) == adapters && spans.size(1) == blocks &&
              spans.size(2) == 2);
  const int64_t* span_data = spans.data_ptr<int64_t>();
  for (int64_t index = 0; index < spans.numel(); index += 2) {
    TORCH_CHECK(0 <= span_data[index] && span_data[index] <= span_data[index + 1] &&
                    span_data[index + 1] <= rank,
                "rank span out of range");
  }
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const int64_t* start_of = starts.data_ptr<int64_t>();
  TORCH_CHECK(start_of[0] == 0 && start_of[adapters] == rows.numel());
  std::vector<std::pair<int64_t, int64_t>> units;  // (adapter, first index into rows)
  for (int64_t adapter = 0; adapter < adapters; ++adapter) {
    TORCH_CHECK(start_of[adapter] <= start_of[adapter + 1], "adapter runs out of order");
    for (int64_t first = start_of[adapter]; first < start_of[adapter + 1]; first += kLoraRows) {
      units.emplace_back(adapter, first);
    }
  }
  for (int64_t index = 0; index < rows.numel(); ++index) {
    TORCH_CHECK(row_of[index] >= 0 && row_of[index] < x.size(0) && row_of[index] < out.size(0),
                "row out of range");
  }
  const float* x_data = x.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  const float* a_data = a.data_ptr<float>();
  const float* b_data = b.data_ptr<float>();
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(kLoraRows * rank);
    for (int64_t unit = begin; unit < end; ++unit) {
      const auto [adapter, first] = units[unit];
      const float* x_rows[kLoraRows];
      float* out_rows[kLoraRows];
      const int64_t count = std::min(kLoraRows, start_of[adapter + 1] - first);
      for (int64_t j = 0; j < count; ++j) {
        x_rows[j] = x_data + row_of[first + j] * x_stride;
        out_rows[j] = out_data + row_of[first + j] * out_stride;
      }
      const float* unit_a = a_data + adapter * in * rank;
      const float* unit_b = b_data + adapter * rank * width;
      const int64_t* unit_spans = span_data + adapter * blocks * 2;
      const auto run = count == 4   ? &lora_unit<4>
                       : count == 3 ? &lora_unit<3>
                       : count == 2 ? &lora_unit<2>
                                    : &lora_unit<1>;
      run(x_rows, out_rows, unit_a, unit_b, unit_spans, in, rank, width, sums.data());
    }
  });
}

}  // namespace dpserve_cpu

TORCH_LIBRARY(dpserve_cpu, m) {
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
  m.def(
      "rotate_and_write_kv(Tensor(a!) qkv, Tensor rotation, Tensor positions, Tensor slots, "
      "Tensor(b!) kv_pair, int num_heads, int num_kv_heads, Tensor? q_norm, Tensor? k_norm, "
      "float eps) -> ()");
  m.def(
      "decode_attention(Tensor query, Tensor kv_pair, Tensor block_tables, Tensor seq_lens, "
      "float scale, bool batch_invariant=False) -> Tensor");
  m.def(
      "lora_delta(Tensor x, Tensor(a!) out, Tensor a, Tensor b, Tensor spans, Tensor rows, "
      "Tensor starts) -> ()");
}

TORCH_LIBRARY_IMPL(dpserve_cpu, CPU, m) {
  m.impl("rms_norm", &dpserve_cpu::rms_norm);
  m.impl("rotate_and_write_kv", &dpserve_cpu::rotate_and_write_kv);
  m.impl("decode_attention", &dpserve_cpu::decode_attention);
  m.impl("lora_delta", &dpserve_cpu::lora_delta);
}
