"""GGUF weight groups for the tests of the grouped products: random Q4_1 / Q8_0 blocks, and the tiny Llama of
:mod:`support.hf_tiny` with its block weights replaced by such groups. Needs torch and gguf (the llm extra)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from speculum.models.hf import HFModel
from speculum.models.hf.kernels.gguf_groups import GroupedWeight, pack
from support.hf_tiny import WORDS, save_tiny_model

__all__ = ["BLOCK_BYTES", "LLAMA_GGUF_NAMES", "grouped_tiny", "random_blocks"]

BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}      # one GGUF block: 32 weights with their scale (and minimum)
# transformers' Llama projection -> its tensor name in a GGUF file (GGUF's naming, written out independently
# of the library's table so that the tests check the library against it).
LLAMA_GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                    "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def random_blocks(kind: str, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """GGUF blocks ``(rows, columns / 32 * block bytes)`` of random quants and float16 scales (and minimums)."""
    groups = columns // 32
    blocks = rng.integers(0, 256, size=(rows, groups, BLOCK_BYTES[kind]), dtype=np.uint8)
    scales = (rng.uniform(0.001, 0.05, size=(rows, groups)) * rng.choice([-1, 1], size=(rows, groups)))
    blocks[..., 0:2] = scales.astype(np.float16)[..., None].view(np.uint8)
    if kind == "q4_1":
        blocks[..., 2:4] = (-rng.uniform(0, 0.4, size=(rows, groups))).astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def grouped_tiny(folder: Path, kind: str = "q4_1", head: str | None = None) -> tuple[HFModel, dict[str, GroupedWeight]]:
    """The tiny Llama of ``hf_tiny`` with every block weight replaced by random groups of ``kind``; returns it
    with the groups by GGUF name. The head keeps its float32 weight (its 23 rows do not fill records), unless
    ``head`` names a kind: then the vocabulary is 32 words and the head (tied: the embeddings too) holds
    random groups of that kind (``output.weight``)."""
    words = [*WORDS, *(f"w{i}" for i in range(32 - 3 - len(WORDS)))] if head else WORDS
    path = save_tiny_model(folder, words=words)
    model = HFModel.from_pretrained(path, prepack=False)
    rng = np.random.default_rng(2)
    groups = {}
    with torch.no_grad():
        if head:
            layer = model.module.get_output_embeddings()
            groups["output.weight"] = pack(head, random_blocks(head, *layer.weight.shape, rng))
            layer.weight.copy_(groups["output.weight"].expanded())
        for index, block in enumerate(model.module.model.layers):
            for owner in (block.self_attn, block.mlp):
                for name, gguf_name in LLAMA_GGUF_NAMES.items():
                    layer = getattr(owner, name, None)
                    if layer is None:
                        continue
                    grouped = pack(kind, random_blocks(kind, *layer.weight.shape, rng))
                    layer.weight.copy_(grouped.expanded())
                    groups[f"blk.{index}.{gguf_name}.weight"] = grouped
    return model, groups
