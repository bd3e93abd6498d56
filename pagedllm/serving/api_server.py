"""The OpenAI-compatible HTTP server (FastAPI): routes, errors, auth, limits.

Every failure a client can cause answers in OpenAI's error shape with a 4xx:
400 bad parameters or a prompt too long (and a body that is not strict JSON:
NaN, Infinity, nesting deeper than 64, invalid Unicode), 401 a missing or
wrong key, 404 an unknown model or path, 413 a body over the limit, 429 a
full queue.  A 500 means a bug here (or a fault that ended that request alone
in the engine); a 503 means the engine has stopped or is shutting down.  The
API key guards `/v1/*`; `/health`, `/metrics`, `/stats` and `/dashboard` are
open (they show counts and block ids, never prompts or outputs).

The event loop only moves bytes: reading a body, parsing and checking it,
tokenizing, the chat template and compiling a grammar run on a small pool of
preparation threads (`prepare`), so a 200 KB prompt or a 1 MB schema never
delays another stream's tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import re
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.core.request import PromptLengthError, check_prompt_length
from pagedllm.serving.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)
from pagedllm.serving.dashboard import dashboard_html, dashboard_state
from pagedllm.serving.engine_state import engine_state
from pagedllm.serving.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    parse_body,
)
from pagedllm.serving.openai_responses import ChoiceTracker, new_id
from pagedllm.serving.server_log import ServerLog
from pagedllm.serving.server_metrics import ServerMetrics
from pagedllm.text.tokenizer import Tokenizer

logger = logging.getLogger("pagedllm")

DISCONNECT_POLL_S = 0.25
MAX_JSON_DEPTH = 64  # nesting of a request body; real schemas and chats stay far below
PREPARE_THREADS = 4
_SURROGATE = re.compile("[\ud800-\udfff]")
T = TypeVar("T")


@dataclass
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20


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


def _lower_priority() -> None:
    """A preparation thread runs at nice 10: on a machine whose cores the engine's threads fill,
    tokenizing a huge prompt then takes the cores the engine leaves, not a share of the step."""
    with contextlib.suppress(AttributeError, OSError):  # per-thread nice values are Linux's
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


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


def build_app(engine: AsyncLLMEngine, tokenizer: Tokenizer, settings: ServerSettings) -> FastAPI:
    """The app around an engine; the app's lifespan starts and stops the engine thread.

    `tokenizer` is the server's own instance (the engine thread uses another one):
    a Rust tokenizer must not be used from two threads at once.  The event loop uses it
    to decode; the preparation threads use a copy of their own, one at a time.
    """
    prep_tokenizer = Tokenizer(tokenizer.path)
    prep_lock = threading.Lock()  # the preparation threads share prep_tokenizer
    prep_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="pagedllm-prepare", initializer=_lower_priority)
    metrics = ServerMetrics()
    engine.step_observers.append(metrics.observe_step)
    engine.step_observers.append(ServerLog().observe_step)
    max_model_len = engine.engine.max_model_len
    created = int(time.time())  # /v1/models' `created`: when this server loaded the model

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not engine.is_running:
            engine.start()
        # Built now rather than by the first constrained or chat request, which would wait for it
        # (seconds for the grammar engine; the chat template's Jinja compile holds the GIL ~0.1 s).
        prep_pool.submit(warm_up, engine.engine.runner.structured.build_tokenizer)
        prep_pool.submit(warm_up, warm_up_text)
        yield
        engine.shutdown()
        prep_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="pagedllm", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)

    # --- errors ------------------------------------------------------------------------

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(error.status_code, str(error.detail), kind).body(), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        body = APIError(500, f"internal server error: {error!r}", "internal_error").body()
        return JSONResponse(body, status_code=500)

    def check_key(request: Request) -> None:
        if settings.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {settings.api_key}".encode()):
            problem = "wrong" if given else "missing"
            raise APIError(
                401,
                f"{problem} API key: send 'Authorization: Bearer <key>'",
                "authentication_error",
                code="invalid_api_key",
            )

    def check_model(model: str | None) -> None:
        if model is not None and model != settings.served_model_name:
            raise APIError(
                404,
                f"the model '{model}' does not exist; this server serves '{settings.served_model_name}'",
                param="model",
                code="model_not_found",
            )

    def check_length(prompt_ids: list[int], max_tokens: int | None) -> None:
        try:
            check_prompt_length(len(prompt_ids), max_tokens, max_model_len)
        except PromptLengthError as error:
            raise bad_request(str(error), error.param) from None

    async def prepare(fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on a preparation thread: the event loop goes on moving other streams' bytes."""
        return await asyncio.get_running_loop().run_in_executor(prep_pool, functools.partial(fn, *args))

    def warm_up(fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as error:  # the first request that needs it will say why, as a 4xx
            logger.warning("warming up %s at start failed: %r", getattr(fn, "__name__", fn), error)

    def warm_up_text() -> None:
        encode("warm")
        if prep_tokenizer.hf.chat_template:
            chat_template([{"role": "user", "content": "warm"}])

    def encode(text: str) -> list[int]:
        with prep_lock:
            return prep_tokenizer.encode(text)

    def chat_template(messages: list[dict[str, str]], tools: list[dict] | None = None) -> list[int]:
        """The model's template over the messages; a template that refuses them is the client's 400."""
        with prep_lock:
            try:
                return prep_tokenizer.apply_chat_template(messages, tools)
            except Exception as error:  # raise_exception() in the template, roles it does not take, ...
                message = getattr(error, "message", None) or str(error) or type(error).__name__
                raise bad_request(f"the chat template refused these messages: {message}", "messages") from None

    def prepare_constraint(params: Any) -> Any:
        """Compile the request's grammar and build its first matcher here, off the engine thread."""
        if params.structured_output is not None:
            try:
                engine.engine.prepare_structured_output(params.structured_output)
            except ValueError as error:
                raise bad_request(str(error), getattr(error, "param", None)) from None
        return params

    async def start(requests: list[tuple[list[int], Any, str]]) -> RequestStream:
        try:
            return await engine.add_requests(requests)
        except QueueFullError as error:
            raise APIError(429, str(error), "rate_limit_error", code="queue_full") from None
        except EngineDeadError as error:
            raise APIError(503, str(error), "service_unavailable") from None
        except ValueError as error:  # the engine's own checks: never fits, bad token ids, ...
            raise bad_request(str(error), getattr(error, "param", None)) from None

    async def respond(request: Request, stream: RequestStream, tracker: ChoiceTracker, body: Any) -> Response:
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return EngineStreamResponse(sse(stream, tracker, include_usage, body), stream)
        collect = asyncio.ensure_future(collect_all(stream, tracker))
        try:
            while not collect.done():  # a client that hangs up stops its request
                await asyncio.wait({collect}, timeout=DISCONNECT_POLL_S)
                if not collect.done() and await request.is_disconnected():
                    collect.cancel()
                    return Response(status_code=499)
            collect.result()
        except EngineDeadError as error:
            raise APIError(503, str(error), "service_unavailable") from None
        except RequestFailedError as error:
            raise request_failed(error, body) from None
        finally:
            stream.abort()
        return JSONResponse(tracker.response())

    # --- OpenAI routes -----------------------------------------------------------------

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        check_key(request)
        card = {"id": settings.served_model_name, "object": "model", "created": created, "owned_by": "pagedllm"}
        extensions = {"max_model_len": max_model_len, "vocab_size": engine.engine.model_config.vocab_size}
        return {"object": "list", "data": [{**card, **extensions}]}

    async def generate(request: Request, prepare_body: Callable[[bytes], tuple]) -> Response:
        """A generation route: the body prepared off the loop, its requests added, the reply sent."""
        check_key(request)
        requests, tracker, body = await prepare(prepare_body, await request.body())
        stream = await start(requests)
        return await respond(request, stream, tracker, body)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, prepare_completion)

    def prepare_completion(raw: bytes) -> tuple[list, ChoiceTracker, CompletionRequest]:
        body = parse_body(CompletionRequest, parse_json(raw))
        check_model(body.model)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        prompts = body.prompts()
        prompt_ids = [p if isinstance(p, list) else encode(p) for p in prompts]
        for ids in prompt_ids:
            check_length(ids, max_tokens)
        params = prepare_constraint(body.sampling_params(max_tokens, body.logprobs))
        if body.samples > body.n:  # best_of: draw them all on the shared prompt, rank by log-probability
            params = dataclasses.replace(params, n=body.samples, logprobs=params.logprobs or 0)
        tracker_id = new_id("cmpl")
        request_ids = [f"{tracker_id}-{i}" for i in range(len(prompt_ids))]
        echo = None
        if body.echo:
            with prep_lock:
                echo = {
                    rid: p if isinstance(p, str) else prep_tokenizer.decode(p) for rid, p in zip(request_ids, prompts)
                }
        tracker = ChoiceTracker(
            False,
            settings.served_model_name,
            body.samples,
            request_ids,
            tokenizer.decode,
            body.logprobs is not None,
            keep=body.n if body.samples > body.n else None,
            echo=echo,
            id=tracker_id,
        )
        return [(ids, params, rid) for ids, rid in zip(prompt_ids, request_ids)], tracker, body

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, prepare_chat)

    def prepare_chat(raw: bytes) -> tuple[list, ChoiceTracker, ChatCompletionRequest]:
        body = parse_body(ChatCompletionRequest, parse_json(raw))
        check_model(body.model)
        in_template = prep_tokenizer.template_takes_tools
        mode = body.tool_mode(in_template)
        prompt_ids = chat_template(
            body.conversation(in_template), mode.openai_tools() if mode is not None and in_template else None
        )
        check_length(prompt_ids, body.requested_max_tokens)
        max_tokens = body.requested_max_tokens
        if max_tokens is None:  # as OpenAI: up to the context length
            max_tokens = max_model_len - len(prompt_ids)
        params = prepare_constraint(body.sampling_params(max_tokens, body.num_logprobs))
        tracker_id = new_id("chatcmpl")
        tracker = ChoiceTracker(
            True,
            settings.served_model_name,
            body.n,
            [tracker_id],
            tokenizer.decode,
            body.logprobs,
            tools=mode,
            id=tracker_id,
        )
        return [(prompt_ids, params, tracker_id)], tracker, body

    # --- tokenizer (vLLM's shape) -----------------------------------------------------

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        check_key(request)
        return await prepare(tokenize_body, await request.body())

    def tokenize_body(raw: bytes) -> dict:
        body = parse_body(TokenizeRequest, parse_json(raw))
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send either prompt (text) or messages (a chat)", "prompt")
        if body.messages is not None:
            tokens = chat_template([m.for_template() for m in body.messages])
        else:
            with prep_lock:
                tokens = prep_tokenizer.hf.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        check_key(request)
        return await prepare(detokenize_body, await request.body())

    def detokenize_body(raw: bytes) -> dict:
        body = parse_body(DetokenizeRequest, parse_json(raw))
        check_model(body.model)
        vocab = engine.engine.model_config.vocab_size
        outside = [t for t in body.tokens if not 0 <= t < vocab]
        if outside:
            raise bad_request(f"tokens must be ids in [0, {vocab}), got {outside[:5]}", "tokens")
        with prep_lock:
            return {"prompt": prep_tokenizer.decode(body.tokens)}

    # --- health, metrics, stats, dashboard ---------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return JSONResponse({"status": "dead", "error": repr(engine.error)}, status_code=503)
        if engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats() -> dict:
        return await engine_call(engine_state)

    @app.get("/dashboard")
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(dashboard_html())

    @app.get("/dashboard/state")
    async def dashboard_data() -> dict:
        return await engine_call(lambda e: dashboard_state(e, metrics.throughput()))

    async def engine_call(fn: Any) -> Any:
        try:
            return await engine.call(fn)
        except EngineDeadError as error:
            raise APIError(503, str(error), "service_unavailable") from None

    return app


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
