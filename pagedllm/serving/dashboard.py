"""The live dashboard: what the KV cache and the scheduler hold right now.

`dashboard_state` runs on the engine thread (between steps), so the grid, the
block tables and the counters are one consistent picture.  The page itself
(`static/dashboard.html`) polls `/dashboard/state` and draws it.
"""

from __future__ import annotations

from importlib import resources

from pagedllm.engine import LLMEngine


def dashboard_state(engine: LLMEngine, throughput: list[int]) -> dict:
    """The engine's state plus every block's state, the requests with their block tables, and throughput."""
    return engine.state() | engine.kv_picture() | {"throughput": throughput}


def dashboard_html() -> str:
    return resources.files("pagedllm.serving").joinpath("static/dashboard.html").read_text()
