"""Transparent huge pages for the CPU engine's large, read-every-step memory: the weights and the KV cache.

Why: a CPU decode step streams every weight once. With 4 KiB pages that is one TLB entry per
4 KiB and a page walk whenever the stream crosses into a page the TLB has not seen; with 2 MiB
pages the same weights need 512× fewer entries. Measured on the 2-core development VM (SmolLM2-135M,
float32, bs=1, in-process A/B over the same weights): the step was ~1.1-1.2× faster with the
weights in huge pages (bench/README.md, "Weights in huge pages; decode batches above 8"). Linux grants huge pages to
anonymous memory only when the THP mode is ``always``, or ``madvise`` and the range was advised
(``MADV_HUGEPAGE``); most distributions (and this VM) ship ``madvise``, so nothing happens unless
we ask. PyTorch's own switch (``THP_MEM_ALLOC_ENABLE``) is read once, process-wide, when the first
large tensor is allocated; advising our own allocations is explicit and does not depend on import
order.

What: `advised_empty` allocates a 2 MiB-aligned byte buffer and advises it; `pack_weights` copies a
finished model's CPU parameters and buffers into one such arena (each tensor keeps its shape,
strides and values; the Python objects stay the same, only their storage moves; a loader can pack
first and load straight into the arena, so the weights are written once); `zeros` makes
a KV-cache tensor in a fresh anonymous mapping, advised the same way, that is reserved but not
touched: no page exists until the engine first writes (or reads) it, so start-up does not grow with
the KV budget (zeroing 2 GiB up front cost ~5 s of first-touch page faults at every start).

Invariants:
- Values (but for the parameters a loader says it is about to write: `pack_weights`'s
  ``unwritten``), shapes, strides, dtypes and object identity (``module._parameters[name] is param``)
  are unchanged; tied parameters stay one object. Only tensors that own their whole storage and
  are dense are moved (a view into another tensor's storage is left where it is, so nothing that
  shares memory is split).
- Nothing here raises for lack of huge pages: with THP ``never``, on a kernel without THP or off
  Linux, or with ``TIDEPOOL_HUGEPAGES=off``, tensors stay where they were (`pack_weights`) or are
  fresh mappings without the advice (`zeros`), and the log says why.
- `zeros` is all zeros without writing a byte: its memory is a new private anonymous mapping
  (``mmap(MAP_PRIVATE | MAP_ANONYMOUS)``), which the kernel guarantees reads as zeros (each page is
  a zero-filled page, or the shared zero page, on first touch; never another process's or an
  earlier allocation's bytes, unlike a heap block a malloc could reuse). Stale bytes are therefore
  never read; the engine does not rely on the zeros anyway: the KV cache manager hands a block to
  a request that writes a slot's keys and values before attention reads that slot, and the padded
  reads of the torch decode path only need finite values, which zeros are.
- Run before anything caches raw pointers (the compiled decode step re-checks its pointers every
  step anyway).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
ALIGN = 64  # each tensor starts on a cache line
MODE_ENV = "TIDEPOOL_HUGEPAGES"  # auto (default) | off
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = THP_ENABLED) -> str:
    """The kernel's THP mode: ``always``, ``madvise`` or ``never`` (the bracketed word), or ``unavailable``."""
    try:
        text = path.read_text()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unavailable"


def unavailable_reason(environ: dict[str, str] | None = None, mode: str | None = None) -> str | None:
    """Why huge pages will not be asked for here, or None when they will."""
    env = os.environ if environ is None else environ
    if env.get(MODE_ENV, "auto").strip().lower() in ("off", "0", "false", "no"):
        return f"{MODE_ENV}=off"
    if not sys.platform.startswith("linux"):
        return f"not Linux ({sys.platform})"
    mode = thp_mode() if mode is None else mode
    if mode in ("never", "unavailable"):
        return f"transparent huge pages are {mode} on this kernel ({THP_ENABLED})"
    return None


_libc: ctypes.CDLL | None = None


def _madvise(address: int, length: int) -> int:
    """``madvise(address, length, MADV_HUGEPAGE)``: 0, or the errno."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    rc = _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), ctypes.c_int(MADV_HUGEPAGE))
    return 0 if rc == 0 else ctypes.get_errno()


def advised_empty(num_bytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `num_bytes`, starting on a 2 MiB boundary and advised for huge pages (`fresh_zeros`).

    Callers treat it as uninitialised and write it. Advise before the first touch: the kernel then faults
    the range in 2 MiB at a time. A failed madvise (old kernel, THP compiled out) leaves an ordinary buffer
    and logs a warning.
    """
    return fresh_zeros(num_bytes, advise=True)


def huge_page_bytes(tensor: torch.Tensor, smaps: Path = Path("/proc/self/smaps")) -> int:
    """Bytes of huge pages (``AnonHugePages``) in the mappings that hold `tensor`'s storage; 0 if unknown."""
    return mapped_bytes(tensor, "AnonHugePages", smaps)


