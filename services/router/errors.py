"""Answers in OpenAI's error shape, with the request id (docs/gateway.md, "Statuses")."""

from __future__ import annotations

import msgspec
from aiohttp import web

_enc = msgspec.json.Encoder()


class ApiError(Exception):
    """An answer in OpenAI's error shape."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
    }

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ) -> None:
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}
        self.param = param
        super().__init__(message)

    def response(self, request_id: str, client_request_id: str | None = None) -> web.Response:
        body = {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error"),
                "param": self.param,
                "code": self.code,
            }
        }
        headers = {**id_headers(request_id, client_request_id), **self.headers}
        close = headers.pop("Connection", None) == "close"
        resp = web.Response(
            body=_enc.encode(body), status=self.status, headers=headers, content_type="application/json"
        )
        if close:
            resp.force_close()  # the rest of the body cannot be read: the client must not reuse the connection
        return resp


def id_headers(request_id: str, client_request_id: str | None) -> dict[str, str]:
    """The ids an answer carries: the gateway's own (the one its usage record and the logs are keyed
    on) and, echoed, the client's ``X-Request-Id`` when it sent a plain one."""
    if client_request_id is None:
        return {"x-request-id": request_id}
    return {"x-request-id": request_id, "x-client-request-id": client_request_id}


def http_error(exc: web.HTTPException, request: web.Request) -> ApiError:
    """aiohttp's own refusals (no such route, method not allowed, too large…) in the gateway's words."""
    routes = "/v1/chat/completions, /v1/completions, /v1/embeddings (POST) and /v1/models, /v1/models/{id} (GET)"
    if exc.status == 404:
        return ApiError(404, f"no route {request.method} {request.path}: this gateway serves {routes}", "not_found")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return ApiError(
            405,
            f"method {request.method} is not allowed on {request.path} (allowed: {allowed})",
            "method_not_allowed",
            {"Allow": allowed},
        )
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return ApiError(413, f"the request body is too large: {exc.text}", "body_too_large")
    return ApiError(exc.status, exc.reason or f"HTTP {exc.status}", f"http_{exc.status}")
