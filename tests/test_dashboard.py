"""The live dashboard in headless Chromium (Debian's package, driven by Playwright):
the grid has one cell per KV block, it changes while requests run, and a
screenshot is kept as a test artifact (PAGEDLLM_TEST_ARTIFACTS, default
test-artifacts/)."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from pathlib import Path

import openai
import pytest
from conftest import release_shared_engines

from pagedllm.config import EngineConfig
from pagedllm.engine import LLMEngine
from pagedllm.testing.servers import MODEL, serve_in_process


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


SCREEN = {"width": 1400, "height": 1000}


def fits_on_screen(page) -> bool:
    return page.evaluate(
        "() => document.documentElement.scrollHeight <= window.innerHeight"
        " && document.documentElement.scrollWidth <= window.innerWidth"
    )


def legend_counts(page) -> dict[str, int]:
    return page.evaluate(
        """() => Object.fromEntries(['free', 'used', 'shared', 'cached', 'adapter'].map(
            k => [k, Number(document.getElementById('count-' + k).textContent)]))"""
    )


@contextlib.contextmanager
def dashboard(config: EngineConfig):
    """A server for `config` in this process and its dashboard open in headless Chromium on a
    1400x1000 screen; yields (server, page, artifacts folder)."""
    from playwright.sync_api import sync_playwright

    executable = chromium_path()
    artifacts = Path(os.environ.get("PAGEDLLM_TEST_ARTIFACTS", "test-artifacts"))
    artifacts.mkdir(parents=True, exist_ok=True)
    with serve_in_process(LLMEngine(config)) as (server, _), sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport=SCREEN)
            page.goto(server.url + "/dashboard")
            yield server, page, artifacts
        finally:
            browser.close()


def drain_in_background(streams) -> list[threading.Thread]:
    threads = [threading.Thread(target=lambda s=s: list(s)) for s in streams]
    for thread in threads:
        thread.start()
    return threads


def test_dashboard_draws_the_kv_grid_live(tmp_path):
    with dashboard(EngineConfig(dtype="float32", kv_cache_memory="128MiB")) as (server, page, artifacts):
        num_blocks = server.stats()["kv"]["num_blocks"]  # 182
        page.wait_for_function(f"document.querySelectorAll('#grid .block').length === {num_blocks}")
        assert cell_counts(page) == {"free": num_blocks}
        assert fits_on_screen(page)

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
        drained = drain_in_background(streams)
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
        page.wait_for_function("document.querySelectorAll('#grid .used, #grid .shared').length === 0", timeout=30_000)
        idle = cell_counts(page)
        assert idle.get("cached", 0) > 0 and idle.get("free", 0) + idle["cached"] == num_blocks


def test_a_large_cache_is_drawn_in_aggregated_cells_on_one_screen():
    """The default 4 GiB of a 16-bit cache is 11,650 blocks: cells of 6 blocks, 1,942 cells, all on
    one screen.  (float32 math beside its default float16 cache: the same blocks as a bfloat16
    cache, at the speed of every CPU class; bfloat16 math is emulated, and slow, on AVX2.)"""
    release_shared_engines()  # 4 GiB of cache beside what the suite holds between tests: the peak otherwise
    config = EngineConfig(dtype="float32", kv_cache_dtype="float16", kv_cache_memory="4GiB")
    with dashboard(config) as (server, page, artifacts):
        num_blocks = server.stats()["kv"]["num_blocks"]
        assert num_blocks == 11650
        page.wait_for_function(f"document.getElementById('grid').dataset.numBlocks === '{num_blocks}'")
        assert page.evaluate("document.getElementById('grid').dataset.blocksPerCell") == "6"
        assert page.evaluate("document.querySelectorAll('#grid .block').length") == 1942
        assert "each cell is 6 consecutive blocks (96 tokens)" in page.inner_text("#scale")
        assert fits_on_screen(page)

        client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=300)
        streams = [
            client.completions.create(model=MODEL, prompt=[100 + i] * 200, max_tokens=40, stream=True, n=2, seed=i)
            for i in range(3)
        ]
        drained = drain_in_background(streams)
        page.wait_for_function(
            "Number(document.getElementById('count-used').textContent) > 0 && "
            "Number(document.getElementById('count-shared').textContent) > 0",
            timeout=120_000,
        )
        # The colours add up to the legend: each mixed cell carries its counts (adapter pages, used,
        # shared, cached, free).
        drawn = page.evaluate(
            """() => {
                const sums = [0, 0, 0, 0, 0];
                for (const cell of document.querySelectorAll('#grid .block')) {
                    const counts = (cell.dataset.counts || '0,0,0,0,6').split(',').map(Number);
                    counts.forEach((c, i) => sums[i] += c);
                }
                return sums;
            }"""
        )
        legend = legend_counts(page)
        assert drawn == [legend["adapter"], legend["used"], legend["shared"], legend["cached"], legend["free"]]
        assert sum(legend.values()) == num_blocks
        assert "(" in page.inner_text("#summary")  # the held share in percent
        assert fits_on_screen(page)
        page.screenshot(path=str(artifacts / "dashboard-large-cache.png"))
        for thread in drained:
            thread.join(120)
