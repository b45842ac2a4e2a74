"""Errors in OpenAI's JSON shape, and the mapping from worker gRPC statuses to HTTP."""

from __future__ import annotations

from typing import Any

import grpc

from maskwire.rpc import RpcError
from maskwire.text import MESSAGE_LIMIT, truncate_echo


class APIError(Exception):
    """An error the client sees as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body; message and param are bounded and valid Unicode whatever they quote
        (a worker's message, a model name, a field path), so writing the error cannot fail."""
        return {
            "error": {
                "message": truncate_echo(self.message, MESSAGE_LIMIT),
                "type": self.type,
                "param": None if self.param is None else truncate_echo(self.param),
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, what: str = "") -> APIError:
    detail = f": {what}" if what else ""
    return APIError(
        400, f"`{param}` is not supported by this server{detail}", param=param, code="unsupported"
    )


def model_not_found(model: str, served: list[str]) -> APIError:
    return APIError(
        404,
        f"The model `{truncate_echo(model)}` does not exist; this server serves {', '.join(served) or 'no model'}",
        param="model",
        code="model_not_found",
    )


def overloaded(message: str = "the server is at capacity; retry later") -> APIError:
    return APIError(429, message, type="rate_limit_error", code="rate_limit_exceeded")


def no_worker(message: str = "no worker is available") -> APIError:
    return APIError(503, message, type="service_unavailable_error", code="no_worker")


def deadline(message: str = "the request did not finish before its deadline") -> APIError:
    return APIError(504, message, type="timeout_error", code="deadline_exceeded")


def internal(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


_HTTP_BY_CODE: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_request"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", "invalid_request"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", "failed_precondition"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", "unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "deadline_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "cancelled", "cancelled"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "unauthenticated"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", "permission_denied"),
}


def from_rpc(err: RpcError, constraint_param: str | None = None) -> APIError:
    """Map a worker error; field violations become part of the message (and `param`).

    `constraint_param` names the request field that produced the constraint (e.g.
    `response_format`), so a bad schema points the client at what it sent.
    """
    status, type_, code = _HTTP_BY_CODE.get(err.code, (500, "server_error", "internal_error"))
    message = err.message or err.code.name.lower()
    param: str | None = None
    if err.violations:
        details = "; ".join(f"{f}: {d}" if f else d for f, d in err.violations)
        message = f"{message} ({details})" if details not in message else message
        first = err.violations[0][0]
        param = constraint_param if ("constraint" in first or not first) else first
    if err.reason and status >= 400:
        code = err.reason.lower()
    return APIError(status, message, type=type_, param=param, code=code)
