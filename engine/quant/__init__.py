"""Weight-only quantization (int8, int4) and GPTQ/AWQ checkpoints, as one transform of a built model.

`quantize` converts dense weights into the runtime layouts, `formats` converts published GPTQ/AWQ
tensors into the same int4 layout, `runtime` holds the modules swapped in for dense weights, `spec`
reads and writes a checkpoint's `quantization_config` (the one source for what it holds), `load`
makes a checkpoint's quantized weights and swaps them in (`apply_quantized`, the transform the loading
layer applies after building the model), `perplexity` measures what quantization costs, and `cli` is
`tidepool quantize` (the only module here that imports the loading layer, whose `quantized_copy` does
the work). The model code never changes.
"""
