"""Data-parallel serving end to end: `pagedllm serve --data-parallel-size 2 --ray-address ...`
on a local Ray cluster of two nodes (Ray's own multi-node test cluster, one CPU each), the
real SmolLM2 in each replica, driven by the real `openai` client.  Requests that share a
prefix land on one replica; streaming works through the front-end; a replica killed while
requests run loses none of them (each gets its answer, or a clear error if its stream had
started), is marked down at once, and comes back after Ray restarts it, with no KV block
held anywhere afterwards."""

import concurrent.futures
import os
import shutil
import signal
import subprocess
import time

import httpx
import pytest

from pagedllm.replicas.frontend import labelled, sum_numbers
from pagedllm.replicas.serve import replica_args
from pagedllm.testing.servers import MODEL, free_port, listening_hosts, wait_healthy

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")


def test_replicas_get_every_flag_but_the_front_ends():
    argv = ["smollm2", "--data-parallel-size", "2", "--port=9000", "--host", "0.0.0.0", "--router", "round-robin",
            "--kv-cache-memory", "64MiB", "--kv-events", "--ray-address", "auto", "--max-waiting", "8"]  # fmt: skip
    assert replica_args(argv) == ["smollm2", "--kv-cache-memory", "64MiB", "--max-waiting", "8"]


def test_totals_add_counts_not_rates_and_metrics_carry_the_replica():
    stats = [{"running": 1, "prefix_cache_hit_rate": 0.5, "kv": {"used_blocks": 3}}, {"running": 2, "kv": {}}]
    assert sum_numbers(stats) == {"running": 3, "kv": {"used_blocks": 3}}
    assert labelled('x_total{a="b"} 2.0', 1) == 'x_total{replica="1",a="b"} 2.0'
    assert labelled("y 3", 0) == 'y{replica="0"} 3' and labelled("# HELP y", 0) == "# HELP y"


def test_a_request_under_an_adapter_is_placed_by_its_adapters_blocks():
    """Replica 0 holds a prompt's blocks computed under adapter `a`, replica 1 the same prompt's
    on the base model: the front-end sends each request where its own blocks are."""
    import asyncio
    import json

    from pagedllm.core.kv_cache_manager import adapter_salt, prompt_block_keys, root_key
    from pagedllm.replicas.frontend import Frontend
    from pagedllm.replicas.router import Router

    router = Router(2, 16, "prefix")
    prompt = list(range(200, 300))
    router.apply_events(0, [(True, k) for k in prompt_block_keys(prompt, 16, root_key(b"", adapter_salt("a#0f")))])
    router.apply_events(1, [(True, k) for k in prompt_block_keys(prompt, 16, root_key())])
    frontend = Frontend(None, router, None, None, 0.2, None)
    frontend.state.adapter_keys["a"] = "a#0f"

    def placed(model: str) -> int:
        raw = json.dumps({"model": model, "prompt": prompt}).encode()
        placement = asyncio.run(frontend.place("/v1/completions", raw, ()))
        router.finished(placement)
        return placement.replica

    assert placed("a") == 0 and placed(MODEL) == 1 and placed("a") == 0


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    return ray_cluster


