"""An in-process fake `Worker` gRPC server for the gateway's unit tests (never used elsewhere).

Each test scripts the reply: text chunks and a finish reason, or an `RpcError` with rich details.
The fake records the requests it saw and whether a call was cancelled by the client.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from maskwire.rpc import RpcError
from maskwire.v1 import common_pb2, worker_pb2, worker_pb2_grpc

MODEL = "SmolLM2-135M-Instruct"
# The embedded SmolLM2's template, verbatim (its string literals hold real newlines).
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class Reply:
    chunks: list[str] = field(default_factory=lambda: ["Hello", " world"])
    finish: int = worker_pb2.FINISH_REASON_STOP
    prompt_tokens: int = 7
    error: RpcError | None = None
    delay_s: float = 0.0  # between chunks
    error_text: str = ""
    schema_report: common_pb2.SchemaReport | None = None  # sent on the first chunk


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self) -> None:
        self.reply: Callable[[worker_pb2.GenerateRequest], Reply] = lambda _: Reply()
        self.requests: list[worker_pb2.GenerateRequest] = []
        self.cancelled: list[str] = []
        self.chat_template = CHATML
        self.lock = threading.Lock()

    def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[worker_pb2.GenerateResponse]:
        with self.lock:
            self.requests.append(request)
        reply = self.reply(request)
        ended = threading.Event()  # the reply went out whole (or as the scripted error)

        def on_termination() -> None:
            # A call that ends before its reply did was cancelled, whether the server noticed
            # between two messages (the generator is then never resumed) or during a delay.
            if not ended.is_set():
                with self.lock:
                    self.cancelled.append(request.request_id)

        context.add_callback(on_termination)
        if reply.error is not None:
            ended.set()
            context.abort_with_status(rpc_status.to_status(reply.error.to_status()))
        n = max(1, request.n)
        for i, text in enumerate(reply.chunks):
            if reply.delay_s:
                time.sleep(reply.delay_s)
            if not context.is_active():
                return
            for index in range(n):  # n > 1: the choices' messages interleave, same text
                yield self._message(request, reply, i, text, index)
        ended.set()

    def _message(
        self, request: worker_pb2.GenerateRequest, reply: Reply, i: int, text: str, index: int
    ) -> worker_pb2.GenerateResponse:
        last = i == len(reply.chunks) - 1
        msg = worker_pb2.GenerateResponse(request_id=request.request_id, text=text, index=index)
        msg.token_ids.extend([100 + i])
        if request.sampling.logprobs:
            # Scripted: the i-th chunk is one token, logprob -(i+1)/2; odd ones forced.
            entry = msg.logprobs.add(
                token_id=100 + i,
                token=text.encode(),
                logprob=0.0 if i % 2 else -(i + 1) / 2,
                forced=bool(i % 2),
            )
            for k in range(request.sampling.top_logprobs):
                entry.top_logprobs.add(token_id=k, token=b"t%d" % k, logprob=-k - 0.25)
        if i == 0 and index == 0 and reply.schema_report is not None:
            msg.schema_report.CopyFrom(reply.schema_report)
        if last:
            msg.finish_reason = reply.finish  # type: ignore[assignment]
            msg.error = reply.error_text
            msg.usage.prompt_tokens = reply.prompt_tokens
            msg.usage.completion_tokens = len(reply.chunks)
        return msg

    def Abort(
        self, request: worker_pb2.AbortRequest, context: grpc.ServicerContext
    ) -> worker_pb2.AbortResponse:
        return worker_pb2.AbortResponse(found=False)

    def GetModelInfo(
        self, request: worker_pb2.GetModelInfoRequest, context: grpc.ServicerContext
    ) -> worker_pb2.ModelInfo:
        return worker_pb2.ModelInfo(
            model=MODEL,
            vocab_size=49152,
            logits_size=49152,
            max_context=8192,
            eos_token_ids=[2],
            eos_token="<|im_end|>",
            chat_template=self.chat_template,
            structured_outputs=True,
            device="cpu",
            tokenizer=common_pb2.TokenizerFingerprint(vocab_size=49152),
            max_batch_size=8,
        )


class FakeWorkerServer:
    """A sync gRPC server on a free loopback port hosting a FakeWorker."""

    def __init__(self) -> None:
        self.worker = FakeWorker()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        worker_pb2_grpc.add_WorkerServicer_to_server(self.worker, self.server)
        self.health = health.HealthServicer()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"

    def __enter__(self) -> FakeWorkerServer:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(0)
