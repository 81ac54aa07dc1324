"""Checkpoints: sharded saves any layout can load (store.py), with their manifest,
checksums and the per-rank layout of what each rank holds."""

from .store import latest_checkpoint, load_checkpoint, save_checkpoint

__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint"]
