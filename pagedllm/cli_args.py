"""The command line's shared flags: engine settings, sampling and structured output."""

from __future__ import annotations

import argparse
import dataclasses

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


def engine_fields() -> list[dataclasses.Field]:
    """EngineConfig's fields that the command line offers, in their declared order."""
    return [f for f in dataclasses.fields(EngineConfig) if f.metadata.get("cli", False)]


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser, sweep: bool = False, serving: bool = False) -> None:
    """One flag per EngineConfig field (pagedllm/config.py says its kind, choices and help); with
    `sweep`, --block-size takes a comma-separated list (bench); `serving` takes the server's
    defaults (a capped prefill share while requests decode)."""
    g = parser.add_argument_group("engine")
    for f in engine_fields():
        kind, help_text, flag = f.metadata["kind"], f.metadata["help"], flag_of(f)
        if kind == "bool":
            off = f.metadata["off_flag"]
            if f.default:  # on by default: the flag that turns it off, and the plain one for clarity
                on_by_default = help_text if "(default: on" in help_text else f"{help_text} (default: on)"
                g.add_argument(flag, dest=f.name, action="store_true", default=True, help=on_by_default)
                g.add_argument(off, dest=f.name, action="store_false", help=f"turn {flag} off (it is on by default)")
            else:
                g.add_argument(flag, dest=f.name, action="store_true", default=False, help=help_text)
            continue
        if kind == "list":
            g.add_argument(flag, dest=f.name, action="append", default=[], metavar="NAME=PATH", help=help_text)
            continue
        default = f.default
        if f.name == "prefill_tokens_with_decodes" and serving:
            default = SERVE_PREFILL_TOKENS_WITH_DECODES
        if f.name == "block_size" and sweep:
            g.add_argument(flag, dest=f.name, default=str(default), help="one size or a list: 8,16,32")
            continue
        types = {"int": int, "float": float, "optional-int": _optional_positive_int}
        g.add_argument(
            flag,
            dest=f.name,
            type=types.get(kind, str),
            default=default,
            choices=f.metadata["choices"] or None,
            help=help_text,
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
    """The EngineConfig that the parsed engine flags describe."""
    values = {f.name: getattr(args, f.name) for f in engine_fields()}
    if block_size is not None:
        values["block_size"] = block_size
    return EngineConfig(**values)


def engine_flags(config: EngineConfig) -> list[str]:
    """The flags that give `config` to another pagedllm process (`pagedllm serve` in the serving
    benchmark): every field the command line offers, spelled out whatever that command's default."""
    flags: list[str] = []
    for f in engine_fields():
        value, kind = getattr(config, f.name), f.metadata["kind"]
        if kind == "bool":
            if value != f.default or value:
                flags.append(flag_of(f) if value else f.metadata["off_flag"])
        elif kind == "list":
            for item in value:
                flags += [flag_of(f), str(item)]
        elif value is None:
            if kind == "optional-int":
                flags += [flag_of(f), "none"]
        else:
            flags += [flag_of(f), str(value)]
    return flags


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
