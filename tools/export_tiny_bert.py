"""Export a tiny transformers BertModel to ONNX with bench.engine's exporter (torch.onnx, opset 17, dynamic batch).

Why: tests/data/bert_tiny_exported.onnx is a real exported graph -- transformers' masking_utils mask, Shape/Gather/
Expand arithmetic and all -- small enough to commit, so the passes that must see through an exporter's graph
(fuse_attention, fold_attention_heads, narrow_attention_mask) are tested on the CPU in CI, not only on the GPU
machine. Needs torch and transformers (the GPU machine's image has both):

    python -m tools.export_tiny_bert tests/data/bert_tiny_exported.onnx
"""

from __future__ import annotations

import sys
from pathlib import Path


def export(path: Path, layers: int = 2, hidden: int = 64, heads: int = 2, seq: int = 16) -> Path:
    import onnx
    import torch
    from transformers import BertConfig, BertModel

    from bench.engine import export_onnx, single_output

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=4 * hidden, max_position_embeddings=seq, attn_implementation="eager")
    module = BertModel(config, add_pooling_layer=False).eval()
    ids = torch.randint(0, config.vocab_size, (2, seq))
    export_onnx(single_output(module), ["input_ids", "attention_mask", "token_type_ids"],
                (ids, torch.ones_like(ids), torch.zeros_like(ids)), path)
    onnx.save(onnx.load(str(path)), str(path))  # one file: no external-data side file
    return path


if __name__ == "__main__":
    print(export(Path(sys.argv[1] if len(sys.argv) > 1 else "bert_tiny_exported.onnx")))
