"""`pagedllm bench --compare`: one workload under several settings, one report folder.

Each setting (a KV layout and a block size) runs the same requests in turn in
one process, on a fresh engine, so the runs differ only in memory management.
The folder holds `summary.json`, one `series-<setting>.csv` of per-step KV
memory samples per setting, and the PNG plots drawn by `pagedllm.benchmarking.plots`.
"""

from __future__ import annotations

import csv
import dataclasses
import gc
import importlib.util
import json
import logging
from pathlib import Path

from pagedllm.benchmarking.settings import BenchSetting
from pagedllm.benchmarking.throughput import run_on_engine
from pagedllm.config import EngineConfig
from pagedllm.core.kv_metrics import SAMPLE_COLUMNS
from pagedllm.engine import LLMEngine

logger = logging.getLogger("pagedllm")
PLOTS_INSTALL = "pip install 'pagedllm[bench]'"


def run_compare(
    base: EngineConfig,
    settings: list[BenchSetting],
    requests: list[dict],
    report_dir: str | Path,
    ignore_eos: bool = True,
    workload_name: str = "",
) -> dict:
    """Run every setting, write the report folder, return the summary."""
    report = Path(report_dir)
    report.mkdir(parents=True, exist_ok=True)
    # Check every setting before the first (long) run starts.
    configs = [
        dataclasses.replace(
            base, kv_layout=s.kv_layout, block_size=s.block_size, enable_prefix_caching=s.prefix_caching
        )
        for s in settings
    ]
    plots = importlib.util.find_spec("matplotlib") is not None
    if not plots:  # said now, not after a long run: the summary and series are written regardless
        logger.warning("%s: no plots (matplotlib is not installed: %s)", report, PLOTS_INSTALL)
    results: dict[str, dict] = {}
    series: dict[str, list[dict]] = {}
    for setting, config in zip(settings, configs):
        with LLMEngine(config) as engine:
            results[setting.name] = run_on_engine(engine, requests, ignore_eos, desc=setting.name)
            series[setting.name] = engine.kv_memory_rows()
        del engine
        gc.collect()
        write_series(report / f"series-{setting.name}.csv", series[setting.name])
    summary = {"workload": workload_name, "requests": len(requests), "settings": results}
    (report / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    if not plots:
        summary["plots_skipped"] = f"matplotlib is not installed: {PLOTS_INSTALL}"
        (report / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary
    from pagedllm.benchmarking.plots import draw_report

    summary["plots"] = [p.name for p in draw_report(report, settings, results, series)]
    (report / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def write_series(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SAMPLE_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
