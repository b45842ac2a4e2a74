"""Assemble and run a worker process: tokenizer, backend, model, sampler, grammar client, engine,
gRPC server, metrics, discovery and graceful drain."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import torch
import torch._inductor.config

from maskwire.bitmask import words_per_row
from maskwire.cpus import available_cpus
from maskwire.discovery import Resolver
from maskwire.rpc import Server, start_metrics_server
from maskwire.tls import ClientTLS, server_tls_mode
from maskwire.tokenizer import Tokenizer, load_tokenizer
from maskwire.v1 import worker_pb2, worker_pb2_grpc
from neuron_worker import device_thread, kernels
from neuron_worker.backends import Backend, create_backend
from neuron_worker.drafter import DEFAULT_SIZES, DraftConfig, DraftMatch
from neuron_worker.engine import Engine, EngineConfig
from neuron_worker.grammar_client import GrammarClient
from neuron_worker.graphs import GRAPH_LAYOUT, MAX_FLAT_TOKENS
from neuron_worker.metrics import Metrics
from neuron_worker.parallel.serving import RankGroup, RankSpec
from neuron_worker.scheduler import parse_buckets, pow2_buckets
from neuron_worker.servicer import WorkerServicer
from neuron_worker.step_device import StepDevice, StepDeviceLike
from neuron_worker.thread_governor import GovernorConfig, ThreadGovernor
from neuron_worker.tuning import Tuning, cache_use, use_compile_cache
from neuron_worker.tuning import resolve as resolve_tuning

if TYPE_CHECKING:
    from neuron_worker.model import Transformer

log = logging.getLogger(__name__)

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


def engine_config(
    args: argparse.Namespace, model_max_seq: int, *, bucketed: bool = True, overlap: bool = True
) -> EngineConfig:
    """EngineConfig from the CLI flags (limits checked, buckets resolved); `bucketed`: forward
    shapes padded to the buckets (XLA) rather than dynamic; `overlap` as resolved by tuning."""
    if args.max_batch_size < 1:
        raise SystemExit("--max-batch-size must be >= 1")
    if args.max_queue < 0:
        raise SystemExit("--max-queue must be >= 0")
    if args.max_prompt_bytes < 1 or args.tokenizer_threads < 1:
        raise SystemExit("--max-prompt-bytes and --tokenizer-threads must be >= 1")
    if not -1 <= args.flat_pass_tokens <= MAX_FLAT_TOKENS:
        raise SystemExit(f"--flat-pass-tokens must be -1 (auto) or 0..{MAX_FLAT_TOKENS}")
    if args.verify_pass_tokens < -1:
        raise SystemExit("--verify-pass-tokens must be -1 (auto), 0 (no limit) or more")
    if args.admit_window_ms < 0 or args.admit_quiet_ms < 0:
        raise SystemExit("--admit-window-ms and --admit-quiet-ms must be >= 0")
    max_seq = min(args.max_seq_len, model_max_seq)
    if max_seq < 2:
        raise SystemExit("--max-seq-len must be >= 2")
    if args.max_seq_len > model_max_seq:
        log.warning(
            "--max-seq-len %d exceeds the model's %d; using %d",
            args.max_seq_len,
            model_max_seq,
            max_seq,
        )
    return EngineConfig(
        max_batch=args.max_batch_size,
        max_seq_len=max_seq,
        max_queue=args.max_queue,
        batch_buckets=tuple(parse_buckets(args.batch_buckets, args.max_batch_size, 1)),
        seq_buckets=tuple(
            parse_buckets(args.seq_buckets, max_seq, 128)
            if args.seq_buckets
            else pow2_buckets(min(128, max_seq), max_seq)
        ),
        max_prefill_tokens=args.max_prefill_tokens,
        admit_window_s=args.admit_window_ms / 1e3,
        admit_quiet_s=args.admit_quiet_ms / 1e3,
        flat_tokens=None if args.flat_pass_tokens < 0 else args.flat_pass_tokens,
        # A decode step is one token per row: 1 is always a bucket.
        token_buckets=tuple(sorted({1, *parse_buckets(args.token_buckets, max_seq, 1)})),
        bucketed=bucketed,
        structured_outputs=args.structured_outputs,
        overlap=overlap,
        jump_forward=args.jump_forward,
        speculative=draft_config(args),
    )


def ranges_dir(cache: Path | None, args: argparse.Namespace) -> Path | None:
    """The compile cache's subdirectory for this worker's symbolic size ranges (rows, sequence,
    logits rows per row). torch's FX graph cache does not key on the ranges a dimension was
    marked dynamic with, and a graph compiled for rows <= 8 carries that bound as a guard: loaded
    by a worker whose rows go to 40, dynamo refuses it (ConstraintViolationError at warm-up)."""
    if cache is None:
        return None
    spec = draft_config(args)
    width = spec.verify_width if spec else 1
    # Flat passes' rows go up to it; "auto": the runner's default (`default_flat_tokens`).
    flat = args.flat_pass_tokens if args.flat_pass_tokens >= 0 else "auto"
    ranges = f"rows{args.max_batch_size}-seq{args.max_seq_len}-verify{width}-flat{flat}"
    return cache / f"{ranges}-layout{GRAPH_LAYOUT}"


def verify_pass_tokens(args: argparse.Namespace) -> int:
    """`--verify-pass-tokens`, with its default resolved: on a CPU, the max batch size (a
    verification pass runs flat through the 4-bit kernel, which reads the weights once per 8
    rows: at c8, more drafts than that cost more than they save); elsewhere no limit."""
    if args.verify_pass_tokens >= 0:
        return int(args.verify_pass_tokens)
    return int(args.max_batch_size) if args.device == "cpu" else 0


def draft_config(args: argparse.Namespace) -> DraftConfig | None:
    """The drafter's settings from `--speculative` and its flags (None: speculation off)."""
    if getattr(args, "speculative", "none") == "none":
        return None
    match: DraftMatch = getattr(args, "draft_match", "text")
    min_n, max_n = DEFAULT_SIZES[match]
    try:
        return DraftConfig(
            num_draft_tokens=args.num_draft_tokens,
            forced_drafts=args.forced_draft_tokens,
            match=match,
            min_n=min_n if args.ngram_min is None else args.ngram_min,
            max_n=max_n if args.ngram_max is None else args.ngram_max,
            pass_tokens=verify_pass_tokens(args),
            gate=getattr(args, "speculation_gate", True),
        )
    except ValueError as e:
        raise SystemExit(f"--speculative ngram: {e}") from None


