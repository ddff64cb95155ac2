"""What two Tidepool processes must agree on, in one torch-free place.

The operator renders engine pods from these tables, the engine parses its flags and exports its
metrics from them, the router reads the same metric names, and the download init container shares
its environment names with the operator's builders. Modules:
- `serve_flags`: every `tidepool serve` flag (name, type, default, choices, help, which are managed).
- `quantization`: the weight-quantization method names.
- `metrics_names`, `router_metrics_names`: the Prometheus names the engine and the router export.
- `download`: the download init container's environment and termination-log names.
- `catalogue`: the `tidepool pull` catalogue (catalogue:// model URIs).
- `lora`: the `lora_path` source URIs the operator sends and the engine fetches (hf://org/name[@rev]).
- `wire`: the multi-node control channel's frames (typed, versioned, no pickle), handshake and key file.
- `sleep`: vLLM's sleep-mode endpoints (paths, levels, wake tags, the `sleeping` error code, the gauge's states).
- `cpu_ops`: the prebuilt CPU ops' directory variable, ISA names and log lines (engine, images, dev cluster).

Invariant: standard library only, no import side effects (tests/test_architecture.py checks both),
so the operator image, which has no torch, can import all of it.
"""
