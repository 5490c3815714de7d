"""Tiny random Hugging Face models saved to disk, for fast tests of the hf backend (no real weights).

Not a test module: imported by the hf backend's tests and the CLI's."""
from __future__ import annotations

from pathlib import Path

WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran", "to", "a", "big", "red", "house", "and", "then",
         "it", "was", "very", "happy", "sad", "tree"]


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


def tiny_config(family: str, vocab_size: int, layers: int, max_context: int, window: int = 4):
    """A transformers config of ``family`` at toy size: 4 query heads over 2 key/value heads of 8 features;
    Mistral and Gemma 3 with a ``window``-token sliding window (Gemma 3 on every layer but the second, whose
    rotary base differs), Gemma 3 with an attention scale other than its head size's."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_context,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "mistral":
        return MistralConfig(**common, head_dim=8, sliding_window=window)
    if family == "qwen2":       # AutoTokenizer loads Qwen2's tokenizer class, which adds <|endoftext|>
        return Qwen2Config(**{**common, "vocab_size": vocab_size + 1})
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=8)
    if family == "gemma3_text":
        types = ["full_attention" if i % 3 == 1 else "sliding_attention" for i in range(layers)]
        return Gemma3TextConfig(**common, head_dim=8, sliding_window=window, layer_types=types,
                                query_pre_attn_scalar=12)
    raise ValueError(f"no tiny config for {family!r}")


def save_tiny_model(folder: Path, *, words=WORDS, seed: int = 0, layers: int = 3, max_context: int = 64,
                    family: str = "llama") -> Path:
    """A random 3-block model of ``family`` (:func:`tiny_config`) with a word-level tokenizer over ``words``
    (+ 3 specials) in ``folder``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate([*specials, *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>")
    module = AutoModelForCausalLM.from_config(tiny_config(family, len(vocab), layers, max_context))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            # Large random weights: peaked, well-separated next-token distributions (no near-ties).
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.6)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep stderr clean for tests that inspect it
    try:
        module.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    finally:
        hf_logging.enable_progress_bar()
    return folder