def resolve_settings(args: argparse.Namespace) -> Tuning:
    """The settings the flags resolve to (`neuron_worker.tuning.resolve`): what the worker runs."""
    return resolve_tuning(
        device=args.device,
        spec=args.model,
        dtype=args.dtype,
        compile=args.compile,
        quantize=args.quantize,
        warmup=args.warmup,
        compile_cache=args.compile_cache,
        overlap=args.overlap,
        tensor_parallel=args.tensor_parallel_size,
        cuda_graphs=args.cuda_graphs,
    )


def use_caches(args: argparse.Namespace, tuning: Tuning) -> Path | None:
    """Point the compiled graphs and the kernels at the compile cache; returns the directory of
    this worker's graphs (None: not compiled, or no usable cache). With adaptive threads on CPU,
    generated kernels read the team size when they run (not when compiled), so the thread
    governor's size holds for them too, and graphs (keyed by it) are not shared with others."""
    if args.adaptive_threads and args.device == "cpu":
        torch._inductor.config.cpp.dynamic_threads = True
    cache = use_compile_cache(ranges_dir(tuning.compile_cache, args)) if tuning.compile else None
    if tuning.compile_cache is not None:
        kernels.set_kernel_dir(tuning.compile_cache / "kernels")
    return cache


async def use_caches_on_device_thread(args: argparse.Namespace, tuning: Tuning) -> Path | None:
    """`use_caches` where the graphs are compiled and run: torch's compiler settings set by
    assignment hold only for the thread that sets them."""
    return await device_thread.run(lambda: use_caches(args, tuning))


