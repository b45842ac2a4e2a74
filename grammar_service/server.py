"""Assemble and run the grammar service from parsed CLI flags."""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import grpc

from grammar_service.backend import LlgBackend
from grammar_service.bounds import ConstraintBounds
from grammar_service.compile_cache import CompileCache
from grammar_service.compile_pool import Compiler, use_large_thread_stacks
from grammar_service.compiler import TESTING_FAULT_ENV, ParserLimits, arm_testing_faults
from grammar_service.poison import PoisonList
from grammar_service.runtime import Limits, Runtime
from grammar_service.sandbox import Sandbox, SandboxConfig, SandboxUnavailable
from grammar_service.schema import formats
from grammar_service.schema.monitor import token_classes
from grammar_service.servicer import GrammarServicer
from maskwire.rpc import Server, start_metrics_server
from maskwire.tls import server_tls_mode
from maskwire.tokenizer import TokenizerLoadError, load_tokenizer
from maskwire.v1 import common_pb2, grammar_pb2, grammar_pb2_grpc

log = logging.getLogger("grammar_service")

SERVICE_NAME = grammar_pb2.DESCRIPTOR.services_by_name["GrammarService"].full_name


def build_runtime(args: argparse.Namespace) -> Runtime:
    specs = args.tokenizer or ["default"]
    formats.warm_up()
    tokenizers = []
    for spec in specs:
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
    limits = ParserLimits(
        max_items_in_row=args.max_items_in_row,
        initial_lexer_fuel=args.initial_lexer_fuel,
        step_lexer_fuel=args.step_lexer_fuel,
        step_max_items=args.step_max_items,
        max_lexer_states=args.max_lexer_states,
        max_grammar_size=args.max_grammar_size,
    )
    faults = testing_faults(args)
    sandbox = None
    if args.compile_sandbox:
        sandbox = Sandbox(
            specs,
            limits,
            SandboxConfig(
                workers=args.compile_workers,
                memory_mb=args.compile_memory_mb,
                stack_mb=args.compile_stack_mb,
                large_bytes=args.compile_large_bytes,
                testing_faults=faults,
            ),
        )
    compiler = Compiler(
        limits=limits,
        bounds=ConstraintBounds(
            max_schema_depth=args.max_schema_depth,
            max_schema_nodes=args.max_schema_nodes,
            max_grammar_depth=args.max_grammar_depth,
            max_grammar_rules=args.max_grammar_rules,
            max_choices=args.max_choices,
        ),
        threads=args.compile_threads,
        timeout_s=args.compile_timeout_s,
        max_schema_bytes=args.max_schema_bytes,
        sandbox=sandbox,
        schema_mode=common_pb2.SchemaMode.Value(f"SCHEMA_MODE_{args.schema_mode.upper()}"),
        poison=PoisonList(state_dir(args), args.poison_ttl_s),
    )
    return Runtime(
        tokenizers=tokenizers,
        compiler=compiler,
        cache=CompileCache(args.compile_cache_size, args.compile_cache_bytes),
        backend=LlgBackend(args.mask_threads or None),
        limits=Limits(
            max_requests=args.max_requests,
            max_requests_per_stream=args.max_requests_per_stream,
            max_rows_per_step=args.max_rows_per_step,
            max_drafts_per_row=args.max_drafts_per_row,
            compact_min_rows=args.compact_min_rows,
            max_request_step_s=args.max_request_step_ms / 1e3,
            max_replay_s=args.max_replay_ms / 1e3,
        ),
    )


def testing_faults(args: argparse.Namespace) -> str:
    """The test-only fault hook's specs, armed in this process (and passed to the sandbox's
    children) only with `--testing-faults`, and said loudly; the variable alone arms nothing."""
    spec = os.environ.get(TESTING_FAULT_ENV, "")
    if not args.testing_faults:
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


def state_dir(args: argparse.Namespace) -> Path | None:
    """Where the poison list survives restarts: --state-dir, else one directory per port under
    the user's state directory (a free port, 0, has no stable identity: memory only)."""
    if args.state_dir:
        return Path(args.state_dir)
    if not args.port:
        return None
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "maskwire" / f"grammar-service-{args.port}"


async def main(args: argparse.Namespace, credentials: grpc.ServerCredentials | None = None) -> int:
    use_large_thread_stacks(args.thread_stack_mb)
    try:
        runtime = build_runtime(args)
    except TokenizerLoadError as e:
        log.error("%s", e)
        return 2
    try:
        # Not ready before a compile worker is: a replica must be able to compile what it is sent.
        await runtime.compiler.start(list(runtime.tokenizers.values()))
    except SandboxUnavailable as e:
        log.error("the compile sandbox did not start: %s", e)
        runtime.compiler.shutdown()
        return 1
    servicer = GrammarServicer(runtime)
    server = Server(
        host=args.host,
        port=args.port,
        service_names=[SERVICE_NAME],
        register=lambda s: grammar_pb2_grpc.add_GrammarServiceServicer_to_server(servicer, s),
        max_message_bytes=args.max_message_bytes,
        credentials=credentials,
        health_port=args.health_port,
    )
    start_metrics_server(args.metrics_port, args.host)
    await server.start()
    log.info(
        "grammar service listening on %s:%d (%s)",
        args.host,
        server.port,
        server_tls_mode(args),
    )
    try:
        await server.serve_until_signal(args.drain_grace_s, on_drain=servicer.drain)
    finally:
        runtime.compiler.shutdown()
    log.info("grammar service stopped")
    return 0
