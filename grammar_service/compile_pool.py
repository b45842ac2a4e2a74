"""`Compiler`: runs the compile stages of `grammar_service.compiler` off the event loop, safely.

    size check -> poison check -> translate + bounds + schema layer (thread) -> verify (sandbox
    child, or a thread with --no-compile-sandbox) -> build the template matcher (thread, journaled)

When the grammar compiler refuses a JSON schema the layer prepared in a way one of its fallbacks
avoids (e.g. overlapping patternProperties), the constraint is translated again with that
fallback and verified again, within the same deadline.

One deadline covers the whole compile, queueing included. A constraint whose compile kills a
sandbox child, or this process, is remembered in the `PoisonList` and refused from then on with
`INVALID_ARGUMENT` (reason `CONSTRAINT_CRASHED`). The threads run with the large stack that
`use_large_thread_stacks` sets, so a deep grammar that the bounds let through does not overflow.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from grammar_service import metrics
from grammar_service.compiler import (
    CompiledGrammar,
    ParserLimits,
    Translation,
    build_template,
    constraint_kind,
    error_field,
    grammar_key,
    input_bytes,
    retry_relaxed,
    translate,
    verify,
)
from grammar_service.config import CompileSettings, ConstraintBounds
from grammar_service.poison import PoisonList
from grammar_service.sandbox import Sandbox, SandboxCrashed, SandboxUnavailable
from maskwire.rpc import RpcError
from maskwire.tokenizer import Tokenizer
from maskwire.v1 import common_pb2

T = TypeVar("T")


def use_large_thread_stacks(stack_mb: int) -> None:
    """Threads started from now on get `stack_mb` of stack (llguidance recurses natively over a
    grammar's structure; the default 8 MB holds about a thousand levels)."""
    threading.stack_size(stack_mb << 20)


def crashed_error(kind: str, why: str) -> RpcError:
    field = error_field(kind)
    return RpcError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"constraint crashed the grammar service: {why}; it is refused from now on",
        [(field, "compiling this constraint crashed a grammar-service process")],
        reason="CONSTRAINT_CRASHED",
    )