@pytest.fixture(scope="module")
def frontend(cluster, tmp_path_factory):
    # Started as a user starts it, from the folder that holds a clone: a `pagedllm` folder in the
    # working directory must not stand in for the package in the replicas' processes.
    parent = tmp_path_factory.mktemp("home")
    (parent / "pagedllm" / "pagedllm").mkdir(parents=True)
    port = free_port()
    command = [shutil.which("pagedllm") or "pagedllm", "serve", "--data-parallel-size", "2", "--ray-address",
               cluster.address, "--port", str(port), "--kv-cache-memory", "128MiB"]  # fmt: skip
    process = subprocess.Popen(command, cwd=parent)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=240, process=process)
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def wait_all_up(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(url + "/health").json()["replicas"] != ["up", "up"]:
        assert time.monotonic() < deadline, "a replica did not come back"
        time.sleep(0.5)


def test_a_replica_that_cannot_start_is_one_line_naming_its_own_error(cluster):
    """Before the front-end fixture takes the cluster's two CPUs: a KV cache no machine has
    passes the front-end's checks (it reads the model file only) and fails in each replica."""
    command = [shutil.which("pagedllm") or "pagedllm", "serve", "--data-parallel-size", "2", "--ray-address",
               cluster.address, "--port", str(free_port()), "--kv-cache-memory", "64TiB"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 2, done.stderr[-3000:]
    # Ray forwards the replicas' own stderr lines too, in its own time: the error is the line that
    # starts as the CLI's errors do.
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("pagedllm: error: ")]
    assert "replica" in error and "while starting: pagedllm: error: kv_cache_memory" in error, error
    assert "Traceback" not in done.stderr


def test_shared_prefixes_land_together_and_streams_pass_through(frontend):
    oai = client(frontend)
    system = "You answer questions about the solar system, briefly and exactly. " * 30
    for i in range(4):
        reply = oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": f"Planet {i}?"}],
            max_tokens=6,
            temperature=0,
        )
        assert reply.choices[0].message.content
    stats = httpx.get(frontend + "/stats").json()
    rates = [replica["prefix_cache_hit_rate"] for replica in stats["replicas"]]
    assert sorted(rates)[0] == 0.0 and max(rates) > 0.5  # one replica took all four: its cache served 3
    stream = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream)
    tokens = httpx.post(frontend + "/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert httpx.post(frontend + "/detokenize", json={"tokens": tokens}).json()["prompt"] == "Hello world"
    too_big = httpx.post(frontend + "/v1/completions", content=b"x" * (5 * 2**20))  # over the 4 MiB default
    assert too_big.status_code == 413
    for address in stats["router"]["addresses"]:  # a replica answers the front-end only, on its node's address
        host, port = address.removeprefix("http://").rsplit(":", 1)
        assert listening_hosts(int(port)) == [host], address
        direct = httpx.post(address + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert direct.status_code == 401, direct.text
    bad = httpx.post(frontend + "/v1/completions", content=b"{not json")  # the replica's own 400, passed back
    assert bad.status_code == 400 and "error" in bad.json()
    page = httpx.get(frontend + "/dashboard").text
    assert 'src="replicas/0/dashboard"' in page and 'src="replicas/1/dashboard"' in page
    state = httpx.get(frontend + "/replicas/1/dashboard/state")  # what replica 1's page fetches
    assert state.status_code == 200 and "blocks" in state.text
    metrics = httpx.get(frontend + "/metrics").text
    assert 'replica="0"' in metrics and 'replica="1"' in metrics and "pagedllm_router_requests_routed" in metrics


def test_a_replica_killed_mid_run_loses_no_request(frontend, cluster):
    oai = client(frontend)
    replicas = httpx.get(frontend + "/health").json()["replicas"]
    assert replicas == ["up", "up"]

    def ask(i: int) -> str:
        try:
            # ignore_eos: every request runs its 48 tokens, so those on the killed replica are still
            # in flight when it dies (an early end of text let them all finish first on a fast CPU).
            reply = oai.completions.create(
                model=MODEL, prompt=f"Count to ten, attempt {i}:", max_tokens=48, extra_body={"ignore_eos": True}
            )
            return "answered" if reply.choices[0].text is not None else "empty"
        except openai.APIError as error:
            return f"error: {error}"

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(ask, i) for i in range(16)]
        # Kill a replica as soon as it serves several requests: a fixed wait let a fast CPU finish
        # the first wave and most of the second before the kill, leaving nothing to place again.
        deadline = time.monotonic() + 30
        while True:
            router = httpx.get(frontend + "/stats").json()["router"]
            busiest = max(range(2), key=lambda i: router["in_flight"][i])
            if router["in_flight"][busiest] >= 2:
                break
            assert time.monotonic() < deadline, f"requests never in flight: {router['in_flight']}"
            time.sleep(0.02)
        killed_pid = _server_pid(router["addresses"][busiest])
        os.kill(killed_pid, signal.SIGKILL)
        outcomes = [f.result(timeout=180) for f in futures]
    # Every request answered; none had streamed (these are not streams), so those on the killed
    # replica were placed again, invisibly to the client.
    assert outcomes == ["answered"] * 16
    router = httpx.get(frontend + "/stats").json()["router"]
    assert router["requests_retried"] >= 1 and router["replicas_marked_down"] >= 1
    wait_all_up(frontend, timeout=120)  # Ray restarted it, and the front-end took it back
    servers = subprocess.run(["pgrep", "-f", "kv-events"], capture_output=True, text=True).stdout.split()
    assert len(servers) == 2 and str(killed_pid) not in servers
    # After all that, no replica holds a block.
    deadline = time.monotonic() + 10
    while True:
        used = [r["kv"]["used_blocks"] for r in httpx.get(frontend + "/stats").json()["replicas"]]
        if used == [0, 0]:
            break
        assert time.monotonic() < deadline, f"blocks still held: {used}"
        time.sleep(0.2)
    assert oai.completions.create(model=MODEL, prompt="Hello", max_tokens=4).choices[0].text is not None


def _server_pid(address: str) -> int:
    """The pid of the replica's `pagedllm serve` process listening at `address` (http://host:port)."""
    port = address.rsplit(":", 1)[1]
    out = subprocess.run(["pgrep", "-f", f"kv-events.*--port {port}"], capture_output=True, text=True).stdout.split()
    assert len(out) == 1, f"expected one replica server on port {port}, found {out}"
    return int(out[0])
