"""The `maskwire.v1.Worker` gRPC service: validates requests, feeds the engine, streams deltas."""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from maskwire.logs import debug_payloads
from maskwire.rpc import FieldViolation, RpcError
from maskwire.text import truncate_echo, utf8_len
from maskwire.tokenizer import Tokenizer
from maskwire.v1 import worker_pb2, worker_pb2_grpc
from neuron_worker.detokenize import Detokenizer
from neuron_worker.engine import Engine
from neuron_worker.request import Request, Sampling

log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 16
MAX_REQUEST_ID_CHARS = 256  # ids travel in every grammar Step row and in logs


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Generate / Abort / GetModelInfo over one engine."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        *,
        model_name: str,
        device: str,
        max_prompt_tokens: int,
        max_prompt_bytes: int,
        tokenizer_threads: int,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.device = device
        self.max_prompt_tokens = max_prompt_tokens
        self.max_prompt_bytes = max_prompt_bytes
        # Prompts are tokenized here, off the event loop (health checks and every stream keep
        # being served); the pool's size bounds the CPU and memory tokenization takes at once.
        self._tokenize_pool = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix="tokenize")

    def close(self) -> None:
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ Generate
    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        req: Request | None = None
        done = False
        try:
            req = await self._build(request)
            await self.engine.submit(req)
            if debug_payloads():
                log.debug("generate %s: %d prompt tokens", req.request_id, len(req.prompt))
            # The schema's enforcement report rides on the first message.
            report = req.grammar.report if req.grammar is not None else None
            while True:
                item = await req.outputs.get()
                if isinstance(item, RpcError):
                    done = True
                    raise item
                if item.finish_reason != worker_pb2.FINISH_REASON_UNSPECIFIED:
                    done = True
                if report is not None:
                    item.schema_report.CopyFrom(report)
                    report = None
                yield item
                if done:
                    return
        except RpcError as e:
            done = True
            self.engine.metrics.rejected(e.code.name)
            await e.abort(context)
        finally:
            # Client went away (or the handler failed): free the KV slot and grammar state.
            if req is not None and not done:
                self.engine.abort(req.request_id, "client cancelled the call")

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
        )
        constraint = msg.constraint if msg.HasField("constraint") else None
        return Request(
            request_id=msg.request_id or f"req-{uuid.uuid4().hex[:16]}",
            prompt=prompt,
            sampling=sampling,
            detok=Detokenizer(self.tokenizer.token_bytes, sampling.stop),
            constraint=constraint,
            reasoning_end_marker=msg.reasoning_end_marker,
            speculate=not msg.disable_speculation,
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
        if len(msg.request_id) > MAX_REQUEST_ID_CHARS:
            bad.append(("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters"))
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
