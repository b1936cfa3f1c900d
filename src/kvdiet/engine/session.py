"""`Session`: one request inside the engine's cache system — its model state beside its control-plane record.

Created by `kvdiet.engine.runner.ModelRunner.start`, advanced by ``prefill``/``decode``, ended by ``finish`` or
``abort``. The control plane sees only ``cache`` (`kvdiet.cache.control.CacheRequest`: block hashes and
token ids, the plan, what is persisted, the window state held for the end); the rest is tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdiet.cache.control import CacheRequest
from kvdiet.cache.plan import Provenance
from kvdiet.engine.window_blocks import WindowBlockLog
from kvdiet.model.state import RequestState

__all__ = ["Session"]


@dataclass(slots=True)
class Session:
    """One request in the cache system.

    Attributes:
        state: the model's per-request state (block table, window rings, compressor tails, Engram history).
        tokens: prompt ids, then each fed output id.
        prompt_tokens: N.
        provenance: where the prompt's tokens came from.
        cache: the control plane's record of the request (payload values are bytes).
        window_log: ``full-store``: the window entries of blocks filled but not yet written through.
        done: finished or aborted (blocks returned).
    """

    state: RequestState
    tokens: list[int]
    prompt_tokens: int
    provenance: Provenance
    cache: CacheRequest[bytes]
    window_log: WindowBlockLog | None = None
    done: bool = field(default=False)
