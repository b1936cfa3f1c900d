"""Will a model fit in this machine's memory? Checked from the config or the checkpoint's headers, before any
tensor is allocated, so a model that cannot fit gets one line instead of the allocator's traceback or the OOM
killer.

- Random weights (`random_weights_bytes`): every parameter fp32 (``kvdiet.weights`` counts them from the
  config), Engram tables as FP8 bytes plus the fp32 draw of the largest one.
- A checkpoint (`checkpoint_footprint`): what stays resident — dense tensors as fp32, FP8/FP4 weights as their
  bytes under fp8 numerics (4 B per weight under bf16), Engram tables up to the row-read threshold — plus the
  smallest working set of routed experts (one token's ``num_experts_per_tok`` of the largest expert, read on
  first use by `kvdiet.model.expert_cache`).

The available memory is ``MemAvailable`` of /proc/meminfo, lowered to a cgroup v2 limit when one applies.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvdiet.config import ModelConfig
from kvdiet.model.checkpoint import ROUTED_EXPERT, Checkpoint
from kvdiet.units import format_gb
from kvdiet.weights import estimate_weights

__all__ = [
    "CheckpointFootprint",
    "InsufficientMemoryError",
    "available_memory_bytes",
    "check_fits",
    "checkpoint_footprint",
    "random_weights_bytes",
]

_ENGRAM_TABLE = re.compile(r"\.engram\.embed\.(weight|scale)$")
_MARGIN = 1.1  # norms, mHC and other small tensors the estimate leaves out, and allocator slack
_GB = 1e9


class InsufficientMemoryError(ValueError):
    """The model needs more memory than this machine has (the message gives both numbers)."""


def available_memory_bytes() -> int:
    """Bytes this process can still allocate: ``MemAvailable``, capped by a cgroup v2 ``memory.max``."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max":
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(0, avail)


def random_weights_bytes(cfg: ModelConfig) -> int:
    """Bytes a model with seeded random weights allocates (see the module docstring)."""
    est = estimate_weights(cfg, engram_on_device=True)
    dense = est.params * 4
    largest_table = max(cfg.engram_num_embeddings or (0,)) * (cfg.engram_head_dim or 0)
    return int((dense + est.engram_bytes + largest_table * 4) * _MARGIN)


@dataclass(frozen=True, slots=True)
class CheckpointFootprint:
    """Resident bytes of a model loaded from a checkpoint (bytes).

    Attributes:
        resident: every tensor kept in memory (all but routed experts and row-read Engram tables).
        experts: all routed experts, as they would sit in memory.
        expert_working_set: the experts one token needs (``num_experts_per_tok`` × the largest expert).
        checkpoint: the checkpoint's bytes on disk (tensors the text model may read).
    """

    resident: int
    experts: int
    expert_working_set: int
    checkpoint: int

    @property
    def minimum(self) -> int:
        return self.resident + self.expert_working_set


def checkpoint_footprint(
    ckpt: Checkpoint, cfg: ModelConfig, *, numerics: str, table_resident_bytes: int
) -> CheckpointFootprint:
    """What loading ``ckpt`` keeps resident under ``numerics`` ("fp8" or "bf16"), from its headers alone."""
    resident = 0
    per_expert: dict[tuple[int, int], int] = {}
    for name in ckpt.tensors:
        size = _resident_bytes(ckpt, name, numerics=numerics, table_resident_bytes=table_resident_bytes)
        match = ROUTED_EXPERT.match(name)
        if match:
            key = (int(match.group(1)), int(match.group(2)))
            per_expert[key] = per_expert.get(key, 0) + size
        else:
            resident += size
    experts = sum(per_expert.values())
    working = max(per_expert.values(), default=0) * cfg.num_experts_per_tok
    return CheckpointFootprint(resident, experts, working, ckpt.nbytes)


def check_fits(what: str, need: int, *, have: int | None = None) -> None:
    """Raise `InsufficientMemoryError` ``"{what} needs ~N GB; this machine has M GB"`` when ``need > have``."""
    have = available_memory_bytes() if have is None else have
    if need > have:
        raise InsufficientMemoryError(
            f"{what} needs ~{format_gb(need / _GB, 1)} GB; this machine has {format_gb(have / _GB, 1)} GB available"
        )


def _resident_bytes(ckpt: Checkpoint, name: str, *, numerics: str, table_resident_bytes: int) -> int:
    info = ckpt.tensors[name]
    if _ENGRAM_TABLE.search(name):
        table = ckpt.tensors.get(name.rsplit(".", 1)[0] + ".weight")
        if table is not None and table.nbytes > table_resident_bytes:
            return 0  # read row by row from the file
        return info.nbytes if info.dtype in ("F8_E4M3", "F8_E8M0", "U8") else math.prod(info.shape) * 33 // 32
    quantized = info.dtype in ("F8_E4M3", "F4", "I8", "U8")
    if name.endswith(".scale"):
        return info.nbytes if numerics == "fp8" else 0
    if quantized and numerics == "fp8":
        return info.nbytes
    logical = info.nbytes * 2 if info.dtype in ("F4", "I8", "U8") else math.prod(info.shape)
    return logical * 4
