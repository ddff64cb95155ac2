"""The engine modules the operator side may import: stdlib only (the operator image has no torch).

`tidepool.engine` itself (lazy exports; sets OpenMP defaults via `threads`), the serve-flag table and the
quantization method list it reads, the `tidepool pull` catalogue (plain data: catalogue:// model URIs), and the
download step's contract (`tidepool.engine.download.contract`, whose
package file imports nothing). Tests in tests/operator check that importing the API, the builders and
the table pulls in no other engine module and no torch/numpy.
"""

TORCH_FREE_ENGINE_MODULES = (
    "tidepool.engine",
    "tidepool.engine.threads",
    "tidepool.engine.serve_flags",
    "tidepool.engine.quant",
    "tidepool.engine.quant.methods",
    "tidepool.engine.download",
    "tidepool.engine.download.contract",
    "tidepool.engine.gguf",
    "tidepool.engine.gguf.catalogue",
)
