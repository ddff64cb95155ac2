"""Prebuilt CPU ops: the names the engine, the images and the dev cluster agree on (stdlib only).

An engine image carries the compiled CPU ops (engine/cpu_ops/*.cpp) built ahead of time by
`tidepool build-ops` for the ISAs it targets, in a directory named by `PREBUILT_DIR_ENV`
(docker/Dockerfile: `IMAGE_PREBUILT_DIR`; the dev cluster: a host directory mounted read-only into the
pods, e2e/controlplane/devcluster_addons.py). The engine loads the best variant this CPU runs and logs
`LOADED_LINE` once; where there is none it builds at run time and logs `COMPILE_LINE` once (a WARNING
when a prebuilt directory was named but has nothing usable, an INFO where none was named). The
real-pod tier reads a new pod's log for these two lines.

ISAs (`ISAS`, best last): `sse4` (x86-64-v2), `avx2` (x86-64-v3: AVX2, FMA, F16C), `avx512` (x86-64-v4:
AVX-512 F/BW/CD/DQ/VL), `armv8` (aarch64, NEON). `auto` (`AUTO_ISA`) names the best one the building
machine runs.

Invariants: the names here are the only spelling of the directory's variable and the two log lines;
`ISAS` lists every name `tidepool build-ops --isa` takes besides `auto`.
"""

from __future__ import annotations

PREBUILT_DIR_ENV = "TIDEPOOL_CPU_OPS_DIR"
IMAGE_PREBUILT_DIR = "/opt/tidepool/cpu-ops"  # where docker/Dockerfile's engine image puts them
MANIFEST_NAME = "manifest.json"  # in the prebuilt directory: which library serves which op and ISA
LOADED_LINE = "CPU ops: prebuilt ops loaded"
COMPILE_LINE = "CPU ops: compiling at run time"
ISAS = ("sse4", "avx2", "avx512", "armv8")
AUTO_ISA = "auto"
