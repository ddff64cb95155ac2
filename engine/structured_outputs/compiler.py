"""Constraints compiled once, off the engine thread, with a bounded cache and a time limit.

Role: the server awaits `compile_async(spec)` (run in this compiler's own small thread pool, at
most `timeout_s`); the compiled `Grammar` then travels with the request to
the engine, which never compiles what the server already did. `compile(spec)` is the
synchronous form, for the offline `LLM` and for requests that arrive without a grammar.

Invariants: the cache holds at most `max_entries` grammars, keyed by `StructuredOutputsParams.key`,
least recently used evicted first; an error is never cached (a schema fixed by its author is tried
again). Every method is thread-safe. A compile that overruns its time limit keeps its pool thread
until it finishes (llguidance's own size and fuel limits bound it), and the pool has
`num_threads` threads: runaway constraints can delay other constraints, never the engine.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from .backend import Grammar, GrammarBackend, GrammarError
from .params import StructuredOutputsParams

DEFAULT_CACHE_ENTRIES = 256
DEFAULT_TIMEOUT_S = 10.0


class GrammarCompiler:
    def __init__(
        self,
        backend_factory: Callable[[], GrammarBackend],
        max_entries: int = DEFAULT_CACHE_ENTRIES,
        num_threads: int = 2,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self._backend_factory = backend_factory
        self._backend: GrammarBackend | None = None
        self.max_entries = max_entries
        self.timeout_s = timeout_s
        self._num_threads = num_threads
        self._pool: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses that compiled successfully
        self.compile_seconds = 0.0  # their total compile time

    @property
    def backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                self._backend = self._backend_factory()
            return self._backend

    def cached(self, spec: StructuredOutputsParams) -> Grammar | None:
        with self._lock:
            grammar = self._cache.get(spec.key)
            if grammar is not None:
                self._cache.move_to_end(spec.key)
            return grammar

    def compile(self, spec: StructuredOutputsParams) -> Grammar:
        """The grammar for `spec`, from the cache or compiled now (in the calling thread)."""
        grammar = self.cached(spec)
        if grammar is not None:
            return grammar
        start = time.perf_counter()
        grammar = self.backend.compile(spec)
        elapsed = time.perf_counter() - start
        with self._lock:
            self.num_compiled += 1
            self.compile_seconds += elapsed
            self._cache[spec.key] = grammar
            self._cache.move_to_end(spec.key)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return grammar

    def submit(self, spec: StructuredOutputsParams) -> Future[Grammar]:
        """`compile(spec)` in the compiler's threads (an already-finished future on a cache hit)."""
        grammar = self.cached(spec)
        if grammar is not None:
            done: Future[Grammar] = Future()
            done.set_result(grammar)
            return done
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._num_threads, thread_name_prefix="grammar-compile")
            pool = self._pool
        return pool.submit(self.compile, spec)

    async def compile_async(self, spec: StructuredOutputsParams) -> Grammar:
        """`compile(spec)` in the compiler's threads, awaited at most `timeout_s` (GrammarError past it): the
        server's path, so an event loop never waits on a compile."""
        try:
            return await asyncio.wait_for(asyncio.wrap_future(self.submit(spec)), self.timeout_s)
        except TimeoutError:
            raise GrammarError(
                f"compiling the {spec.kind} constraint took longer than {self.timeout_s:g} s; "
                "simplify it (fewer alternatives, bounded repetitions)"
            ) from None

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
