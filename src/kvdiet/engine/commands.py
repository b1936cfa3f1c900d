"""The commands an `EngineLoop` takes from other threads: one frozen value per command.

Callers on any thread put them on the loop's queue; the engine thread applies them between steps, in order,
dispatching on the type (`EngineLoop._apply`). Nothing here touches the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvdiet.engine.prepared import PreparedRequest
from kvdiet.engine.request import RequestOutput

__all__ = ["AbortAll", "AbortRequest", "AddRequest", "Command", "Deliver", "Shutdown"]

Deliver = Callable[[RequestOutput | BaseException], None]
"""Receives a request's outputs on the engine thread, or the exception that ended it."""


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Queue a validated request; its outputs (or a refusal: a duplicate id) go to ``deliver``."""

    request_id: str
    request: PreparedRequest
    deliver: Deliver


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """End one request now (an unknown or finished id is ignored)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class AbortAll:
    """End every request now (server shutdown: open streams end with ``abort``)."""


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop the loop after this drain (wakes a loop waiting for work)."""


Command = AddRequest | AbortRequest | AbortAll | Shutdown
