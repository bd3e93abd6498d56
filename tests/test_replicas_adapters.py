"""LoRA adapters loaded and unloaded through the data-parallel front-end, against two stand-in
replicas (httpx's mock transport answering as `pagedllm serve --allow-runtime-lora` does): every
replica loads an adapter or none keeps it, an unload refused where the adapter is in use can be
retried, and a replica that comes back is given the adapters again before it takes requests."""

from __future__ import annotations

import asyncio
import json

import httpx
from fastapi.testclient import TestClient

from pagedllm.replicas.adapters import LOAD, UNLOAD
from pagedllm.replicas.frontend import Frontend
from pagedllm.replicas.router import Router

ADDRESSES = ["http://r0", "http://r1"]


class Replicas:
    """What each stand-in replica holds; `refuse` makes one refuse every load (no room)."""

    def __init__(self) -> None:
        self.loaded: dict[str, set[str]] = {a: set() for a in ADDRESSES}
        self.in_use: dict[str, set[str]] = {a: set() for a in ADDRESSES}
        self.refuse: set[str] = set()
        self.calls: list[tuple[str, str]] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        address = f"{request.url.scheme}://{request.url.host}"
        assert request.headers["authorization"] == "Bearer replica-key"
        if request.url.path == "/kv_events":
            return httpx.Response(200, json={"block_size": 16, "events": [], "adapters": {}})
        name = json.loads(request.content)["lora_name"]
        self.calls.append((address, request.url.path))
        held = self.loaded[address]
        if request.url.path == LOAD:
            if name in held:
                return httpx.Response(400, json={"error": {"message": f"adapter {name!r} is loaded already"}})
            if address in self.refuse:
                return httpx.Response(400, json={"error": {"message": "max_loras adapters are loaded"}})
            held.add(name)
            return httpx.Response(200, json={"status": "loaded", "lora_name": name})
        if name in self.in_use[address]:
            return httpx.Response(409, json={"error": {"message": f"adapter {name!r} is in use"}})
        if name not in held:
            return httpx.Response(404, json={"error": {"message": f"the model {name!r} does not exist"}})
        held.remove(name)
        return httpx.Response(200, json={"status": "unloaded", "lora_name": name})


def frontend_over(replicas: Replicas) -> tuple[Frontend, TestClient]:
    async def resolve(i: int) -> str:
        return ADDRESSES[i]

    frontend = Frontend(None, Router(2, 16, "prefix"), resolve, "client-key", 0.2, "replica-key")
    frontend.client = frontend.adapters.client = httpx.AsyncClient(transport=httpx.MockTransport(replicas.handle))
    frontend.state.addresses = list(ADDRESSES)
    return frontend, TestClient(frontend.app(2**20))


KEY = {"authorization": "Bearer client-key"}


def test_a_load_reaches_every_replica_and_a_refused_one_undoes_it():
    replicas = Replicas()
    _, client = frontend_over(replicas)
    body = {"lora_name": "a", "lora_path": "/adapters/a"}
    assert client.post(LOAD, json=body).status_code == 401  # the client's key, as on one server
    reply = client.post(LOAD, json=body, headers=KEY)
    assert reply.status_code == 200 and reply.json()["lora_name"] == "a"
    assert replicas.loaded == {"http://r0": {"a"}, "http://r1": {"a"}}

    replicas.refuse.add("http://r1")
    refused = client.post(LOAD, json={"lora_name": "b", "lora_path": "/adapters/b"}, headers=KEY)
    assert refused.status_code == 400 and "max_loras" in refused.json()["error"]["message"]
    assert replicas.loaded == {"http://r0": {"a"}, "http://r1": {"a"}}  # r0 gave b back
    assert ("http://r0", UNLOAD) in replicas.calls


def test_an_unload_refused_where_the_adapter_runs_finishes_on_retry():
    replicas = Replicas()
    frontend, client = frontend_over(replicas)
    assert client.post(LOAD, json={"lora_name": "a", "lora_path": "/a"}, headers=KEY).status_code == 200
    replicas.in_use["http://r1"].add("a")
    busy = client.post(UNLOAD, json={"lora_name": "a"}, headers=KEY)
    assert busy.status_code == 409 and replicas.loaded == {"http://r0": set(), "http://r1": {"a"}}
    assert "a" not in frontend.adapters.loaded  # a replica that comes back is not given it again
    replicas.in_use["http://r1"].clear()
    assert client.post(UNLOAD, json={"lora_name": "a"}, headers=KEY).status_code == 200  # r0's 404 counts as done
    assert replicas.loaded == {"http://r0": set(), "http://r1": set()}
    gone = client.post(UNLOAD, json={"lora_name": "a"}, headers=KEY)
    assert gone.status_code == 404


