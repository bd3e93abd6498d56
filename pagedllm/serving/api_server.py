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
preparation threads (serving/preparation.py), so a 200 KB prompt or a 1 MB
schema never delays another stream's tokens.  This module builds the app: the
routes are the small handlers of serving/handlers.py.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.serving.async_engine import AsyncLLMEngine
from pagedllm.serving.handlers import Handlers
from pagedllm.serving.openai_protocol import APIError
from pagedllm.serving.preparation import Preparation
from pagedllm.serving.request_body import BodySizeLimit
from pagedllm.serving.server_log import ServerLog
from pagedllm.serving.server_metrics import ServerMetrics
from pagedllm.serving.settings import ServerSettings
from pagedllm.text.tokenizer import Tokenizer

logger = logging.getLogger("pagedllm")


def build_app(engine: AsyncLLMEngine, tokenizer: Tokenizer, settings: ServerSettings) -> FastAPI:
    """The app around an engine; the app's lifespan starts and stops the engine thread.

    `tokenizer` is the server's own instance (the engine thread uses another one): a Rust
    tokenizer must not be used from two threads at once.  The event loop uses it to decode; the
    preparation threads use a copy of their own, one at a time.
    """
    preparation = Preparation(tokenizer.path, engine.grammars)
    metrics = ServerMetrics()
    engine.step_observers.append(metrics.observe_step)
    engine.step_observers.append(ServerLog().observe_step)
    handlers = Handlers(engine, tokenizer, preparation, metrics, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not engine.is_running:
            engine.start()
        preparation.warm_up()
        yield
        engine.shutdown()
        preparation.shutdown()

    app = FastAPI(title="pagedllm", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    routes = [
        ("GET", "/v1/models", handlers.models),
        ("POST", "/v1/completions", handlers.completions),
        ("POST", "/v1/chat/completions", handlers.chat_completions),
        ("POST", "/tokenize", handlers.tokenize),
        ("POST", "/detokenize", handlers.detokenize),
        ("GET", "/health", handlers.health),
        ("GET", "/metrics", handlers.prometheus_metrics),
        ("GET", "/stats", handlers.stats),
        ("GET", "/dashboard", handlers.dashboard),
        ("GET", "/dashboard/state", handlers.dashboard_state),
    ]
    if settings.runtime_lora:
        routes.append(("POST", "/v1/load_lora_adapter", handlers.load_lora_adapter))
        routes.append(("POST", "/v1/unload_lora_adapter", handlers.unload_lora_adapter))
    if settings.kv_events:  # the engine records them when made with record_kv_events
        routes.append(("GET", "/kv_events", handlers.kv_events))
    for method, path, handler in routes:
        app.add_api_route(path, handler, methods=[method])
    return app


async def api_error(request: Request, error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    return JSONResponse(APIError(error.status_code, str(error.detail), kind).body(), status_code=error.status_code)


async def internal_error(request: Request, error: Exception) -> JSONResponse:
    logger.exception("internal error on %s", request.url.path)
    body = APIError(500, f"internal server error: {error!r}", "internal_error").body()
    return JSONResponse(body, status_code=500)
