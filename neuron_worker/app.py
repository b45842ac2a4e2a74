"""Assemble and run a worker process: tokenizer, backend, model, sampler, grammar client, engine,
gRPC server, metrics, discovery and graceful drain."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from maskwire.bitmask import words_per_row
from maskwire.cpus import available_cpus
from maskwire.discovery import Resolver
from maskwire.heap import freeze_startup_heap
from maskwire.rpc import Server, start_metrics_server
from maskwire.tokenizer import Tokenizer, load_tokenizer
from maskwire.v1 import worker_pb2, worker_pb2_grpc
from neuron_worker import compile_cache, device_thread
from neuron_worker.backends import Backend, create_backend
from neuron_worker.config import GrammarSettings, WorkerConfig, fit_context
from neuron_worker.engine import Engine
from neuron_worker.engine_config import EngineConfig
from neuron_worker.grammar_client import GrammarClient
from neuron_worker.greedy_kernel import GreedyKernel
from neuron_worker.metrics import Metrics
from neuron_worker.parallel.serving import RankGroup, RankSpec
from neuron_worker.servicer import WorkerServicer
from neuron_worker.step_device import StepDevice, StepDeviceLike
from neuron_worker.thread_governor import GovernorConfig, ThreadGovernor

if TYPE_CHECKING:
    from neuron_worker.model import Transformer

log = logging.getLogger(__name__)

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


def load_worker_model(config: WorkerConfig, backend: Backend) -> Transformer:
    """The model as the worker serves it: `--model` in the settings' dtype, with the serving
    kernels and the settings' quantization (a sharded model gets those after sharding; "auto":
    timed at the widths of the engine's decode passes)."""
    from neuron_worker.kernel_choice import decode_rows
    from neuron_worker.model import load_model

    return load_model(
        config.model.spec,
        device=backend.device,
        dtype=config.tuning.dtype,
        serving=config.model.tensor_parallel_size == 1,
        quantize=config.tuning.quantize,
        decode_rows=decode_rows(config.engine),
    ).eval()


def use_compile_cache(config: WorkerConfig) -> Path | None:
    """Point the compiled graphs and the kernels at the compile cache
    (`neuron_worker.compile_cache`); returns this worker's graph directory (None: not compiled,
    or no usable cache)."""
    return compile_cache.use_for_worker(
        config.tuning.compile_cache,
        config.engine,
        compiled=config.tuning.compile,
        dynamic_threads=config.model.adaptive_threads and config.model.device == "cpu",
    )


async def use_compile_cache_on_device_thread(config: WorkerConfig) -> Path | None:
    """`use_compile_cache` where the graphs are compiled and run: torch's compiler settings set
    by assignment hold only for the thread that sets them."""
    return await device_thread.run(lambda: use_compile_cache(config))


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
    greedy = None
    if config.greedy_kernel and GreedyKernel.available(backend.device):
        greedy = GreedyKernel(vocab_size, eos_ids)
        log.info("greedy steps sample in one C++ call (the greedy kernel)")
    return StepDevice(
        model=model,
        backend=backend,
        sampler=sampler,
        config=config,
        eos_ids=eos_ids,
        words=words_per_row(vocab_size),
        graph_dir=graph_dir,
        greedy=greedy,
    )


async def serve(config: WorkerConfig) -> int:
    """Run the worker `config` describes until SIGTERM/SIGINT, then drain."""
    began = time.perf_counter()
    worker = await start_engine(config)
    engine = worker.engine
    servicer = WorkerServicer(
        engine,
        worker.tokenizer,
        model_name=worker.model_name,
        device=config.model.device,
        limits=config.prompts,
    )
    listen = config.server
    server = Server(
        host=listen.host,
        port=listen.port,
        service_names=[WORKER_SERVICE],
        register=lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s),
        credentials=listen.credentials,
        health_port=listen.health_port,
    )
    start_metrics_server(listen.metrics_port, listen.host)
    await server.start()
    log.info(
        "worker serving %s on %s:%d (%s; %s, structured outputs %s, batch %d, KV slots %d, "
        "context %d) in %.1fs",
        worker.model_name,
        listen.host,
        server.port,
        listen.tls_mode,
        worker.backend.describe(),
        "on" if engine.config.structured_outputs else "off",
        engine.config.max_batch,
        engine.config.kv_slots,
        engine.config.max_seq_len,
        time.perf_counter() - began,
    )
    watch_device(engine, server, worker.ranks)

    def on_drain() -> None:
        engine.draining = True

    try:
        await server.serve_until_signal(listen.drain_grace_s, on_drain=on_drain)
    finally:
        servicer.close()
        await worker.stop()
    return 0


@dataclass
class RunningEngine:
    """A started engine and what it runs on, for the gRPC server and the shutdown."""

    engine: Engine
    tokenizer: Tokenizer
    model_name: str
    backend: Backend
    ranks: RankGroup | None  # tensor parallelism's rank group (None: one process)
    resolver: Resolver | None  # the grammar replicas' discovery (None: structured outputs off)

    async def stop(self) -> None:
        await self.engine.stop()
        if self.resolver is not None:
            await self.resolver.stop()
        if self.ranks is not None:
            self.ranks.stop()


