"""Tiny random Hugging Face models saved to disk, for fast tests of the hf backend (no real weights).

Not a test module: imported by test_hf.py and test_cli_generate.py."""
from __future__ import annotations

from pathlib import Path

WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran", "to", "a", "big", "red", "house", "and", "then",
         "it", "was", "very", "happy", "sad", "tree"]


def save_tiny_model(folder: Path, *, words=WORDS, seed: int = 0, layers: int = 3, max_context: int = 64) -> Path:
    """A random 3-block Llama with a word-level tokenizer over ``words`` (+ 3 specials) in ``folder``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate([*specials, *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_context,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    module = LlamaForCausalLM(config)
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
