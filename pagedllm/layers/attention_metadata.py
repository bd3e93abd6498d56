"""What attention needs to know about one step, built once by the model runner and shared
by every layer and every attention backend (C++, torch, Triton, reference)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

DECODE_GROUP_SIZE = 32


def group_block_tables(tables: list[list[int]], num_groups: int, max_blocks: int, padding_block: int) -> np.ndarray:
    """[num_groups, len(tables), max_blocks] int64 from tables that hold each block's group entries
    side by side (core/kv_cache_manager.py); freed entries (-1) and padding name `padding_block`,
    a block no query reads."""
    interleaved = np.full((len(tables), max_blocks * num_groups), padding_block, dtype=np.int64)
    for i, table in enumerate(tables):
        interleaved[i, : len(table)] = table
    interleaved[interleaved < 0] = padding_block
    return interleaved.reshape(len(tables), max_blocks, num_groups).transpose(2, 0, 1)


@dataclass
class DecodeGroup:
    """Single-token requests of similar length, run as one batched matmul."""

    tokens: torch.Tensor  # [G] row of each member's query token
    block_ids: torch.Tensor  # [G * num_blocks] the members' block tables, flattened, padded with 0
    key_padding: torch.Tensor  # [G, num_blocks * block_size] True where a key is past the member's length
    k_buf: torch.Tensor  # gather scratch, reused by every layer of the step
    v_buf: torch.Tensor
    lens: torch.Tensor  # [G] each member's context length
    _before_window: dict[int, torch.Tensor] = field(default_factory=dict)

    def before_window(self, window: int) -> torch.Tensor:
        """[G, keys] True where a key is older than the member's sliding window."""
        if window not in self._before_window:
            keys = self.key_padding.shape[1]
            self._before_window[window] = torch.arange(keys)[None, :] < (self.lens - window)[:, None]
        return self._before_window[window]


