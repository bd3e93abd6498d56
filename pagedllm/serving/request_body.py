"""A request body as the server accepts it: at most the size limit (413 past it), strict JSON
(UTF-8, finite numbers, nesting at most MAX_JSON_DEPTH, no lone surrogates); anything else is a
400 that says what is wrong."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from fastapi.responses import JSONResponse

from pagedllm.serving.openai_protocol import APIError, bad_request

MAX_JSON_DEPTH = 64  # nesting of a request body; real schemas and chats stay far below
_SURROGATE = re.compile("[\ud800-\udfff]")


class BodySizeLimit:
    """ASGI middleware: a body over the limit gets a 413, whether or not it declares its length."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> APIError:
        return APIError(
            413, f"the request body is larger than the limit of {self.max_bytes} bytes", code="request_too_large"
        )

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            error = self._too_large()
            await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, limited_receive, send)


def parse_json(raw: bytes) -> Any:
    """A request body as strict JSON: UTF-8, finite numbers (Python's json reads NaN, Infinity and
    1e999, which are not JSON), nesting at most MAX_JSON_DEPTH, no lone surrogates in strings
    (a tokenizer cannot encode them).  Anything else is a 400 that says what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise bad_request(f"the request body is not valid UTF-8: {error}") from None
    try:
        value = json.loads(text, parse_constant=_not_json, parse_float=_finite_float)
    except RecursionError:
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except json.JSONDecodeError as error:
        raise bad_request(f"the request body is not valid JSON: {error}") from None
    except ValueError as error:  # an integer of more digits than Python converts
        raise bad_request(f"the request body holds a number out of range: {error}") from None
    _check_json_value(value)
    return value


def _not_json(name: str) -> None:
    raise bad_request(f"the request body holds {name}, which is not JSON: numbers must be finite")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise bad_request(f"the request body holds the number {text[:40]}, which is out of range for a float")
    return value


def _check_json_value(value: Any) -> None:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise bad_request("the request body holds a string with a lone surrogate (invalid Unicode)")
        elif isinstance(item, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
            if isinstance(item, dict):
                stack.extend((key, depth) for key in item)
                stack.extend((v, depth + 1) for v in item.values())
            else:
                stack.extend((v, depth + 1) for v in item)
