"""CLI commands `train-eagle3` and `eval-accept` (flags generated from the config fields)."""

from __future__ import annotations

import argparse
import dataclasses

from specserve.config import add_cli_args, config_from_cli_args
from specserve.train.eagle3 import TrainConfig
from specserve.train.evaluate import EvalConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser(
        "train-eagle3", help="train an EAGLE-3 draft head for a target model",
        description="Train an EAGLE-3 head (training-time test, 7 unrolled steps) and export it "
        "in the public format.")
    train.add_argument("--data", nargs="+", default=[], metavar="PATH",
                       help="text files, .jsonl ({\"text\"} or {\"messages\"}), directories, "
                       "or @LIST (a file listing paths)")
    add_cli_args(train, TrainConfig, skip=("data",))
    train.set_defaults(func=run)

    ev = subparsers.add_parser(
        "eval-accept", help="accept length of a draft head on held-out files",
        description="Accept length (mean and per position) for chain and tree speculation at "
        "several temperatures, and greedy speculative == plain output.")
    ev.add_argument("--files", nargs="+", default=[], metavar="PATH",
                    help="held-out text files, directories or @LIST")
    add_cli_args(ev, EvalConfig, skip=("files",))
    ev.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.command == "train-eagle3":
        from specserve.train.eagle3 import train_eagle3

        cfg = config_from_cli_args(args, TrainConfig)
        result = train_eagle3(dataclasses.replace(cfg, data=tuple(args.data)))
        accs = result.accuracy[-1] if result.accuracy else []
        print(f"trained {result.steps} steps; head written to {result.out}; last loss "
              f"{result.losses[-1] if result.losses else float('nan'):.4f}, top-1 per step "
              + " ".join(f"{a:.2f}" for a in accs))
        return 0
    from specserve.train.evaluate import evaluate_accept, format_table

    if not args.files:
        raise ValueError("--files needs the held-out files to draw prompts from")
    cfg = config_from_cli_args(args, EvalConfig)
    result = evaluate_accept(dataclasses.replace(cfg, files=tuple(args.files)))
    print(format_table(result))
    return 0
