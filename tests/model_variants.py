"""Random-model variants the model-vs-transformers tests build (a module of its own, not conftest:
several conftest.py files exist, and `from conftest import ...` would pick whichever came first)."""

from __future__ import annotations

from typing import Any

# name -> (architecture class name in transformers, config overrides)
HF_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("LlamaForCausalLM", {"num_key_value_heads": 2}),
    "llama-mqa-tied-llama3rope": (
        "LlamaForCausalLM",
        {
            "num_key_value_heads": 1,
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama-headdim24-linearrope": (
        "LlamaForCausalLM",
        {"head_dim": 24, "num_key_value_heads": 4, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ),
    "mistral-window": ("MistralForCausalLM", {"num_key_value_heads": 2, "sliding_window": 48}),
    "qwen2-tied": ("Qwen2ForCausalLM", {"num_key_value_heads": 2, "tie_word_embeddings": True, "rope_theta": 1e6}),
}
