"""Weight-only quantization (int8, int4) and GPTQ/AWQ checkpoint loading, applied as a pair.

`quantize` converts dense weights into the runtime layouts, `formats` converts published GPTQ/AWQ
tensors into the same int4 layout, `runtime` holds the modules swapped in for dense weights,
`load` hooks all of it into model loading, `cli` is `tidepool quantize`, and `perplexity`
measures what quantization costs. The model code never changes.
"""
