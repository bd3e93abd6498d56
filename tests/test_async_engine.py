"""The engine thread's bridge to the event loop, on a stand-in engine (no model): coalesced
outputs for slow readers, observers that raise, commands racing an engine that dies."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pagedllm.core.outputs import CompletionOutput, RequestOutput
from pagedllm.serving.async_engine import AsyncLLMEngine, EngineDeadError, NewRequest


class StandInEngine:
    """Each step gives every open request one more token "a"; `fail_at` makes a step raise."""

    def __init__(self, steps_per_request: int = 50) -> None:
        self.open: dict[str, list[int]] = {}
        self.steps_per_request = steps_per_request
        self.groups = self.open
        self.num_waiting = 0
        self.num_kv_blocks_used = 0
        self.fail_at: int | None = None
        self.steps = 0
        self.step_gate = threading.Event()  # cleared: the next step waits inside `step` for it
        self.step_gate.set()
        self.held = threading.Event()  # set once a step is waiting at the cleared gate

    def add_request(self, prompt, params, request_id, lora=None):
        self.open[request_id] = []

    def abort_request(self, request_id):
        self.open.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.open)

    def step(self):
        if not self.step_gate.is_set():
            self.held.set()
        self.step_gate.wait()
        self.steps += 1
        if self.fail_at is not None and self.steps >= self.fail_at:
            raise RuntimeError("stand-in step failure")
        outputs = []
        for request_id, tokens in list(self.open.items()):
            tokens.append(1)
            finished = len(tokens) >= self.steps_per_request
            completion = CompletionOutput(0, "a" * len(tokens), tokens, finished, "length" if finished else None)
            completion.delta = "a"
            outputs.append(RequestOutput(request_id, None, [0], [completion], finished))
            if finished:
                del self.open[request_id]
        return outputs

    def shutdown(self):
        pass


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_slow_reader_gets_coalesced_outputs_with_every_delta():
    engine = StandInEngine(steps_per_request=40)
    async_engine = AsyncLLMEngine(engine)
    async_engine.start()

    async def main():
        stream = await async_engine.add_requests([NewRequest([1], None, "r")])
        outputs = []
        async for output in stream:
            outputs.append(output)
            await asyncio.sleep(0.02)  # slower than the stand-in's steps
        return outputs

    try:
        outputs = run(main())
    finally:
        async_engine.shutdown()
    assert "".join(o.delta for o in outputs) == "a" * 40
    assert outputs[-1].finished and outputs[-1].outputs[0].num_tokens == 40
    assert len(outputs) < 40  # several steps came as one output


def test_an_observer_that_raises_is_dropped_and_the_engine_goes_on(caplog):
    engine = StandInEngine(steps_per_request=5)
    async_engine = AsyncLLMEngine(engine)
    seen = []
    async_engine.step_observers.append(lambda e, outputs, elapsed: 1 / 0)
    async_engine.step_observers.append(lambda e, outputs, elapsed: seen.append(len(outputs)))
    async_engine.start()

    async def main():
        stream = await async_engine.add_requests([NewRequest([1], None, "r")])
        return [o async for o in stream]

    try:
        outputs = run(main())
    finally:
        async_engine.shutdown()
    assert outputs[-1].finished
    assert len(async_engine.step_observers) == 1 and len(seen) >= 1
    assert "step observer" in caplog.text


def test_commands_queued_as_the_engine_dies_are_answered_not_left_waiting():
    engine = StandInEngine(steps_per_request=10**6)
    async_engine = AsyncLLMEngine(engine)
    async_engine.start()

    async def main():
        stream = await async_engine.add_requests([NewRequest([1], None, "r")])
        engine.step_gate.clear()  # hold the engine inside a step ...
        await asyncio.to_thread(engine.held.wait, 5)
        engine.fail_at = engine.steps + 1
        pending = asyncio.ensure_future(async_engine.call(lambda e: "ran"))  # ... queue a command ...
        await asyncio.sleep(0.05)
        engine.step_gate.set()  # ... then let the step fail
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(pending, timeout=5)
        with pytest.raises(EngineDeadError):
            await async_engine.call(lambda e: "too late")

    try:
        run(main())
    finally:
        async_engine.shutdown()
