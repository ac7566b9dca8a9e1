"""The config.json of Qwen2.5-7B and Qwen2.5-32B, for plans that need no weights.

Source: the public files on the Hugging Face Hub, huggingface.co/Qwen/Qwen2.5-7B and
huggingface.co/Qwen/Qwen2.5-32B (``config.json``), as reproduced in the repository
citsjtu2020/LLM-Prof (``sglang/Model_Config.md``). Their model cards give 7.61B and 32.5B
parameters (6.53B and 31.0B without the embeddings).
"""

from __future__ import annotations

import json
from pathlib import Path

QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584,
    "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 131072,
    "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": True,
    "use_mrope": False, "use_sliding_window": False, "vocab_size": 152064,
}

QWEN25_32B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 5120,
    "initializer_range": 0.02, "intermediate_size": 27648, "max_position_embeddings": 131072,
    "max_window_layers": 64, "model_type": "qwen2", "num_attention_heads": 40,
    "num_hidden_layers": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 152064,
}


def qwen2_parameters(config: dict) -> int:
    """Qwen2's parameter count by hand: per block q (h x h + h), k and v (kv x h + kv each,
    kv = kv_heads x head_dim), o (h x h), the MLP (3 x h x i) and two norms (2h); then the
    embedding and the untied head (V x h each) and the final norm (h)."""
    h, i, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    block = (h * h + h) + 2 * (kv * h + kv) + h * h + 3 * h * i + 2 * h
    return config["num_hidden_layers"] * block + 2 * vocab * h + h


def write_config(folder: Path, config: dict) -> Path:
    """``config`` as ``folder/config.json``; the folder, as a model path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder
