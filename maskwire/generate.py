"""`maskwire generate`: send one Generate request to a worker over gRPC and print the answer.

The text goes to stdout (as it arrives with `--stream`); progress (tokens, tok/s) and a one-line
summary go to stderr. A failed call prints one line built from the gRPC status, including any
`google.rpc.BadRequest` field violations, and exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING

from maskwire.tls import TLSConfigError, add_client_tls_arguments, client_tls_from_args

if TYPE_CHECKING:
    import grpc

    from maskwire.v1 import common_pb2, worker_pb2

DEFAULT_WORKER = "127.0.0.1:50052"  # `maskwire up`'s default --worker-port


class UsageError(Exception):
    """Bad flags or unreadable input files: reported as one line, exit code 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "prompt", nargs="?", default=None, help="prompt text ('-' or omitted: read stdin)"
    )
    parser.add_argument(
        "--worker",
        default=DEFAULT_WORKER,
        metavar="HOST:PORT",
        help=f"worker gRPC address (default {DEFAULT_WORKER}, as `maskwire up` prints)",
    )
    parser.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    parser.add_argument("--system", default="", help="system message (with --chat)")
    parser.add_argument("--model", default="", help="model name the worker must serve")
    kind = parser.add_argument_group("constraint (at most one)").add_mutually_exclusive_group()
    kind.add_argument(
        "--json-schema", metavar="FILE", help="JSON Schema file (or inline JSON starting with '{')"
    )
    kind.add_argument("--regex", metavar="RE", help="regular expression the output must match")
    kind.add_argument(
        "--choice",
        action="append",
        metavar="TEXT",
        help="allowed output; repeat for each alternative",
    )
    kind.add_argument(
        "--grammar",
        metavar="FILE",
        help="Lark grammar (start rule `start`) or GBNF grammar (`root ::= ...`, or a .gbnf file)",
    )
    kind.add_argument("--json-object", action="store_true", help="any JSON object")
    parser.add_argument(
        "--json-whitespace-flexible",
        action="store_true",
        help="allow any whitespace in JSON output (default: compact separators)",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=256, help="most tokens to generate (default 256)"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default), up to 2"
    )
    parser.add_argument("--top-p", type=float, default=0.0, help="nucleus mass in (0, 1]")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed")
    parser.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)"
    )
    parser.add_argument(
        "--stream", action="store_true", help="print text as it arrives instead of at the end"
    )
    parser.add_argument(
        "--quiet", "-q", action="store_true", help="no progress display and no summary line"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="deadline for the whole request (default: none)",
    )
    add_client_tls_arguments(parser, "worker", "the worker")


def _read_text(path: str, what: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"{what}: cannot read {path}: {e.strerror or e}") from None


def build_constraint(args: argparse.Namespace) -> common_pb2.Constraint | None:
    """The Constraint for the flags given, or None when unconstrained."""
    from maskwire.v1 import common_pb2

    c = common_pb2.Constraint()
    if args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith("{"):
            text = _read_text(text, "--json-schema")
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            raise UsageError(
                f"--json-schema: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"
            ) from None
        c.json_schema = text
    elif args.regex is not None:
        c.regex = args.regex
    elif args.choice:
        if any(not x for x in args.choice):
            raise UsageError("--choice: alternatives must not be empty")
        c.choice.choices.extend(args.choice)
    elif args.grammar is not None:
        text = _read_text(args.grammar, "--grammar")
        if args.grammar.endswith(".gbnf") or (
            not args.grammar.endswith(".lark") and _looks_like_gbnf(text)
        ):
            c.gbnf = text
        else:
            c.lark = text
    elif args.json_object:
        c.json_object = True
    else:
        return None
    if args.json_whitespace_flexible:
        c.json_options.whitespace_flexible = True
    return c


def _looks_like_gbnf(text: str) -> bool:
    # GBNF defines `root ::= ...`; Lark uses `name: ...`.
    return any(line.strip().startswith("root") and "::=" in line for line in text.splitlines())


def build_request(
    args: argparse.Namespace, prompt: str, constraint: common_pb2.Constraint | None
) -> worker_pb2.GenerateRequest:
    from maskwire.v1 import worker_pb2

    if args.max_tokens < 0:
        raise UsageError("--max-tokens must be >= 0")
    sampling = worker_pb2.SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        stop=args.stop,
    )
    if args.seed is not None:
        if args.seed < 0:
            raise UsageError("--seed must be >= 0")
        sampling.seed = args.seed
    req = worker_pb2.GenerateRequest(text=prompt, sampling=sampling, model=args.model)
    if constraint is not None:
        req.constraint.CopyFrom(constraint)
    return req


def describe_rpc_error(err: grpc.RpcError, worker: str) -> str:
    """One line for a failed call: code, message, field violations, and a hint when unreachable."""
    import grpc

    from maskwire.rpc import RpcError

    rich = RpcError.from_call_error(err)
    if rich.code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in rich.message.lower():
        cause = rich.message.rsplit(": ", 1)[-1]
        return (
            f"UNAVAILABLE: cannot reach a worker at {worker} ({cause}); "
            "start one with `maskwire up` or pass --worker HOST:PORT (a TLS worker needs "
            "--worker-tls-ca, and --worker-tls-cert/--worker-tls-key when it requires mutual TLS)"
        )
    line = f"{rich.code.name}: {rich.message or 'no details'}"
    # Field violations add what the message does not already say.
    extra = [f"{f}: {d}" if f else d for f, d in rich.violations if d not in rich.message]
    if extra:
        line += " [" + "; ".join(extra) + "]"
    return line


