"""The engine on a background thread, for servers.

One thread owns the `LLMEngine` and is the only code that touches it: it
runs the step loop and, between steps, the commands that other threads
submit (add a request, abort one, read a snapshot).  Each request's outputs
travel to its consumer's mailbox as they are produced.

Invariants:
- a request added here either reaches its consumer until it finishes, or
  is aborted: a consumer that stops reading (a client that disconnects, a
  cancelled task) aborts its request, and the abort runs before the next
  step, so its blocks are free within one step;
- a consumer holds at most one pending output per request, however slowly
  it reads: a newer output replaces the unread one, their text deltas joined
  (outputs carry the whole state, so nothing else is lost);
- a fault in one request (its sampling, grammar, text) ends that request
  with `RequestFailedError` for its consumer; the engine goes on;
- a failing command (bad input) fails only its caller; a step loop that
  cannot go on fails every open request with `EngineDeadError`, and every
  later call, rather than hanging them: a command is either run, or answered
  with that error (never left in the queue);
- an observer (metrics, logs) that raises is logged and dropped, never fatal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pagedllm.core.outputs import RequestOutput
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine import EngineInfo, LLMEngine
from pagedllm.execution.structured_output import StructuredOutputs
from pagedllm.execution.thread_control import release_openmp_workers

logger = logging.getLogger("pagedllm")

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The step loop failed; the engine serves nothing more."""


class QueueFullError(RuntimeError):
    """More requests are waiting than the server admits (`max_waiting`)."""


class RequestFailedError(RuntimeError):
    """A fault while handling this request ended it (the engine goes on serving the others).
    `param` names the request's setting at fault when its own input caused it, else None."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class NewRequest:
    """A request for the engine: prompt (text or token ids), sampling settings, its id, and the
    LoRA adapter it runs under (None: the base model)."""

    prompt: str | list[int]
    params: SamplingParams
    request_id: str
    lora: str | None = None


@dataclass
class _Command:
    run: Callable[[LLMEngine], Any]
    done: Callable[[Any, BaseException | None], None]


class _Stream:
    """The mailbox between the engine thread and one consumer: the latest unread output per request.

    The engine thread `put`s every step; the consumer `take`s whatever is there. A slow reader
    therefore holds one output per request, not one per step: a newer output replaces the unread
    one, with the text deltas of both joined.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: dict[str, RequestOutput] = {}
        self._error: BaseException | None = None
        self._ready = asyncio.Event()  # set on the loop's thread when something arrived

    def put(self, output: RequestOutput) -> None:
        with self._lock:
            wake = not self._pending and self._error is None
            unread = self._pending.get(output.request_id)
            self._pending[output.request_id] = output if unread is None else _coalesce(unread, output)
        if wake:
            self._wake()

    def fail(self, error: BaseException) -> None:
        with self._lock:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:  # the consumer's loop is closed: nobody is left to tell
            pass

    async def take(self) -> list[RequestOutput]:
        """Every unread output, oldest request first; raises the engine's error once nothing is left."""
        while True:
            with self._lock:
                outputs = list(self._pending.values())
                self._pending.clear()
                error = self._error
                self._ready.clear()
            if outputs:
                return outputs
            if error is not None:
                raise error
            await self._ready.wait()


