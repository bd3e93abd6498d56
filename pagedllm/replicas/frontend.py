"""One OpenAI-compatible endpoint in front of several `pagedllm serve` replicas.

Each completion or chat request is tokenized here (the replicas' own tokenizer and chat
template), placed by the router (pagedllm/replicas/router.py) and forwarded whole to its
replica, whose reply (a stream included) passes back byte for byte: every API feature of
the single server works as it does there, and the replica's own checks answer bad input.
A client that disconnects closes the forwarded request, and the replica aborts it.

Faults:
- a replica that cannot be reached before it has sent a byte (refused, reset, gone) is
  marked down and the request goes to another replica: nothing was streamed, so the
  retry is invisible to the client;
- a replica lost mid-stream ends that stream with an error event (OpenAI's error shape),
  then `[DONE]`: the tokens already sent cannot be taken back;
- every `poll_interval` the front-end drains each replica's block events (`/kv_events`),
  which is also its health check: a replica that fails it is marked down within one
  interval, and taken back (empty cache) as soon as it answers again, at the address
  `resolve` gives for it then (a restarted replica may listen elsewhere).

A request whose `model` names a LoRA adapter is placed by its blocks' keys under that adapter
(the replicas report each adapter's key with their events; replicas that loaded the same file
under the same name agree on it), so requests for one adapter and prefix land together.
Adapters loaded at run time through the front-end go to every replica (replicas/adapters.py).

The front-end checks the client's API key itself (when it has one) and calls every replica with
the replicas' own key (`replica_key`), which no client is given.

`/health` is ok while any replica is up; `/stats` and `/metrics` give every replica's and the
totals; `/replicas/{i}/...` reaches replica i's own pages (its dashboard, its stats), and
`/dashboard` shows every replica's dashboard side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from pagedllm.core.kv_cache_manager import adapter_salt
from pagedllm.replicas.adapters import RuntimeAdapters
from pagedllm.replicas.router import NoReplicaError, Placement, Router
from pagedllm.serving.handlers import check_api_key
from pagedllm.serving.openai_protocol import APIError
from pagedllm.serving.request_body import BodySizeLimit
from pagedllm.text.tokenizer import Tokenizer

logger = logging.getLogger("pagedllm")

Resolve = Callable[[int], Awaitable[str]]  # replica index -> its base URL now (http://host:port)
_LOST = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, httpx.ConnectTimeout)


@dataclass
class FrontendState:
    router: Router
    resolve: Resolve
    addresses: list[str | None]
    api_key: str | None = None
    poll_interval: float = 0.2
    down_since: dict[int, float] = field(default_factory=dict)
    num_retried: int = 0  # requests re-placed after their replica could not take them
    num_marked_down: int = 0  # times a replica was found down
    num_failed_mid_stream: int = 0
    route_seconds: float = 0.0  # time spent tokenizing and placing, over all requests
    adapter_keys: dict[str, str] = field(default_factory=dict)  # LoRA adapter name -> key, from the replicas


# Routing reads a text prompt's first characters only: the leading blocks are what it matches.
ROUTING_CHARS = 1 << 15


def build_frontend(
    tokenizer: Tokenizer,
    router: Router,
    resolve: Resolve,
    api_key: str | None = None,
    poll_interval: float = 0.2,
    max_body_bytes: int = 4 * 2**20,
    replica_key: str | None = None,
) -> FastAPI:
    """`api_key`: what clients must send (None: nothing); `replica_key`: what the replicas require
    (None: nothing)."""
    return Frontend(tokenizer, router, resolve, api_key, poll_interval, replica_key).app(max_body_bytes)


class Frontend:
    """The routes of the data-parallel endpoint, one method each, and the replicas' health poll."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        router: Router,
        resolve: Resolve,
        api_key: str | None,
        poll_interval: float,
        replica_key: str | None,
    ) -> None:
        self.tokenizer, self.router, self.resolve, self.api_key = tokenizer, router, resolve, api_key
        self.state = FrontendState(router, resolve, [None] * len(router.replicas), api_key, poll_interval)
        # One thread tokenizes (a Rust tokenizer is not for two threads at once), off the event loop.
        self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-route")
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=5.0), limits=httpx.Limits(max_connections=None)
        )
        self.headers = {"authorization": f"Bearer {replica_key}"} if replica_key else {}
        self.adapters = RuntimeAdapters(self.client, self.headers, self.live_addresses, self.mark_address_down)

    def app(self, max_body_bytes: int) -> FastAPI:
        app = FastAPI(title="pagedllm (data parallel)", lifespan=self.lifespan, docs_url=None, redoc_url=None)
        app.state.frontend = self.state
        app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)  # as each replica's: never read a huge body
        app.add_api_route("/v1/completions", self.forward, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.forward, methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"])
        app.add_api_route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"])
        app.add_api_route("/tokenize", self.any_replica, methods=["POST"])
        app.add_api_route("/detokenize", self.any_replica, methods=["POST"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/stats", self.stats, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_api_route("/dashboard", self.dashboard, methods=["GET"])
        app.add_api_route("/replicas/{i}/{page:path}", self.replica_page, methods=["GET"])
        return app

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        await self.poll_all()
        poller = asyncio.create_task(self.poll_forever())
        yield
        poller.cancel()
        await self.client.aclose()
        self.tokenizing.shutdown(wait=False)

    # --- replicas' health and cache events -----------------------------------------------

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll(i) for i in range(len(self.router.replicas))))

    async def poll_forever(self) -> None:
        while True:
            await self.poll_all()
            await asyncio.sleep(self.state.poll_interval)

    async def poll(self, i: int) -> None:
        state, router = self.state, self.router
        try:
            if state.addresses[i] is None:
                wait = max(1.0, state.poll_interval * 5)
                state.addresses[i] = await asyncio.wait_for(self.resolve(i), timeout=wait)
            reply = await self.client.get(f"{state.addresses[i]}/kv_events", headers=self.headers, timeout=5.0)
            reply.raise_for_status()
            body = reply.json()
            events = [(bool(s), bytes.fromhex(k)) for s, k in body["events"]]
            self.state.adapter_keys.update({str(k): str(v) for k, v in body.get("adapters", {}).items()})
        except Exception as error:  # noqa: BLE001 - any failure to answer is a replica down
            if router.replicas[i].live:
                logger.warning("replica %d is down (%s)", i, error)
                self.mark_down(i)
            state.addresses[i] = None  # ask where it is again: a restarted replica may have moved
            return
        if not router.replicas[i].live:
            # A restarted replica has its --lora flags only.  Awaited here, so that it takes no request
            # before it has them; the other replicas' polls wait while its adapters load.
            if not await self.adapters.replay(state.addresses[i], lambda: self.mark_up(i)):
                state.addresses[i] = None  # lost again while its adapters were given back: tried anew
                return
        router.apply_events(i, events)

    def mark_up(self, i: int) -> None:
        logger.info("replica %d is back after %.1f s", i, time.monotonic() - self.state.down_since.pop(i, 0.0))
        self.router.mark_up(i)

    def mark_address_down(self, address: str) -> None:
        for i, known in enumerate(self.state.addresses):
            if known == address and self.router.replicas[i].live:
                logger.warning("replica %d is down (it did not answer an adapter load or unload)", i)
                self.mark_down(i)

    def mark_down(self, i: int) -> None:
        self.router.mark_down(i)
        self.state.down_since[i] = time.monotonic()
        self.state.addresses[i] = None
        self.state.num_marked_down += 1

    # --- placing and forwarding a request --------------------------------------------------

    def client_refused(self, request: Request) -> Response | None:
        try:
            check_api_key(request.headers.get("authorization", ""), self.api_key)
        except APIError as error:
            return JSONResponse(error.body(), status_code=error.status)
        return None

    def routing_ids(self, path: str, body: dict) -> list[int]:
        if path.endswith("chat/completions"):
            return self.tokenizer.apply_chat_template(body.get("messages") or [], body.get("tools"))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]  # a batch of prompts: placed by the first
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt[:ROUTING_CHARS])
        return [t for t in prompt if isinstance(t, int)] if isinstance(prompt, list) else []

    async def place(self, path: str, raw: bytes, exclude: tuple[int, ...]) -> Placement:
        start = time.perf_counter()
        loop = asyncio.get_running_loop()
        salt = b""
        try:
            body = json.loads(raw)
            ids = await loop.run_in_executor(self.tokenizing, self.routing_ids, path, body)
            key = self.state.adapter_keys.get(body.get("model")) if isinstance(body.get("model"), str) else None
            salt = adapter_salt(key) if key else b""
        except Exception:  # noqa: BLE001 - a body the replica will refuse: placed by load alone
            ids = []
        placement = self.router.route(ids, salt, exclude=exclude)
        self.state.route_seconds += time.perf_counter() - start
        return placement

    async def forward(self, request: Request) -> Response:
        if (refused := self.client_refused(request)) is not None:
            return refused
        raw = await request.body()
        path = request.url.path
        forward_headers = {k: v for k, v in request.headers.items() if k == "content-type"} | self.headers
        tried: list[int] = []
        while True:
            try:
                placement = await self.place(path, raw, tuple(tried))
            except NoReplicaError as error:
                body = {"error": {"message": str(error), "type": "service_unavailable", "code": 503}}
                return JSONResponse(body, status_code=503)
            address = self.state.addresses[placement.replica]
            upstream = None
            try:
                if address is None:
                    raise httpx.ConnectError("replica address unknown")
                outgoing = self.client.build_request("POST", address + path, content=raw, headers=forward_headers)
                upstream = await self.client.send(outgoing, stream=True)
                chunks = upstream.aiter_raw()
                first = await anext(chunks, b"")
            except _LOST as error:
                if upstream is not None:
                    await upstream.aclose()
                self.router.finished(placement)
                logger.warning(
                    "replica %d lost before answering (%s): placing the request again", placement.replica, error
                )
                if self.router.replicas[placement.replica].live:
                    self.mark_down(placement.replica)
                tried.append(placement.replica)
                self.state.num_retried += 1
                continue
            except BaseException:  # the client went away (cancelled) or another failure: undo the placement
                if upstream is not None:
                    await upstream.aclose()
                self.router.finished(placement)
                raise
            return StreamingResponse(
                self.relay(upstream, chunks, first, placement),
                status_code=upstream.status_code,
                media_type=upstream.headers.get("content-type"),
            )

    async def relay(
        self, upstream: httpx.Response, chunks: AsyncIterator[bytes], first: bytes, placement: Placement
    ) -> AsyncIterator[bytes]:
        try:
            if first:
                yield first
            async for chunk in chunks:
                yield chunk
        except _LOST as error:
            self.state.num_failed_mid_stream += 1
            message = f"the replica serving this request was lost mid-reply ({error!r}); retry the request"
            yield b"data: " + json.dumps({"error": {"message": message, "type": "replica_lost"}}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            await upstream.aclose()
            self.router.finished(placement)

    # --- pages every replica answers alike, and the combined ones --------------------------

    def live_addresses(self) -> list[str]:
        return [a for a, view in zip(self.state.addresses, self.router.replicas) if a is not None and view.live]

    async def load_lora_adapter(self, request: Request) -> Response:
        """Every replica up loads the adapter, or none does (replicas/adapters.py)."""
        if (refused := self.client_refused(request)) is not None:
            return refused
        return await self.adapters.load(await request.body())

    async def unload_lora_adapter(self, request: Request) -> Response:
        if (refused := self.client_refused(request)) is not None:
            return refused
        return await self.adapters.unload(await request.body())

    def first_up(self) -> str | None:
        for i, address in enumerate(self.state.addresses):
            if address is not None and self.router.replicas[i].live:
                return address
        return None

    async def models(self, request: Request) -> Response:
        if (refused := self.client_refused(request)) is not None:
            return refused
        if (address := self.first_up()) is None:
            return JSONResponse({"error": {"message": "no replica is up", "type": "service_unavailable"}}, 503)
        reply = await self.client.get(f"{address}/v1/models", headers=self.headers)
        return Response(reply.content, reply.status_code, media_type="application/json")

    async def any_replica(self, request: Request) -> Response:
        """/tokenize and /detokenize: every replica answers them alike; the first one up does."""
        if (refused := self.client_refused(request)) is not None:
            return refused
        body = await request.body()
        if (address := self.first_up()) is None:
            return JSONResponse({"error": {"message": "no replica is up", "type": "service_unavailable"}}, 503)
        reply = await self.client.post(address + request.url.path, content=body, headers=self.headers)
        return Response(reply.content, reply.status_code, media_type=reply.headers.get("content-type"))

    async def health(self) -> Response:
        up = [view.live for view in self.router.replicas]
        body = {"status": "ok" if any(up) else "dead", "replicas": ["up" if u else "down" for u in up]}
        return JSONResponse(body, status_code=200 if any(up) else 503)

    async def replica_json(self, i: int, page: str) -> dict | None:
        address = self.state.addresses[i]
        if address is None:
            return None
        try:
            reply = await self.client.get(f"{address}/{page}", headers=self.headers, timeout=5.0)
            return reply.json() if reply.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    async def stats(self) -> dict:
        replicas = range(len(self.router.replicas))
        per_replica = await asyncio.gather(*(self.replica_json(i, "stats") for i in replicas))
        total = sum_numbers([s for s in per_replica if s is not None])
        queried = total.get("prefix_cache_queried_tokens", 0)
        total["prefix_cache_hit_rate"] = total.get("prefix_cache_hit_tokens", 0) / queried if queried else 0.0
        return {
            "router": router_stats(self.state),
            "replicas": [s if s is not None else {"status": "down"} for s in per_replica],
            "total": total,
        }

    async def metrics(self) -> Response:
        lines = [f"pagedllm_router_{k} {v}" for k, v in router_stats(self.state).items() if isinstance(v, (int, float))]
        seen: set[str] = set()  # each HELP / TYPE line once, for every replica's samples
        for i, address in enumerate(self.state.addresses):
            if address is None:
                continue
            try:
                reply = await self.client.get(f"{address}/metrics", timeout=5.0)
            except httpx.HTTPError:
                continue
            for line in reply.text.splitlines():
                if line.startswith("#"):
                    if line in seen:
                        continue
                    seen.add(line)
                lines.append(labelled(line, i))
        return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def replica_page(self, i: int, page: str, request: Request) -> Response:
        if not 0 <= i < len(self.router.replicas) or self.state.addresses[i] is None:
            return JSONResponse({"error": {"message": f"replica {i} is not up", "type": "not_found_error"}}, 404)
        url = f"{self.state.addresses[i]}/{page}"
        reply = await self.client.get(url, params=request.query_params, headers=self.headers)
        return Response(reply.content, reply.status_code, media_type=reply.headers.get("content-type"))

    async def dashboard(self) -> HTMLResponse:
        """Every replica's live dashboard, side by side (each is the replica's own page, proxied)."""
        router = self.router
        frames = "".join(
            f"<section><h2>replica {i} ({'up' if view.live else 'down'})</h2>"
            f'<iframe src="replicas/{i}/dashboard" title="replica {i}"></iframe></section>'
            for i, view in enumerate(router.replicas)
        )
        style = "body{font-family:sans-serif;margin:1em}iframe{width:100%;height:640px;border:1px solid #ccc}"
        return HTMLResponse(
            f"<!doctype html><title>pagedllm replicas</title><style>{style}</style>"
            f"<h1>{len(router.replicas)} replicas, router {router.policy}</h1>"
            f'<p>Counts over all replicas: <a href="stats">/stats</a>, <a href="metrics">/metrics</a></p>{frames}'
        )


def router_stats(state: FrontendState) -> dict:
    router = state.router
    return {
        "policy": router.policy,
        "replicas_up": sum(view.live for view in router.replicas),
        "requests_routed": router.num_routed,
        "requests_routed_by_load": router.num_routed_by_load,
        "requests_retried": state.num_retried,
        "requests_failed_mid_stream": state.num_failed_mid_stream,
        "replicas_marked_down": state.num_marked_down,
        "in_flight": [view.in_flight for view in router.replicas],
        "addresses": list(state.addresses),
        "route_ms_mean": round(1e3 * state.route_seconds / max(1, router.num_routed), 3),
    }


def sum_numbers(items: list[dict]) -> dict:
    """Field by field (nested dicts too), the sum of the counts in the replicas' /stats; rates
    (`*_rate`) do not add up and are left out."""
    total: dict = {}
    for item in items:
        for key, value in item.items():
            if isinstance(value, dict):
                total[key] = sum_numbers([total.get(key, {}), value])
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and not key.endswith("_rate"):
                total[key] = total.get(key, 0) + value
    return {key: value for key, value in total.items() if value != {}}


def labelled(line: str, replica: int) -> str:
    """A Prometheus sample line with replica="i" added to its labels (comments as they are)."""
    if not line or line.startswith("#"):
        return line
    name, _, rest = line.partition(" ")
    if "{" in name:
        return name.replace("{", f'{{replica="{replica}",', 1) + " " + rest
    return f'{name}{{replica="{replica}"}} {rest}'
