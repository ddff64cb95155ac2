"""LoRA adapters over HTTP, as vLLM serves them: load and unload at run time, `/v1/models` cards, start-up modules.

Role:
- `load` and `unload`, behind vLLM's `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and
  `POST /v1/unload_lora_adapter {"lora_name"}` (app.py registers them only with
  --allow-runtime-lora-updating; without it they are 404, as vLLM without
  VLLM_ALLOW_RUNTIME_LORA_UPDATING). Success is vLLM's 200 plain text ("Success: LoRA
  adapter 'NAME' added successfully." / "... removed successfully."); a refusal is OpenAI's error
  body with the `LoRAError`'s status and code (400: bad name, already loaded, rank too large,
  wrong base architecture, missing or corrupt files, ...; 404: unloading a name not loaded).
- `adapter_cards`: one `/v1/models` entry per adapter, `parent` the base model's id and `root`
  the adapter's path (vLLM's shape).
- `load_modules`: --lora-modules, read and registered on the loading thread before the server
  reports ready; a module that fails stops the start with `LoRAModuleError` naming it.

Invariants:
- An adapter's files are fetched when `lora_path` is a source URI (lora_fetch.py), then read and
  checked (`EngineInfo.load_lora`, pure and thread-safe), in a worker thread, never on the event
  loop or the engine thread, so every other request keeps being
  served while one adapter loads; only the registration (cheap) goes to the engine thread, as a
  `RegisterAdapter` command answered through a future.
- A load never leaves a half-registered adapter: it is registered whole, or refused whole.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from ..lora.types import AdapterInfo, LoRAError, LoRASnapshot
from .async_engine import AsyncEngine, EngineDeadError
from .commands import RegisterAdapter, UnregisterAdapter
from .lora_modules import LoRAModule, adapter_name_error
from .protocol import APIError, ModelCard, StrictModel
from .replies import engine_error

if TYPE_CHECKING:
    from ..lora.peft import LoadedAdapter


logger = logging.getLogger(__name__)


class LoadLoRAAdapterRequest(StrictModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(StrictModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; accepted and ignored (adapters are named)


class LoRAModuleError(RuntimeError):
    """An adapter of --lora-modules could not be loaded: the server does not start."""


async def load(engine: AsyncEngine, model_name: str, name: str, path: str) -> None:
    """Read and check the adapter in a worker thread, then register it on the engine thread."""
    error = adapter_name_error(name, [model_name])
    if error is not None:
        raise APIError(error, param="lora_name")
    if not path:
        raise APIError("lora_path must name the adapter's folder (adapter_config.json and "
                       "adapter_model.safetensors)", param="lora_path")  # fmt: skip
    snapshot, reader = engine.info.lora_snapshot, engine.info.load_lora
    if snapshot is None or reader is None:  # the routes exist only with --enable-lora; kept for a clear answer
        raise APIError("this server was started without --enable-lora", code="lora_disabled")
    if name in snapshot().names():  # before any file is read (the registry's own words); it checks again at register
        raise APIError(f"The lora adapter '{name}' has already been loaded.", param="lora_name", code="invalid_lora")
    try:
        adapter = await engine.guard(asyncio.to_thread(read_adapter, reader, name, path))
        _log_loaded(await engine.ask(RegisterAdapter(adapter, Future())))
    except (LoRAError, EngineDeadError) as err:
        logger.warning("refused to load LoRA adapter %r from %r: %s", name, path, err)
        raise engine_error(err) from err


async def unload(engine: AsyncEngine, name: str) -> None:
    """Unregister the adapter on the engine thread (its admitted requests finish; new ones get 404)."""
    try:
        await engine.ask(UnregisterAdapter(name, Future()))
    except (LoRAError, EngineDeadError) as err:
        raise engine_error(err) from err
    logger.info("unloaded LoRA adapter %r (its admitted requests finish)", name)


def read_adapter(reader: Callable[[str, str], LoadedAdapter], name: str, path: str) -> LoadedAdapter:
    """The adapter at `path` (a folder, or a source URI fetched first: lora_fetch.py), read and checked (blocking).

    lora_fetch (and through it httpx and the download clients) is imported here, at the first adapter
    load, not when the app is built: a server without adapters never needs it.
    """
    from .lora_fetch import local_adapter_folder

    return reader(name, local_adapter_folder(path))


def _log_loaded(info: AdapterInfo) -> None:
    logger.info("loaded LoRA adapter %r from %s: rank %d on %s, %.1f MiB, read in %.2f s", info.name, info.path,
                info.rank, ",".join(info.targets), info.num_bytes / 2**20, info.load_seconds)  # fmt: skip


def adapter_cards(snapshot: LoRASnapshot, base: ModelCard) -> list[ModelCard]:
    """`/v1/models` entries of the loaded adapters: `parent` the base model's id, `root` the adapter's path."""
    return [
        ModelCard(id=a.name, created=base.created, root=a.path, parent=base.id, max_model_len=base.max_model_len)
        for a in snapshot.adapters
    ]


def load_modules(
    register: Callable[[LoadedAdapter], AdapterInfo] | None,
    reader: Callable[[str, str], LoadedAdapter] | None,
    modules: Sequence[LoRAModule],
) -> None:
    """--lora-modules, read and registered (`LoRARegistry.register`, handed over by the loading thread, which owns
    the engine until its thread starts) before the server reports ready."""
    if register is None or reader is None:
        if modules:
            raise LoRAModuleError("--lora-modules needs --enable-lora")
        return
    for module in modules:
        try:
            _log_loaded(register(read_adapter(reader, module.name, module.path)))
        except LoRAError as err:
            raise LoRAModuleError(f"--lora-modules {module.name}={module.path}: {err}") from err
