"""A safetensors checkpoint on disk, read tensor by tensor (or row by row) without mapping it into memory.

Layouts: one ``.safetensors`` file; a folder with shards listed in ``model.safetensors.index.json`` (the
Hugging Face layout DeepSeek releases); a folder with ``model.safetensors`` (other files beside it, such as
reference outputs, are not weights); or a folder of ``*.safetensors`` files (but the reference outputs and
the Engram token map, `kvdiet.model.checkpoint_token_map`). ``config.json`` sits beside. The format is
an 8-byte little-endian header length, a JSON header (``{name: {dtype, shape, data_offsets}}``) and the raw
bytes (safetensors specification). Headers are parsed once; a tensor is read with positioned reads
(``os.preadv``) straight into a fresh tensor, so what stays in this process is what the caller keeps — the
page cache, not the process, holds the rest. That is what lets routed experts and Engram tables far larger
than memory be read on first use (`kvdiet.model.expert_cache`, `kvdiet.model.engram`).

Names are normalised to DeepSeek's reference names (``layers.{i}.attn.wq_a.weight``, ``…scale``): a
``model.`` prefix, ``self_attn``/``mlp`` module names, ``weight_scale_inv``, ``e_score_correction_bias``,
``embed_tokens`` and ``lm_head`` — the renames DeepSeek's own ``convert.py`` and vLLM's V4.1 loader apply —
are mapped back. Tensors of parts a text model does not run (``mtp.*`` MTP/DSpark drafter, ``vision.*``,
``aligner.*``, ``image_*``) are listed in ``skipped`` and never read.

This module knows nothing about the model: `kvdiet.model.loader` matches tensors to parameters.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvdiet.model.checkpoint_token_map import NOT_WEIGHTS

__all__ = ["ROUTED_EXPERT", "Checkpoint", "TensorInfo", "WeightsError", "reference_name"]

INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER = 256 << 20  # bytes; a larger header is not a safetensors file

# safetensors dtype code → (torch dtype, bytes per element); F4 stores two values per byte.
_DTYPES: dict[str, tuple[torch.dtype, float]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    "F8_E8M0": (torch.float8_e8m0fnu, 1),
    "F4": (torch.float4_e2m1fn_x2, 0.5),
}

# Renames applied by converters (DeepSeek convert.py, vLLM's V4.1 loader), mapped back, in order.
_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), r)
    for p, r in (
        (r"^model\.", ""),
        (r"^embed_tokens\.", "embed."),
        (r"^lm_head\.", "head."),
        (r"\.self_attn\.", ".attn."),
        (r"\.mlp\.", ".ffn."),
        (r"\.weight_scale_inv$", ".scale"),
        (r"\.weight_scale$", ".scale"),
        (r"\.e_score_correction_bias$", ".bias"),
    )
)
ROUTED_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.")
"""A routed expert's tensors or modules: ``layers.{layer}.ffn.experts.{expert}.…`` (groups: layer, expert)."""
_SKIPPED = re.compile(r"^(model\.)?(mtp|vision|aligner|image_[a-z_]*)[.]")


class WeightsError(ValueError):
    """A checkpoint is unreadable or does not fit the model: every offending file or tensor is named."""


