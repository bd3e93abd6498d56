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
"""

from __future__ import annotations

import asyncio
import json
import logging

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
    """The adapters loaded through the front-end (name -> the load's body, in load order)."""

    def __init__(self, client: httpx.AsyncClient, headers: dict[str, str]) -> None:
        self.client, self.headers = client, headers
        self.loaded: dict[str, bytes] = {}

    async def post(self, address: str, path: str, raw: bytes) -> httpx.Response | None:
        """The replica's reply, or None where it could not be reached."""
        headers = {"content-type": "application/json"} | self.headers
        try:
            return await self.client.post(address + path, content=raw, headers=headers, timeout=300.0)
        except httpx.HTTPError as error:
            logger.warning("replica at %s did not answer %s (%s)", address, path, error)
            return None

    async def load(self, addresses: list[str], raw: bytes) -> Response:
        if not addresses:
            return _unavailable("no replica is up")
        replies = await asyncio.gather(*(self.post(a, LOAD, raw) for a in addresses))
        failed = [(a, r) for a, r in zip(addresses, replies) if r is None or r.status_code != 200]
        name = _lora_name(raw)
        if not failed and name is not None:
            self.loaded[name] = raw
            return _reply(replies[0])
        loaded = [a for a, r in zip(addresses, replies) if r is not None and r.status_code == 200]
        if loaded and name is not None:  # all or none: those that took it give it back
            undo = json.dumps({"lora_name": name}).encode()
            await asyncio.gather(*(self.post(a, UNLOAD, undo) for a in loaded))
        address, reply = failed[0] if failed else (addresses[0], replies[0])
        if reply is None:
            return _unavailable(f"the replica at {address} was lost while loading the adapter; nothing was loaded")
        return _reply(reply)

    async def unload(self, addresses: list[str], raw: bytes) -> Response:
        if not addresses:
            return _unavailable("no replica is up")
        replies = await asyncio.gather(*(self.post(a, UNLOAD, raw) for a in addresses))
        answered = [r for r in replies if r is not None]
        done = [r for r in answered if r.status_code == 200]
        if done and (name := _lora_name(raw)) is not None:
            self.loaded.pop(name, None)
        in_use = [r for r in answered if r.status_code == 409]
        if in_use:
            return _reply(in_use[0])
        if done:
            return _reply(done[0])
        return _reply(answered[0]) if answered else _unavailable("no replica answered the unload")

    async def replay(self, address: str) -> None:
        """Give a replica that came back every adapter loaded through the front-end."""
        for name, raw in list(self.loaded.items()):
            reply = await self.post(address, LOAD, raw)
            if reply is None or (reply.status_code != 200 and "loaded already" not in reply.text):
                status = "no answer" if reply is None else f"{reply.status_code} {reply.text[:300]}"
                logger.warning("replica at %s did not load adapter %r again: %s", address, name, status)
