"""The command line's shared flags: engine settings, sampling and structured output."""

from __future__ import annotations

import argparse

from pagedllm.config import SERVE_PREFILL_TOKENS_WITH_DECODES, EngineConfig


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help, with each option's default added where it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):  # on/off flags say it
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def add_engine_args(parser: argparse.ArgumentParser, sweep: bool = False, serving: bool = False) -> None:
    """Engine flags; with `sweep`, --block-size takes a comma-separated list (bench); `serving`
    takes the server's defaults (a capped prefill share while requests decode)."""
    defaults = EngineConfig.__dataclass_fields__
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="a bundled model (smollm2, gemma3-270m), a GGUF file or a Hugging Face checkpoint directory "
        "(default: smollm2)",
    )
    g.add_argument(
        "--dtype",
        default=defaults["dtype"].default,
        choices=["auto", "float32", "bfloat16"],
        help="auto: bfloat16 where the CPU has native bf16 math (AVX512-BF16, AMX), else float32",
    )
    if sweep:
        g.add_argument("--block-size", default=str(defaults["block_size"].default), help="one size or a list: 8,16,32")
    else:
        g.add_argument("--block-size", type=int, default=defaults["block_size"].default, help="tokens per KV block")
    g.add_argument(
        "--kv-layout",
        default=defaults["kv_layout"].default,
        choices=["paged", "contiguous"],
        help="contiguous: the per-request reservation baseline (docs/paging.md)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_true",
        default=defaults["enable_prefix_caching"].default,
        help="reuse the KV of earlier prompts' full blocks (the default)",
    )
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", help="turn it off")
    g.add_argument(
        "--no-window-freeing",
        dest="window_freeing",
        action="store_false",
        help="sliding-window layers keep every block until the request ends (by default they give back "
        "the blocks their window has left behind)",
    )
    g.add_argument(
        "--reserve",
        default=defaults["reserve"].default,
        choices=["max-model-len", "request"],
        help="contiguous layout: reserve max-model-len slots per request, or prompt + max_tokens",
    )
    g.add_argument(
        "--kv-cache-memory",
        default=None,
        help="e.g. 2GiB (default: 4GiB on the CPU; on CUDA what --gpu-memory-utilization leaves)",
    )
    g.add_argument(
        "--device",
        default=defaults["device"].default,
        help="auto, cpu, cuda or cuda:N (auto: CUDA when torch sees a GPU, else the CPU)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=defaults["gpu_memory_utilization"].default,
        help="CUDA: share of the GPU's memory for weights, activations and the KV cache",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run decode steps eagerly instead of replaying captured CUDA graphs",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=defaults["max_num_batched_tokens"].default,
        help="token budget of one step (prefill chunks + decodes)",
    )
    g.add_argument(
        "--prefill-tokens-with-decodes",
        type=_optional_positive_int,
        default=SERVE_PREFILL_TOKENS_WITH_DECODES if serving else defaults["prefill_tokens_with_decodes"].default,
        help="most prompt tokens in a step that also carries decodes; lower: steadier inter-token latency, "
        "less throughput (none: the whole step budget)",
    )
    g.add_argument(
        "--max-num-seqs", type=int, default=defaults["max_num_seqs"].default, help="most requests running at once"
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output (default: the model's, lowered to what the KV cache holds if smaller)",
    )
    g.add_argument(
        "--attention",
        default=defaults["attention"].default,
        choices=["auto", "cpp", "torch", "triton", "reference"],
        help="attention kernels; auto: triton on CUDA, else the C++ kernels where they build",
    )
    g.add_argument(
        "--linear",
        default=defaults["linear"].default,
        choices=["auto", "onednn", "torch"],
        help="GEMM backend of the projections: oneDNN with packed weights where it runs (auto), or F.linear",
    )
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks to split the model over (docs/parallel.md); spawns N-1 workers unless --distributed-init-method",
    )
    g.add_argument(
        "--distributed-init-method",
        default=None,
        help="join ranks started by a launcher: env:// (torchrun) or tcp://HOST:PORT",
    )
    g.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="threads per rank (default: one per core that other processes leave free, measured every second)",
    )
    g.add_argument(
        "--no-adaptive-threads",
        dest="adaptive_threads",
        action="store_false",
        help="keep one thread per core even when other processes take cores",
    )
    g.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the most likely tokens up to P")
    g.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens (0: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below P x the top probability (0: off)")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="most tokens to generate")
    g.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, over the output so far (-2 to 2)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, per repeat in the output (-2 to 2)")
    g.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="transformers' rule over prompt and output (1: off)"
    )
    g.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        metavar="TOKEN_ID=VALUE",
        help="add VALUE (-100 to 100) to a token's logit (repeatable)",
    )
    g.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop token before this many tokens")
    g.add_argument("--bad-word", action="append", default=[], help="a word never to generate (repeatable)")
    s = parser.add_argument_group("structured output (one of)")
    s.add_argument("--json-schema", default=None, help="the reply follows this JSON schema: a file, or the JSON itself")
    s.add_argument("--json-object", action="store_true", help="the reply is a JSON object")
    s.add_argument("--regex", default=None, help="the reply matches this regular expression")
    s.add_argument("--choice", action="append", default=None, help="the reply is one of these strings (repeatable)")
    s.add_argument("--grammar", default=None, help="the reply follows this grammar (Lark or GBNF): a file, or the text")


def _optional_positive_int(text: str) -> int | None:
    if text.lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'none', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'none', got {text!r}")
    return value


def engine_config(args: argparse.Namespace, block_size: int | None = None) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        block_size=block_size if block_size is not None else args.block_size,
        kv_layout=args.kv_layout,
        enable_prefix_caching=args.enable_prefix_caching,
        window_freeing=args.window_freeing,
        reserve=args.reserve,
        kv_cache_memory=args.kv_cache_memory,
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        prefill_tokens_with_decodes=args.prefill_tokens_with_decodes,
        max_model_len=args.max_model_len,
        attention=args.attention,
        linear=args.linear,
        num_threads=args.num_threads,
        adaptive_threads=args.adaptive_threads,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_init_method=args.distributed_init_method,
    )


def sampling_params(args: argparse.Namespace):
    from pagedllm.core.sampling_params import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        logit_bias=parse_logit_bias(args.logit_bias),
        min_tokens=args.min_tokens,
        bad_words=args.bad_word,
        structured_output=structured_output(args),
    )


def structured_output(args: argparse.Namespace):
    """The --json-schema / --json-object / --regex / --choice / --grammar constraint, if any."""
    from pathlib import Path

    from pagedllm.core.sampling_params import StructuredOutput

    def text_or_file(value: str) -> str:
        path = Path(value)
        return path.read_text() if len(value) < 4096 and path.is_file() else value

    given = {
        "json_schema": text_or_file(args.json_schema) if args.json_schema else None,
        "json_object": args.json_object,
        "regex": args.regex,
        "choice": tuple(args.choice) if args.choice else None,
        "grammar": text_or_file(args.grammar) if args.grammar else None,
    }
    if not any(given.values()):
        return None
    return StructuredOutput(**given)


def parse_logit_bias(items: list[str]) -> dict[int, float]:
    """['42=-100', '7=5'] -> {42: -100.0, 7: 5.0}."""
    bias = {}
    for item in items:
        token, sep, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise ValueError(f"--logit-bias takes TOKEN_ID=VALUE, e.g. 42=-100; got {item!r}") from None
        if not sep:
            raise ValueError(f"--logit-bias takes TOKEN_ID=VALUE, e.g. 42=-100; got {item!r}")
    return bias
