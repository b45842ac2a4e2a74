"""`maskwire worker`: flags and startup (torch and the model are imported inside `run`)."""

from __future__ import annotations

import argparse
import sys

from maskwire.discovery import add_refresh_argument
from maskwire.server_args import add_grpc_server_arguments
from maskwire.tls import add_client_tls_arguments
from neuron_worker.config import (
    DEFAULT_DRAIN_GRACE_S,
    DEFAULT_PORT,
    GrammarSettings,
    ModelSettings,
    PromptLimits,
)
from neuron_worker.drafter import DEFAULT_SIZES, DraftConfig
from neuron_worker.engine_config import EngineConfig

# Every default is the configuration's (`neuron_worker.config`): defined there, once.
MODEL = ModelSettings()
ENGINE = EngineConfig()
DRAFTS = DraftConfig()
PROMPTS = PromptLimits()
GRAMMAR = GrammarSettings()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every worker flag, grouped by concern (`--help` lists them by group)."""
    add_grpc_server_arguments(p, port=DEFAULT_PORT, drain_grace_s=DEFAULT_DRAIN_GRACE_S)
    _model_flags(p)
    _compile_flags(p)
    _batch_flags(p)
    _pass_flags(p)
    _grammar_flags(p)
    _speculation_flags(p)
    add_client_tls_arguments(p, "grammar", "the grammar service")


def _model_flags(p: argparse.ArgumentParser) -> None:
    """Which checkpoint runs on which device, in which dtype, over how many ranks and threads."""
    g = p.add_argument_group("model and device")
    g.add_argument(
        "--model",
        default=MODEL.spec,
        metavar="SPEC",
        help="`default` (embedded SmolLM2), a .gguf file or a HF checkpoint directory",
    )
    g.add_argument("--device", choices=("cpu", "cuda", "xla"), default=MODEL.device)
    g.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="model dtype (auto: bfloat16 where the device computes it natively, i.e. CUDA or a "
        "CPU with AVX512-BF16/AMX; float32 elsewhere)",
    )
    g.add_argument(
        "--quantize",
        choices=("auto", "none", "int4", "int4a8", "int8"),
        default="auto",
        help="weight-only quantized kernels for decode passes on CPU; auto: when the checkpoint's "
        "weights are Q4_1 already (the embedded SmolLM2), each kind of projection takes the "
        "fastest of int4 (exact), int8 and dense bf16 as timed at start (cached in the compile "
        "cache), else none; int4, int8, none: that path, untimed (int4 and int8 on other "
        "checkpoints round the weights); int4a8: the Q4_1 weights times 8-bit activations "
        "(bf16 with AVX512-VNNI, or fp32 with AVX2; rounds the activations, never chosen by auto)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=MODEL.tensor_parallel_size,
        metavar="N",
        help="shard the model over N ranks (N - 1 follower processes started by the worker; "
        "gloo on CPU, nccl on CUDA); the mask and the wire stay full-vocabulary",
    )
    g.add_argument(
        "--tensor-parallel-timeout-s",
        type=float,
        default=MODEL.tensor_parallel_timeout_s,
        help="bound on the ranks' start-up rendezvous and on every collective: a rank that stops "
        "answering fails the worker's requests after this long, never hangs them",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=MODEL.threads,
        help="torch CPU threads (0: torch's default, capped by the container's CPU limit; "
        "with tensor parallelism, per rank, default the CPUs divided by the ranks)",
    )
    g.add_argument(
        "--adaptive-threads",
        action=argparse.BooleanOptionalAction,
        default=MODEL.adaptive_threads,
        help="on CPU, shrink the torch thread team while other processes hold the CPUs it runs on "
        "(measured per device call from the threads' scheduler wait) and grow it back when they "
        "are free; off: always --threads (default on)",
    )


def _compile_flags(p: argparse.ArgumentParser) -> None:
    """Compiled graphs, their cache and their warm-up."""
    g = p.add_argument_group("compilation")
    g.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the forward and the sampler (default: on for cpu and cuda; every graph "
        "is built before the worker reports ready)",
    )
    g.add_argument(
        "--compile-cache",
        default=None,
        metavar="DIR",
        help="keep compiled graphs here across restarts (default $XDG_CACHE_HOME/maskwire/compile; "
        "'' for none); one subdirectory per batch size, context and draft width",
    )
    g.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run every graph shape once before serving (default: on when compiled, and on xla)",
    )
    g.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay the compiled decode pass as CUDA graphs captured at warm-up, one per (rows, "
        "KV length) bucket (default: on for --device cuda when compiled)",
    )


def _batch_flags(p: argparse.ArgumentParser) -> None:
    """The batch, the context, the queue and the prompts a request may bring."""
    g = p.add_argument_group("batching and limits")
    g.add_argument(
        "--max-batch-size", type=int, default=ENGINE.max_batch, help="requests decoded together"
    )
    g.add_argument(
        "--max-seq-len",
        type=int,
        default=ENGINE.max_seq_len,
        help="context per request (prompt + output)",
    )
    g.add_argument(
        "--max-queue",
        type=int,
        default=ENGINE.max_queue,
        help="waiting requests before RESOURCE_EXHAUSTED",
    )
    g.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=PROMPTS.max_prompt_tokens,
        help="longest prompt (0: --max-seq-len - 1)",
    )
    g.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=PROMPTS.max_prompt_bytes,
        help="longest text prompt in UTF-8 bytes, refused before it is tokenized "
        f"(default {PROMPTS.max_prompt_bytes // 1024 // 1024} MiB)",
    )
    g.add_argument(
        "--tokenizer-threads",
        type=int,
        default=PROMPTS.tokenizer_threads,
        help="prompts tokenized at once, on threads off the event loop (default "
        f"{PROMPTS.tokenizer_threads}); each holds about 90 MB per MiB of prompt while it runs",
    )
    g.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=ENGINE.max_prefill_tokens,
        help="padded tokens one prefill batch computes (admission budget; prompt prefixes the "
        "prefix cache holds are not counted)",
    )
    g.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=ENGINE.prefix_cache,
        help="a prompt that starts like one whose K/V a KV slot still holds (a shared system "
        "prompt or tool list, a repeated request, an earlier turn) computes only its new tokens "
        "(default on)",
    )
    g.add_argument(
        "--prefix-cache-slots",
        type=int,
        default=ENGINE.prefix_cache_slots,
        help="KV slots beyond --max-batch-size that only keep finished requests' prompts and "
        "answers for later ones, so the prefix cache holds that many more prompts than run at "
        "once (each costs one slot of KV memory, --max-seq-len positions; default "
        f"{ENGINE.prefix_cache_slots})",
    )
    g.add_argument(
        "--prefix-refresh-tokens",
        type=int,
        default=ENGINE.prefix_refresh_tokens,
        help="while idle, rewrite finished answers into their KV slots in prompt passes of at "
        "most this many tokens, so that a conversation's next turn reuses the whole exchange "
        "(a request arriving meanwhile waits for one such pass at most; 0: never; default "
        f"{ENGINE.prefix_refresh_tokens})",
    )
    g.add_argument(
        "--prefix-refresh-idle-ms",
        type=float,
        default=ENGINE.prefix_refresh_idle_s * 1e3,
        help="start rewriting finished answers only after the worker has been idle this long, "
        "so that a client sending its next request at once never waits for one (default "
        f"{ENGINE.prefix_refresh_idle_s * 1e3:g})",
    )
    g.add_argument(
        "--admit-window-ms",
        type=float,
        default=ENGINE.admit_window_s * 1e3,
        help="from idle, hold the first request up to this long for others to share its "
        "prefill; the wait ends sooner after --admit-quiet-ms without a new request or with a "
        f"full batch (default {ENGINE.admit_window_s * 1e3:g}; 0: admit at once)",
    )
    g.add_argument(
        "--admit-quiet-ms",
        type=float,
        default=ENGINE.admit_quiet_s * 1e3,
        help="gap between arrivals that ends the admission wait "
        f"(default {ENGINE.admit_quiet_s * 1e3:g})",
    )
    g.add_argument(
        "--stream-interval-ms",
        type=float,
        default=ENGINE.stream_interval_s * 1e3,
        help="send a request's new tokens at most this often (its first at once, its last with "
        "the final message): fewer messages leave the worker, gateway and client more CPU for "
        f"the model (default {ENGINE.stream_interval_s * 1e3:g}; 0: after every step)",
    )


def _pass_flags(p: argparse.ArgumentParser) -> None:
    """How forward passes are shaped and scheduled: flat passes, the bucket lists, forced
    tokens, and overlap with the grammar round trip."""
    g = p.add_argument_group("forward passes")
    g.add_argument(
        "--flat-pass-tokens",
        type=int,
        default=-1,  # auto: `EngineConfig.flat_tokens` None
        help="run a multi-token pass (forced tokens, draft verification, prefill) of at most "
        "this many tokens as one token per row, through the decode kernels (default -1: 512 "
        "where the decode attention kernel reads the cache in place, else max batch size x "
        "max(4, 1 + draft tokens); at most 512; 0: never; dynamic shapes only)",
    )
    g.add_argument(
        "--batch-buckets", default="", help="comma-separated batch sizes (default 1,2,4,...,max)"
    )
    g.add_argument(
        "--seq-buckets", default="", help="comma-separated KV lengths (default 128,256,...,max)"
    )
    g.add_argument(
        "--token-buckets",
        default="",
        help="comma-separated tokens per row in one forward pass, for prefill and jump-forward "
        "(default 1,2,4,...,max); fewer buckets = fewer graphs to compile on XLA",
    )
    g.add_argument(
        "--jump-forward",
        action=argparse.BooleanOptionalAction,
        default=ENGINE.jump_forward,
        help="run grammar-forced tokens through the model in one pass (default on)",
    )
    g.add_argument(
        "--fused-decode",
        action=argparse.BooleanOptionalAction,
        default=ENGINE.fused_decode,
        help="run passes of one token per row as one C++ call through the worker's kernels, not "
        "a graph, where it serves the model (bf16 with the AVX512-BF16 kernels or fp32 with the "
        "AVX2 ones, one device; default on)",
    )
    g.add_argument(
        "--greedy-kernel",
        action=argparse.BooleanOptionalAction,
        default=ENGINE.greedy_kernel,
        help="sample steps whose rows are all greedy, without penalties or logprobs, in one C++ "
        "call instead of the sampler's graphs (the same tokens), where the worker's kernels run "
        "(CPU, one device; default on)",
    )
    g.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="overlap the grammar round trip with the forward pass; forced tokens then need a "
        "pass of their own (default: on for cuda and xla, off on cpu, where a forward takes far "
        "longer than the round trip it would hide)",
    )


def _grammar_flags(p: argparse.ArgumentParser) -> None:
    """Structured outputs: the grammar service, its discovery and its deadlines."""
    g = p.add_argument_group("structured outputs and the grammar service")
    so = g.add_mutually_exclusive_group()
    so.add_argument(
        "--enable-structured-outputs",
        dest="structured_outputs",
        action="store_true",
        default=ENGINE.structured_outputs,
        help="accept constrained requests; the sampler always takes a mask (default)",
    )
    so.add_argument(
        "--disable-structured-outputs",
        dest="structured_outputs",
        action="store_false",
        help="no grammar service, no mask input; constrained requests fail FAILED_PRECONDITION",
    )
    g.add_argument(
        "--grammar-service",
        default=GRAMMAR.targets,
        metavar="HOST:PORT[,HOST:PORT...]",
        help="grammar-service replicas (or dns:///NAME:PORT for every address behind a name); "
        "required unless --disable-structured-outputs",
    )
    add_refresh_argument(g, default=GRAMMAR.dns_refresh_s)
    g.add_argument(
        "--grammar-timeout-s",
        type=float,
        default=GRAMMAR.step_timeout_s,
        help="per-step deadline for grammar answers; past it the affected requests fail",
    )
    g.add_argument(
        "--grammar-open-timeout-s",
        type=float,
        default=GRAMMAR.open_timeout_s,
        help="deadline for opening a request on the grammar service (includes compiling)",
    )
    g.add_argument(
        "--grammar-compact-masks",
        action=argparse.BooleanOptionalAction,
        default=GRAMMAR.compact_masks,
        help="let the grammar service answer large steps with compact mask rows (fewer bytes; "
        "its --compact-min-rows picks the steps)",
    )
    g.add_argument(
        "--grammar-poison-after",
        type=int,
        default=GRAMMAR.poison_after,
        help="grammar replicas that may die holding one request's compile, Open or first step "
        "before the request fails as CONSTRAINT_CRASHED and its constraint is never sent again "
        "(the retry after the first death survives a machine failure)",
    )


def _speculation_flags(p: argparse.ArgumentParser) -> None:
    """Speculative decoding: how many drafts, and which ones are verified."""
    g = p.add_argument_group("speculative decoding")
    g.add_argument(
        "--speculative",
        choices=("auto", "none", "ngram"),
        default="auto",
        help="speculative decoding: `ngram` drafts tokens from the request's own prompt and "
        "output (prompt lookup), checked by the grammar, verified in one forward (default auto: "
        "ngram on cpu, none elsewhere)",
    )
    g.add_argument(
        "--num-draft-tokens",
        type=int,
        default=DRAFTS.num_draft_tokens,
        help="most draft tokens per request and step with --speculative (adaptive below it)",
    )
    g.add_argument(
        "--forced-draft-tokens",
        type=int,
        default=DRAFTS.forced_drafts,
        help="most drafts of the grammar's forced bytes per request and step with --speculative "
        f"(the next key after drafts that close a JSON string; default {DRAFTS.forced_drafts})",
    )
    g.add_argument(
        "--verify-pass-tokens",
        type=int,
        default=-1,  # auto: decided by the device (`config._verify_pass_tokens`)
        help="most tokens in one verification pass, every row's pending, forced and draft "
        "tokens together; drafts beyond it are not proposed, but a copy that closes a string of "
        "a constrained output (the grammar's forced tail follows it) is not counted (default "
        "-1: the max batch size on cpu, where a wider pass costs about its width; no limit "
        "elsewhere; 0: none)",
    )
    g.add_argument(
        "--speculation-gate",
        action=argparse.BooleanOptionalAction,
        default=DRAFTS.gate,
        help="verify a step's drafts only when the step costs measured so far say the tokens "
        "they are expected to add pay for the wider pass (default on; off: verify every draft)",
    )
    g.add_argument(
        "--draft-pause-declines",
        type=int,
        default=DRAFTS.pause_declines,
        help="the gate's declines in a row at a batch size after which that batch size drafts "
        "nothing for 4 steps, then 8, ... 32 while the declines go on (default "
        f"{DRAFTS.pause_declines}; 0: never pause)",
    )
    _drafter_flags(g)


def _drafter_flags(g: argparse._ArgumentGroup) -> None:
    """What the n-gram drafter matches."""
    g.add_argument(
        "--draft-match",
        choices=tuple(DEFAULT_SIZES),
        default=DRAFTS.match,
        help="what the drafter matches: `text` (default; finds copies however they were "
        "tokenized, e.g. a passage's ` Riverside` in a JSON value's `\"Riverside`) or token "
        "n-grams",
    )
    g.add_argument(
        "--ngram-min",
        type=int,
        default=None,
        help="shortest suffix the drafter matches, in bytes of text (default "
        f"{DEFAULT_SIZES['text'][0]}) or tokens ({DEFAULT_SIZES['tokens'][0]})",
    )
    g.add_argument(
        "--ngram-max",
        type=int,
        default=None,
        help="longest suffix the drafter matches, in bytes of text (default "
        f"{DEFAULT_SIZES['text'][1]}) or tokens ({DEFAULT_SIZES['tokens'][1]})",
    )


def run(args: argparse.Namespace) -> int:
    from maskwire.logs import setup_logging

    setup_logging(args.log_level)
    from maskwire import event_loop
    from neuron_worker.app import serve
    from neuron_worker.config import ConfigError, worker_config

    try:  # before the model loads: a bad flag or certificate fails in a second, not a minute
        config = worker_config(args)
    except ConfigError as e:
        print(f"maskwire worker: {e}", file=sys.stderr)
        return 2
    return event_loop.run(serve(config), config.server.event_loop)
