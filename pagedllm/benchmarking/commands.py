"""`pagedllm bench` and `pagedllm bench serve`: where their requests come from, and the commands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from pagedllm.cli_args import HelpFormatter, add_engine_args, engine_config


def add_request_args(parser: argparse.ArgumentParser) -> None:
    """Where a benchmark's requests come from: a JSONL workload file or a synthetic dataset."""
    from pagedllm.benchmarking.datasets import DATASETS, DatasetSpec

    defaults = DatasetSpec.__dataclass_fields__
    g = parser.add_argument_group("requests (one of --workload or --dataset)")
    g.add_argument(
        "--workload",
        default=None,
        help='JSONL file, one request per line: {"id", "prompt_token_ids", "max_tokens"} (docs/benchmarks.md)',
    )
    g.add_argument("--dataset", default=None, choices=DATASETS, help="draw synthetic requests (docs/benchmarks.md)")
    g.add_argument(
        "--num-prompts",
        "--num-requests",
        dest="num_prompts",
        type=int,
        default=None,
        help="requests to draw (dataset; default 100), or the first N of a workload",
    )
    g.add_argument("--input-len", type=int, default=defaults["input_len"].default, help="dataset: prompt length")
    g.add_argument("--output-len", type=int, default=defaults["output_len"].default, help="dataset: output length")
    g.add_argument(
        "--range-ratio",
        type=float,
        default=defaults["range_ratio"].default,
        help="dataset random/shared-prefix: lengths uniform in len x [1-r, 1+r]",
    )
    g.add_argument("--prefix-len", type=int, default=defaults["prefix_len"].default, help="dataset shared-prefix")
    g.add_argument("--num-prefixes", type=int, default=defaults["num_prefixes"].default, help="dataset shared-prefix")
    g.add_argument("--seed", type=int, default=0, help="seeds the dataset (and bench serve's arrival times)")
    g.add_argument("--save-workload", default=None, help="also write the requests as a JSONL workload file")


def bench_requests(args: argparse.Namespace, vocab_size: Callable[[], int]) -> tuple[list[dict], str]:
    """The requests the flags name, and a name for them; `vocab_size` is asked only for a dataset."""
    from pagedllm.benchmarking.datasets import DatasetSpec, generate_dataset, load_workload, save_workload

    if (args.workload is None) == (args.dataset is None):
        raise ValueError("pass either --workload FILE or --dataset random|shared-prefix|sharegpt-like")
    if args.workload is not None:
        requests, name = load_workload(args.workload, args.num_prompts), str(args.workload)
    else:
        spec = DatasetSpec(
            name=args.dataset,
            num_prompts=100 if args.num_prompts is None else args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            range_ratio=args.range_ratio,
            prefix_len=args.prefix_len,
            num_prefixes=args.num_prefixes,
            seed=args.seed,
        )
        requests, name = generate_dataset(spec, vocab_size()), spec.describe()
    if args.save_workload:
        save_workload(requests, args.save_workload)
    return requests, name


def cmd_bench(args: argparse.Namespace) -> int:
    from pagedllm.benchmarking.report import run_compare
    from pagedllm.benchmarking.settings import parse_list, parse_on_off, settings_grid
    from pagedllm.benchmarking.throughput import print_result, run_bench
    from pagedllm.models.loader import read_model_config, resolve_model_path

    block_sizes = parse_list(args.block_size, int)
    layouts = parse_list(args.compare) if args.compare else [args.kv_layout]
    base = engine_config(args, block_size=block_sizes[0])
    requests, workload_name = bench_requests(args, lambda: read_model_config(resolve_model_path(args.model)).vocab_size)
    caching = parse_on_off(args.prefix_caching) if args.prefix_caching else [args.enable_prefix_caching]
    settings = settings_grid(layouts, block_sizes, caching)
    if len(settings) > 1 or args.report_dir:
        result = run_compare(
            base,
            settings,
            requests,
            args.report_dir or "bench-results/report",
            ignore_eos=not args.respect_eos,
            workload_name=workload_name,
        )
        print(f"report written to {args.report_dir or 'bench-results/report'}/", file=sys.stderr)
    else:
        result = {"workload": workload_name, **run_bench(base, requests, ignore_eos=not args.respect_eos)}
    print_result(result, args.output)
    return exit_status(result)


