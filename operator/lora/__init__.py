"""LoRA adapters declared in `spec.lora`, brought onto every serving engine replica without restarting it.

- `plan`: pure: what to load/unload on one replica, when its readiness gate may open, status.lora.
- `client`: the engine's vLLM-compatible adapter endpoints over HTTP (`ReplicaApi`, pluggable resolver).
- `sync`: the LoRA step of a service's sync (`LoraSync`), its per-service memory (`LoraState`).

What the pod template carries for LoRA (flags, env, the readiness gate) is in builders/lora.py.
"""
