"""Work on a request before the engine sees it, off the event loop.

Reading a body, parsing and checking it, tokenizing, the chat template and compiling a grammar
run on a small pool of preparation threads, so a 200 KB prompt or a 1 MB schema never delays
another stream's tokens.  The threads share one tokenizer of their own (a Rust tokenizer must
not be used from two threads at once), one at a time, and run at nice 10: on a machine whose
cores the engine's threads fill, tokenizing a huge prompt takes the cores the engine leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pagedllm.execution.structured_output import StructuredOutputs
from pagedllm.serving.openai_protocol import bad_request
from pagedllm.text.tokenizer import Tokenizer

logger = logging.getLogger("pagedllm")

PREPARE_THREADS = 4
T = TypeVar("T")


def _lower_priority() -> None:
    with contextlib.suppress(AttributeError, OSError):  # per-thread nice values are Linux's
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


class Preparation:
    def __init__(self, tokenizer_path: Any, grammars: StructuredOutputs) -> None:
        self.tokenizer = Tokenizer(tokenizer_path)
        self.lock = threading.Lock()  # the preparation threads share self.tokenizer
        self.grammars = grammars  # the engine's grammar compiler: thread-safe
        self.pool = ThreadPoolExecutor(
            PREPARE_THREADS, thread_name_prefix="pagedllm-prepare", initializer=_lower_priority
        )

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a preparation thread: the event loop goes on moving other streams' bytes."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))

    def warm_up(self) -> None:
        """Build now what the first constrained or chat request would otherwise wait for (seconds
        for the grammar engine; the chat template's Jinja compile holds the GIL ~0.1 s)."""
        self.pool.submit(self._try, self.grammars.build_tokenizer)
        self.pool.submit(self._try, self._warm_up_text)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _try(fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as error:  # the first request that needs it will say why, as a 4xx
            logger.warning("warming up %s at start failed: %r", getattr(fn, "__name__", fn), error)

    def _warm_up_text(self) -> None:
        self.encode("warm")
        if self.tokenizer.hf.chat_template:
            self.chat_template([{"role": "user", "content": "warm"}])

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        with self.lock:
            if add_special_tokens is None:
                return self.tokenizer.encode(text)
            return self.tokenizer.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        with self.lock:
            return self.tokenizer.decode(token_ids)

    def chat_template(self, messages: list[dict[str, str]], tools: list[dict] | None = None) -> list[int]:
        """The model's template over the messages; a template that refuses them is the client's 400."""
        with self.lock:
            try:
                return self.tokenizer.apply_chat_template(messages, tools)
            except Exception as error:  # raise_exception() in the template, roles it does not take, ...
                message = getattr(error, "message", None) or str(error) or type(error).__name__
                raise bad_request(f"the chat template refused these messages: {message}", "messages") from None

    @property
    def template_takes_tools(self) -> bool:
        return self.tokenizer.template_takes_tools

    def constraint(self, params: Any) -> Any:
        """Compile the request's grammar and build its first matcher here, off the engine thread."""
        if params.structured_output is not None:
            try:
                self.grammars.prepare(params.structured_output)
            except ValueError as error:
                raise bad_request(str(error), getattr(error, "param", None)) from None
        return params
