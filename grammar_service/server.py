"""Assemble and run the grammar service from its configuration (`grammar_service.config`)."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from grammar_service.backend import LlgBackend
from grammar_service.compile_cache import CompileCache
from grammar_service.compile_pool import Compiler, use_large_thread_stacks
from grammar_service.compiler import TESTING_FAULT_ENV, arm_testing_faults
from grammar_service.config import ServiceConfig
from grammar_service.runtime import Runtime
from grammar_service.sandbox import Sandbox, SandboxUnavailable
from grammar_service.schema import formats
from grammar_service.schema.monitor import token_classes
from grammar_service.servicer import GrammarServicer
from maskwire.heap import freeze_startup_heap
from maskwire.rpc import Server, start_metrics_server
from maskwire.tokenizer import TokenizerLoadError, load_tokenizer
from maskwire.v1 import grammar_pb2, grammar_pb2_grpc

log = logging.getLogger("grammar_service")

SERVICE_NAME = grammar_pb2.DESCRIPTOR.services_by_name["GrammarService"].full_name


def start_sandbox(config: ServiceConfig, faults: str) -> Sandbox | None:
    """The compile sandbox (`faults`: the armed test-only fault specs its children get), its
    children already starting: each loads the tokenizers (about a second) on another core while
    this process loads its own (`build_runtime`)."""
    if config.sandbox is None:
        return None
    sandbox = Sandbox(
        config.tokenizers,
        config.parser_limits,
        dataclasses.replace(config.sandbox, testing_faults=faults),
    )
    sandbox.start()
    return sandbox


def build_runtime(config: ServiceConfig, sandbox: Sandbox | None) -> Runtime:
    formats.warm_up()
    tokenizers = []
    for spec in config.tokenizers:
        t0 = time.perf_counter()
        tok = load_tokenizer(spec)
        fp = tok.fingerprint
        token_classes(tok)  # the schema output check's per-token tables, before serving
        log.info(
            "tokenizer %s (%s) loaded in %.1fs: %s",
            spec,
            tok.name,
            time.perf_counter() - t0,
            fp.short(),
        )
        tokenizers.append(tok)
    settings = config.compile
    compiler = Compiler(
        limits=config.parser_limits, bounds=config.bounds, settings=settings, sandbox=sandbox
    )
    return Runtime(
        tokenizers=tokenizers,
        compiler=compiler,
        cache=CompileCache(settings.cache_size, settings.cache_bytes),
        backend=LlgBackend(config.process.mask_threads or None),
        limits=config.limits,
    )


def testing_faults(armed: bool) -> str:
    """The test-only fault hook's specs, armed in this process (and passed to the sandbox's
    children) only with `--testing-faults`, and said loudly; the variable alone arms nothing."""
    spec = os.environ.get(TESTING_FAULT_ENV, "")
    if not armed:
        if spec:
            log.warning(
                "%s is set and ignored: the fault hook needs --testing-faults", TESTING_FAULT_ENV
            )
        return ""
    log.warning(
        "TEST-ONLY MODE (--testing-faults): compiling a grammar that contains a marker of %s=%r "
        "aborts or hangs this service or its compile workers. Never run this in production.",
        TESTING_FAULT_ENV,
        spec,
    )
    arm_testing_faults(spec)
    return spec


async def main(config: ServiceConfig) -> int:
    use_large_thread_stacks(config.process.thread_stack_mb)
    sandbox = start_sandbox(config, testing_faults(config.process.testing_faults))
    try:
        runtime = build_runtime(config, sandbox)
    except TokenizerLoadError as e:
        log.error("%s", e)
        if sandbox is not None:
            sandbox.close()
        return 2
    try:
        # Not ready before a compile worker is: a replica must be able to compile what it is sent.
        await runtime.compiler.start(list(runtime.tokenizers.values()))
    except SandboxUnavailable as e:
        log.error("the compile sandbox did not start: %s", e)
        runtime.compiler.shutdown()
        return 1
    servicer = GrammarServicer(runtime)
    listen = config.server
    server = Server(
        host=listen.host,
        port=listen.port,
        service_names=[SERVICE_NAME],
        register=lambda s: grammar_pb2_grpc.add_GrammarServiceServicer_to_server(servicer, s),
        max_message_bytes=config.process.max_message_bytes,
        credentials=listen.credentials,
        health_port=listen.health_port,
    )
    start_metrics_server(listen.metrics_port, listen.host)
    await server.start()
    freeze_startup_heap("grammar service")
    log.info(
        "grammar service listening on %s:%d (%s)",
        listen.host,
        server.port,
        listen.tls_mode,
    )
    try:
        await server.serve_until_signal(listen.drain_grace_s, on_drain=servicer.drain)
    finally:
        runtime.compiler.shutdown()
    log.info("grammar service stopped")
    return 0