def load_worker_model(args: argparse.Namespace, tuning: Tuning, backend: Backend) -> Transformer:
    """The model as the worker serves it: `args.model` in the settings' dtype, with the serving
    kernels and the settings' quantization (a sharded model gets those after sharding)."""
    from neuron_worker.model import load_model

    return load_model(
        args.model,
        device=backend.device,
        dtype=tuning.dtype,
        serving=args.tensor_parallel_size == 1,
        quantize=tuning.quantize,
    ).eval()


def graph_dir(cache: Path | None, backend: Backend) -> Path | None:
    """Where the forward graphs are saved whole, to load without re-tracing the model. CPU
    only: torch's precompile API has not run on the other devices here."""
    return cache / "graphs" if cache is not None and backend.name == "cpu" else None


def build_step_device(
    model: Transformer,
    backend: Backend,
    config: EngineConfig,
    *,
    vocab_size: int,
    eos_ids: tuple[int, ...],
    graph_dir: Path | None = None,
) -> StepDevice:
    """One process's model, sampler and KV cache as the worker serves them (device thread)."""
    from neuron_worker.sampler import Sampler

    sampler = Sampler(
        vocab_size=vocab_size,
        logits_size=int(model.config.vocab_size),
        # Verification passes sample every draft position: 1 + K logits rows per request.
        max_rows=max(2, config.batch_buckets[-1]) * config.verify_width,
        device=backend.device,
        structured_outputs=config.structured_outputs,
        compile=backend.compile_enabled,
    )
    return StepDevice(
        model=model,
        backend=backend,
        sampler=sampler,
        config=config,
        eos_ids=eos_ids,
        words=words_per_row(vocab_size),
        graph_dir=graph_dir,
    )


