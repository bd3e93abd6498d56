"""What one server is started with, besides its engine: names, key, body limits."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20
    # Record the prefix cache's stored and evicted block keys for `GET /kv_events` (a replica behind
    # the data-parallel router, pagedllm/replicas/): the router drains them, so one reader only.
    kv_events: bool = False
    # Other names requests may give as `model` for the same model (a bundled model's CLI name, e.g.
    # gemma3-270m beside gemma-3-270m); responses always carry served_model_name.
    model_aliases: tuple[str, ...] = ()
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key): a client names a
    # directory on the server's disk, so they are off unless the operator turns them on.
    runtime_lora: bool = False
    # Ignore body fields no body of this API declares (default: a 400 naming the field).
    allow_unknown_fields: bool = False
