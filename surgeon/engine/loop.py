"""The engine on a thread of its own, fed by asyncio code.

`LLM` is not thread-safe, so one background thread alone calls add_request / step / abort.
Submissions and aborts reach it through a thread-safe queue; each request's outputs go back to the
asyncio loop that submitted it, into that request's asyncio.Queue. The thread blocks on its queue
when the engine is idle (no spinning) and survives failures: a request add_request refuses gets the
error alone; a step that raises fails the requests in flight (a batch cannot say which one broke
it) and the engine carries on with the next ones.

    engine = EngineLoop(llm).start()
    handle = await engine.submit(prompt, params)   # ValueError: bad request; EngineBusy: queue full
    async for out in handle: ...                   # StepOutput, the last one has a finish_reason
    handle.abort()                                 # frees its KV blocks; a no-op once finished
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


class EngineBusy(RuntimeError):
    """Too many requests are already waiting; try again later (HTTP 503)."""


class EngineStopped(RuntimeError):
    """The engine thread has stopped (or died); nothing more will be served."""


@dataclass
class _Submit:
    prompt: object
    params: object
    images: list | None
    handle: RequestHandle


@dataclass
class _Abort:
    request_id: str


_STOP = object()


@dataclass(eq=False)
class RequestHandle:
    """One request's outputs, as an async iterator of the engine's StepOutputs."""

    request_id: str
    engine: EngineLoop
    loop: asyncio.AbstractEventLoop
    accepted: asyncio.Future  # resolved once add_request returned (or raised)
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        out = await self.next()
        if out is None:
            raise StopAsyncIteration
        return out

    async def next(self, timeout: float | None = None):
        """The next StepOutput, None once finished; asyncio.TimeoutError after `timeout` seconds
        (the request keeps running: abort() it), the engine's exception if it failed the request."""
        if self.finished:
            return None
        item = await asyncio.wait_for(self.outputs.get(), timeout)
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finish_reason is not None:
            self.finished = True
        return item

    def abort(self) -> None:
        """Stop generating and free the request's blocks; safe to call at any time, more than once."""
        if not self.finished:
            self.finished = True
            self.engine._inbox.put(_Abort(self.request_id))

    # Called from the engine thread.
    def _deliver(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            pass

    def _settle(self, error: BaseException | None) -> None:
        def settle():
            if not self.accepted.done():
                if error is None:
                    self.accepted.set_result(None)
                else:
                    self.accepted.set_exception(error)

        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:
            pass


class EngineLoop:
    """Owns an LLM and runs it on one daemon thread.

    At most `max_pending` requests may wait beyond the engine's `max_num_seqs` running ones; past
    that, submit raises EngineBusy rather than queueing without bound.
    """

    def __init__(self, llm, max_pending: int = 256):
        self.llm = llm
        self.capacity = llm.max_num_seqs + max_pending
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, RequestHandle] = {}  # engine thread only
        self._count = 0  # admitted and not finished; guarded by _lock
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="surgeon-engine", daemon=True)
        self.error: BaseException | None = None  # set if the thread itself died

    # ---- asyncio side
    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self._inbox.put(_STOP)
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def active(self) -> int:
        """Requests admitted and not yet finished or aborted."""
        return self._count

    async def submit(self, prompt, params, images: list | None = None) -> RequestHandle:
        """Hand a request to the engine; returns once the engine accepted it, so bad input (ValueError)
        raises here, before a caller commits to a streamed response."""
        if not self.alive:
            raise EngineStopped(f"the engine is not running ({self.error or 'stopped'})")
        with self._lock:
            if self._count >= self.capacity:
                raise EngineBusy(f"server busy: {self._count} requests in flight (limit {self.capacity}); retry later")
            self._count += 1
        loop = asyncio.get_running_loop()
        handle = RequestHandle(uuid.uuid4().hex, self, loop, loop.create_future())
        self._inbox.put(_Submit(prompt, params, images, handle))
        try:
            await handle.accepted
        except asyncio.CancelledError:
            handle.abort()  # the caller went away while the engine was busy: drop it once added
            raise
        except BaseException:
            handle.finished = True
            raise
        return handle

    # ---- engine thread
    def _run(self) -> None:
        try:
            while True:
                # Block while the engine has nothing to do; otherwise take what arrived and step.
                commands = [self._inbox.get()] if not self._live else []
                while True:
                    try:
                        commands.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                for command in commands:
                    if command is _STOP:
                        return
                    self._apply(command)
                if self._live:
                    self._step()
        except BaseException as exc:  # a bug in the engine loop itself: report, fail everyone
            log.exception("engine thread died")
            self.error = exc
        finally:
            self._fail_all(EngineStopped(f"the engine stopped ({self.error or 'shut down'})"))
            self._drain_inbox()

    def _apply(self, command) -> None:
        if isinstance(command, _Submit):
            handle = command.handle
            try:
                self.llm.add_request(
                    command.prompt, command.params, images=command.images, request_id=handle.request_id
                )
            except Exception as exc:  # bad input: this request only
                self._release()
                handle._settle(exc)
                return
            self._live[handle.request_id] = handle
            handle._settle(None)
        elif isinstance(command, _Abort):
            if self._live.pop(command.request_id, None) is not None:
                self._safe_abort(command.request_id)
                self._release()

    def _step(self) -> None:
        try:
            outputs = self.llm.step()
        except Exception as exc:
            # A step runs a batch: the failing request cannot be told apart, so every running
            # request gets the error and is dropped; the thread and later requests carry on.
            log.exception("engine step failed")
            for request_id in list(self._live):
                self._safe_abort(request_id)
            self._fail_all(exc)
            return
        for out in outputs:
            handle = self._live.get(out.request_id)
            if handle is None:
                continue  # aborted while this step ran
            if out.finish_reason is not None:
                del self._live[out.request_id]
                self._release()
            handle._deliver(out)

    def _safe_abort(self, request_id: str) -> None:
        try:
            self.llm.abort(request_id)
        except Exception:
            log.exception("abort of %s failed", request_id)

    def _fail_all(self, error: BaseException) -> None:
        for handle in self._live.values():
            handle._deliver(error)
            self._release()
        self._live.clear()

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Submit):
                self._release()
                command.handle._settle(EngineStopped("the engine stopped"))

    def _release(self) -> None:
        with self._lock:
            self._count -= 1
