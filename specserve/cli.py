"""The `specserve` command: generate | serve | bench latency | bench serve | doctor | train-eagle3."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from specserve.config import EngineConfig, add_cli_args, config_from_cli_args


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the generated flags; no --model means the bundled default pair."""
    from specserve import defaults

    config = config_from_cli_args(args)
    if not config.model:
        config = config.replace(model=defaults.default_model_path())
        draft = defaults.default_draft_path()
        if draft and not config.spec.draft_model and getattr(args, "spec_algorithm", None) is None:
            config = config.replace(spec={"algorithm": "eagle3", "draft_model": draft})
    return config


def _generate(args: argparse.Namespace) -> int:
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    llm = LLM(config)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed_request)
    t0 = time.perf_counter()
    out = llm.generate([args.prompt], params)[0]
    dt = time.perf_counter() - t0
    print(args.prompt + out.text)
    n = len(out.token_ids)
    line = f"[{n} tokens in {dt:.2f} s, {n / dt:.1f} tok/s, finish_reason={out.finish_reason}"
    if out.spec_cycles:
        line += f", accept length {out.accept_length:.2f} over {out.spec_cycles} cycles"
    print(line + "]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a continuation of one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed-request", type=int, default=None, help="per-request sampling seed")
    add_cli_args(gen)
    gen.set_defaults(func=_generate)

    for module, name in (("specserve.server.api", "serve"), ("specserve.doctor", "doctor"),
                         ("specserve.train.cli", "train-eagle3")):
        _register(module, name, sub)
    bench = sub.add_parser("bench", help="benchmarks: latency (offline) | serve (HTTP load)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for module, name in (("specserve.bench.latency", "latency"),
                         ("specserve.bench.serving", "serve")):
        _register(module, name, bench_sub)
    return parser


def _register(module: str, name: str, subparsers: argparse._SubParsersAction) -> None:
    """Add a module's sub-commands. A command whose optional dependency is missing (the
    server's FastAPI stack on a bare GPU box, say) still parses and says what to install."""
    import importlib

    try:
        importlib.import_module(module).register(subparsers)
    except ImportError as exc:
        if not (exc.name or "").split(".")[0] or (exc.name or "").startswith("specserve"):
            raise
        stub = subparsers.add_parser(name, help=f"(unavailable: {exc.name} is not installed)")
        stub.add_argument("rest", nargs=argparse.REMAINDER)

        def unavailable(_args: argparse.Namespace, missing: str = exc.name or "?") -> int:
            raise ValueError(f"this command needs the Python package {missing!r}: "
                             f"pip install 'specserve[test]' or pip install {missing}")

        stub.set_defaults(func=unavailable)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
