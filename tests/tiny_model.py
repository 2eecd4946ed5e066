"""A tiny random-weight Llama and a real byte-level BPE tokenizer, built offline in ~1 s.

Tests and the engine benchmark need a transformers directory that loads with
``AutoModelForCausalLM`` / ``AutoTokenizer`` exactly like a hub model, without a network.
Everything here is deterministic (fixed corpus, fixed torch seed), so two builds produce the
same weights and the same vocabulary.
"""

from __future__ import annotations

from pathlib import Path

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