class Compiler:
    """Compiles constraints with a per-compile deadline, a size limit and crash isolation."""

    def __init__(
        self,
        *,
        limits: ParserLimits,
        bounds: ConstraintBounds = ConstraintBounds(),  # noqa: B008 (frozen, immutable)
        settings: CompileSettings = CompileSettings(),  # noqa: B008 (frozen, immutable)
        sandbox: Sandbox | None = None,
    ) -> None:
        """`settings`: threads, deadline, size limit, the default schema mode (for JSON schemas
        whose request does not say) and the poison list's place and TTL; the cache settings
        are the runtime's. `sandbox` None verifies in this process (tests,
        `--no-compile-sandbox`)."""
        self.limits = limits
        self.schema_mode = common_pb2.SchemaMode.Value(
            f"SCHEMA_MODE_{settings.schema_mode.upper()}"
        )
        self.bounds = bounds
        self.timeout_s = settings.timeout_s
        self.max_schema_bytes = settings.max_schema_bytes
        self.sandbox = sandbox
        self.poison = PoisonList(settings.state_dir, settings.poison_ttl_s)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, settings.threads), thread_name_prefix="compile"
        )
        self._tokenizer_index: dict[int, int] = {}

    async def start(self, tokenizers: list[Tokenizer], timeout_s: float = 120.0) -> None:
        """Start the sandbox's children, where not started yet, for these tokenizers (in the order
        the sandbox got) and wait until one can compile. Raises SandboxUnavailable after
        `timeout_s`."""
        self._tokenizer_index = {id(t): i for i, t in enumerate(tokenizers)}
        if self.sandbox is not None:
            self.sandbox.start()
            await self.sandbox.wait_ready(timeout_s)

    def check_size(self, constraint: common_pb2.Constraint) -> None:
        """Refuse a constraint whose strings, text and options together, pass --max-schema-bytes;
        the violation names its largest field."""
        sizes = input_bytes(constraint)
        total = sum(sizes.values())
        if total > self.max_schema_bytes:
            field = max(sizes, key=lambda f: sizes[f])
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"constraint is {total} bytes (its text and options together); this service "
                f"accepts at most {self.max_schema_bytes} (--max-schema-bytes)",
                [
                    (
                        field,
                        f"{sizes[field]} bytes; the constraint may have at most "
                        f"{self.max_schema_bytes} in all (--max-schema-bytes)",
                    )
                ],
                reason="CONSTRAINT_TOO_LARGE",
            )

    def check_poison(self, constraint: common_pb2.Constraint, key: str) -> None:
        why = self.poison.reason(key)
        if why is not None:
            metrics.POISON_REQUESTS.inc()
            raise crashed_error(constraint.WhichOneof("kind") or "", why)

    async def compile(
        self,
        constraint: common_pb2.Constraint,
        tokenizer: Tokenizer,
        grammar_id: str = "",
        client: str = "",
    ) -> CompiledGrammar:
        """Compile off the event loop (`client`: who asks, for the sandbox's fair share).
        Raises RpcError: INVALID_ARGUMENT for a bad, too complex or poisoned constraint,
        DEADLINE_EXCEEDED after `timeout_s`, UNAVAILABLE when the sandbox cannot run."""
        self.check_size(constraint)
        key = grammar_id or grammar_key(constraint, tokenizer)
        self.check_poison(constraint, key)
        kind = constraint_kind(constraint)
        t0 = time.perf_counter()
        try:
            translation, template, warnings = await self._translate_and_verify(
                constraint, tokenizer, key, error_field(kind), client
            )
        except RpcError:
            raise
        except Exception as e:  # never let a library failure become a stack trace on the wire
            raise self._failure(e, key, kind) from None
        assert template is not None
        return CompiledGrammar(
            grammar_id=key,
            grammar=translation.grammar,
            tokenizer=tokenizer,
            warnings=warnings,
            template=template,
            compile_ms=(time.perf_counter() - t0) * 1000.0,
            report=translation.report,
            checks=translation.checks,
        )

    async def _translate_and_verify(
        self,
        constraint: common_pb2.Constraint,
        tokenizer: Tokenizer,
        key: str,
        field: str,
        client: str,
    ) -> tuple[Translation, Any, tuple[str, ...]]:
        """(translation, template, warnings), within one deadline of `timeout_s`: translated
        again with a fallback while the verifier refuses what a fallback avoids."""
        deadline = time.monotonic() + self.timeout_s
        relax: frozenset[str] = frozenset()
        while True:
            translation: Translation = await self._in_thread(
                deadline,
                translate,
                constraint,
                tokenizer,
                self.bounds,
                self.schema_mode,
                relax,
            )
            try:
                template, warnings = await self._verify(
                    key, translation.grammar, tokenizer, field, deadline, client
                )
            except RpcError as e:
                relax = retry_relaxed(e, relax, constraint, self.schema_mode)
                continue
            return translation, template, warnings

    def _failure(self, e: Exception, key: str, kind: str) -> RpcError:
        """The answer to a compile that failed with `e` (a crash also poisons `key`)."""
        field = error_field(kind)
        if isinstance(e, SandboxCrashed):
            why = f"compiling it crashed a compile worker ({e})"
            self.poison.add(key, why)
            return crashed_error(kind, why)
        if isinstance(e, SandboxUnavailable):
            return RpcError(
                grpc.StatusCode.UNAVAILABLE,
                f"cannot compile now: {e}",
                reason="COMPILE_SANDBOX_UNAVAILABLE",
            )
        if isinstance(e, TimeoutError):
            return RpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"compiling the constraint took longer than {self.timeout_s:g}s "
                "(--compile-timeout-s)",
                [(field, "grammar too complex to compile in time")],
                reason="COMPILE_TIMEOUT",
            )
        if isinstance(e, RecursionError):
            return RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"invalid {field}: nested too deeply",
                [(field, "nested too deeply")],
                reason="CONSTRAINT_TOO_COMPLEX",
            )
        return RpcError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"cannot compile the constraint: {e}",
            [(field, str(e))],
            reason="INVALID_CONSTRAINT",
        )

    async def _verify(
        self,
        key: str,
        grammar: str,
        tokenizer: Tokenizer,
        field: str,
        deadline: float,
        client: str,
    ) -> tuple[Any, tuple[str, ...]]:
        """Verify (sandboxed unless disabled) and build the template: (template, warnings)."""
        if self.sandbox is None:
            checked = await self._in_thread(
                deadline, verify, grammar, tokenizer, self.limits, field
            )
            return checked.matcher, checked.warnings
        warnings = await self.sandbox.verify(
            grammar,
            self._tokenizer_index.get(id(tokenizer), 0),
            field,
            deadline=deadline,
            client=client,
        )
        template = await self._in_thread(deadline, self._build, key, grammar, tokenizer, field)
        return template, warnings

    def _build(self, key: str, grammar: str, tokenizer: Tokenizer, field: str) -> Any:
        with self.poison.journal(key):
            return build_template(grammar, tokenizer, self.limits, field)

    async def _in_thread(self, deadline: float, fn: Callable[..., T], *args: object) -> T:
        # The thread cannot be interrupted: past the deadline it finishes in the background and
        # its result is dropped (the pool size bounds how many can pile up). The stages run here
        # are the cheap ones, or ones the sandbox has already seen finish in time.
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        return await asyncio.wait_for(fut, max(deadline - time.monotonic(), 0.0))

    def shutdown(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
