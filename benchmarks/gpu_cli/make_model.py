"""A SmolLM2-135M-shaped Llama with random weights, for the GPU machine (no weights can be
carried there): hidden 576 (llama.cpp's 32-block fallbacks apply), 9/3 heads, intermediate
1536, tied embeddings, SmolLM2's tokenizer (from ``TOKENIZER_DIR``).

    python benchmarks/gpu_cli/make_model.py TOKENIZER_DIR OUT_DIR [N_LAYERS]
"""
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

tok, dst = Path(sys.argv[1]), Path(sys.argv[2])
layers = int(sys.argv[3]) if len(sys.argv) > 3 else 30
cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                  num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
                  head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-5,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
torch.manual_seed(0)
m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
dst.mkdir(parents=True, exist_ok=True)
m.save_pretrained(dst)
for f in tok.iterdir():
    shutil.copy(f, dst / f.name)
print("made", dst, f"{sum(p.numel() for p in m.parameters()) / 1e6:.1f}M parameters")
