// The CPU kernels one file calls from another: the glue (cpu_kernels.cpp) and the decode matmul
// (decode_matmul.cpp), as decode_layers.cpp runs them a whole decoder layer at a time. Each is
// also a torch operation (torch.ops.dpserve_cpu.*), which says what it takes.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace dpserve_cpu {

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps);

void rotate_and_write_kv(at::Tensor qkv, const at::Tensor& rotation, const at::Tensor& positions,
                         const at::Tensor& slots, at::Tensor kv_pair, int64_t num_heads,
                         int64_t num_kv_heads, const std::optional<at::Tensor>& q_norm,
                         const std::optional<at::Tensor>& k_norm, double eps);

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& kv_pair,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale, bool batch_invariant);

at::Tensor decode_matmul(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& other, int64_t epilogue, int64_t isa,
                         const std::optional<at::Tensor>& scales, bool bf16_dots);

// decode_matmul's epilogues (its Epilogue; cpu_kernels.py's EPILOGUE_*).
inline constexpr int64_t kEpilogueNone = 0, kEpilogueSilu = 1, kEpilogueMul = 2, kEpilogueAdd = 3;

}  // namespace dpserve_cpu