async def serve(
    args: argparse.Namespace,
    *,
    credentials: grpc.ServerCredentials | None = None,
    grammar_tls: ClientTLS | None = None,
) -> int:
    """Run the worker; `credentials` make its port TLS/mTLS, `grammar_tls` its grammar channels."""
    if args.tensor_parallel_size < 1:
        raise SystemExit("--tensor-parallel-size must be >= 1")
    # torch sizes its pool to the node; a container's CPU limit caps it (see maskwire.cpus).
    torch.set_num_threads(args.threads or rank_threads(args.tensor_parallel_size))
    began = time.perf_counter()
    tuning = resolve_settings(args)
    cache = await use_caches_on_device_thread(args, tuning)
    log.info("worker settings: %s; %d threads", tuning.describe(), torch.get_num_threads())
    tokenizer = load_tokenizer(args.model)
    backend = create_backend(args.device, compile=tuning.compile, cuda_graphs=tuning.cuda_graphs)
    tp = args.tensor_parallel_size
    # From here on torch runs on the device thread only (`neuron_worker.device_thread`: a second
    # thread running torch doubles the forward's time on a small machine).
    model = await device_thread.run(lambda: load_worker_model(args, tuning, backend))
    config = engine_config(
        args,
        int(model.config.max_seq_len),
        bucketed=backend.name == "xla",
        overlap=tuning.overlap,
    )
    model_name = str(model.config.name)
    ranks: RankGroup | None = None
    device: StepDeviceLike
    if tp > 1:
        spec = rank_spec(args, tuning.dtype, config, tokenizer)
        ranks = await device_thread.run(lambda: RankGroup.start(model, spec, tp, backend))
        device = ranks.leader
        log.info("tensor parallel: %d ranks, rank 0 holds %s", tp, ranks.leader.shard)
    else:
        device = await device_thread.run(
            lambda: build_step_device(
                model,
                backend,
                config,
                vocab_size=tokenizer.vocab_size,
                eos_ids=tuple(tokenizer.eos_token_ids),
                graph_dir=graph_dir(cache, backend),
            )
        )

    grammar: GrammarClient | None = None
    resolver: Resolver | None = None
    if config.structured_outputs:
        grammar = GrammarClient(
            [],
            tokenizer.fingerprint.to_proto(),
            words_per_row=tokenizer.words_per_row,
            step_timeout_s=args.grammar_timeout_s,
            open_timeout_s=args.grammar_open_timeout_s,
            tls=grammar_tls,
            compact_masks=args.grammar_compact_masks,
            poison_after=args.grammar_poison_after,
        )
        client = grammar
        resolver = Resolver(
            args.grammar_service,
            refresh_s=args.grammar_dns_refresh_s,
            on_change=lambda ch: client.update_replicas(sorted(ch.added), sorted(ch.removed)),
        )
        await resolver.start()

    metrics = Metrics()
    engine = Engine(
        device=device,
        tokenizer=tokenizer,
        grammar=grammar,
        config=config,
        metrics=metrics,
    )
    await engine.start()
    if tuning.warmup:
        await engine.warmup()
        if cache is not None:
            loaded, compiled = cache_use()
            log.info(
                "compile cache %s: %d graphs loaded from it, %d compiled into it",
                cache,
                loaded,
                compiled,
            )
    engine.serving()
    if args.adaptive_threads and backend.name == "cpu" and tp == 1 and torch.get_num_threads() > 1:
        device_thread.govern(
            ThreadGovernor(GovernorConfig(full=torch.get_num_threads()), torch.set_num_threads)
        )
    servicer = WorkerServicer(
        engine,
        tokenizer,
        model_name=model_name,
        device=args.device,
        max_prompt_tokens=args.max_prompt_tokens or config.max_seq_len - 1,
        max_prompt_bytes=args.max_prompt_bytes,
        tokenizer_threads=args.tokenizer_threads,
    )
    server = Server(
        host=args.host,
        port=args.port,
        service_names=[WORKER_SERVICE],
        register=lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s),
        credentials=credentials,
        health_port=args.health_port,
    )
    start_metrics_server(args.metrics_port, args.host)
    await server.start()
    log.info(
        "worker serving %s on %s:%d (%s; %s, structured outputs %s, batch %d, context %d) in %.1fs",
        model_name,
        args.host,
        server.port,
        server_tls_mode(args),
        backend.describe(),
        "on" if config.structured_outputs else "off",
        config.max_batch,
        config.max_seq_len,
        time.perf_counter() - began,
    )

    def on_drain() -> None:
        engine.draining = True

    loop = asyncio.get_running_loop()
    health_updates: set[asyncio.Task[None]] = set()

    def device_lost(reason: str) -> None:  # on the event loop, once
        task = loop.create_task(server.set_not_serving())
        health_updates.add(task)
        task.add_done_callback(health_updates.discard)

    engine.on_lost = device_lost
    if ranks is not None:
        ranks.watch(lambda reason: loop.call_soon_threadsafe(engine.device_lost, reason))
    try:
        await server.serve_until_signal(args.drain_grace_s, on_drain=on_drain)
    finally:
        servicer.close()
        await engine.stop()
        if resolver is not None:
            await resolver.stop()
        if ranks is not None:
            ranks.stop()
    return 0


def rank_threads(world: int) -> int:
    """Torch threads per rank: the CPUs the container may use, shared by the ranks (torch's own
    default sizes its pool to the node, not to a container's CPU limit)."""
    return max(1, min(torch.get_num_threads(), available_cpus()) // world)


def rank_spec(
    args: argparse.Namespace, dtype: torch.dtype, config: EngineConfig, tokenizer: Tokenizer
) -> RankSpec:
    """What the follower ranks need to build the same sharded device as rank 0."""
    return RankSpec(
        model=args.model,
        device=args.device,
        dtype=dtype,
        threads=torch.get_num_threads(),
        config=config,
        eos_ids=tuple(tokenizer.eos_token_ids),
        words=tokenizer.words_per_row,
        vocab_size=tokenizer.vocab_size,
        timeout_s=args.tensor_parallel_timeout_s,
    )