async def start_engine(config: WorkerConfig) -> RunningEngine:
    """Threads, compile cache, tokenizer, model, device, grammar client, then the engine,
    warmed up when the settings say so and marked serving."""
    tp = config.model.tensor_parallel_size
    # torch sizes its pool to the node; a container's CPU limit caps it (see maskwire.cpus).
    torch.set_num_threads(config.model.threads or rank_threads(tp))
    cache = await use_compile_cache_on_device_thread(config)
    log.info("worker settings: %s; %d threads", config.tuning.describe(), torch.get_num_threads())
    tokenizer = load_tokenizer(config.model.spec)
    backend = create_backend(
        config.model.device, compile=config.tuning.compile, cuda_graphs=config.tuning.cuda_graphs
    )
    # From here on torch runs on the device thread only (`neuron_worker.device_thread`: a second
    # thread running torch doubles the forward's time on a small machine).
    model = await device_thread.run(lambda: load_worker_model(config, backend))
    engine_config = fit_context(config.engine, int(model.config.max_seq_len))
    device, ranks = await start_device(config, engine_config, model, backend, tokenizer, cache)

    grammar: GrammarClient | None = None
    resolver: Resolver | None = None
    if config.grammar is not None:
        grammar = grammar_client(config.grammar, tokenizer)
        resolver = grammar_resolver(config.grammar, grammar)
        await resolver.start()

    engine = Engine(
        device=device,
        tokenizer=tokenizer,
        grammar=grammar,
        config=engine_config,
        metrics=Metrics(),
    )
    await engine.start()
    if config.tuning.warmup:
        await warm_up(engine, cache)
    freeze_startup_heap("worker")
    engine.serving()
    if config.model.adaptive_threads and backend.name == "cpu" and tp == 1:
        govern_threads()
    return RunningEngine(engine, tokenizer, str(model.config.name), backend, ranks, resolver)


def watch_device(engine: Engine, server: Server, ranks: RankGroup | None) -> None:
    """A lost device (or rank) turns the server's health to NOT_SERVING; the engine fails what
    it holds."""
    loop = asyncio.get_running_loop()
    health_updates: set[asyncio.Task[None]] = set()

    def device_lost(reason: str) -> None:  # on the event loop, once
        task = loop.create_task(server.set_not_serving())
        health_updates.add(task)
        task.add_done_callback(health_updates.discard)

    engine.on_lost = device_lost
    if ranks is not None:
        ranks.watch(lambda reason: loop.call_soon_threadsafe(engine.device_lost, reason))


async def start_device(
    config: WorkerConfig,
    engine: EngineConfig,
    model: Transformer,
    backend: Backend,
    tokenizer: Tokenizer,
    cache: Path | None,
) -> tuple[StepDeviceLike, RankGroup | None]:
    """The device side of every step: this process's `StepDevice`, or with tensor parallelism
    the rank group's leader (and the group, to watch and stop)."""
    tp = config.model.tensor_parallel_size
    if tp > 1:
        spec = rank_spec(config, engine, tokenizer)
        ranks = await device_thread.run(lambda: RankGroup.start(model, spec, tp, backend))
        log.info("tensor parallel: %d ranks, rank 0 holds %s", tp, ranks.leader.shard)
        return ranks.leader, ranks
    device = await device_thread.run(
        lambda: build_step_device(
            model,
            backend,
            engine,
            vocab_size=tokenizer.vocab_size,
            eos_ids=tuple(tokenizer.eos_token_ids),
            graph_dir=compile_cache.graph_directory(cache, backend.name),
        )
    )
    return device, None


async def warm_up(engine: Engine, cache: Path | None) -> None:
    """Build every graph a request can hit, and log what the compile cache held of them."""
    await engine.warmup()
    if cache is not None:
        loaded, compiled = compile_cache.cache_use()
        log.info(
            "compile cache %s: %d graphs loaded from it, %d compiled into it",
            cache,
            loaded,
            compiled,
        )


def govern_threads() -> None:
    """Shrink the torch thread team while other processes hold its CPUs (`--adaptive-threads`),
    from the team this process has now."""
    full = torch.get_num_threads()
    if full > 1:
        device_thread.govern(ThreadGovernor(GovernorConfig(full=full), torch.set_num_threads))


def grammar_client(settings: GrammarSettings, tokenizer: Tokenizer) -> GrammarClient:
    """The grammar client, with no replica yet (`grammar_resolver` adds them)."""
    return GrammarClient(
        [],
        tokenizer.fingerprint.to_proto(),
        words_per_row=tokenizer.words_per_row,
        settings=settings,
    )


def grammar_resolver(settings: GrammarSettings, client: GrammarClient) -> Resolver:
    """Follows `--grammar-service`'s targets and hands their replicas to `client`."""
    return Resolver(
        settings.targets,
        refresh_s=settings.dns_refresh_s,
        on_change=lambda ch: client.update_replicas(sorted(ch.added), sorted(ch.removed)),
    )


def rank_threads(world: int) -> int:
    """Torch threads per rank: the CPUs the container may use, shared by the ranks (torch's own
    default sizes its pool to the node, not to a container's CPU limit)."""
    return max(1, min(torch.get_num_threads(), available_cpus()) // world)


def rank_spec(config: WorkerConfig, engine: EngineConfig, tokenizer: Tokenizer) -> RankSpec:
    """What the follower ranks need to build the same sharded device as rank 0."""
    return RankSpec(
        model=config.model.spec,
        device=config.model.device,
        dtype=config.tuning.dtype,
        threads=torch.get_num_threads(),
        config=engine,
        eos_ids=tuple(tokenizer.eos_token_ids),
        words=tokenizer.words_per_row,
        vocab_size=tokenizer.vocab_size,
        timeout_s=config.model.tensor_parallel_timeout_s,
    )
