"""The live dashboard in headless Chromium (Debian's package, driven by Playwright):
the grid has one cell per KV block, it changes while requests run, and a
screenshot is kept as a test artifact (PAGEDLLM_TEST_ARTIFACTS, default
test-artifacts/)."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import openai
import pytest
from server_helpers import MODEL, serve_in_process

from pagedllm.config import EngineConfig
from pagedllm.engine import LLMEngine


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install Debian's chromium package (.ci/run does)")
        pytest.skip("no chromium here: apt-get install chromium")
    return path


def cell_counts(page) -> dict[str, int]:
    return page.evaluate(
        """() => {
            const counts = {};
            for (const cell of document.querySelectorAll('#grid .block')) {
                const state = cell.className.replace('block ', '');
                counts[state] = (counts[state] || 0) + 1;
            }
            return counts;
        }"""
    )


def test_dashboard_draws_the_kv_grid_live(tmp_path):
    from playwright.sync_api import sync_playwright

    executable = chromium_path()
    artifacts = Path(os.environ.get("PAGEDLLM_TEST_ARTIFACTS", "test-artifacts"))
    artifacts.mkdir(parents=True, exist_ok=True)
    engine = LLMEngine(EngineConfig(dtype="float32", kv_cache_memory="64MiB"))
    with serve_in_process(engine) as (server, _), sync_playwright() as playwright:
        num_blocks = server.stats()["kv"]["num_blocks"]
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(server.url + "/dashboard")
            page.wait_for_function(f"document.querySelectorAll('#grid .block').length === {num_blocks}")
            assert cell_counts(page) == {"free": num_blocks}

            client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=300)
            streams = [
                client.completions.create(
                    model=MODEL,
                    prompt=f"Story {i}: " + "once upon a time " * 10,
                    max_tokens=60,
                    stream=True,
                    n=3 if i == 0 else 1,
                    temperature=1.0,
                    seed=i,
                )
                for i in range(4)
            ]
            drained = [threading.Thread(target=lambda s=s: list(s)) for s in streams]
            for thread in drained:
                thread.start()
            # Sequences hold blocks, and the n=3 request's samples share their prompt's blocks.
            page.wait_for_function(
                "document.querySelectorAll('#grid .used').length > 0 && "
                "document.querySelectorAll('#grid .shared').length > 0",
                timeout=60_000,
            )
            page.wait_for_function("document.querySelectorAll('#running tbody tr').length >= 4")
            busy = cell_counts(page)
            page.screenshot(path=str(artifacts / "dashboard.png"), full_page=True)
            assert sum(busy.values()) == num_blocks and busy.get("used", 0) > 0

            for thread in drained:
                thread.join(120)
            # Finished: nothing held; the prompts' full blocks stay cached (evictable).
            page.wait_for_function(
                "document.querySelectorAll('#grid .used, #grid .shared').length === 0", timeout=30_000
            )
            idle = cell_counts(page)
            assert idle.get("cached", 0) > 0 and idle.get("free", 0) + idle["cached"] == num_blocks
        finally:
            browser.close()
