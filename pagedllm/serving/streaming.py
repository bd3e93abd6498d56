"""Replies that carry an engine request: server-sent events for streams, one JSON body
otherwise; however a reply ends (finished, failed, client gone), its engine requests end with it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from pagedllm.serving.async_engine import EngineDeadError, RequestFailedError, RequestStream
from pagedllm.serving.openai_protocol import APIError, bad_request
from pagedllm.serving.openai_responses import ChoiceTracker


class EngineStreamResponse(StreamingResponse):
    """A streamed reply whose engine requests end with it, however it ends: finished, failed, or a
    client gone before the first byte (then the body's generator never starts, and its own
    `finally` never runs)."""

    def __init__(self, content: AsyncIterator[str], engine_stream: RequestStream) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.engine_stream = engine_stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.engine_stream.abort()


async def collect_all(stream: RequestStream, tracker: ChoiceTracker) -> None:
    async for output in stream:
        tracker.latest[output.request_id] = output


def request_failed(error: RequestFailedError, body: Any) -> APIError:
    """A fault that ended one request: a 400 naming the body's field when its own input caused it
    (a grammar the grammar engine gave up on mid-way), else a 500."""
    if error.param == "structured_output":
        field = body.structured_output()[1] or ("tool_choice" if getattr(body, "tools", None) else None)
        return bad_request(str(error), field)
    return APIError(500, str(error), "internal_error", code="request_failed")


async def sse(stream: RequestStream, tracker: ChoiceTracker, include_usage: bool, body: Any) -> AsyncIterator[str]:
    """Server-sent events; a client that disconnects cancels this generator, and the finally aborts."""
    try:
        if tracker.chat:
            yield _event(tracker.role_chunk())
        async for output in stream:
            chunk = tracker.chunk(output)
            if chunk is not None:
                yield _event(chunk)
        if include_usage:
            yield _event(tracker.usage_chunk())
    except EngineDeadError as error:
        yield _event(APIError(503, str(error), "service_unavailable").body())
    except RequestFailedError as error:  # this request alone: the others go on
        yield _event(request_failed(error, body).body())
    finally:
        stream.abort()
    yield "data: [DONE]\n\n"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
