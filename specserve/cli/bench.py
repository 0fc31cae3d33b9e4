"""`specserve bench latency` (offline, in one process) and `specserve bench serve` (HTTP)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from specserve.bench.stats import parse_positive_list
from specserve.cli.engine_args import add_engine_args


def positive_list(kind: type) -> Callable[[str], list]:
    """An argparse type: '1,2,4' -> [1, 2, 4], positive numbers only."""

    def parse(text: str) -> list:
        try:
            return parse_positive_list(text, kind, "")
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"want comma-separated positive {kind.__name__}s, got {text!r}"
            ) from None

    parse.__name__ = f"{kind.__name__} list"
    return parse


def at_least(lo: int) -> Callable[[str], int]:
    """An argparse type: an integer >= lo."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"want an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value

    parse.__name__ = f"integer >= {lo}"
    return parse


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks: latency (offline) | serve (HTTP load)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    _register_latency(bench_sub)
    _register_serve(bench_sub)


def _register_latency(sub: argparse._SubParsersAction) -> None:
    from specserve.models.presets import PRESETS

    p = sub.add_parser(
        "latency",
        help="offline decode latency: plain vs speculation",
        description="Offline decode latency, plain vs speculative, against the "
        "weight-stream floor and the weights + KV roofline. A preset name as "
        f"--model ({', '.join(PRESETS)}) means random weights.",
    )
    p.add_argument(
        "--batch-sizes",
        default=[1, 8, 32, 128],
        type=positive_list(int),
        help="comma-separated batch sizes (default: 1,8,32,128)",
    )
    p.add_argument(
        "--context-len",
        default=[1024],
        type=positive_list(int),
        help="prompt tokens, comma-separated (default: 1024)",
    )
    p.add_argument(
        "--output-len",
        type=at_least(2),
        default=128,
        help="decode tokens timed per request (default: 128)",
    )
    p.add_argument(
        "--runs", type=at_least(1), default=10, help="timed runs per mode and point (default: 10)"
    )
    p.add_argument(
        "--warmup", type=at_least(0), default=2, help="untimed runs per mode and point (default: 2)"
    )
    p.add_argument(
        "--prompts",
        default=None,
        help="'chat', 'code' or a .jsonl file (default: random token ids)",
    )
    p.add_argument("--no-baseline", action="store_true", help="time speculation only")
    p.add_argument(
        "--floor",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure the weight-stream floor, copy bandwidth, matmul peak and the "
        "roofline (default: on CUDA)",
    )
    p.add_argument(
        "--compare-hf",
        action="store_true",
        help="time transformers' generate at batch 1 on the same weights",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a progress bar over the runs and one line per point on stderr (default: on)",
    )
    p.add_argument("--log", action="store_true", help="append to the experiment log + plot")
    p.add_argument("--exp-dir", default="experiments", help="where LOG.md and results live")
    p.add_argument("--label", default="latency", help="names this run in the log and plots")
    p.add_argument("--json-out", default=None, help="write the full report as JSON here")
    add_engine_args(p, skip=("chat_template", "generation_config"))
    p.set_defaults(func=_latency)


def _latency(args: argparse.Namespace) -> int:
    from specserve.cli.commands import checked_engine_config
    from specserve.models.presets import PRESETS

    if args.model in PRESETS and args.load_format is None:
        args.load_format = "dummy"  # a preset is a shape: random weights
    config = checked_engine_config(args)
    if args.no_baseline and not config.spec.enabled:
        raise ValueError(
            "--no-baseline without speculation leaves nothing to time; add "
            "--spec-draft-model PATH|dummy"
        )
    from specserve.bench.latency import run

    return run(args, config)


def _register_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="load-test an OpenAI-compatible server over HTTP")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    p.add_argument(
        "--start-server",
        default=None,
        metavar="ARGS",
        help="start `specserve serve ARGS` on a free loopback port for the run",
    )
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--prompts", default="chat", help="'chat', 'code' or a .jsonl file")
    p.add_argument(
        "--max-tokens", type=at_least(1), default=128, help="tokens generated per request"
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="ask the server not to stop early")
    p.add_argument(
        "--concurrency",
        default=None,
        type=positive_list(int),
        help="closed-loop sweep, e.g. 1,2,4,8 (default)",
    )
    p.add_argument(
        "--request-rate",
        default=None,
        type=positive_list(float),
        help="Poisson arrivals per second, e.g. 2,8",
    )
    p.add_argument(
        "--max-concurrency", type=at_least(1), default=None, help="cap with --request-rate"
    )
    p.add_argument(
        "--num-requests", type=at_least(1), default=64, help="requests per point and repeat"
    )
    p.add_argument("--repeats", type=at_least(1), default=3, help="timed repeats of each point")
    p.add_argument("--warmup-requests", type=at_least(0), default=2)
    p.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--log", action="store_true", help="append to the experiment log + plot")
    p.add_argument("--exp-dir", default="experiments", help="where LOG.md and results live")
    p.add_argument("--label", default="serve", help="names this run in the log and plot")
    p.add_argument("--baseline", default=None, help="label of a logged run to compare against")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    if args.request_rate and args.concurrency:
        raise ValueError("pass either --concurrency or --request-rate, not both")
    from specserve.bench.serving import run

    return run(args)
