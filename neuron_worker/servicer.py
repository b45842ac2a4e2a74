"""The `maskwire.v1.Worker` gRPC service: validates requests, feeds the engine, streams its
events as `GenerateResponse` messages and its errors as gRPC statuses."""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import grpc

from maskwire.logs import debug_payloads
from maskwire.rpc import FieldViolation, RpcError
from maskwire.text import truncate_echo, utf8_len
from maskwire.tokenizer import Tokenizer
from maskwire.v1 import worker_pb2, worker_pb2_grpc
from neuron_worker.config import PromptLimits
from neuron_worker.detokenize import Detokenizer
from neuron_worker.engine import Engine
from neuron_worker.events import Delta, EngineError, Final, FinishReason, TokenEntry
from neuron_worker.logprobs import TOP_WIDTH
from neuron_worker.penalties import BIAS_WIDTH
from neuron_worker.request import Request, Sampling

log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 16
MAX_REQUEST_ID_CHARS = 256  # ids travel in every grammar Step row and in logs
MAX_CACHE_SALT_CHARS = 256  # a salt lives as long as its slot's cached prompt


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Generate / Abort / GetModelInfo over one engine."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        *,
        model_name: str,
        device: str,
        limits: PromptLimits,
    ) -> None:
        """`limits`: the prompt flags, the token limit fitted to `engine`'s context."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.device = device
        self.max_prompt_tokens = limits.prompt_tokens(engine.config)
        self.max_prompt_bytes = limits.max_prompt_bytes
        # Prompts are tokenized here, off the event loop (health checks and every stream keep
        # being served); the pool's size bounds the CPU and memory tokenization takes at once.
        self._tokenize_pool = ThreadPoolExecutor(
            limits.tokenizer_threads, thread_name_prefix="tokenize"
        )

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ Generate
    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        live: list[Request] = []  # this call's requests, once the engine holds them
        done = False
        try:
            req = await self._build(request)
            choices = _choices(req, request.n)
            await self.engine.submit_group(choices, peer=context.peer())
            live = choices
            if debug_payloads():
                log.debug("generate %s: %d prompt tokens", req.request_id, len(req.prompt))
            # The schema's enforcement report rides on the first message.
            report = req.grammar.report if req.grammar is not None else None
            left = len(choices)
            while True:
                item = await req.outputs.get()
                if isinstance(item, Exception):
                    done = True
                    raise status(item)
                msg = response(item)
                if isinstance(item, Final):
                    left -= 1
                    done = left == 0
                if report is not None:
                    msg.schema_report.CopyFrom(report)
                    report = None
                yield msg
                if done:
                    return
        except (RpcError, EngineError) as e:
            done = True
            err = status(e)
            self.engine.metrics.rejected(err.code.name)
            await err.abort(context)
        finally:
            # Client went away (or the handler failed): free the KV slots and grammar state of
            # exactly this call's requests, whatever other calls are named.
            if live and not done:
                self.engine.abort_requests(live, "client cancelled the call")

    async def _build(self, msg: worker_pb2.GenerateRequest) -> Request:
        """Validate a GenerateRequest into an engine Request (INVALID_ARGUMENT / NOT_FOUND).

        Every check is bounded by the limits, not by the size of what was sent; the prompt is
        tokenized last, and only when everything else is valid.
        """
        if msg.model and msg.model != self.model_name:
            raise RpcError(
                grpc.StatusCode.NOT_FOUND,
                f"model {truncate_echo(repr(msg.model))} is not served here; this worker serves "
                f"{self.model_name!r}",
                [("model", f"must be {self.model_name!r} or empty")],
                reason="MODEL_NOT_FOUND",
            )
        bad = self._check_fields(msg)
        prompt, prompt_bad = await self._prompt(msg, tokenize=not bad)
        bad = prompt_bad + bad
        if bad:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "invalid GenerateRequest", bad)
        max_ctx = self.engine.config.max_seq_len
        s = msg.sampling
        room = max_ctx - len(prompt)
        max_tokens = min(s.max_tokens, room) if s.max_tokens else room
        sampling = Sampling(
            temperature=float(s.temperature),
            top_p=float(s.top_p) if s.top_p > 0 else 1.0,
            top_k=int(s.top_k),
            seed=int(s.seed) if s.HasField("seed") else secrets.randbits(63),
            max_tokens=max_tokens,
            stop=tuple(x for x in s.stop if x),
            stop_token_ids=frozenset(int(t) for t in s.stop_token_ids),
            ignore_eos=bool(s.ignore_eos),
            presence_penalty=float(s.presence_penalty),
            frequency_penalty=float(s.frequency_penalty),
            repetition_penalty=float(s.repetition_penalty) or 1.0,
            logit_bias={int(k): float(v) for k, v in s.logit_bias.items() if v},
            logprobs=bool(s.logprobs),
            top_logprobs=int(s.top_logprobs),
            raw_logprobs=s.logprobs_mode == worker_pb2.LOGPROBS_MODE_RAW,
        )
        constraint = msg.constraint if msg.HasField("constraint") else None
        return Request(
            request_id=msg.request_id or f"req-{uuid.uuid4().hex[:16]}",
            prompt=prompt,
            sampling=sampling,
            detok=Detokenizer(self.tokenizer.token_bytes, sampling.stop),
            constraint=constraint,
            reasoning_end_marker=msg.reasoning_end_marker,
            cache_salt=msg.cache_salt,
            # Penalties and logprobs are per sampled position, with the counts and distribution
            # of the tokens before it: a draft position would need the drafts' own counts.
            speculate=not (msg.disable_speculation or sampling.penalized or sampling.logprobs),
        )

    async def _prompt(
        self, msg: worker_pb2.GenerateRequest, *, tokenize: bool
    ) -> tuple[list[int], list[FieldViolation]]:
        """The prompt's token ids, or what is wrong with it. A text prompt is measured in bytes
        before it is tokenized (and not tokenized at all when `tokenize` is false); token ids
        are counted before they are read."""
        max_ctx = self.engine.config.max_seq_len
        limit = min(self.max_prompt_tokens, max_ctx - 1)

        def too_long(n: int) -> list[FieldViolation]:
            return [
                (
                    "prompt",
                    f"{n} tokens; the limit is {limit} (context {max_ctx} tokens, "
                    f"--max-prompt-tokens {self.max_prompt_tokens})",
                )
            ]

        which = msg.WhichOneof("prompt")
        prompt: list[int] = []
        if which == "text" and msg.text:
            size = utf8_len(msg.text)
            if size > self.max_prompt_bytes:
                return [], [
                    (
                        "prompt",
                        f"{size} bytes of text; the limit is {self.max_prompt_bytes} "
                        "(--max-prompt-bytes)",
                    )
                ]
            if not tokenize:
                return [], []
            loop = asyncio.get_running_loop()
            prompt = await loop.run_in_executor(
                self._tokenize_pool, self.tokenizer.encode, msg.text
            )
        elif which == "token_ids":
            ids = msg.token_ids.ids
            if len(ids) > limit:
                return [], too_long(len(ids))
            vocab = self.tokenizer.vocab_size
            if any(t < 0 or t >= vocab for t in ids):
                return [], [("token_ids.ids", f"every id must be in [0, {vocab})")]
            prompt = list(ids)
        if not prompt:
            return [], [("prompt", "set `text` or `token_ids` to a non-empty prompt")]
        if len(prompt) > limit:
            return [], too_long(len(prompt))
        return prompt, []

    def _check_fields(self, msg: worker_pb2.GenerateRequest) -> list[FieldViolation]:
        """Everything but the prompt."""
        bad: list[FieldViolation] = []
        vocab = self.tokenizer.vocab_size
        bad += _check_request_id(msg.request_id, empty_ok=True)
        if len(msg.cache_salt) > MAX_CACHE_SALT_CHARS:
            bad.append(("cache_salt", f"at most {MAX_CACHE_SALT_CHARS} characters"))
        s = msg.sampling
        if not (0.0 <= s.temperature <= 2.0) or math.isnan(s.temperature):
            bad.append(("sampling.temperature", "must be in [0, 2]"))
        if not (0.0 <= s.top_p <= 1.0) or math.isnan(s.top_p):
            bad.append(("sampling.top_p", "must be in (0, 1] (0 means 1)"))
        if len(s.stop) > MAX_STOP_STRINGS:
            bad.append(("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings"))
        if len(s.stop_token_ids) > vocab:  # more than the vocabulary: not read one by one
            bad.append(("sampling.stop_token_ids", f"at most {vocab} ids"))
        elif any(t < 0 or t >= vocab for t in s.stop_token_ids):
            bad.append(("sampling.stop_token_ids", f"every id must be in [0, {vocab})"))
        bad += _check_penalties(s, vocab)
        max_n = self.engine.config.max_batch
        if msg.n > max_n:
            bad.append(("n", f"at most {max_n} (the worker's max batch size)"))
        constraint = msg.constraint if msg.HasField("constraint") else None
        if constraint is not None and constraint.WhichOneof("kind") is None:
            bad.append(("constraint", "set exactly one kind (json_schema, regex, lark, ...)"))
        if constraint is not None and s.ignore_eos:
            bad.append(
                (
                    "sampling.ignore_eos",
                    "only for unconstrained requests: the grammar decides the end",
                )
            )
        return bad

    # ------------------------------------------------------------------ Abort / info
    async def Abort(
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        bad = _check_request_id(request.request_id, empty_ok=False)
        if bad:
            await RpcError(grpc.StatusCode.INVALID_ARGUMENT, "invalid AbortRequest", bad).abort(
                context
            )
        return worker_pb2.AbortResponse(found=self.engine.abort(request.request_id, "aborted"))

    async def GetModelInfo(
        self, request: worker_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ModelInfo:
        tok = self.tokenizer
        return worker_pb2.ModelInfo(
            model=self.model_name,
            vocab_size=tok.vocab_size,
            logits_size=self.engine.logits_size,
            max_context=self.engine.config.max_seq_len,
            eos_token_ids=list(tok.eos_token_ids),
            eos_token=tok.eos_token,
            bos_token=tok.bos_token,
            chat_template=tok.chat_template,
            structured_outputs=self.engine.config.structured_outputs,
            device=self.device,
            tokenizer=tok.fingerprint.to_proto(),
            max_batch_size=self.engine.config.max_batch,
        )


def status(err: Exception) -> RpcError:
    """The gRPC status of an error that ended a call: the engine's own (`EngineError`, as the
    status code of its kind's name), or the grammar client's status as it is."""
    if isinstance(err, RpcError):
        return err
    if isinstance(err, EngineError):
        code = grpc.StatusCode[err.kind.name]
        return RpcError(code, err.message, err.violations, reason=err.reason)
    return RpcError(grpc.StatusCode.INTERNAL, f"internal error: {err}")


_FINISH_REASONS = {
    FinishReason.STOP: worker_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: worker_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP_STRING: worker_pb2.FINISH_REASON_STOP_STRING,
    FinishReason.ABORT: worker_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: worker_pb2.FINISH_REASON_ERROR,
}


def response(item: Delta | Final) -> worker_pb2.GenerateResponse:
    """An engine event as the message that streams it."""
    delta = item.delta if isinstance(item, Final) else item
    msg = worker_pb2.GenerateResponse(
        request_id=delta.request_id,
        index=delta.index,
        token_ids=delta.token_ids,
        text=delta.text,
        logprobs=[_logprob(e) for e in delta.logprobs],
    )
    if isinstance(item, Final):
        msg.finish_reason = _FINISH_REASONS[item.reason]
        msg.stop_string = item.stop_string
        msg.error = item.error
        u = item.usage
        msg.usage.CopyFrom(
            worker_pb2.Usage(
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                forced_tokens=u.forced_tokens,
                forward_passes=u.forward_passes,
                draft_tokens=u.draft_tokens,
                accepted_draft_tokens=u.accepted_draft_tokens,
                cached_prompt_tokens=u.cached_prompt_tokens,
            )
        )
    return msg


def _logprob(e: TokenEntry) -> worker_pb2.TokenLogprob:
    entry = worker_pb2.TokenLogprob(
        token_id=e.token_id, token=e.token, forced=e.forced, logprob=e.logprob
    )
    for tid, text, lp in e.top:
        entry.top_logprobs.add(token_id=tid, token=text, logprob=lp)
    return entry


def _check_request_id(request_id: str, *, empty_ok: bool) -> list[FieldViolation]:
    """A client's request id: a Generate call may leave it empty (the worker assigns one), an
    Abort must name a call. '/' is refused: the worker names an n > 1 call's choices `ID/i`.
    Control characters are refused: ids are written to logs, where a newline forges a line."""
    if not request_id and not empty_ok:
        return [("request_id", "must be the id of a Generate call (it is empty)")]
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        return [("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters")]
    if "/" in request_id:
        return [("request_id", "must not contain '/' (the ids of a call's choices use it)")]
    if not request_id.isprintable():
        return [("request_id", "must not contain control or other unprintable characters")]
    return []


def _in_range(value: float, low: float, high: float) -> bool:
    return low <= value <= high and not math.isnan(value)


def _check_penalties(s: worker_pb2.SamplingParams, vocab: int) -> list[FieldViolation]:
    """Penalties, logit bias and logprobs of `SamplingParams`."""
    bad: list[FieldViolation] = []
    for name in ("presence_penalty", "frequency_penalty"):
        if not _in_range(getattr(s, name), -2.0, 2.0):
            bad.append((f"sampling.{name}", "must be in [-2, 2]"))
    if not _in_range(s.repetition_penalty, 0.0, 2.0):
        bad.append(("sampling.repetition_penalty", "must be in (0, 2] (0 means 1: off)"))
    if len(s.logit_bias) > BIAS_WIDTH:
        bad.append(("sampling.logit_bias", f"at most {BIAS_WIDTH} entries"))
    elif any(not 0 <= k < vocab for k in s.logit_bias):
        bad.append(("sampling.logit_bias", f"token ids must be in [0, {vocab})"))
    elif any(not _in_range(v, -100.0, 100.0) for v in s.logit_bias.values()):
        bad.append(("sampling.logit_bias", "biases must be in [-100, 100]"))
    if s.top_logprobs > TOP_WIDTH:
        bad.append(("sampling.top_logprobs", f"at most {TOP_WIDTH}"))
    elif s.top_logprobs and not s.logprobs:
        bad.append(("sampling.top_logprobs", "needs sampling.logprobs"))
    if s.logprobs_mode not in worker_pb2.LogprobsMode.values():
        bad.append(("sampling.logprobs_mode", "unknown mode"))
    return bad


def _choices(first: Request, n: int) -> list[Request]:
    """The requests of a call's `n` choices: `first` and copies with seeds `seed + i`, sharing
    one output queue (messages say their `index`)."""
    if n <= 1:
        return [first]
    first.group, first.group_size = first.request_id, n
    first.request_id = f"{first.group}/0"
    out = [first]
    for i in range(1, n):
        sampling = replace(first.sampling, seed=(first.sampling.seed + i) % 2**64)
        out.append(
            Request(
                request_id=f"{first.group}/{i}",
                prompt=list(first.prompt),
                sampling=sampling,
                detok=first.detok.fresh(),
                constraint=first.constraint,
                reasoning_end_marker=first.reasoning_end_marker,
                cache_salt=first.cache_salt,
                group=first.group,
                index=i,
                group_size=n,
                outputs=first.outputs,
            )
        )
    return out
