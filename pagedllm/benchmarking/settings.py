"""The settings `pagedllm bench` can compare in one run, and reading them from the command line."""

from __future__ import annotations

import dataclasses


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
