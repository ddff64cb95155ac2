"""Tidepool: LLM inference on Kubernetes.

The top-level package holds only the version and the `tidepool` console script (`tidepool.cli`);
the engine, operator and kernels live in `tidepool.engine`, `tidepool.operator` and
`tidepool.kernels`, which never import one another except as DESIGN.md allows.
"""

__version__ = "0.1.0"
