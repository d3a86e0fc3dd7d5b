"""Read safetensors shards of a HF checkpoint into tensors by their HF names, with checks."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError, WeightError


def shard_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e!r})") from None
        files = [folder / n for n in names]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: shard listed in {index.name} is missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files (only safetensors checkpoints are supported)")
    return files


class TensorStore:
    """All tensors of a checkpoint by name; `get` checks shape and converts dtype."""

    def __init__(self, folder: Path):
        self.where: dict[str, Path] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        for f in shard_files(folder):
            try:
                with safe_open(str(f), framework="pt") as h:
                    for name in h.keys():
                        self.tensors[name] = h.get_tensor(name)
                        self.where[name] = f
            except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                raise CheckpointError(f"{f}: cannot read safetensors file ({e})") from None
        self.folder = folder

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = self.tensors.get(name)
        if t is None:
            raise WeightError(f"{self.folder}: tensor {name!r} is missing from the checkpoint")
        if tuple(t.shape) != tuple(shape):
            raise WeightError(f"{self.where[name]}: tensor {name!r} has shape {tuple(t.shape)}, "
                              f"config.json implies {tuple(shape)}")
        if not t.is_floating_point():
            raise WeightError(f"{self.where[name]}: tensor {name!r} has dtype {t.dtype}, expected a float type")
        return finite(t.to(dtype), str(self.where[name]), name)


def finite(t, where: str, name: str):
    """`t` (a tensor or array), or WeightError if it holds a NaN or an infinity: one vectorized pass
    at load, never garbage tokens later."""
    ok = bool(torch.isfinite(t).all()) if isinstance(t, torch.Tensor) else bool(np.isfinite(t).all())
    if not ok:
        n = int((~torch.isfinite(t)).sum()) if isinstance(t, torch.Tensor) else int((~np.isfinite(t)).sum())
        raise WeightError(f"{where}: tensor {name!r} holds {n} NaN or infinite values")
    return t
