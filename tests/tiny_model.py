"""A tiny random-weight Llama and a real byte-level BPE tokenizer, built offline in ~1 s.

Tests and the engine benchmark need a transformers directory that loads with
``AutoModelForCausalLM`` / ``AutoTokenizer`` exactly like a hub model, without a network.
Everything here is deterministic (fixed corpus, fixed torch seed), so two builds produce the
same weights and the same vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START, IM_END]

VOCAB_SIZE = 384
MAX_POSITIONS = 256
SEED = 1234

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Enough varied English for a few hundred BPE merges; the text itself does not matter.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a
single step. To be or not to be, that is the question. All that glitters is not gold.
Data parallel inference runs many copies of a model, each serving its own requests.
The coordinator routes requests to engines; every engine batches the requests it holds.
Continuous batching admits new sequences while others are still decoding their tokens.
Hello world! How are you today? I am fine, thank you. What is the capital of France?
Paris is the capital of France. Berlin is the capital of Germany. Rome is in Italy.
One, two, three, four, five, six, seven, eight, nine, ten. Numbers: 0 1 2 3 4 5 6 7 8 9.
Tokens are generated one at a time, and each new token attends to every previous one.
The cache keeps the keys and values of earlier positions so they are not computed again.
Once upon a time there was a small model that wanted to write stories about the sea.
""".strip()


def _train_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps offsets exact for byte-level tokens; no BOS is added
    # automatically (chat templates and callers add special tokens where they want them).
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=MAX_POSITIONS,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_tiny_model(
    directory: Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
) -> Path:
    """Write a tiny Llama (by default hidden 64, 2 layers, 4 heads / 2 KV heads, ~0.1M
    parameters) and its tokenizer. The benchmark asks for a larger one to load the CPU more."""
    return _write_tiny_llama(
        directory,
        _train_tokenizer(),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
    )


def build_tiny_byte_model(directory: Path) -> Path:
    """The tiny Llama over ``ByT5Tokenizer``: a byte-level tokenizer that has no fast
    (``tokenizers``) version, as some models ship. Structured output cannot use it (the
    grammar library needs a fast tokenizer); everything else must."""
    from transformers import ByT5Tokenizer

    return _write_tiny_llama(directory, ByT5Tokenizer())


def _write_tiny_llama(
    directory: Path,
    tokenizer,  # a transformers tokenizer
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
) -> Path:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=MAX_POSITIONS,
        # A wider init than the default 0.02 gives peaked, prompt-dependent next-token
        # distributions, so greedy outputs differ between prompts and are not near-ties.
        initializer_range=0.3,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# ---------------------------------------------------------------- the paged engine's variants

# Each architecture family the paged engine runs, as a tiny random model (models.registry).
VARIANT_KINDS = ("qwen2", "mistral", "llama3-rope-tied-biases", "qwen3", "qwen3-moe", "mixtral")


def variant_config(kind: str, tokenizer: Any) -> Any:
    """A tiny random config of one of ``VARIANT_KINDS`` over ``tokenizer``'s vocabulary."""
    from transformers import (
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "max_position_embeddings": 256,
        "initializer_range": 0.3,
        "eos_token_id": tokenizer.eos_token_id,
    }
    if kind == "qwen2":  # biases on q/k/v, not on o
        return Qwen2Config(**common, tie_word_embeddings=True)
    if kind == "mistral":
        return MistralConfig(**common, sliding_window=None, head_dim=32)
    if kind == "qwen3":
        # Per-head q/k RMSNorm before RoPE; random norm weights (transformers starts them at
        # ones), so a weight left in transformers' dimension order, not RoPE pair order, shows.
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    if kind == "qwen3-moe":
        # Eight experts, two per token, renormalised; the second layer dense (mlp_only_layers).
        return Qwen3MoeConfig(
            **common,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        )
    if kind == "mixtral":
        # Every layer sparse: six experts, two per token, always renormalised.
        return MixtralConfig(
            **common, sliding_window=None, num_local_experts=6, num_experts_per_tok=2
        )
    # Llama 3's RoPE scaling, tied embeddings, biases everywhere in attention and the MLP.
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    return LlamaConfig(
        **common,
        rope_parameters=rope,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
    )


def build_variant_model(kind: str, tiny_model_path: Path, directory: Path) -> Any:
    """A tiny random model of ``kind`` saved in ``directory`` (with the tiny tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    torch.manual_seed(6)
    model = AutoModelForCausalLM.from_config(variant_config(kind, tokenizer)).eval()
    with torch.no_grad():  # norm weights away from their initial ones (every norm alike)
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):  # a MoE router: no ties between experts
                parameter.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model
