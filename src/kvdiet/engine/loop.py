"""`EngineLoop`: the engine on its own thread, fed by asyncio callers (the server).

One thread owns the `LLMEngine`: it takes typed commands (`kvdiet.engine.commands`: add, abort, abort
all, shut down) from a queue between steps, runs steps while there is work, and hands each `RequestOutput`
to its request's callback. Requests arrive already validated (`PreparedRequest`, from `LLMEngine.prepare`);
the loop does not check them again. Async callers use `EngineLoop.generate`, an async iterator of outputs;
leaving it early (a client disconnect cancels it) aborts the request, so its blocks return to the pool at
the next step boundary.

The loop also keeps `snapshot`, an immutable `EngineSnapshot` of engine and cache figures taken on the
engine thread between steps (at most every ``refresh_s`` seconds, when requests enter the engine, and before a
request's final output is handed over, so a caller that has its final output never finds it counted as running
or waiting), so metrics scrapes never touch the engine or its tiers from another thread; a request submitted
and not yet taken in counts as waiting from the moment it is queued (16 at once had shown as 2 running, 0
waiting for four seconds). If a step raises, the loop stops serving (`healthy`
turns False; pending requests get the error) rather than continue on a state it cannot trust.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator

from kvdiet.engine.commands import AbortAll, AbortRequest, AddRequest, Command, Deliver, Shutdown
from kvdiet.engine.engine import LLMEngine
from kvdiet.engine.engine_snapshot import EngineSnapshot
from kvdiet.engine.prepared import PreparedRequest
from kvdiet.engine.request import RequestOutput

__all__ = ["EngineDeadError", "EngineLoop"]

log = logging.getLogger("kvdiet.engine")


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an error, or the loop is closed; no request can run."""


