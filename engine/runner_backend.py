"""Stage 2 of a model-runner step: the runner's attention backend, chosen once per runner.

`choose_backend` picks one of three at construction, and every step then asks it alone how host
lists become device tensors and `AttentionMetadata` (no per-step device branches in the runner):

- `TorchCpuBackend` ("cpu-torch"): the reference path of `layers.attention_backend`. Each step
  precomputes the decode mask and a scratch buffer for the gathered decode K/V (reused by every
  layer); no kernel views, so the layers take torch's SDPA.
- `CompiledCpuBackend` ("cpu-compiled"): the compiled CPU attention op (`cpu_ops`, when it is
  available). Kernel views only: the op reads each sequence's blocks in place, no mask, no scratch.
- `CudaBackend` ("cuda"): the Triton kernels. Kernel views plus the decode mask (heads wider than
  the kernels take SDPA); host lists reach the device through pinned memory, non-blocking.

Both CPU backends lay the model's weights out for the CPU once (`prepare_model`) and keep the
weights and the KV cache in memory advised for transparent huge pages (`hugepages`). A backend
also builds the metadata of a captured decode graph (`graph_metadata`) from the graph's static
inputs; on the CPU that is the fake-capture path of the tests.
"""

from __future__ import annotations

import torch

from . import hugepages
from .config import ModelConfig
from .cuda_graphs import GraphInputs
from .layers.attention_backend import attach_kernel_views, build_decode_mask, build_prefill_mask, cpu_kernel_available
from .layers.attention_metadata import AttentionMetadata, PrefillChunk
from .layers.linear import uses_compiled_gemv
from .layers.weight_layout import apply_weight_layout
from .quant.runtime import prepare_for_cpu
from .runner_inputs import PrefillSpan, StepInputs


class RunnerBackend:
    """What differs between devices and attention paths; the shared metadata layout lives here."""

    name = ""

    def __init__(self, device: torch.device, config: ModelConfig, block_size: int) -> None:
        self.device = device
        self.dtype = config.torch_dtype
        self.block_size = block_size
        self.sliding_window = config.sliding_window
        self.kv_block_shape = (block_size, config.num_key_value_heads, config.head_dim)

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Lay the weights out for this backend, once, before the KV cache is allocated."""

    def zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def to_device(self, values: list[int]) -> torch.Tensor:
        """An int64 tensor on the device."""
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def metadata(self, inputs: StepInputs) -> AttentionMetadata:
        """The step's attention metadata, shared by every layer."""
        tables = inputs.decode_tables
        max_blocks = max((len(t) for t in tables), default=0)
        flat = [b for table in tables for b in table + [0] * (max_blocks - len(table))]
        meta = AttentionMetadata(
            slot_mapping=self.to_device(inputs.slots),
            num_decode_seqs=len(tables),
            decode_block_tables=self.to_device(flat).view(len(tables), max_blocks),
            decode_mask=None,
            prefills=[self._chunk(span) for span in inputs.prefills],
        )
        self._complete(meta, inputs, max_blocks)
        return meta

    def _chunk(self, span: PrefillSpan) -> PrefillChunk:
        mask = build_prefill_mask(span.start, span.num_new, span.context_len, self.sliding_window, self.device)
        return PrefillChunk(span.query_start, span.num_new, span.context_len, self.to_device(span.block_table), mask)

    def _complete(self, meta: AttentionMetadata, inputs: StepInputs, max_blocks: int) -> None:
        """What this backend adds to the shared layout (masks, scratch, kernel views)."""
        raise NotImplementedError

    def _decode_mask(self, inputs: StepInputs, max_blocks: int) -> torch.Tensor:
        return build_decode_mask(inputs.decode_lens, max_blocks * self.block_size, self.sliding_window, self.device)

    def _attach_views(self, meta: AttentionMetadata, inputs: StepInputs) -> None:
        spans = inputs.prefills
        attach_kernel_views(
            meta,
            inputs.decode_tables + [s.block_table for s in spans],
            inputs.decode_lens + [s.context_len for s in spans],
            [1] * len(inputs.decode_tables) + [s.num_new for s in spans],
            self.sliding_window,
        )

    def graph_metadata(self, inputs: GraphInputs) -> AttentionMetadata:
        """The metadata a captured decode forward reads: only views of the graph's static arena."""
        return AttentionMetadata(
            slot_mapping=inputs.slot_mapping,
            num_decode_seqs=inputs.num_seqs,
            decode_block_tables=inputs.block_tables,
            decode_mask=None,
            block_tables=inputs.block_tables,
            seq_lens=inputs.seq_lens,
            cu_seqlens_q=inputs.cu_seqlens_q,
            sliding_window=self.sliding_window,
        )


class TorchCpuBackend(RunnerBackend):
    name = "cpu-torch"

    def prepare_model(self, model: torch.nn.Module) -> None:
        if not uses_compiled_gemv():
            apply_weight_layout(model)  # the torch path: per-shape [in, out] storage, faster single-token matmuls
        prepare_for_cpu(model)  # quantized weights laid out for the compiled ops (a no-op without them)
        hugepages.pack_weights(model)  # after the layout changes: it moves the tensors as they now are

    def zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return hugepages.zeros(shape, self.dtype)  # reserved, not touched: pages fault in (kernel-zeroed) as used

    def _complete(self, meta: AttentionMetadata, inputs: StepInputs, max_blocks: int) -> None:
        if inputs.decode_tables:
            meta.decode_mask = self._decode_mask(inputs, max_blocks)
            shape = (len(inputs.decode_tables) * max_blocks, *self.kv_block_shape)
            meta.decode_kv_scratch = (torch.empty(shape, dtype=self.dtype), torch.empty(shape, dtype=self.dtype))

    def graph_metadata(self, inputs: GraphInputs) -> AttentionMetadata:
        """The torch path indexes with int64 and needs the decode mask (the CPU tests' fake capture)."""
        meta = super().graph_metadata(inputs)
        meta.slot_mapping, meta.decode_block_tables = inputs.slot_mapping.long(), inputs.block_tables.long()
        keys = torch.arange(inputs.block_tables.shape[1] * self.block_size).unsqueeze(0)
        lens = inputs.seq_lens.long().unsqueeze(1)
        mask = keys < lens
        if self.sliding_window is not None:
            mask &= keys > lens - 1 - self.sliding_window
        meta.decode_mask = mask[:, None, None, :]
        return meta


class CompiledCpuBackend(TorchCpuBackend):
    name = "cpu-compiled"

    def _complete(self, meta: AttentionMetadata, inputs: StepInputs, max_blocks: int) -> None:
        self._attach_views(meta, inputs)


class CudaBackend(RunnerBackend):
    name = "cuda"

    def to_device(self, values: list[int]) -> torch.Tensor:
        """Through pinned memory with a non-blocking copy (no sync)."""
        return torch.tensor(values, dtype=torch.long, pin_memory=True).to(self.device, non_blocking=True)

    def _complete(self, meta: AttentionMetadata, inputs: StepInputs, max_blocks: int) -> None:
        if inputs.decode_tables:
            meta.decode_mask = self._decode_mask(inputs, max_blocks)
        self._attach_views(meta, inputs)


def choose_backend(device: torch.device, config: ModelConfig, block_size: int) -> RunnerBackend:
    """The backend for a runner on `device` (on the CPU: compiled when the op is available; may build it)."""
    if device.type == "cuda":
        return CudaBackend(device, config, block_size)
    if cpu_kernel_available():
        return CompiledCpuBackend(device, config, block_size)
    return TorchCpuBackend(device, config, block_size)
