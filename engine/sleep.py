"""Sleep mode on an idle engine: release its KV cache (and, at level 2, its weights) and take them back.

vLLM's two levels (contract/sleep.py has the HTTP side), on a single-process engine:

- level 1: the KV cache's memory is released and the prefix cache emptied; the weights stay in host
  memory. On the CPU they are there already, so nothing is copied; on a GPU each weight storage is
  copied to pinned host memory and its device memory freed.
- level 2: the weights' memory is released too; `wake` reads them again from the model files, which the
  page cache usually holds: the checkpoint's dense loading writes straight into the model's own
  parameters (one write per weight, whatever their layout: only strides differ, shapes never do); a model
  with quantized projections instead loads a fresh model on the CPU, lays it out as the runner did and
  copies every parameter back by name.

How memory is released without moving anything: on the CPU the whole pages inside a tensor are
dropped with ``madvise(MADV_DONTNEED)`` (the KV cache is a private anonymous mapping, engine/hugepages.py,
and every page reads back as zeros when next touched); on a GPU the tensor's storage is resized to
0 and back. Tensor objects, their shapes and (on the CPU) their addresses never change, so the model,
the LoRA slots attached to its layers, the step hooks and the compiled CPU ops keep their references;
on a GPU the captured decode graphs are dropped on wake (they are recaptured on first use, with the
new addresses).

Invariants:
- `sleep` runs only on an engine with no unfinished request (the server aborts them first, as vLLM's
  default ``mode="abort"``): no KV block is referenced, so the prefix cache is emptied whole and no
  released byte is read before it is written again (KV slots are written before attention reads them;
  the whole pages of a released weight are written back before the next step).
- After `wake` the engine computes exactly what it computed before `sleep` (same weights, bit for bit:
  level 1 keeps or copies them back, level 2 reloads them through the same readers as start-up).
- What is released: the runner's KV cache; at level 2 the target model's parameters that the reload
  rewrites whole (all of them for a dense model). A speculative draft model and its own KV cache, the
  LoRA adapters' slots and host copies, and quantized projections (modules, not parameters) stay
  resident: adapters loaded before the sleep keep working without a reload.
- Not for a tensor/pipeline-parallel engine (the other ranks' memory is in their own processes):
  `check_supported` says so, and the server refuses `--enable-sleep-mode` with it at start.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import time
from dataclasses import dataclass

import torch

from .hugepages import HUGE_PAGE
from .loading.formats import open_checkpoint
from .loading.loader import load_model
from .quant.runtime import QuantizedWeight

logger = logging.getLogger(__name__)

MADV_DONTNEED = 4  # <sys/mman.h> on Linux
_PAGE = mmap.PAGESIZE
_libc: ctypes.CDLL | None = None


@dataclass(frozen=True, slots=True)
class SleepReport:
    """What one `sleep` or `wake` did: the level, the bytes released (or restored) and how long it took."""

    level: int
    kv_bytes: int
    weight_bytes: int
    seconds: float


def check_supported(engine: object) -> None:
    """ValueError when sleep mode cannot work on this engine (several ranks)."""
    if getattr(engine, "executor", None) is not None:
        raise ValueError("--enable-sleep-mode: not supported with tensor or pipeline parallelism (several ranks)")


class EngineSleeper:
    """The sleep state of one `LLMEngine`; call it only from the thread that owns the engine."""

    def __init__(self, engine: object) -> None:
        check_supported(engine)
        self.engine = engine
        self.level = 0  # 0: awake
        self._host: dict[int, torch.Tensor] = {}  # GPU level 1: storage key (`_key`) -> pinned host copy
        self._sizes: dict[int, int] = {}  # GPU: storage key -> bytes, for the storages resized to 0
        # Level 2 rereads the dense weights straight into the model's own parameters (one write each) unless the
        # model holds quantized projections: then a fresh model is loaded and its parameters copied by name.
        model = engine.runner.model  # type: ignore[attr-defined]
        self._in_place = not any(isinstance(m, QuantizedWeight) for m in model.modules())

    @property
    def is_sleeping(self) -> bool:
        return self.level > 0

    def sleep(self, level: int) -> SleepReport:
        """Release the KV cache (and at level 2 the weights). Asleep already: a deeper level releases the rest."""
        if level not in (1, 2):
            raise ValueError(f"level: expected 1 or 2, got {level!r}")
        engine = self.engine
        if engine.has_unfinished_requests():  # type: ignore[attr-defined]
            raise RuntimeError("the engine has unfinished requests: abort them before it sleeps")
        started = time.perf_counter()
        kv_bytes = weight_bytes = 0
        if self.level == 0:
            if not engine.kv_cache.pool.reset_prefix_cache():  # type: ignore[attr-defined]
                raise RuntimeError("KV blocks are still referenced: the prefix cache cannot be emptied")
            kv_bytes = sum(self._release(t, whole_storage=True) for t in self._kv_tensors())
        if level == 2 and self.level < 2:
            self._host.clear()  # level 1 -> 2 on a GPU: the host copies are dropped, the files are the source
            weight_bytes = sum(self._release(t) for t in self._weight_storages(self._reloadable()))
        elif level == 1 and self.level == 0 and self._device.type == "cuda":
            weight_bytes = self._offload_weights()
        self.level = max(self.level, level)
        report = SleepReport(self.level, kv_bytes, weight_bytes, time.perf_counter() - started)
        logger.info("asleep (level %d): released %.1f MiB of KV cache and %.1f MiB of weights in %.3f s",
                    report.level, kv_bytes / 2**20, weight_bytes / 2**20, report.seconds)  # fmt: skip
        return report

    def wake(self) -> SleepReport:
        """Take the memory back: weights copied back (GPU level 1) or reloaded (level 2), the KV cache zeroed."""
        started = time.perf_counter()
        level, weight_bytes, kv_bytes = self.level, 0, 0
        if level == 0:
            return SleepReport(0, 0, 0, 0.0)
        cuda = self._device.type == "cuda"
        if level == 2:
            weight_bytes = self._reload_weights()
        elif cuda:
            weight_bytes = self._restore_host_copies()
        for tensor in self._kv_tensors():
            kv_bytes += tensor.numel() * tensor.element_size()
            if cuda:  # CPU pages come back as zeros by themselves
                self._restore(tensor)
                tensor.zero_()
        runner = self.engine.runner  # type: ignore[attr-defined]
        if cuda and runner.graphs is not None:
            runner.graphs.graphs.clear()  # captured with the old addresses: recaptured on first use
        self.level = 0
        report = SleepReport(level, kv_bytes, weight_bytes, time.perf_counter() - started)
        logger.info("awake (was level %d): %.1f MiB of weights restored in %.3f s", level, weight_bytes / 2**20,
                    report.seconds)  # fmt: skip
        return report

    # ---- what is released -----------------------------------------------------------------------
    @property
    def _device(self) -> torch.device:
        return self.engine.runner.device  # type: ignore[attr-defined]

    def _kv_tensors(self) -> list[torch.Tensor]:
        return [t for pair in self.engine.runner.kv_caches for t in pair]  # type: ignore[attr-defined]

    def _named_weights(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.engine.runner.model.named_parameters(remove_duplicate=False))  # type: ignore[attr-defined]

    def _reloadable(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters level 2 releases: those the checkpoint's dense loading writes whole (in place), or all."""
        named = self._named_weights()
        if not self._in_place:
            return named
        rows: dict[str, int] = {}
        for name, _, num_rows in self.engine.runner.model.checkpoint_layout().values():  # type: ignore[attr-defined]
            rows[name] = rows.get(name, 0) + num_rows
        return [(n, p) for n, p in named if rows.get(n) == p.shape[0]]

    def _weight_storages(self, named: list[tuple[str, torch.Tensor]] | None = None) -> list[torch.Tensor]:
        """One tensor per distinct storage of these parameters (default: all); CPU: each tensor's own bytes; GPU:
        each storage whole, left out when a parameter not in `named` shares it."""
        chosen = named if named is not None else self._named_weights()
        names = {n for n, _ in chosen}
        shared = {_key(p) for n, p in self._named_weights() if n not in names and p.device.type != "cpu"}
        seen: dict[int, torch.Tensor] = {}
        for _, param in chosen:
            key = param.data_ptr() if param.device.type == "cpu" else _key(param)
            if key not in shared:
                seen.setdefault(key, param.data)
        return list(seen.values())

    # ---- GPU level 1: weights to host and back --------------------------------------------------
    def _offload_weights(self) -> int:
        total = 0
        for tensor in self._weight_storages():
            storage = tensor.untyped_storage()
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True)
            host.copy_(_bytes_of(storage))
            self._host[_key(tensor)] = host
            total += self._release(tensor)
        torch.cuda.synchronize(self._device)
        return total

    def _restore_host_copies(self) -> int:
        total = 0
        for tensor in self._weight_storages():
            storage = tensor.untyped_storage()
            host = self._host.pop(_key(tensor))
            self._restore(tensor)
            _bytes_of(storage).copy_(host)
            total += host.numel()
        torch.cuda.synchronize(self._device)
        return total

    # ---- level 2: weights reread from the model files -------------------------------------------
    def _reload_weights(self) -> int:
        """Reread the released parameters from the model files: in place (the checkpoint's dense loading into the
        model's own parameters, whatever their layout: shapes are unchanged), else through a fresh model on the
        CPU, laid out as the runner did, copied back by name."""
        engine = self.engine
        config, rc = engine.config, engine.resolved  # type: ignore[attr-defined]
        cuda = self._device.type == "cuda"
        targets = self._reloadable()
        if cuda:
            for tensor in self._weight_storages(targets):
                self._restore(tensor)
        if self._in_place:
            checkpoint = open_checkpoint(config.model, config.quantization)
            try:
                checkpoint.read_config()  # a GGUF file's tensor row order depends on its head counts
                checkpoint.load_dense(engine.runner.model, rc.dtype, False)  # type: ignore[attr-defined]
            finally:
                checkpoint.close()
            return sum(p.numel() * p.element_size() for _, p in targets)
        fresh, _ = load_model(config.model, dtype=rc.dtype, device=torch.device("cpu"), max_positions=rc.max_model_len,
                              show_progress=False, quantization=config.quantization)  # fmt: skip
        if not cuda:
            engine.runner.backend.prepare_model(fresh)  # type: ignore[attr-defined]
        source = dict(fresh.named_parameters(remove_duplicate=False))
        missing = [n for n, p in targets if n not in source or source[n].shape != p.shape or source[n].dtype != p.dtype]
        if missing:
            raise RuntimeError(f"waking from level 2: the reloaded model lacks or reshapes {missing[:5]}")
        total = 0
        with torch.no_grad():
            for name, param in targets:
                param.data.copy_(source[name])
                total += param.numel() * param.element_size()
        return total

    # ---- releasing memory in place ----------------------------------------------------------------
    def _release(self, tensor: torch.Tensor, whole_storage: bool = False) -> int:
        """Give back the memory behind `tensor` without changing the tensor object; the bytes released.

        `whole_storage`: the tensor's storage is its own (a KV tensor, in a mapping of its own: hugepages.zeros),
        so the whole of it goes, the alignment padding around the tensor included."""
        if tensor.device.type == "cpu":
            own = tensor.numel() * tensor.element_size()
            storage = tensor.untyped_storage()
            if whole_storage and storage.nbytes() <= own + 2 * HUGE_PAGE:  # padding only, no other tensor's bytes
                return _dontneed(storage.data_ptr(), storage.nbytes())
            return _dontneed(tensor.data_ptr(), own)
        storage = tensor.untyped_storage()
        size = storage.nbytes()
        if size:
            self._sizes[_key(tensor)] = size
            storage.resize_(0)
        return size

    def _restore(self, tensor: torch.Tensor) -> None:
        """A GPU tensor's storage allocated again at its size (contents undefined until written)."""
        size = self._sizes.pop(_key(tensor), 0)
        if size:
            tensor.untyped_storage().resize_(size)


def _key(tensor: torch.Tensor) -> int:
    """A stable key of the storage behind `tensor` (its StorageImpl; the Python storage objects are not stable)."""
    return tensor.untyped_storage()._cdata


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a flat uint8 tensor (a view, no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _dontneed(address: int, length: int) -> int:
    """``madvise(MADV_DONTNEED)`` over the whole pages inside [address, address + length): bytes dropped.

    The partial pages at either end are left alone (they may hold a neighbour's bytes); a dropped page of
    private memory reads as zeros when next touched (anonymous memory) or as the file's bytes (a file mapping).
    """
    global _libc
    start = -(-address // _PAGE) * _PAGE
    end = (address + length) // _PAGE * _PAGE
    if end <= start:
        return 0
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    rc = _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(MADV_DONTNEED))
    if rc != 0:
        err = ctypes.get_errno()
        logger.warning("sleep: madvise(MADV_DONTNEED) failed (%s); that memory stays resident", os.strerror(err))
        return 0
    return end - start
