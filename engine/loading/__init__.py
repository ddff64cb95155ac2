"""The loading layer: what a model path is, and how it becomes a running model, in stages.

Modules, by role:
- `formats`: the format registry, the one place that decides what a path is (a Hugging Face folder
  with safetensors, a GGUF file, a quantized checkpoint: Tidepool int8/int4, GPTQ, AWQ) and which
  checkpoint reader serves it; `read_model_config` is stage 1 alone (no weights).
- `safetensors`: the reader of folders (dense or quantized); `engine/gguf/checkpoint.py` reads GGUF files;
  `sparse_checkpoint`: of 2:4-sparse folders (`engine/sparsity/`: the format, and the runtime weights it swaps in).
- `loader`: `load_model`, the stages: read config -> build the model -> quantization as one transform
  (quantized weights swapped in for dense parameters; the model code never changes) -> load the dense
  weights. Sharding (TP/PP) comes last, in `engine/distributed/worker.py`, on the loaded model.
- `prepare`: `LLM(quantization=...)`: the checkpoint to load for a method (a dense folder quantized once
  into a cache folder); `quantized_copy`: writes such a folder (`tidepool quantize`).

Dependencies run one way: loading -> {gguf, quant, sparsity, models, config}; none of those imports this package
(but `sparsity/prune.py`, `tidepool sparsify`'s writer, which reads folders with `safetensors`).
Importing this package imports nothing.
"""
