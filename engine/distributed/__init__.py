"""Tensor and pipeline parallelism: torch.distributed ranks (gloo on CPU, NCCL on CUDA) behind the engine.

Modules, in the order a step meets them: `executor` (driver side: processes, stand-in model),
`comm` (control channel), `worker` (worker loop, shard loading), `pp` (stages, micro-batches),
`tp` (sharding a built model), `parallel_state` (rank layout, groups), `launch` (spawning,
worker-only nodes). Nothing here is imported or started when tensor_parallel_size ==
pipeline_parallel_size == 1.
"""