class EngineLoop:
    """Runs ``engine`` on a background thread (see the module docstring).

    Args:
        engine: the engine; after `start`, only the loop thread touches it.
        refresh_s: minimum seconds between two `snapshot` refreshes.
    Attributes:
        error: the exception that stopped the engine thread, or None.
    """

    def __init__(self, engine: LLMEngine, *, refresh_s: float = 0.25) -> None:
        self.engine = engine
        self.refresh_s = refresh_s
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._deliver: dict[str, Deliver] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._refreshed = 0.0
        self._accepting = threading.Lock()  # orders `submit` against the loop stopping
        self._closed = False
        self.error: BaseException | None = None
        self._snapshot: EngineSnapshot | None = None
        self._queued = 0  # requests submitted and not yet taken into the engine (under _accepting)

    # --- lifecycle ---

    def start(self) -> EngineLoop:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._refresh(force=True)
            self._thread = threading.Thread(target=self._run, name="kvdiet-engine", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread, abort every request (their callers get a final ``abort`` output) and close the
        cache tiers. Idempotent."""
        with self._accepting:
            self._closed = True
        self._stop.set()
        self._commands.put(Shutdown())
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._refuse_queued(EngineDeadError("the engine loop is closed"))
        aborted = [(rid, self.engine.abort_request(rid)) for rid in list(self.engine.requests)]
        if aborted:
            self._retake()
        for rid, out in aborted:
            deliver = self._deliver.pop(rid, None)
            if deliver is not None and out is not None:
                _delivered(deliver, out)
        self.engine.runner.close()

    @property
    def healthy(self) -> bool:
        return (
            not self._closed and self._thread is not None and self._thread.is_alive() and self.error is None
        )

    @property
    def snapshot(self) -> EngineSnapshot | None:
        """The latest `EngineSnapshot` (None before `start`), with the requests submitted and not yet taken into
        the engine counted as waiting; never mutated, so any thread may read it. Taken again before any final
        output is delivered (a finished or aborted request is out of its request and block figures by then;
        the tiers' resident bytes and entries and the cached-block count are kept from the last full refresh).
        """
        taken, queued = self._snapshot, self._queued
        if taken is None or queued == 0:
            return taken
        return dataclasses.replace(taken, num_waiting=taken.num_waiting + queued)

    # --- requests (any thread) ---

    def submit(self, request: PreparedRequest, deliver: Deliver, request_id: str) -> None:
        """Queue a request validated by `LLMEngine.prepare`; ``deliver`` is called on the engine thread with
        each output (or an exception: the engine failed, or ``request_id`` is already in use).

        Raises:
            EngineDeadError: the loop is not serving.
        """
        with self._accepting:  # a request queued here is either run or refused, never forgotten
            if not self.healthy:
                raise EngineDeadError(f"the engine is not running{f': {self.error!r}' if self.error else ''}")
            self._commands.put(AddRequest(request_id, request, deliver))
            self._queued += 1

    def abort(self, request_id: str) -> None:
        """Abort a request at the next step boundary (unknown or finished ids are ignored)."""
        self._commands.put(AbortRequest(request_id))

    def abort_all(self) -> None:
        """Abort every request at the next step boundary (server shutdown: streams end with ``abort``)."""
        self._commands.put(AbortAll())

    async def generate(
        self, request: PreparedRequest, *, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request validated by `LLMEngine.prepare` and yield its outputs until the final one.
        Leaving early aborts it.

        Raises:
            EngineDeadError: the engine is not serving, or failed while running this request.
            ValueError: ``request_id`` is already in use.
        """
        rid = request_id or f"req-{uuid.uuid4().hex}"
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.submit(request, lambda out: loop.call_soon_threadsafe(outputs.put_nowait, out), rid)
        done = False
        try:
            while True:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    done = True
                    raise out
                done = out.finished
                yield out
                if done:
                    return
        finally:
            if not done:
                self.abort(rid)

    # --- the engine thread ---

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop.is_set():
                self._drain(block=not engine.has_unfinished)
                if self._stop.is_set():
                    break
                if engine.has_unfinished:
                    outputs = engine.step()
                    if any(out.finished for out in outputs):
                        self._retake()
                    for out in outputs:
                        self._send(out)
                self._refresh()
        except BaseException as exc:  # a failed step leaves state we cannot trust: stop serving
            log.exception("engine step failed; the engine stops serving")
            with self._accepting:
                self.error = exc
            dead = EngineDeadError(f"engine failed: {exc!r}")
            for rid in list(self._deliver):
                _delivered(self._deliver.pop(rid), dead)
            self._refuse_queued(dead)

    def _refuse_queued(self, error: EngineDeadError) -> None:
        """Answer every request still in the command queue with ``error`` (the loop will not run them)."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, AddRequest):
                with self._accepting:
                    self._queued -= 1
                _delivered(cmd.deliver, error)

    def _drain(self, *, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=self.refresh_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        added = 0
        while True:
            self._apply(cmd)
            added += isinstance(cmd, AddRequest)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
        if added:  # in the engine's figures before they leave the queued count (not out of both meanwhile)
            self._retake()
            with self._accepting:
                self._queued -= added

    def _apply(self, cmd: Command) -> None:
        match cmd:
            case AddRequest(rid, request, deliver):
                try:
                    self.engine.add_prepared(request, request_id=rid)
                except ValueError as exc:  # a duplicate id
                    _delivered(deliver, exc)
                    return
                self._deliver[rid] = deliver
            case AbortRequest(rid):
                self._abort(rid)
            case AbortAll():
                for rid in list(self.engine.requests):
                    self._abort(rid)
            case Shutdown():
                self._stop.set()

    def _abort(self, request_id: str) -> None:
        out = self.engine.abort_request(request_id)
        if out is not None:
            self._retake()
            self._send(out)

    def _send(self, out: RequestOutput) -> None:
        rid = out.request_id
        deliver = self._deliver.pop(rid, None) if out.finished else self._deliver.get(rid)
        if deliver is not None and not _delivered(deliver, out):
            self._deliver.pop(rid, None)  # nobody listens any more (its event loop closed)
            self.engine.abort_request(rid)

    def _retake(self) -> None:
        """A snapshot of the request and block figures now: without the requests that just finished, before
        their callers hear of it, or with those just taken in (the figures that cost a scan, the tiers'
        resident ones and the cached-block count, come from the last full refresh; the ``refresh_s`` clock
        runs on)."""
        self._snapshot = EngineSnapshot.take(self.engine, resident=self._snapshot)

    def _refresh(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._refreshed < self.refresh_s:
            return
        self._refreshed = now
        self._snapshot = EngineSnapshot.take(self.engine)


def _delivered(deliver: Deliver, item: RequestOutput | BaseException) -> bool:
    """Hand ``item`` to a caller; False when the caller is gone (its event loop closed), so a departed
    caller never stops the engine."""
    try:
        deliver(item)
    except RuntimeError:
        log.warning("dropping an output: its caller's event loop is closed")
        return False
    return True
