"""`pagedllm serve --data-parallel-size 2` on one machine, as a user starts it from the folder that
holds a clone: the replicas are the front-end's child processes (no Ray), listen on 127.0.0.1
only and require the front-end's API key, a LoRA adapter loaded through the front-end reaches
every replica, a replica killed is started again (with that adapter), and a stop leaves no
replica behind."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import httpx
import openai

from pagedllm.models.loader import read_model_config, resolve_model_path
from pagedllm.testing.lora import write_random_adapter
from pagedllm.testing.servers import MODEL, free_port, listening_hosts, wait_healthy

API_KEY = "front-end-key"


def children_of(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in found]


def test_local_replicas_listen_on_loopback_answer_only_the_front_end_and_come_back(tmp_path):
    (tmp_path / "pagedllm" / "pagedllm").mkdir(parents=True)  # a clone, seen from its parent folder
    port = free_port()
    command = [shutil.which("pagedllm") or "pagedllm", "serve", "--data-parallel-size", "2", "--port", str(port),
               "--kv-cache-memory", "128MiB", "--api-key", API_KEY, "--allow-runtime-lora"]  # fmt: skip
    process = subprocess.Popen(command, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=180, process=process)
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        # Not "What is the capital of France?": its first token is a near tie (transformers: "The"
        # 25.33, "L" 25.24), which the float32 dtype of AVX2 and AVX-512 CPUs turns to "L'Étoile".
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Name the capital of France."}], max_tokens=16,
            temperature=0,
        )  # fmt: skip
        assert "Paris" in reply.choices[0].message.content
        wrong = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert wrong.status_code == 401  # the front-end checks the client's key itself

        addresses = httpx.get(url + "/stats").json()["router"]["addresses"]
        assert listening_hosts(port) == ["127.0.0.1"]
        for address in addresses:
            replica_port = int(address.rsplit(":", 1)[1])
            assert address.startswith("http://127.0.0.1:") and listening_hosts(replica_port) == ["127.0.0.1"]
            direct = httpx.post(address + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
            assert direct.status_code == 401, direct.text  # the replicas require the front-end's key too

        adapter = write_random_adapter(
            tmp_path / "adapter", read_model_config(resolve_model_path(None)), rank=4, seed=1
        )
        keys = {"authorization": f"Bearer {API_KEY}"}
        loaded = httpx.post(
            url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapter)}, headers=keys
        )
        assert loaded.status_code == 200, loaded.text

        def adapters_of(address: str) -> set[str]:
            models = httpx.get(address + "/v1/models", headers=keys).json()["data"]
            return {m["id"] for m in models if m.get("parent")}

        assert [adapters_of(a) for a in addresses] == [{"a"}, {"a"}]
        assert client.completions.create(model="a", prompt="Hello", max_tokens=4).choices[0].text is not None

        replicas = children_of(process.pid)
        assert len(replicas) == 2
        os.kill(replicas[0], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while httpx.get(url + "/health").json()["replicas"] != ["up", "up"] or replicas[0] in children_of(process.pid):
            assert time.monotonic() < deadline, "the killed replica did not come back"
            time.sleep(0.5)
        assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=4).choices[0].text is not None
        addresses = httpx.get(url + "/stats").json()["router"]["addresses"]
        assert [adapters_of(a) for a in addresses] == [{"a"}, {"a"}]  # the new replica was given it again

        replicas = children_of(process.pid)  # the one started again in place of the killed one
        assert len(replicas) == 2
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=90) == 0
        survivors = [pid for pid in replicas if os.path.exists(f"/proc/{pid}")]
        assert not survivors, f"replica servers left running: {survivors}"
    finally:
        if process.poll() is None:
            process.kill()
        stderr = process.communicate()[1]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "replica 0's server exited" in stderr or "replica 1's server exited" in stderr
