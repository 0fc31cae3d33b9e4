"""`specserve generate`, `specserve serve` and `specserve doctor`."""

from __future__ import annotations

import argparse
import sys
import time

from specserve.cli.engine_args import add_engine_args, engine_config_from_args
from specserve.cli.preflight import check_engine_config, check_port
from specserve.config import EngineConfig

SAMPLING_FLAG_HELP = "(default: the model's generation config, else {})"


def register(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser(
        "generate",
        help="generate a continuation of one prompt",
        description="Generate a continuation of PROMPT (with the default model, or --chat: "
        "the reply to PROMPT as a user message); prints the text, then tok/s (and the accept "
        "length with speculation) on stderr.",
    )
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64, help="(default: 64)")
    gen.add_argument(
        "--temperature", type=float, default=None, help=SAMPLING_FLAG_HELP.format("0 = greedy")
    )
    gen.add_argument("--top-p", type=float, default=None, help=SAMPLING_FLAG_HELP.format("1.0"))
    gen.add_argument("--top-k", type=int, default=None, help=SAMPLING_FLAG_HELP.format("-1 = off"))
    gen.add_argument("--seed-request", type=int, default=None, help="per-request sampling seed")
    gen.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="send PROMPT as a user message through the model's chat template and print the "
        "reply (default: on for the default model, off with --model)",
    )
    add_engine_args(gen, skip=("chat_template",))
    gen.set_defaults(func=generate)

    serve = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="Serve MODEL over an OpenAI-compatible HTTP API.",
    )
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    serve.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    serve.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health (shows in ps: "
        "prefer --api-key-file or $SPECSERVE_API_KEY)",
    )
    serve.add_argument("--api-key-file", default=None, help="read the API key from this file")
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model ids clients may send; the first is reported in responses "
        "(default: the --model value, or the default model's name)",
    )
    serve.add_argument(
        "--max-body-bytes", type=int, default=None, help="cap on a request body (default: 8 MiB)"
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM waits for in-flight requests (default: 30)",
    )
    serve.add_argument("--max-connections", type=int, default=1024,
                       help="open connections past this get 503 (0 = no cap; default: 1024)")
    serve.add_argument("--timeout-header", type=float, default=10.0,
                       help="seconds a client has to send the request headers (408 after; "
                       "default: 10)")
    serve.add_argument("--timeout-body", type=float, default=30.0,
                       help="seconds a client has to send the whole body (408 after; "
                       "default: 30)")
    serve.add_argument("--request-timeout", type=float, default=0.0,
                       help="abort a request unfinished this long after arrival (504; "
                       "default: 0 = off)")
    serve.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                       help="run the engine core in a process of its own (default: on; off: "
                       "a thread of the server process)")
    add_engine_args(serve, positional_model=True)
    serve.set_defaults(func=serve_command)

    doctor = sub.add_parser("doctor", help="report the hardware and usable fast paths")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    from specserve.comm_report import add_measure_args  # torch-free

    add_measure_args(doctor)
    doctor.set_defaults(func=doctor_command)


def checked_engine_config(args: argparse.Namespace, dummy_ok: bool = False) -> EngineConfig:
    """The EngineConfig of the flags, with every value and path checked."""
    config = engine_config_from_args(args)
    check_engine_config(config, dummy_ok)
    return config


def generate(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    # the default model is an instruct model: chat unless told otherwise
    chat = args.chat if args.chat is not None else not args.model
    config = checked_engine_config(args)
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    llm = LLM(config)
    given = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    sampling = {
        "temperature": 0.0,
        **llm.engine.generation_defaults.params,
        **{k: v for k, v in given.items() if v is not None},
    }
    params = SamplingParams(**sampling, max_tokens=args.max_tokens, seed=args.seed_request)
    prompt: str | list[int] = args.prompt
    if chat:
        if llm.tokenizer is None:
            raise ValueError("--chat needs the model's tokenizer and chat template; this model "
                             "has none (pass --no-chat)")
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    t0 = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    dt = time.perf_counter() - t0
    print(out.text if chat else args.prompt + out.text)
    n = len(out.token_ids)
    how = "greedy" if params.greedy else ", ".join(f"{k}={v}" for k, v in sampling.items())
    line = (
        f"[{n} tokens in {dt:.2f} s, {n / dt:.1f} tok/s, {how}, finish_reason={out.finish_reason}"
    )
    if out.spec_cycles:
        line += f", accept length {out.accept_length:.2f} over {out.spec_cycles} cycles"
    print(line + "]", file=sys.stderr)
    return 0


def serve_command(args: argparse.Namespace) -> int:
    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    if args.served_model_name is not None and not all(args.served_model_name):
        raise ValueError("--served-model-name names must be non-empty")
    from specserve.server.guard import check_serve_limits, resolve_api_key  # torch-free

    key = resolve_api_key(args.api_key, args.api_key_file)
    timeouts = {"timeout-header": args.timeout_header, "timeout-body": args.timeout_body,
                "request-timeout": args.request_timeout, "drain-timeout": args.drain_timeout}
    check_serve_limits(args.host, key, timeouts, args.max_connections,
                       args.max_body_bytes or 1)
    config = checked_engine_config(args)
    check_port(args.host, args.port)
    from specserve import defaults
    from specserve.server.api import serve
    given = args.model_tag or args.model
    names = args.served_model_name or [given or defaults.DEFAULT_MODEL_NAME]
    return serve(
        config, names, args.host, args.port, key, args.max_body_bytes, args.drain_timeout,
        args.timeout_header, args.timeout_body, args.request_timeout, args.max_connections,
        args.engine_process,
    )


def doctor_command(args: argparse.Namespace) -> int:
    from specserve.doctor import run

    return run(args)
