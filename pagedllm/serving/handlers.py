"""The server's routes, one small handler each.

A generation route reads its body, prepares it on a preparation thread (parse, check, tokenize,
template, grammar: pagedllm/serving/preparation.py), adds its requests to the engine, and
replies as a stream or one body (pagedllm/serving/streaming.py).  Every failure a client can
cause is an `APIError` in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from pagedllm.core.request import PromptLengthError, check_prompt_length
from pagedllm.serving.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    NewRequest,
    QueueFullError,
    RequestFailedError,
    RequestStream,
)
from pagedllm.serving.dashboard import dashboard_html, dashboard_state
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
from pagedllm.serving.preparation import Preparation
from pagedllm.serving.request_body import parse_json
from pagedllm.serving.server_metrics import ServerMetrics
from pagedllm.serving.settings import ServerSettings
from pagedllm.serving.streaming import EngineStreamResponse, collect_all, request_failed, sse
from pagedllm.text.tokenizer import Tokenizer

DISCONNECT_POLL_S = 0.25
Prepared = tuple[list[NewRequest], ChoiceTracker, Any]  # engine requests, tracker, body


def check_api_key(authorization: str, api_key: str | None) -> None:
    """A 401 unless the `Authorization` header carries `api_key` (None: no key needed)."""
    if api_key is None:
        return
    if not secrets.compare_digest(authorization.encode(), f"Bearer {api_key}".encode()):
        problem = "wrong" if authorization else "missing"
        raise APIError(
            401,
            f"{problem} API key: send 'Authorization: Bearer <key>'",
            "authentication_error",
            code="invalid_api_key",
        )


def service_unavailable(error: EngineDeadError) -> APIError:
    return APIError(503, str(error), "service_unavailable")


class Handlers:
    """The routes of one server.  `tokenizer` is the event loop's own (it decodes replies); the
    preparation threads have theirs, and the engine thread another."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        tokenizer: Tokenizer,
        preparation: Preparation,
        metrics: ServerMetrics,
        settings: ServerSettings,
    ) -> None:
        self.engine, self.tokenizer, self.prep, self.metrics = engine, tokenizer, preparation, metrics
        self.served_model_name, self.api_key = settings.served_model_name, settings.api_key
        self.model_names = {settings.served_model_name, *settings.model_aliases}  # what a request's `model` may be
        self.allow_unknown_fields = settings.allow_unknown_fields
        self.max_model_len = engine.info.max_model_len
        self.vocab_size = engine.info.vocab_size
        self.created = int(time.time())  # /v1/models' `created`: when this server loaded the model

    # --- checks ------------------------------------------------------------------------

    def check_key(self, request: Request) -> None:
        check_api_key(request.headers.get("authorization", ""), self.api_key)

    def check_model(self, model: str | None) -> None:
        """For the routes that only tokenize: the base model's names."""
        if model is not None and model not in self.model_names:
            raise self.no_such_model(model)

    def adapter_of(self, model: str | None) -> str | None:
        """The LoRA adapter a generation request names as its `model` (None: the base model); the
        engine refuses a name no adapter has (see `start`)."""
        return None if model is None or model in self.model_names else model

    def no_such_model(self, model: str) -> APIError:
        return APIError(
            404,
            f"the model '{model:.200}' does not exist; this server serves '{self.served_model_name}' "
            "and the LoRA adapters /v1/models lists",
            param="model",
            code="model_not_found",
        )

    def check_length(self, prompt_ids: list[int], max_tokens: int | None) -> None:
        try:
            check_prompt_length(len(prompt_ids), max_tokens, self.max_model_len)
        except PromptLengthError as error:
            raise bad_request(str(error), error.param) from None

    # --- generation --------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, self.prepare_completion)

    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, self.prepare_chat)

    async def generate(self, request: Request, prepare_body: Callable[[bytes], Prepared]) -> Response:
        """A generation route: the body prepared off the loop, its requests added, the reply sent."""
        self.check_key(request)
        requests, tracker, body = await self.prep.run(prepare_body, await request.body())
        stream = await self.start(requests)
        return await self.respond(request, stream, tracker, body)

    async def start(self, requests: list[NewRequest]) -> RequestStream:
        try:
            return await self.engine.add_requests(requests)
        except KeyError:  # an adapter name the engine does not have
            raise self.no_such_model(requests[0].lora or "") from None
        except QueueFullError as error:
            raise APIError(429, str(error), "rate_limit_error", code="queue_full") from None
        except EngineDeadError as error:
            raise service_unavailable(error) from None
        except ValueError as error:  # the engine's own checks: never fits, bad token ids, ...
            raise bad_request(str(error), getattr(error, "param", None)) from None

    async def respond(self, request: Request, stream: RequestStream, tracker: ChoiceTracker, body: Any) -> Response:
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
            raise service_unavailable(error) from None
        except RequestFailedError as error:
            raise request_failed(error, body) from None
        finally:
            stream.abort()
        return JSONResponse(tracker.response())

    def prepare_completion(self, raw: bytes) -> Prepared:
        body = parse_body(CompletionRequest, parse_json(raw), self.allow_unknown_fields)
        lora = self.adapter_of(body.model)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        prompts = body.prompts()
        prompt_ids = [p if isinstance(p, list) else self.prep.encode(p) for p in prompts]
        for ids in prompt_ids:
            self.check_length(ids, max_tokens)
        params = self.prep.constraint(body.sampling_params(max_tokens, body.logprobs))
        if body.samples > body.n:  # best_of: draw them all on the shared prompt, rank by log-probability
            params = dataclasses.replace(params, n=body.samples, logprobs=params.logprobs or 0)
        tracker_id = new_id("cmpl")
        request_ids = [f"{tracker_id}-{i}" for i in range(len(prompt_ids))]
        echo = None
        if body.echo:
            echo = {rid: p if isinstance(p, str) else self.prep.decode(p) for rid, p in zip(request_ids, prompts)}
        tracker = ChoiceTracker(
            False,
            self.served_model_name,
            body.samples,
            request_ids,
            self.tokenizer.decode,
            body.logprobs is not None,
            keep=body.n if body.samples > body.n else None,
            echo=echo,
            id=tracker_id,
        )
        return [NewRequest(ids, params, rid, lora) for ids, rid in zip(prompt_ids, request_ids)], tracker, body

    def prepare_chat(self, raw: bytes) -> Prepared:
        body = parse_body(ChatCompletionRequest, parse_json(raw), self.allow_unknown_fields)
        lora = self.adapter_of(body.model)
        in_template = self.prep.template_takes_tools
        mode = body.tool_mode(in_template)
        tools = mode.openai_tools() if mode is not None and in_template else None
        prompt_ids = self.prep.chat_template(body.conversation(in_template), tools)
        self.check_length(prompt_ids, body.requested_max_tokens)
        max_tokens = body.requested_max_tokens
        if max_tokens is None:  # as OpenAI: up to the context length
            max_tokens = self.max_model_len - len(prompt_ids)
        params = self.prep.constraint(body.sampling_params(max_tokens, body.num_logprobs))
        tracker_id = new_id("chatcmpl")
        tracker = ChoiceTracker(
            True, self.served_model_name, body.n, [tracker_id], self.tokenizer.decode, body.logprobs, tools=mode,
            id=tracker_id,
        )  # fmt: skip
        return [NewRequest(prompt_ids, params, tracker_id, lora)], tracker, body

    # --- models and the tokenizer (vLLM's shape) -----------------------------------------

    async def models(self, request: Request) -> dict:
        self.check_key(request)
        card = {"id": self.served_model_name, "object": "model", "created": self.created, "owned_by": "pagedllm"}
        extensions = {"max_model_len": self.max_model_len, "vocab_size": self.vocab_size}
        adapters = await self.engine.call(lambda engine: engine.lora_adapters())
        cards = [{**card, "id": a["name"], "parent": self.served_model_name, "root": a["path"]} for a in adapters]
        return {"object": "list", "data": [{**card, **extensions}, *cards]}

    async def load_lora_adapter(self, request: Request) -> dict:
        """`{"lora_name": NAME, "lora_path": PATH}`: load a PEFT or GGUF adapter from the server's disk."""
        self.check_key(request)
        body = parse_json(await request.body())
        name, path = (body.get("lora_name"), body.get("lora_path")) if isinstance(body, dict) else (None, None)
        if not isinstance(name, str) or not isinstance(path, str):
            raise bad_request("send lora_name and lora_path, both strings", "lora_name")
        if name in self.model_names:
            raise bad_request(f"'{name:.200}' is the base model's name", "lora_name")
        try:
            await self.engine.call(lambda engine: engine.load_lora(name, path))
        except (ValueError, KeyError) as error:  # a bad file (ModelFileError), a taken name, max_loras
            raise bad_request(str(error), "lora_path") from None
        return {"status": "loaded", "lora_name": name}

    async def unload_lora_adapter(self, request: Request) -> dict:
        """`{"lora_name": NAME}`: forget an adapter no unfinished request uses."""
        self.check_key(request)
        body = parse_json(await request.body())
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str):
            raise bad_request("send lora_name, a string", "lora_name")
        try:
            await self.engine.call(lambda engine: engine.unload_lora(name))
        except KeyError:
            raise self.no_such_model(name) from None
        except ValueError as error:  # in use
            raise APIError(409, str(error), "invalid_request_error", param="lora_name", code="adapter_in_use") from None
        return {"status": "unloaded", "lora_name": name}

    async def tokenize(self, request: Request) -> dict:
        self.check_key(request)
        return await self.prep.run(self.tokenize_body, await request.body())

    def tokenize_body(self, raw: bytes) -> dict:
        body = parse_body(TokenizeRequest, parse_json(raw), self.allow_unknown_fields)
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send either prompt (text) or messages (a chat)", "prompt")
        if body.messages is not None:
            tokens = self.prep.chat_template([m.for_template() for m in body.messages])
        else:
            tokens = self.prep.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens}

    async def detokenize(self, request: Request) -> dict:
        self.check_key(request)
        return await self.prep.run(self.detokenize_body, await request.body())

    def detokenize_body(self, raw: bytes) -> dict:
        body = parse_body(DetokenizeRequest, parse_json(raw), self.allow_unknown_fields)
        self.check_model(body.model)
        outside = [t for t in body.tokens if not 0 <= t < self.vocab_size]
        if outside:
            raise bad_request(f"tokens must be ids in [0, {self.vocab_size}), got {outside[:5]}", "tokens")
        return {"prompt": self.prep.decode(body.tokens)}

    # --- health, metrics, stats, dashboard ---------------------------------------------

    async def health(self) -> Response:
        if not self.engine.is_running:
            return JSONResponse({"status": "dead", "error": repr(self.engine.error)}, status_code=503)
        if self.engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def prometheus_metrics(self) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def stats(self) -> dict:
        return await self.engine_call(lambda e: e.state())

    async def kv_events(self, request: Request) -> dict:
        """The block keys the prefix cache stored and evicted since the last call, oldest first, as
        [1 stored / 0 evicted, key in hex], and each loaded LoRA adapter's key (the router salts a
        request's blocks by it); behind the API key (keys are hashes of prompts)."""
        self.check_key(request)

        def drain(engine: Any) -> dict:
            events = engine.drain_kv_events()
            adapters = {a["name"]: a["key"] for a in engine.lora_adapters()}
            return {
                "block_size": engine.info.block_size,
                "events": [[int(s), k.hex()] for s, k in events],
                "adapters": adapters,
            }

        return await self.engine_call(drain)

    async def dashboard(self) -> HTMLResponse:
        return HTMLResponse(dashboard_html())

    async def dashboard_state(self) -> dict:
        return await self.engine_call(lambda e: dashboard_state(e, self.metrics.throughput()))

    async def engine_call(self, fn: Any) -> Any:
        try:
            return await self.engine.call(fn)
        except EngineDeadError as error:
            raise service_unavailable(error) from None