@dataclass
class AttentionMetadata:
    """What attention needs to know about one step; built once by the model runner
    and shared by every layer (derived tensors are built on first use)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    query_start_loc: list[int]  # [num_requests + 1]: request i owns tokens [qsl[i], qsl[i+1])
    seq_lens: list[int]  # [num_requests]: context length after this step
    block_tables: torch.Tensor  # [num_requests, max_blocks] int64, padded with 0
    prefill_indices: list[int] = field(default_factory=list)  # requests with more than one new token
    decode_indices: list[int] = field(default_factory=list)  # requests with one new token, shortest first
    # The requests the decode rows belong to: rows verifying a request's drafts (one decode row a
    # position, model_runner.VerifyRow) count once, so the C++ decode kernel cuts each row's keys
    # into the parts it would without drafts (its split depends on the step's request count).
    decode_split_requests: int = 0
    max_query_len: int = 0  # the most new tokens of any request
    # The same on the step's device, built by the model runner in its one host-to-device copy
    # (the Triton kernel reads them; under a CUDA graph they are the graph's static inputs).
    query_starts: torch.Tensor | None = None  # [num_requests + 1] int64
    seq_lens_tensor: torch.Tensor | None = None  # [num_requests] int64
    _decode_groups: list[DecodeGroup] | None = None
    _decode_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    _prefill_tensors: dict[tuple[int, ...], tuple[torch.Tensor, ...]] = field(default_factory=dict)

    def prefill_tensors(self, indices: list[int] | None = None) -> tuple[torch.Tensor, ...]:
        """(first query row, new tokens, seq lens, block tables) of the prefilling requests (or of
        `indices`, some of them), for the C++ kernel."""
        index = tuple(self.prefill_indices if indices is None else indices)
        if index not in self._prefill_tensors:
            qsl = self.query_start_loc
            # Built as ordinary tensors even inside the model's inference mode: they keep a version
            # counter, so the kernels' boundary checks their values once a step, not once a layer.
            with torch.inference_mode(False):
                self._prefill_tensors[index] = self._prefill_tensors_of(index, qsl)
        return self._prefill_tensors[index]

    def _prefill_tensors_of(self, index: tuple[int, ...], qsl: list[int]) -> tuple[torch.Tensor, ...]:
        return (
            torch.tensor([qsl[i] for i in index], dtype=torch.int64),
            torch.tensor([qsl[i + 1] - qsl[i] for i in index], dtype=torch.int64),
            torch.tensor([self.seq_lens[i] for i in index], dtype=torch.int64),
            self.block_tables[torch.tensor(index, dtype=torch.int64)].contiguous(),
        )

    def whole_prompt_prefills(self, min_tokens: int, window: int = 0) -> list[int]:
        """Prefilling requests whose whole context is this step's tokens (no cached prefix, no
        earlier chunk), at least `min_tokens` of them, and that a sliding window does not cut."""
        qsl = self.query_start_loc
        return [
            i
            for i in self.prefill_indices
            if qsl[i + 1] - qsl[i] == self.seq_lens[i] >= min_tokens and (window == 0 or self.seq_lens[i] <= window)
        ]

    def decode_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query rows, seq lens, block tables) of the decoding requests, for the C++ kernel."""
        if self._decode_tensors is None:
            index = self.decode_indices
            with torch.inference_mode(False):  # ordinary tensors, as prefill_tensors builds them
                self._decode_tensors = (
                    torch.tensor([self.query_start_loc[i] for i in index], dtype=torch.int64),
                    torch.tensor([self.seq_lens[i] for i in index], dtype=torch.int64),
                    self.block_tables[torch.tensor(index, dtype=torch.int64)].contiguous(),
                )
        return self._decode_tensors

    def decode_groups(self, kv_cache: torch.Tensor) -> list[DecodeGroup]:
        """Decoding requests cut into groups of similar length, for the pure-torch path."""
        if self._decode_groups is None:
            _, _, block_size, kv_heads, head_dim = kv_cache.shape
            self._decode_groups = []
            for start in range(0, len(self.decode_indices), DECODE_GROUP_SIZE):
                members = self.decode_indices[start : start + DECODE_GROUP_SIZE]
                lens = torch.tensor([self.seq_lens[i] for i in members])
                num_blocks = -(-int(lens.max()) // block_size)
                block_ids = self.block_tables[torch.tensor(members), :num_blocks].reshape(-1)
                row = block_size * kv_heads * head_dim
                self._decode_groups.append(
                    DecodeGroup(
                        tokens=torch.tensor([self.query_start_loc[i] for i in members]),
                        block_ids=block_ids,
                        key_padding=torch.arange(num_blocks * block_size)[None, :] >= lens[:, None],
                        k_buf=torch.empty(block_ids.shape[0], row, dtype=kv_cache.dtype),
                        v_buf=torch.empty(block_ids.shape[0], row, dtype=kv_cache.dtype),
                        lens=lens,
                    )
                )
        return self._decode_groups


def build_attention_metadata(
    slot_mapping: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    query_starts: torch.Tensor | None = None,
    seq_lens_tensor: torch.Tensor | None = None,
    draft_rows: int = 0,
) -> AttentionMetadata:
    """`draft_rows`: decode rows that verify a draft (rows after each request's first)."""
    meta = AttentionMetadata(slot_mapping, query_start_loc, seq_lens, block_tables)
    meta.query_starts, meta.seq_lens_tensor = query_starts, seq_lens_tensor
    num_new = [query_start_loc[i + 1] - query_start_loc[i] for i in range(len(seq_lens))]
    meta.max_query_len = max(num_new, default=0)
    meta.prefill_indices = [i for i, n in enumerate(num_new) if n > 1]
    meta.decode_indices = sorted((i for i, n in enumerate(num_new) if n == 1), key=lambda i: seq_lens[i])
    meta.decode_split_requests = max(1, len(meta.decode_indices) - draft_rows)
    return meta