def mapped_bytes(tensor: torch.Tensor, field: str, smaps: Path = Path("/proc/self/smaps")) -> int:
    """`field` (``Rss``, ``AnonHugePages``, ...) summed over the mappings holding `tensor`'s storage; 0 if unknown."""
    storage = tensor.untyped_storage()
    lo, hi = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    total, inside, key = 0, False, f"{field}:"
    try:
        with smaps.open() as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    start, end = (int(part, 16) for part in head.split("-"))
                    inside = start < hi and lo < end
                elif inside and head == key:
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0
    return total


def fresh_zeros(num_bytes: int, *, advise: bool) -> torch.Tensor:
    """A uint8 CPU tensor of `num_bytes` zeros in a new anonymous mapping, 2 MiB-aligned, no page touched yet.

    `advise`: ask for huge pages (``MADV_HUGEPAGE``) before the first touch. The tensor keeps the
    mapping alive (it is unmapped when the last view of it is freed).
    """
    length = -(-max(num_bytes, 1) // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, length + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # fd -1: MAP_ANONYMOUS, kernel-zeroed
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # shares the pages (no copy) and holds `mapping`
    offset = (-raw.data_ptr()) % HUGE_PAGE
    buffer = raw[offset : offset + num_bytes]
    error = _madvise(buffer.data_ptr(), length) if advise and num_bytes else 0
    if error:
        logger.warning("huge pages: madvise failed (%s); this buffer uses ordinary pages", os.strerror(error))
    return buffer


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor (e.g. a KV cache), reserved, not touched (see the module doc); huge-page advised if allowed."""
    numel = 1
    for size in shape:
        numel *= size
    element = torch.empty((), dtype=dtype).element_size()
    buffer = fresh_zeros(numel * element, advise=unavailable_reason() is None)
    return buffer.view(dtype).view(shape)


@dataclass(slots=True)
class PackReport:
    moved: int = 0  # tensors now in the arena
    num_bytes: int = 0  # their bytes
    skipped: int = 0  # CPU tensors left in place (views of shared storage, or not dense)
    huge_bytes: int = 0  # of the arena, bytes the kernel backs with huge pages (counted by the first `summary`)
    reason: str | None = None  # why nothing was packed, when nothing was
    arena: torch.Tensor | None = field(default=None, repr=False)  # the packed bytes, when something was packed

    def summary(self) -> str:
        if self.reason is not None:
            return f"weights stay in ordinary pages: {self.reason}"
        if self.arena is not None and not self.huge_bytes:
            self.huge_bytes = huge_page_bytes(self.arena)
        return (
            f"{self.moved} weight tensors ({self.num_bytes / 2**20:.1f} MiB) in one arena advised for huge pages, "
            f"{self.huge_bytes / 2**20:.0f} MiB of it backed by 2 MiB pages"
            + (f"; {self.skipped} tensors sharing storage left in place" if self.skipped else "")
        )


def _owns_dense_storage(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The strides to rebuild `tensor` with, when it is dense and alone in its storage; else None."""
    if tensor.storage_offset() != 0 or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        return None
    strides = torch.empty_like(tensor, device="meta").stride()  # dense layouts keep their strides
    return strides if strides == tensor.stride() else None


def pack_weights(model: nn.Module, *, unwritten: Collection[nn.Parameter] = ()) -> PackReport:
    """Move `model`'s CPU parameters and buffers into one huge-page-advised arena (in place); see the module doc.

    `unwritten`: parameters the caller is about to overwrite whole (a loader packing before it loads,
    so the weights are written once, straight into the arena): they move without their values and
    read as garbage until written. Then nothing is logged here; the caller logs `report` (the arena's
    huge pages are counted when `summary` is first asked for, after the load has touched them).
    """
    report = PackReport(reason=unavailable_reason())
    if report.reason is not None:
        logger.info("huge pages: %s", report.summary())
        return report
    skip_copy = {id(param) for param in unwritten}
    tensors: dict[int, tuple[torch.Tensor, tuple[int, ...]]] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type != "cpu" or id(tensor) in tensors or tensor.numel() == 0:
            continue
        strides = _owns_dense_storage(tensor)
        if strides is None:
            report.skipped += 1
            continue
        tensors[id(tensor)] = (tensor, strides)
    if not tensors:
        report.reason = "no CPU weights to move"
        return report
    sizes = [-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t, _ in tensors.values()]
    report.arena = arena = advised_empty(sum(sizes))
    offset = 0
    with torch.no_grad():
        for (tensor, strides), size in zip(tensors.values(), sizes, strict=True):
            nbytes = tensor.numel() * tensor.element_size()
            view = arena[offset : offset + nbytes].view(tensor.dtype).as_strided(tensor.shape, strides)
            if id(tensor) not in skip_copy:
                view.copy_(tensor)
            tensor.data = view  # the old storage is freed here, so the peak is one tensor over the arena
            offset += size
            report.moved += 1
            report.num_bytes += nbytes
    if not skip_copy:
        logger.info("huge pages: %s", report.summary())
    return report
