"""The offline API: `LLM(...).generate(prompts, params)` and `LLM.chat(messages)`."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm import tqdm

from pagedllm.config import EngineConfig
from pagedllm.core.outputs import RequestOutput
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine import LLMEngine

Prompt = str | list[int]
Messages = list[dict[str, str]]


def prompts_and_params(
    prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
) -> tuple[list[Prompt], list[SamplingParams]]:
    """A prompt or a list of them, and one SamplingParams for all (or None: the defaults) or one
    per prompt, as two lists of the same length."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    prompts = list(prompts)
    if params is None or isinstance(params, SamplingParams):
        params = [params or SamplingParams()] * len(prompts)
    params = list(params)
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
    return prompts, params


class LLM:
    """An engine for offline batches.  Keyword arguments are `EngineConfig` fields
    (e.g. `LLM(dtype="float32", block_size=16, kv_cache_memory="2GiB")`)."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        unknown = set(engine_args) - set(EngineConfig.field_names())
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at interpreter exit)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in the prompts' order.  A prompt is text or a list of token ids.
        `lora`: a LoRA adapter for every prompt or one per prompt (None: the base model), each the
        name of a loaded adapter or a PEFT directory or GGUF adapter, loaded under its path on first use."""
        prompts, params = prompts_and_params(prompts, params)
        if not prompts:
            return []
        adapters = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(adapters) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(adapters)} LoRA adapters")
        for name in set(adapters) - {None}:
            self.use_lora(name)
        engine = self.engine
        ids: list[str] = []
        results: dict[str, RequestOutput] = {}
        show = len(prompts) >= 8 if use_tqdm is None else use_tqdm
        try:
            for prompt, p, adapter in zip(prompts, params, adapters):
                ids.append(engine.add_request(prompt, p, lora=adapter))
            wanted = set(ids)
            with tqdm(total=len(ids), desc="generate", unit="req", disable=not show) as bar:
                while len(results) < len(ids):
                    for output in engine.step():
                        if output.finished and output.request_id in wanted:
                            results[output.request_id] = output
                            bar.update(1)
        except BaseException:
            # A bad prompt or an interrupt: nothing of this batch stays queued or holds blocks.
            for request_id in ids:
                if request_id not in results:
                    engine.abort_request(request_id)
            raise
        return [results[i] for i in ids]

    def use_lora(self, name_or_path: str) -> None:
        """Load the adapter (PEFT directory or GGUF file) `name_or_path` under its path, unless an
        adapter of that name is loaded."""
        if name_or_path not in {a["name"] for a in self.engine.lora_adapters()}:
            self.engine.load_lora(name_or_path, name_or_path)

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        beam_width: int,
        max_tokens: int,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Beam search per prompt; each output holds the `beam_width` best hypotheses, best first
        (`outputs[i].score`, `.cumulative_logprob`, `.token_ids`, `.text`)."""
        params = SamplingParams(
            beam_width=beam_width,
            n=beam_width,
            max_tokens=max_tokens,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
        )
        return self.generate(prompts, params, use_tqdm)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.engine.tokenizer.apply_chat_template(list(m)) for m in conversations]
        return self.generate(prompts, params, use_tqdm)
