"""The engine on a background thread, for servers.

One thread owns the `LLMEngine` and is the only code that touches it: it
runs the step loop and, between steps, the commands that other threads
submit (add a request, abort one, read a snapshot).  Each request's outputs
travel to its consumer's asyncio queue as they are produced.

Invariants:
- a request added here either reaches its consumer's queue until it
  finishes, or is aborted: a consumer that stops reading (a client that
  disconnects, a cancelled task) aborts its request, and the abort runs
  before the next step, so its blocks are free within one step;
- a failing command (bad input) fails only its caller; a failing step
  (an engine bug) fails every open request with `EngineDeadError`, and
  every later call, rather than hanging them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pagedllm.core.outputs import RequestOutput
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine import LLMEngine

logger = logging.getLogger("pagedllm")

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The step loop failed; the engine serves nothing more."""


class QueueFullError(RuntimeError):
    """More requests are waiting than the server admits (`max_waiting`)."""


@dataclass
class _Command:
    run: Callable[[LLMEngine], Any]
    done: Callable[[Any, BaseException | None], None]


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)


class RequestStream:
    """The outputs of requests added together, in step order; iteration ends when all are finished.

    Whoever iterates must call `abort()` when done (a `finally`): it ends whatever
    is still running, so a consumer that goes away never leaves blocks held.
    """

    def __init__(self, engine: AsyncLLMEngine, request_ids: list[str], stream: _Stream) -> None:
        self.request_ids = request_ids
        self._engine = engine
        self._stream = stream
        self._unfinished = set(request_ids)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._stream.outputs.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()  # the engine is dead: nothing to abort
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item

    def abort(self) -> None:
        for request_id in self._unfinished:
            self._engine.abort(request_id)
        self._unfinished.clear()


# (engine, outputs, step seconds); None for outputs produced between steps (aborts).
StepObserver = Callable[[LLMEngine, list[RequestOutput], float | None], None]


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int | None = None) -> None:
        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        # Called on the engine thread after every step and every abort.
        self.step_observers: list[StepObserver] = []
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop after the current step; open requests end with EngineDeadError."""
        self._stopping.set()
        self._commands.put(_Command(lambda engine: None, lambda result, error: None))
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.shutdown()  # tensor-parallel workers, once the engine thread is done with them

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # --- calls from the event loop -----------------------------------------------------

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between two steps; return its result or raise its error."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if not future.done():
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)

        self._submit(_Command(fn, lambda result, error: loop.call_soon_threadsafe(settle, result, error)))
        return await future

    async def add_requests(self, requests: list[tuple[str | list[int], SamplingParams, str]]) -> RequestStream:
        """Add (prompt, params, request id) requests, all or none, and return one stream of their outputs.

        Bad input raises (ValueError, QueueFullError) and leaves nothing queued.
        """
        stream = _Stream(asyncio.get_running_loop())
        ids = [request_id for _, _, request_id in requests]

        def add(engine: LLMEngine) -> None:
            waiting = len(engine.scheduler.waiting)
            if self.max_waiting is not None and waiting + len(requests) > self.max_waiting:
                raise QueueFullError(
                    f"the server is busy: {waiting} requests are already waiting "
                    f"(--max-waiting {self.max_waiting}); retry later"
                )
            added = []
            try:
                for prompt, params, request_id in requests:
                    engine.add_request(prompt, params, request_id)
                    added.append(request_id)
            except Exception:
                for request_id in added:
                    engine.abort_request(request_id)
                raise
            for request_id in ids:
                self._streams[request_id] = stream

        try:
            await self.call(add)
        except asyncio.CancelledError:
            for request_id in ids:  # the add may have run just before the cancellation
                self.abort(request_id)
            raise
        return RequestStream(self, ids, stream)

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """One request's outputs as steps produce them, the last one finished; leaving early aborts it."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        stream = await self.add_requests([(prompt, params, request_id)])
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """End a request from any thread; its blocks are freed before the next step.
        A no-op for unknown or finished requests, and once the engine has stopped."""
        if self.error is not None or self._stopping.is_set():
            return

        def run(engine: LLMEngine) -> None:
            self._streams.pop(request_id, None)
            output = engine.abort_request(request_id)
            if output is not None:  # observers see every request end, aborted ones too
                for observer in self.step_observers:
                    observer(engine, [output], None)

        self._submit(_Command(run, lambda result, error: None))

    def _submit(self, command: _Command) -> None:
        if self.error is not None or self._stopping.is_set():
            raise EngineDeadError(self._dead_message())
        self._commands.put(command)

    def _dead_message(self) -> str:
        if self.error is not None:
            return f"the engine stopped after an internal error: {self.error!r}"
        return "the engine is shutting down"

    # --- the engine thread -------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping.is_set():
                self._run_commands(wait=not engine.has_unfinished_requests())
                if engine.has_unfinished_requests() and not self._stopping.is_set():
                    start = time.perf_counter()
                    outputs = engine.step()
                    elapsed = time.perf_counter() - start
                    self._dispatch(outputs)
                    for observer in self.step_observers:
                        observer(engine, outputs, elapsed)
        except BaseException as error:  # an engine bug: fail loudly, never hang the clients
            logger.exception("the engine step loop failed")
            self.error = error
        self._fail_everything()

    def _run_commands(self, wait: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if wait else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            try:
                result, error = command.run(self.engine), None
            except Exception as exc:  # the caller's problem (bad input), not the engine's
                result, error = None, exc
            command.done(result, error)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream.put(output)
            if output.finished:
                del self._streams[output.request_id]

    def _fail_everything(self) -> None:
        error = EngineDeadError(self._dead_message())
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command.done(None, error)