def test_a_replica_that_comes_back_gets_the_adapters_before_it_takes_requests():
    replicas = Replicas()
    frontend, client = frontend_over(replicas)
    for name in ("a", "b"):
        assert client.post(LOAD, json={"lora_name": name, "lora_path": f"/{name}"}, headers=KEY).status_code == 200
    frontend.mark_down(1)
    replicas.loaded["http://r1"] = set()  # restarted: only its --lora flags
    assert client.post(LOAD, json={"lora_name": "c", "lora_path": "/c"}, headers=KEY).status_code == 200
    assert replicas.loaded["http://r1"] == set()  # down: not asked
    asyncio.run(frontend.poll(1))
    assert frontend.router.replicas[1].live and replicas.loaded["http://r1"] == {"a", "b", "c"}
    asyncio.run(frontend.poll(0))  # up all along: nothing is loaded twice
    assert [c for c in replicas.calls if c == ("http://r0", LOAD)] == [("http://r0", LOAD)] * 3


def test_with_no_replica_up_a_load_is_a_503():
    replicas = Replicas()
    frontend, client = frontend_over(replicas)
    frontend.mark_down(0)
    frontend.mark_down(1)
    reply = client.post(LOAD, json={"lora_name": "a", "lora_path": "/a"}, headers=KEY)
    assert reply.status_code == 503 and "no replica is up" in reply.json()["error"]["message"]


def test_a_load_in_flight_while_a_replica_comes_back_reaches_it():
    """The comeback's replay waits for a load under way (one lock), so the replica that comes back
    is given the new adapter too, never marked up with the adapters it had before the load."""
    replicas = Replicas()
    frontend, _ = frontend_over(replicas)
    frontend.mark_down(1)
    frontend.state.addresses = list(ADDRESSES)

    async def run() -> None:
        arrived, release = asyncio.Event(), asyncio.Event()

        async def handle(request: httpx.Request) -> httpx.Response:
            if request.url.path == LOAD and request.url.host == "r0":
                arrived.set()
                await release.wait()  # r0 takes its time loading "c"
            return replicas.handle(request)

        frontend.client = frontend.adapters.client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
        load = asyncio.create_task(frontend.adapters.load(json.dumps({"lora_name": "c", "lora_path": "/c"}).encode()))
        await arrived.wait()
        comeback = asyncio.create_task(frontend.poll(1))
        await asyncio.sleep(0.05)
        assert not frontend.router.replicas[1].live  # waits for the load
        release.set()
        assert (await load).status_code == 200
        await comeback

    asyncio.run(run())
    assert frontend.router.replicas[1].live
    assert replicas.loaded == {"http://r0": {"c"}, "http://r1": {"c"}}


def test_a_replica_out_of_reach_during_an_unload_unloads_when_it_is_back():
    """A replica that does not answer an unload is marked down and, back, unloads the adapter
    before it takes requests; so does one that was down and kept it, or restarted with the
    adapter in its --lora flags."""
    replicas = Replicas()
    frontend, client = frontend_over(replicas)
    for name in ("a", "b"):
        assert client.post(LOAD, json={"lora_name": name, "lora_path": f"/{name}"}, headers=KEY).status_code == 200
    unreachable: set[str] = {"r1"}

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host in unreachable:
            raise httpx.ConnectError("no route to host", request=request)
        return replicas.handle(request)

    frontend.client = frontend.adapters.client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    assert client.post(UNLOAD, json={"lora_name": "a"}, headers=KEY).status_code == 200
    assert not frontend.router.replicas[1].live  # did not answer: down
    assert replicas.loaded == {"http://r0": {"b"}, "http://r1": {"a", "b"}}
    assert client.post(UNLOAD, json={"lora_name": "b"}, headers=KEY).status_code == 200  # r1 down: not asked
    unreachable.clear()
    replicas.loaded["http://r1"] = {"a", "b"}  # as if restarted with --lora a=... b=...
    asyncio.run(frontend.poll(1))
    assert frontend.router.replicas[1].live and replicas.loaded == {"http://r0": set(), "http://r1": set()}
    assert client.post(LOAD, json={"lora_name": "a", "lora_path": "/a"}, headers=KEY).status_code == 200
    frontend.mark_down(0)
    replicas.loaded["http://r0"] = set()  # restarted with no flags
    asyncio.run(frontend.poll(0))  # "a" is loaded again (no longer among the unloaded), "b" unloads (404)
    assert replicas.loaded == {"http://r0": {"a"}, "http://r1": {"a"}}
