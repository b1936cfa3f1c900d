"""Where the model runs: ``--device {cpu,cuda,cuda:N}``, checked before anything loads, and the few named
places where data crosses between the device and the host.

Everything a model owns lives on its device: weights and buffers (`kvdiet.model.placement.place`), the paged
device pool, each request's window rings, compressor tails, Engram history and block-table tensor. A forward
runs inside `device_scope`, so the temporaries its layers create without a ``device=`` land there too. What
must reach the host crosses once, explicitly, through `to_host`: logits for sampling (the engine samples on
the host, so a seed gives the same tokens on every device), block payloads for the persistent tier and the
global pool, window snapshots for the SWA pool.

This module knows nothing of the model; importing it loads no torch (the command line builds its parsers
from it).
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from kvdiet.setting_error import SettingError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEVICE_PATTERN",
    "add_device_arg",
    "check_device",
    "device_scope",
    "machine_name",
    "seconds",
    "synchronize",
    "to_host",
]

DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?")
"""The values ``--device`` takes: ``cpu``, ``cuda`` or ``cuda:N``."""


def check_device(name: str) -> None:
    """Raises `SettingError` (a ValueError, one line naming ``device``, or ``--device`` on the command line)
    unless ``name`` is ``cpu``, or ``cuda``/``cuda:N`` on a machine where torch sees that CUDA device. Imports
    torch only for a CUDA name."""
    if not DEVICE_PATTERN.fullmatch(name):
        raise SettingError("{device} must be cpu, cuda or cuda:N, got {got}", got=repr(name))
    if name == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        raise SettingError(
            "{device=}: torch sees no CUDA device here (torch.cuda.is_available() is False)", device=name
        )
    index = int(name.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise SettingError(f"{{device=}}: torch sees {torch.cuda.device_count()} CUDA device(s)", device=name)


def add_device_arg(parser: argparse.ArgumentParser, note: str = "") -> None:
    """``--device {cpu,cuda,cuda:N}`` (default cpu): where the weights, the device pool and request state live;
    ``note`` ends its help (``"; engine mode only"`` on ``replay``)."""
    parser.add_argument(
        "--device",
        default="cpu",
        metavar="{cpu,cuda,cuda:N}",
        help=f"where the model runs: weights, the paged device pool and per-request state (default cpu{note})",
    )


@contextlib.contextmanager
def device_scope(device: torch.device) -> Iterator[None]:
    """Inside the block, torch factory calls without ``device=`` (``torch.empty``, ``arange``, ``tensor`` …)
    allocate on ``device``; on the CPU nothing is pushed (it is torch's default, and the scope's dispatch
    would only cost time)."""
    if device.type == "cpu":
        yield
        return
    import torch

    with torch.device(device):
        yield


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, contiguous: the one explicit device → host crossing (a no-op for a contiguous CPU
    tensor). Callers name what crosses: logits to sample, a block payload, a snapshot."""
    return t.detach().to("cpu").contiguous()


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (CUDA runs asynchronously; a no-op on the CPU): benchmarks time
    between two of these."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn: Callable[[], object], device: torch.device | str) -> float:
    """Wall seconds of ``fn()``, the work it queued on ``device`` included (benchmarks time with it)."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def machine_name(device: torch.device | str = "cpu", *, cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The machine a benchmark runs on, in words, for its table and JSON line: the CPU's model (the first
    ``model name`` of Linux's ``cpuinfo``, else ``platform.processor()``, else "unknown CPU"), the cores this
    process may use (`kvdiet.threads.available_cores`) and, on a CUDA ``device``, the GPU's name. Figures from
    machines that differ (an Intel Xeon and an AMD EPYC VM gave one build other bits and speeds) then say which."""
    from kvdiet.threads import available_cores

    cpu = ""
    try:
        match = re.search(r"^model name[ \t]*:[ \t]*(.*)$", cpuinfo.read_text(errors="replace"), re.MULTILINE)
        cpu = match.group(1).strip() if match else ""
    except OSError:
        pass
    name = f"{cpu or platform.processor() or 'unknown CPU'}, {available_cores()} cores"
    if str(device).startswith("cuda"):
        import torch

        name += f", {torch.cuda.get_device_name(torch.device(device))}"
    return name