def exit_status(result: dict) -> int:
    """1 when any request of the run (of any setting compared) failed, after saying which."""
    failed = failed_requests(result)
    if failed:
        print(f"pagedllm: error: {failed} requests failed; see failed_requests / first_error", file=sys.stderr)
    return 1 if failed else 0


def failed_requests(result) -> int:
    """The failed requests a result counts (`failed_requests` offline, `failed` served), at any depth."""
    if isinstance(result, dict):
        return sum(
            v if k in ("failed_requests", "failed") and type(v) is int else failed_requests(v)
            for k, v in result.items()
        )
    if isinstance(result, list):
        return sum(failed_requests(v) for v in result)
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    import asyncio

    from pagedllm.benchmarking.serve import parse_goodput, replay, server_vocab_size, wait_until_ready
    from pagedllm.benchmarking.throughput import print_result

    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    slos = parse_goodput(args.goodput)
    url = args.url.rstrip("/")
    wait_until_ready(url, args.api_key, args.ready_timeout)
    requests, workload_name = bench_requests(args, lambda: server_vocab_size(url, args.api_key))
    if any(r.get("n", 1) != 1 or r.get("temperature", 0.0) != 0.0 for r in requests):
        raise ValueError("bench serve replays greedy single-sample requests (no n or temperature in the workload)")
    result = asyncio.run(
        replay(url, requests, args.request_rate, args.seed, args.served_model, args.max_concurrency, slos, args.api_key)
    )
    print_result({"workload": workload_name, "url": url, **result}, args.output)
    return exit_status(result)


def add_bench_parser(sub) -> None:
    """The `bench` subcommand (offline throughput) and its `serve` mode (online latency)."""
    p = sub.add_parser(
        "bench",
        help="offline throughput on a workload or dataset (all requests at once); 'bench serve': online latency",
        formatter_class=HelpFormatter,
        description="Offline throughput: submit every request at once, run to completion, print a JSON summary. "
        "'pagedllm bench serve --url URL' measures a running server instead.",
    )
    add_request_args(p)
    p.add_argument("--output", default=None, help="also write the JSON result here")
    p.add_argument("--respect-eos", action="store_true", help="stop at EOS (default: ignore it)")
    p.add_argument(
        "--compare",
        default=None,
        help="KV layouts to run one after another, e.g. paged,contiguous (combined with every --block-size)",
    )
    p.add_argument(
        "--prefix-caching",
        default=None,
        help="on, off, or on,off to run both (combined with --compare and --block-size)",
    )
    p.add_argument(
        "--report-dir",
        default=None,
        help="folder for summary.json, per-step series and plots (default: bench-results/report, several settings)",
    )
    bench_modes = p.add_subparsers(dest="bench_mode", metavar="{serve}")
    q = bench_modes.add_parser(
        "serve",
        help="online latency and throughput against a running OpenAI-compatible server",
        formatter_class=HelpFormatter,
        description="Replay requests against a running server (pagedllm serve, vllm serve, ...) as streamed "
        "completions at a Poisson request rate; print TTFT, inter-token, per-token and end-to-end latency "
        "percentiles, throughput and goodput as JSON.",
    )
    q.add_argument("--url", required=True, help="the server's /v1 base, e.g. http://127.0.0.1:8000/v1")
    q.add_argument("--served-model", default=None, help="the model name to send (default: the first /v1/models lists)")
    q.add_argument("--api-key", default="unused", help="sent as 'Authorization: Bearer KEY'")
    q.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s, Poisson arrivals (inf: all at once)"
    )
    q.add_argument(
        "--ready-timeout", type=float, default=600.0, help="seconds to wait for the server to answer /v1/models"
    )
    q.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    q.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="SLOs a request must meet to count as good: ttft, tpot and/or e2el in milliseconds, e.g. ttft:500 tpot:50",
    )
    q.add_argument("--output", default=None, help="also write the JSON result here")
    q.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    add_request_args(q)
    q.set_defaults(func=cmd_bench_serve)
    add_engine_args(p, sweep=True)
    p.set_defaults(func=cmd_bench)
