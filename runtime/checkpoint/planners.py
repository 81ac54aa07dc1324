"""DCP planners that write and read parc's pieces: each a box of a full tensor.

`PieceSavePlanner` is DCP's planner (deduplication, validation, metadata) plus one
shard write item per piece a rank holds; `PieceLoadPlanner` reads plain objects
through parc's allowlisted unpickler (checkpoint/integrity.py) and each piece's
overlap with the checkpoint straight into the piece's tensor (runtime/checkpoint/store.py
uses both).
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .integrity import load_bytes_safely
from .layout import Piece

__all__ = ["PieceLoadPlanner", "PieceSavePlanner"]


class PieceSavePlanner(DefaultSavePlanner):
    """DCP's planner (dedup, validation, metadata) plus one shard write item per piece."""

    def __init__(self, pieces: list[Piece]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._pieces = {(p.key, p.offsets): p.local for p in pieces}
        self._items = [_write_item(p) for p in pieces]

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self.plan = dataclasses.replace(plan, items=[*plan.items, *self._items])
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        index = write_item.index
        found = self._pieces.get((index.fqn, tuple(index.offset or ())))
        return found if found is not None else super().resolve_data(write_item)


def _write_item(piece: Piece) -> WriteItem:
    offsets = torch.Size(piece.offsets)
    return WriteItem(
        index=MetadataIndex(piece.key, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=piece.local.size()),
            properties=TensorProperties.create_from_tensor(piece.local),
            size=torch.Size(piece.shape),
        ),
    )


class PieceLoadPlanner(DefaultLoadPlanner):
    """DCP's planner for plain objects, plus reads of each piece's overlap with the checkpoint."""

    def __init__(self, pieces: list[Piece]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._pieces = {(p.key, p.offsets): p.local for p in pieces}
        self._chunks: dict[str, list[ChunkStorageMetadata]] = {}
        for p in pieces:
            chunk = ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=p.local.size())
            self._chunks.setdefault(p.key, []).append(chunk)

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        assert self.metadata is not None
        saved = self.metadata.state_dict_metadata
        items = list(plan.items)
        for key, chunks in self._chunks.items():
            entry = saved[key]
            assert isinstance(entry, TensorStorageMetadata)
            items += create_read_items_for_chunk_list(key, entry, chunks)
        return dataclasses.replace(plan, items=items)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # DCP's default unpickles with weights_only=False: a crafted file would run code.
        key = read_item.dest_index.fqn
        self.state_dict[key] = load_bytes_safely(value, key)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        index = read_item.dest_index
        local = self._pieces.get((index.fqn, tuple(index.offset or ())))
        if local is None:
            return super().resolve_tensor(read_item)
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            local = local.narrow(dim, start, length)
        return local
