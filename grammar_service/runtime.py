"""What all streams of one service share: tokenizers, the compiler and its cache, the backend, limits."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc

from grammar_service import metrics
from grammar_service.backend import Backend
from grammar_service.compile_cache import CompileCache
from grammar_service.compile_pool import Compiler
from grammar_service.compiler import CompiledGrammar, grammar_key
from grammar_service.config import Limits
from maskwire.cpus import available_cpus
from maskwire.rpc import RpcError
from maskwire.tokenizer import Fingerprint, Tokenizer
from maskwire.v1 import common_pb2

log = logging.getLogger(__name__)

T = TypeVar("T")


class Runtime:
    def __init__(
        self,
        *,
        tokenizers: Sequence[Tokenizer],
        compiler: Compiler,
        cache: CompileCache,
        backend: Backend,
        limits: Limits,
    ) -> None:
        if not tokenizers:
            raise ValueError("at least one tokenizer is required")
        self.tokenizers = {t.fingerprint: t for t in tokenizers}
        self.default_tokenizer = tokenizers[0]
        self.compiler = compiler
        self.cache = cache
        self.backend = backend
        self.limits = limits
        self.live_requests = 0
        # Slow steps and long replays run here, off the event loop.
        self._work = concurrent.futures.ThreadPoolExecutor(
            max_workers=available_cpus(), thread_name_prefix="session"
        )

    async def in_thread(self, fn: Callable[..., T], *args: object) -> T:
        """Run blocking grammar work on a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._work, fn, *args)

    # -- tokenizers -------------------------------------------------------------------------
    def tokenizer_for(
        self, msg: common_pb2.TokenizerFingerprint, *, field: str, required: bool
    ) -> Tokenizer:
        """The served tokenizer with this fingerprint (FAILED_PRECONDITION when none)."""
        if msg.vocab_size == 0 and not msg.tokens_sha256:
            if required:
                raise RpcError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "the tokenizer fingerprint is required",
                    [(field, "set it from your tokenizer (vocab size, token hash, EOS ids)")],
                )
            return self.default_tokenizer
        fp = Fingerprint.from_proto(msg)
        tok = self.tokenizers.get(fp)
        if tok is None:
            served = "; ".join(f"{t.name}: {f.short()}" for f, t in self.tokenizers.items())
            raise RpcError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"tokenizer mismatch: this service has no tokenizer {fp.short()} (it serves {served})",
                [(field, "does not match any tokenizer this service was started with")],
                reason="TOKENIZER_MISMATCH",
            )
        return tok

    # -- grammars ---------------------------------------------------------------------------
    async def compile(
        self, constraint: common_pb2.Constraint, tokenizer: Tokenizer, client: str = ""
    ) -> tuple[CompiledGrammar, bool]:
        """Compile (or fetch from the cache) for `client` (who asks: a connection). Raises
        RpcError for a bad constraint."""
        self.compiler.check_size(constraint)
        key = grammar_key(constraint, tokenizer)

        async def run() -> CompiledGrammar:
            t0 = time.perf_counter()
            try:
                item = await self.compiler.compile(constraint, tokenizer, key, client)
            except RpcError as e:
                metrics.COMPILE_ERRORS.labels(e.reason or e.code.name).inc()
                raise
            metrics.COMPILE_SECONDS.observe(time.perf_counter() - t0)
            return item

        item, cached = await self.cache.get_or_compile(key, run)
        metrics.CACHE_LOOKUPS.labels("hit" if cached else "miss").inc()
        return item, cached

    def cached(self, grammar_id: str) -> CompiledGrammar | None:
        item = self.cache.get(grammar_id)
        metrics.CACHE_LOOKUPS.labels("hit" if item is not None else "miss").inc()
        return item

    # -- live request accounting ------------------------------------------------------------
    def acquire_request(self, stream_holds: int) -> None:
        """Take a live-request slot for a stream that holds `stream_holds` already
        (RESOURCE_EXHAUSTED when that stream has its share, or the service is full)."""
        share = self.limits.max_requests_per_stream
        if stream_holds >= share:
            raise RpcError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this stream already holds {stream_holds} live requests "
                f"(--max-requests-per-stream {share}); close some, or open more on another stream",
                reason="TOO_MANY_STREAM_REQUESTS",
            )
        if self.live_requests >= self.limits.max_requests:
            raise RpcError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this grammar service already tracks {self.live_requests} requests "
                f"(--max-requests {self.limits.max_requests}); open it on another replica",
                reason="TOO_MANY_REQUESTS",
            )
        self.live_requests += 1
        metrics.LIVE_REQUESTS.set(self.live_requests)

    def release_requests(self, n: int) -> None:
        self.live_requests -= n
        metrics.LIVE_REQUESTS.set(self.live_requests)
