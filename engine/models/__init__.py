"""Model architectures: `llama` (Llama 2/3, Mistral, Qwen2). Loading them is `engine/loading/`'s job."""