def _coalesce(unread: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """`newer` with each completion's delta preceded by the unread one's."""
    deltas = {c.index: c.delta for c in unread.outputs}
    outputs = [c.with_delta(deltas.get(c.index, "") + c.delta) for c in newer.outputs]
    return dataclasses.replace(newer, outputs=outputs)


class RequestStream:
    """The outputs of requests added together, in step order; iteration ends when all are finished.

    Whoever iterates must call `abort()` when done (a `finally`): it ends whatever
    is still running, so a consumer that goes away never leaves blocks held.
    A request that a fault ended raises `RequestFailedError`.
    """

    def __init__(self, engine: AsyncLLMEngine, request_ids: list[str], stream: _Stream) -> None:
        self.request_ids = request_ids
        self._engine = engine
        self._stream = stream
        self._unfinished = set(request_ids)
        self._ready: list[RequestOutput] = []

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._ready:
            if not self._unfinished:
                raise StopAsyncIteration
            try:
                self._ready = await self._stream.take()
            except EngineDeadError:
                self._unfinished.clear()  # the engine is dead: nothing to abort
                raise
        item = self._ready.pop(0)
        if item.finished:
            self._unfinished.discard(item.request_id)
            if item.error is not None:
                raise RequestFailedError(f"request {item.request_id} failed: {item.error}", item.error_param)
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
        # Taken to enqueue a command and to close the queue: a command is queued only while the
        # engine thread will still run or fail it.
        self._queue_lock = threading.Lock()
        self._closed = False
        self._draining = False
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        # The engine was built (and warmed up) on this thread; its OpenMP workers would slow every
        # parallel region the engine thread runs from now on (release_openmp_workers says why).
        release_openmp_workers()
        self._thread.start()

    def start_draining(self) -> None:
        """Refuse new requests (EngineDeadError: 'shutting down'); running ones go on to their end."""
        self._draining = True

    def end_open_requests(self, reason: str) -> None:
        """Abort every request still open, from any thread: blocks freed before the next step, and each
        consumer told `EngineDeadError(reason)` (a stream ends with that error, a client gets a 503)."""

        def run(engine: LLMEngine) -> None:
            self._abort_everything()
            error = EngineDeadError(reason)
            for stream in set(self._streams.values()):
                stream.fail(error)
            self._streams.clear()

        try:
            self._submit(_Command(run, lambda result, error: None))
        except EngineDeadError:
            pass  # stopped already: nothing is open

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop after the current step: requests still open are aborted (their blocks freed) and
        their consumers get EngineDeadError."""
        self._stopping.set()
        self._commands.put(_Command(lambda engine: None, lambda result, error: None))
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.engine.shutdown()  # tensor-parallel workers, once the engine thread is done with them

    @property
    def info(self) -> EngineInfo:
        """The engine's fixed facts (length limit, vocabulary, cache geometry): safe from any thread."""
        return self.engine.info

    def on_worker_failure(self, callback: Callable[[BaseException], None]) -> None:
        """LLMEngine.on_worker_failure: a dead tensor-parallel rank calls `callback(error)`."""
        self.engine.on_worker_failure(callback)

    @property
    def worker_failure(self) -> BaseException | None:
        return self.engine.worker_failure

    @property
    def grammars(self) -> StructuredOutputs:
        """The engine's grammar compiler, which any thread may call (LLMEngine.grammars)."""
        return self.engine.grammars

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def num_open_requests(self) -> int:
        """Requests whose consumer has not had their last output (read from any thread)."""
        return len(self._streams)

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

    async def add_requests(self, requests: list[NewRequest]) -> RequestStream:
        """Add requests, all or none, and return one stream of their outputs.

        Bad input raises (ValueError, KeyError for an unknown adapter, QueueFullError) and leaves
        nothing queued.
        """
        stream = _Stream(asyncio.get_running_loop())
        ids = [r.request_id for r in requests]

        def add(engine: LLMEngine) -> None:
            if self._draining:
                raise EngineDeadError("the server is shutting down: it takes no new requests")
            waiting = engine.num_waiting
            if self.max_waiting is not None and waiting + len(requests) > self.max_waiting:
                raise QueueFullError(
                    f"the server is busy: {waiting} requests are already waiting "
                    f"(--max-waiting {self.max_waiting}); retry later"
                )
            added = []
            try:
                for r in requests:
                    engine.add_request(r.prompt, r.params, r.request_id, r.lora)
                    added.append(r.request_id)
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
        stream = await self.add_requests([NewRequest(prompt, params, request_id)])
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
                self._notify([output], None)

        try:
            self._submit(_Command(run, lambda result, error: None))
        except EngineDeadError:
            pass  # it stopped meanwhile: nothing is left to abort

    def _submit(self, command: _Command) -> None:
        with self._queue_lock:
            if self._closed or self.error is not None or self._stopping.is_set():
                raise EngineDeadError(self._dead_message())
            self._commands.put(command)

    def _dead_message(self) -> str:
        if self._draining and self.error is None:
            return "the server is shutting down: it takes no new requests"
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
                    self._notify(outputs, elapsed)
        except BaseException as error:  # an engine bug: fail loudly, never hang the clients
            logger.exception("the engine step loop failed")
            self.error = error
        if self.error is None:
            self._abort_everything()
        self._fail_everything()

    def _abort_everything(self) -> None:
        """At shutdown: end every request still in the engine and free its blocks."""
        engine = self.engine
        open_requests = list(engine.groups)
        for request_id in open_requests:
            output = engine.abort_request(request_id)
            if output is not None:
                self._notify([output], None)
        if open_requests:
            logger.info(
                "shutdown: aborted %d unfinished requests; %d KV blocks in use",
                len(open_requests),
                engine.num_kv_blocks_used,
            )

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

    def _notify(self, outputs: list[RequestOutput], elapsed: float | None) -> None:
        for observer in list(self.step_observers):
            try:
                observer(self.engine, outputs, elapsed)
            except Exception:  # metrics and logs are no reason to stop serving
                logger.exception("step observer %r failed; it is turned off", observer)
                self.step_observers.remove(observer)

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
        with self._queue_lock:
            self._closed = True  # from here on _submit refuses; what is queued is answered below
        for stream in self._streams.values():
            stream.fail(error)
        self._streams.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command.done(None, error)
