"""The `quantization=` / `--quantization` values: one torch-free list every flag and config imports.

- int8 / int4: Tidepool's weight-only round-to-nearest, applied at load to a dense model (or checked
  against a checkpoint `tidepool quantize` wrote).
- gptq / awq: a published 4-bit checkpoint of that method (checked, converted at load).
- gguf: keep a GGUF file's Q8_0/Q4_0/Q4_1 projections quantized (vLLM's name for GGUF); without it a
  GGUF file is dequantized to the model dtype.

Torch-free on purpose: `tidepool serve`'s argparse and the operator can import it without torch.
"""

from __future__ import annotations

QUANTIZATION_METHODS: tuple[str, ...] = ("int8", "int4", "gptq", "awq", "gguf")
