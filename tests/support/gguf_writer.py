"""Small GGUF files written by gguf-py's own writer, for the tests of GGUF reading and loading."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


def write_gguf(path: Path, *, architecture: str = "llama", seed: int = 0) -> Path:
    """A small GGUF file: two float32 tensors and one Q8_0 tensor, written by gguf-py's writer."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny")
    writer.add_tensor("token_embd.weight", rng.standard_normal((16, 32)).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    block = gguf.quants.quantize(rng.standard_normal((8, 32)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", block, raw_shape=block.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
