"""`pagedllm bench --compare`: one workload under several settings, one report folder.

Each setting (a KV layout and a block size) runs the same requests in turn in
one process, on a fresh engine, so the runs differ only in memory management.
The folder holds `summary.json`, one `series-<setting>.csv` of per-step KV
memory samples per setting, and the PNG plots drawn by `pagedllm.plots`.
"""

from __future__ import annotations

import csv
import dataclasses
import gc
import json
from pathlib import Path

from pagedllm.bench import run_on_engine
from pagedllm.config import EngineConfig
from pagedllm.engine import LLMEngine
from pagedllm.kv_metrics import SAMPLE_COLUMNS


@dataclasses.dataclass(frozen=True)
class BenchSetting:
    kv_layout: str
    block_size: int
    prefix_caching: bool = True

    @property
    def family(self) -> str:
        """The setting without its block size: one line per family in a block-size plot."""
        return self.kv_layout + ("" if self.prefix_caching else "-nocache")

    @property
    def name(self) -> str:
        return f"{self.kv_layout}-bs{self.block_size}" + ("" if self.prefix_caching else "-nocache")


def parse_list(text: str, item=str) -> list:
    """'a,b,c' -> [a, b, c]; names the bad item when `item` cannot read it."""
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            values.append(item(part))
        except ValueError:
            raise ValueError(f"cannot read {part!r} in {text!r}") from None
    if not values:
        raise ValueError(f"empty list: {text!r}")
    return values


def settings_grid(layouts: list[str], block_sizes: list[int], prefix_caching: list[bool]) -> list[BenchSetting]:
    grid = [BenchSetting(layout, bs, cache) for layout in layouts for bs in block_sizes for cache in prefix_caching]
    # The contiguous layout has no prefix cache to turn off: one run of it, whatever was asked.
    grid = [BenchSetting(s.kv_layout, s.block_size, s.prefix_caching or s.kv_layout != "paged") for s in grid]
    return list(dict.fromkeys(grid))


def parse_on_off(text: str) -> list[bool]:
    values = {"on": True, "off": False}
    items = parse_list(text)
    if any(item not in values for item in items):
        raise ValueError(f"--prefix-caching takes on, off or on,off; got {text!r}")
    return [values[item] for item in items]


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
    results: dict[str, dict] = {}
    series: dict[str, list[dict]] = {}
    for setting, config in zip(settings, configs):
        with LLMEngine(config) as engine:
            results[setting.name] = run_on_engine(engine, requests, ignore_eos, desc=setting.name)
            series[setting.name] = engine.memory.rows()
        del engine
        gc.collect()
        write_series(report / f"series-{setting.name}.csv", series[setting.name])
    summary = {"workload": workload_name, "requests": len(requests), "settings": results}
    (report / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    from pagedllm.plots import draw_report

    summary["plots"] = [p.name for p in draw_report(report, settings, results, series)]
    (report / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def write_series(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SAMPLE_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