class Progress:
    """Live `N tokens, X tok/s` on stderr when it is a terminal; a summary line at the end."""

    def __init__(self, out: IO[str], live: bool) -> None:
        self.out = out
        self.live = live
        self.start = time.monotonic()
        self.first: float | None = None
        self.tokens = 0
        self._last_draw = 0.0
        self._drawn = False

    def update(self, new_tokens: int) -> None:
        now = time.monotonic()
        if self.first is None and new_tokens:
            self.first = now
        self.tokens += new_tokens
        if self.live and now - self._last_draw >= 0.1:
            self._last_draw = now
            self.out.write(f"\r\x1b[K{self.tokens} tokens, {self.rate(now):.1f} tok/s")
            self.out.flush()
            self._drawn = True

    def rate(self, now: float | None = None) -> float:
        if self.first is None:
            return 0.0
        span = (now or time.monotonic()) - self.first
        # The first token's time is prefill; the rate counts the decode that followed it.
        return (self.tokens - 1) / span if span > 0 and self.tokens > 1 else 0.0

    def clear(self) -> None:
        if self._drawn:
            self.out.write("\r\x1b[K")
            self.out.flush()
            self._drawn = False


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is None or args.prompt == "-":
        if sys.stdin.isatty():
            raise UsageError("no prompt: give it as an argument or on stdin")
        return sys.stdin.read()
    return str(args.prompt)


def _apply_chat(stub: object, args: argparse.Namespace, prompt: str, timeout: float | None) -> str:
    from maskwire.chat_template import render_chat
    from maskwire.v1 import worker_pb2

    info = stub.GetModelInfo(worker_pb2.GetModelInfoRequest(), timeout=timeout or 30)  # type: ignore[attr-defined]
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": prompt})
    return render_chat(
        info.chat_template,
        messages,
        bos_token=info.bos_token,
        eos_token=info.eos_token,
        add_generation_prompt=True,
    )


def run(args: argparse.Namespace) -> int:
    import grpc

    from maskwire.chat_template import ChatTemplateError
    from maskwire.rpc import client_channel_options
    from maskwire.tls import make_sync_channel
    from maskwire.v1 import worker_pb2, worker_pb2_grpc

    def fail(message: str, code: int = 1) -> int:
        print(f"maskwire generate: {message}", file=sys.stderr)
        return code

    try:
        prompt = _read_prompt(args)
        if args.system and not args.chat:
            raise UsageError("--system needs --chat")
        constraint = build_constraint(args)
        tls = client_tls_from_args(args, "worker")
    except (UsageError, TLSConfigError) as e:
        return fail(str(e), 2)
    timeout = args.timeout or None
    progress = Progress(sys.stderr, live=not args.quiet and not args.stream and sys.stderr.isatty())
    out = sys.stdout
    finish = worker_pb2.FINISH_REASON_UNSPECIFIED
    last: worker_pb2.GenerateResponse | None = None
    pieces: list[str] = []
    with make_sync_channel(args.worker, tls, client_channel_options()) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        call = None
        try:
            if args.chat:
                prompt = _apply_chat(stub, args, prompt, timeout)
            req = build_request(args, prompt, constraint)
            call = stub.Generate(req, timeout=timeout)
            for msg in call:
                progress.update(len(msg.token_ids))
                if msg.text:
                    if args.stream:
                        out.write(msg.text)
                        out.flush()
                    else:
                        pieces.append(msg.text)
                if msg.finish_reason:
                    finish, last = msg.finish_reason, msg
        except UsageError as e:
            return fail(str(e), 2)
        except ChatTemplateError as e:
            return fail(f"--chat: {e}")
        except grpc.RpcError as e:
            progress.clear()
            if args.stream and progress.tokens:
                out.write("\n")
            return fail(describe_rpc_error(e, args.worker))
        except KeyboardInterrupt:
            if call is not None:
                call.cancel()  # cancelling the call aborts the request on the worker
            progress.clear()
            return fail("interrupted", 130)
    progress.clear()
    if args.stream:
        out.write("\n")
    else:
        out.write("".join(pieces) + "\n")
    out.flush()
    return _summarize(args, progress, finish, last)


def _summarize(
    args: argparse.Namespace,
    progress: Progress,
    finish: int,
    last: worker_pb2.GenerateResponse | None,
) -> int:
    from maskwire.v1 import worker_pb2

    reason = worker_pb2.FinishReason.Name(finish).removeprefix("FINISH_REASON_").lower()
    if finish == worker_pb2.FINISH_REASON_ERROR:
        error = last.error if last is not None else ""
        print(f"maskwire generate: generation failed: {error or 'no details'}", file=sys.stderr)
        return 1
    if finish == worker_pb2.FINISH_REASON_UNSPECIFIED:
        print(
            "maskwire generate: the worker ended the stream without a finish reason",
            file=sys.stderr,
        )
        return 1
    if not args.quiet:
        usage = last.usage if last is not None else None
        forced = f" ({usage.forced_tokens} forced)" if usage and usage.forced_tokens else ""
        elapsed = time.monotonic() - progress.start
        count = f"{progress.tokens} token{'s' if progress.tokens != 1 else ''}"
        rate = f", {progress.rate():.1f} tok/s" if progress.tokens > 1 else ""
        print(f"-- {count}{forced} in {elapsed:.2f}s{rate}, finish: {reason}", file=sys.stderr)
    if finish == worker_pb2.FINISH_REASON_LENGTH:
        print(
            f"maskwire generate: warning: stopped at --max-tokens {args.max_tokens}; "
            "a constrained output may be incomplete",
            file=sys.stderr,
        )
    return 0
