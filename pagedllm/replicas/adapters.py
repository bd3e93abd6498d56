"""LoRA adapters loaded and unloaded at run time through the data-parallel front-end.

A load goes to every replica that is up, so that a request for the adapter can be placed on any
of them.  It holds only where every replica loaded it: where one refuses (a bad file, no room
under its --max-loras), those that loaded it unload it again and the client gets that replica's
error.  The front-end keeps each load it passed, and a replica that comes back (restarted: it
starts with its --lora flags only) is given them before it takes requests again.

An unload goes to every replica that is up.  A replica where a running request still uses the
adapter refuses (409) while the others unload it: the client gets the 409 and retries once the
request is done (a replica that unloaded it already answers the retry with 404, which then
counts as done).  Until the retry, requests for it reach only replicas that still hold it, or
get a 404 from one that does not.

A replica that does not answer a load or an unload is marked down, as one that does not answer
a request is, and every adapter unloaded through the front-end is unloaded on it again when it
comes back (with those loaded, given again), so that it holds what the others hold whether it
was restarted (and has its --lora flags again) or was only out of reach.  Loads, unloads and a
replica's return take one lock: a load never runs while a replica comes back, so it either
reaches that replica or is among those given to it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

import httpx
from fastapi.responses import JSONResponse, Response

logger = logging.getLogger("pagedllm")

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


def _lora_name(raw: bytes) -> str | None:
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    name = body.get("lora_name") if isinstance(body, dict) else None
    return name if isinstance(name, str) else None


def _reply(reply: httpx.Response) -> Response:
    return Response(reply.content, reply.status_code, media_type=reply.headers.get("content-type"))


def _unavailable(message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "service_unavailable", "code": 503}}, 503)


class RuntimeAdapters:
    """The adapters loaded through the front-end (name -> the load's body, in load order) and
    those unloaded through it; `live` lists the addresses of the replicas up, `lost` marks the
    replica at an address down."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        headers: dict[str, str],
        live: Callable[[], list[str]],
        lost: Callable[[str], None],
    ) -> None:
        self.client, self.headers, self.live, self.lost = client, headers, live, lost
        self.loaded: dict[str, bytes] = {}
        self.unloaded: set[str] = set()
        self.lock = asyncio.Lock()

    async def post(self, address: str, path: str, raw: bytes) -> httpx.Response | None:
        """The replica's reply, or None where it could not be reached (it is then marked down)."""
        headers = {"content-type": "application/json"} | self.headers
        try:
            return await self.client.post(address + path, content=raw, headers=headers, timeout=300.0)
        except httpx.HTTPError as error:
            logger.warning("replica at %s did not answer %s (%s)", address, path, error)
            self.lost(address)
            return None

    async def load(self, raw: bytes) -> Response:
        async with self.lock:
            return await self._load(self.live(), raw)

    async def _load(self, addresses: list[str], raw: bytes) -> Response:
        if not addresses:
            return _unavailable("no replica is up")
        replies = await asyncio.gather(*(self.post(a, LOAD, raw) for a in addresses))
        failed = [(a, r) for a, r in zip(addresses, replies) if r is None or r.status_code != 200]
        name = _lora_name(raw)
        if not failed and name is not None:
            self.loaded[name] = raw
            self.unloaded.discard(name)
            return _reply(replies[0])
        loaded = [a for a, r in zip(addresses, replies) if r is not None and r.status_code == 200]
        if loaded and name is not None:  # all or none: those that took it give it back
            undo = json.dumps({"lora_name": name}).encode()
            await asyncio.gather(*(self.post(a, UNLOAD, undo) for a in loaded))
        if name is not None and any(r is None for r in replies) and name not in self.loaded:
            self.unloaded.add(name)  # a replica out of reach may have loaded it: undone when it is back
        address, reply = failed[0] if failed else (addresses[0], replies[0])
        if reply is None:
            return _unavailable(f"the replica at {address} was lost while loading the adapter; nothing was loaded")
        return _reply(reply)

    async def unload(self, raw: bytes) -> Response:
        async with self.lock:
            return await self._unload(self.live(), raw)

    async def _unload(self, addresses: list[str], raw: bytes) -> Response:
        if not addresses:
            return _unavailable("no replica is up")
        replies = await asyncio.gather(*(self.post(a, UNLOAD, raw) for a in addresses))
        answered = [r for r in replies if r is not None]
        done = [r for r in answered if r.status_code == 200]
        if done and (name := _lora_name(raw)) is not None:
            self.loaded.pop(name, None)
            self.unloaded.add(name)  # a replica down now (or out of reach) unloads it when it is back
        in_use = [r for r in answered if r.status_code == 409]
        if in_use:
            return _reply(in_use[0])
        if done:
            return _reply(done[0])
        return _reply(answered[0]) if answered else _unavailable("no replica answered the unload")

    async def replay(self, address: str, then: Callable[[], None]) -> bool:
        """Bring a replica that came back to what the others hold: every adapter unloaded through
        the front-end unloaded (a 404 means it never had it), every one loaded given again; then
        `then()` (it is marked up) before the lock is let go.  False, and no `then()`, where the
        replica stopped answering meanwhile."""
        async with self.lock:
            for name in sorted(self.unloaded):
                reply = await self.post(address, UNLOAD, json.dumps({"lora_name": name}).encode())
                if reply is None:
                    return False
                if reply.status_code not in (200, 404):
                    status = f"{reply.status_code} {reply.text[:300]}"
                    logger.warning("replica at %s kept adapter %r: %s", address, name, status)
            for name, raw in list(self.loaded.items()):
                reply = await self.post(address, LOAD, raw)
                if reply is None:
                    return False
                if reply.status_code != 200 and "loaded already" not in reply.text:
                    status = f"{reply.status_code} {reply.text[:300]}"
                    logger.warning("replica at %s did not load adapter %r again: %s", address, name, status)
            then()
            return True
