"""Lossless speculative decoding: proposers (n-gram prompt lookup, a draft model), the rejection
sampler, and the `Speculator` that the engine drives once per step.

Nothing is imported here eagerly: `config` is torch-free (engine_config and the server CLI read it),
the rest needs torch.
"""
