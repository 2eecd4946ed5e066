// Every decoder layer of a decode step in one call on CPU: a Llama-family model's layers (a
// gated MLP, Qwen3's head norms where given) as the same kernels the Python layers call one at
// a time (cpu_ops.h), in the same order with the same operands, so that the result is the
// same to the bit. What it saves is the host's time between them: a SmolLM2-135M step of one
// sequence ran ~270 torch operations from Python, ~1.3 ms of a ~15 ms step outside the
// kernels on two Zen 4 cores (issue 33). Built and loaded with the glue (cpu_kernels.py); held
// by dpserve/engine/layers/cpu_decode_layers.py, which says when a step runs it.

#include <ATen/core/Tensor.h>
#include <ATen/ops/silu.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "cpu_ops.h"

namespace {

using dpserve_cpu::kEpilogueAdd;
using dpserve_cpu::kEpilogueMul;
using dpserve_cpu::kEpilogueNone;
using dpserve_cpu::kEpilogueSilu;

// A projection as layers.linear.Linear holds it for the decode kernel: its weight (fp32,
// bf16 or int8, row-major or column-blocked), bias, int8 scales, and whether bf16 activations
// are rounded for the bf16 dot products.
struct Projection {
  at::Tensor weight;
  std::optional<at::Tensor> bias;
  std::optional<at::Tensor> scales;
  bool bf16_dots = false;

  at::Tensor operator()(const at::Tensor& x, int64_t epilogue, int64_t isa,
                        const std::optional<at::Tensor>& other = std::nullopt) const {
    return dpserve_cpu::decode_matmul(x, weight, bias, other, epilogue, isa, scales, bf16_dots);
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;
  Projection qkv, o, gate, down;
  std::optional<Projection> up;  // none: `gate` is the gate and up projections stacked
  std::optional<at::Tensor> q_norm, k_norm;
};

}  // namespace

struct DecodeLayers : torch::CustomClassHolder {
  int64_t num_heads, num_kv_heads, head_dim, isa;
  double eps, scale;
  bool batch_invariant;  // decode_attention's: the model's prompt chunks attend as rows too
  at::Tensor rotation;  // [positions, head_dim / 2, 2] (cos, sin)
  std::vector<Layer> layers;

  DecodeLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
               double scale, int64_t isa, at::Tensor rotation, bool batch_invariant)
      : num_heads(num_heads),
        num_kv_heads(num_kv_heads),
        head_dim(head_dim),
        isa(isa),
        eps(eps),
        scale(scale),
        batch_invariant(batch_invariant),
        rotation(std::move(rotation)) {
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0);
  }

  // The next layer's weights (`up_weight` absent: `gate_weight` holds gate and up stacked).
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, at::Tensor qkv_weight,
                 std::optional<at::Tensor> qkv_bias, std::optional<at::Tensor> qkv_scales,
                 at::Tensor o_weight, std::optional<at::Tensor> o_bias,
                 std::optional<at::Tensor> o_scales, at::Tensor gate_weight,
                 std::optional<at::Tensor> gate_bias, std::optional<at::Tensor> gate_scales,
                 std::optional<at::Tensor> up_weight, std::optional<at::Tensor> up_bias,
                 std::optional<at::Tensor> up_scales, at::Tensor down_weight,
                 std::optional<at::Tensor> down_bias, std::optional<at::Tensor> down_scales,
                 std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm,
                 bool bf16_dots) {
    Layer layer{std::move(input_norm),
                std::move(post_norm),
                {std::move(qkv_weight), std::move(qkv_bias), std::move(qkv_scales), bf16_dots},
                {std::move(o_weight), std::move(o_bias), std::move(o_scales), bf16_dots},
                {std::move(gate_weight), std::move(gate_bias), std::move(gate_scales), bf16_dots},
                {std::move(down_weight), std::move(down_bias), std::move(down_scales), bf16_dots},
                std::nullopt,
                std::move(q_norm),
                std::move(k_norm)};
    if (up_weight.has_value()) {
      layer.up = Projection{*up_weight, std::move(up_bias), std::move(up_scales), bf16_dots};
    }
    TORCH_CHECK(layer.q_norm.has_value() == layer.k_norm.has_value());
    layers.push_back(std::move(layer));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }

  // `hidden` [rows, hidden] (the embedded tokens, every row a decode row) through every layer;
  // each layer's rotated key and value written to its pool in `kv_pairs`, as the Python
  // layers write them (rotary.RotaryKVWrite, step_attention.StepAttention, mlp.GatedMLP).
  at::Tensor run(at::Tensor hidden, const at::Tensor& positions, const at::Tensor& slots,
                 const std::vector<at::Tensor>& kv_pairs, const at::Tensor& block_tables,
                 const at::Tensor& seq_lens) const {
    TORCH_CHECK(kv_pairs.size() == layers.size(), "one KV pool a layer");
    const int64_t rows = hidden.size(0), q_size = num_heads * head_dim;
    for (size_t index = 0; index < layers.size(); ++index) {
      const Layer& layer = layers[index];
      const at::Tensor& kv_pair = kv_pairs[index];
      at::Tensor normed = dpserve_cpu::rms_norm(hidden, layer.input_norm, eps);
      at::Tensor qkv = layer.qkv(normed, kEpilogueNone, isa);
      dpserve_cpu::rotate_and_write_kv(qkv, rotation, positions, slots, kv_pair, num_heads,
                                       num_kv_heads, layer.q_norm, layer.k_norm, eps);
      const at::Tensor query = qkv.narrow(1, 0, q_size).view({rows, num_heads, head_dim});
      const at::Tensor attended =
          dpserve_cpu::decode_attention(query, kv_pair, block_tables, seq_lens, scale,
                                        batch_invariant);
      hidden = layer.o(attended, kEpilogueAdd, isa, hidden);
      normed = dpserve_cpu::rms_norm(hidden, layer.post_norm, eps);
      at::Tensor activated;
      if (layer.up.has_value()) {
        activated = (*layer.up)(normed, kEpilogueMul, isa, layer.gate(normed, kEpilogueSilu, isa));
      } else {
        const std::vector<at::Tensor> halves = layer.gate(normed, kEpilogueNone, isa).chunk(2, -1);
        activated = at::silu(halves[0]).mul_(halves[1]);
      }
      hidden = layer.down(activated, kEpilogueAdd, isa, hidden);
    }
    return hidden;
  }
};

TORCH_LIBRARY_FRAGMENT(dpserve_cpu, m) {
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, int64_t, at::Tensor, bool>())
      .def("add_layer", &DecodeLayers::add_layer)
      .def("num_layers", &DecodeLayers::num_layers)
      .def("run", &DecodeLayers::run);
}