def reference_name(name: str) -> str:
    """A stored tensor name as DeepSeek's reference names it (see the module docstring)."""
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return name


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor lies.

    Attributes:
        name: the reference name (after `reference_name`); ``stored_name`` is the name in the file.
        file: the shard holding it.
        dtype: safetensors dtype code (``"F8_E4M3"``, ``"F4"``, ``"BF16"`` …).
        shape: the shape torch sees (an F4 tensor's last dim is halved: two values per element).
        offset: absolute byte offset of its data in ``file``; ``nbytes`` its length.
    """

    name: str
    stored_name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype][0]


class Checkpoint:
    """The tensors of a checkpoint, by reference name. Holds no open files (each read opens its shard).

    Use `Checkpoint.open`. Attributes: ``path``; ``tensors`` (name → `TensorInfo`); ``skipped`` (stored names
    not for the text model); ``config_path`` (``config.json`` beside the weights, or None).
    """

    def __init__(
        self, path: Path, tensors: dict[str, TensorInfo], skipped: list[str], config_path: Path | None
    ) -> None:
        self.path, self.tensors, self.skipped, self.config_path = path, tensors, skipped, config_path

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        """Parse the headers of every shard at ``path`` (a file, or a folder as in the module docstring).

        Raises:
            FileNotFoundError: no safetensors file at ``path``.
            WeightsError: a malformed header, data outside its file, a dtype or size that does not add up,
                an index naming a missing shard, or one reference name stored twice (all named).
        """
        path = Path(path)
        files = _shard_files(path)
        tensors: dict[str, TensorInfo] = {}
        skipped: list[str] = []
        problems: list[str] = []
        for file in files:
            for info in _read_header(file):
                if _SKIPPED.match(info.stored_name):
                    skipped.append(info.stored_name)
                elif info.name in tensors:
                    problems.append(
                        f"{info.name} is stored twice ({tensors[info.name].file.name}, {file.name})"
                    )
                else:
                    tensors[info.name] = info
        if problems:
            raise WeightsError(f"checkpoint {path}: " + "; ".join(problems))
        config = path / "config.json" if path.is_dir() else path.parent / "config.json"
        return cls(path, tensors, skipped, config if config.is_file() else None)

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the text model may read."""
        return sum(t.nbytes for t in self.tensors.values())

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` (reference name), freshly allocated, in its stored dtype and shape."""
        info = self.tensors[name]
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        with open(info.file, "rb", buffering=0) as f:
            _pread_into(f.fileno(), buf, info.offset, info.file)
        return buf.view(info.torch_dtype).view(info.shape)

    def read_rows(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (int64 [N], any order, repeats allowed) of a 2-D tensor → [N, cols] in its dtype.

        Each distinct row is one positioned read; for tables too large to keep (Engram).
        """
        info = self.tensors[name]
        row_bytes = info.nbytes // info.shape[0]
        unique, inverse = torch.unique(rows, return_inverse=True)
        buf = torch.empty(unique.numel(), row_bytes, dtype=torch.uint8)
        with open(info.file, "rb", buffering=0) as f:
            for i, row in enumerate(unique.tolist()):
                _pread_into(f.fileno(), buf[i], info.offset + row * row_bytes, info.file)
        return buf.view(info.torch_dtype)[inverse]


def _shard_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"no safetensors checkpoint at {path}")
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise WeightsError(f"{index} is not a safetensors index (no weight_map): {exc}") from exc
        files = sorted({path / shard for shard in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise WeightsError(f"{index} names shards that are not there: {', '.join(missing[:5])}")
        return files
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    shards = sorted(f for f in path.glob("*.safetensors") if f.name not in NOT_WEIGHTS)
    if not shards:
        raise FileNotFoundError(f"no safetensors checkpoint at {path}")
    return shards


def _read_header(file: Path) -> list[TensorInfo]:
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw = f.read(8)
        length = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if not 2 <= length <= min(_MAX_HEADER, size - 8):
            raise WeightsError(
                f"{file} is not a valid safetensors file (header length {length}, size {size})"
            )
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise WeightsError(f"{file} is not a valid safetensors file: bad JSON header ({exc})") from exc
    if not isinstance(header, dict):
        raise WeightsError(f"{file} is not a valid safetensors file: the header is not an object")
    base, out = 8 + length, []
    for stored, meta in header.items():
        if stored == "__metadata__":
            continue
        try:
            code, shape, (begin, end) = meta["dtype"], [int(d) for d in meta["shape"]], meta["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightsError(f"{file}: tensor {stored} has a malformed header entry {meta!r}") from exc
        if code not in _DTYPES:
            raise WeightsError(f"{file}: tensor {stored} has unsupported dtype {code}")
        numel = math.prod(shape)
        want = int(numel * _DTYPES[code][1])
        if not (0 <= begin <= end <= size - base) or end - begin != want:
            raise WeightsError(
                f"{file}: tensor {stored} ({code} {shape}) has data [{begin}, {end}) but needs {want} bytes "
                f"within the file's {size - base}"
            )
        if code == "F4":
            if not shape or shape[-1] % 2:
                raise WeightsError(f"{file}: F4 tensor {stored} has an odd last dim {shape}")
            shape = [*shape[:-1], shape[-1] // 2]
        out.append(TensorInfo(reference_name(stored), stored, file, code, tuple(shape), base + begin, want))
    return out


def _pread_into(fd: int, buf: torch.Tensor, offset: int, file: Path) -> None:
    view = memoryview(buf.numpy()).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise WeightsError(f"{file} ended early at byte {offset + done} (truncated?)")
        done += n
