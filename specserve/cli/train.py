"""`specserve train-eagle3` and `specserve eval-accept` (flags from specserve/train/config.py)."""

from __future__ import annotations

import argparse
import os

from specserve.config_flags import add_cli_args, config_from_cli_args
from specserve.train.config import EvalConfig, TrainConfig


def register(sub: argparse._SubParsersAction) -> None:
    train = sub.add_parser(
        "train-eagle3",
        help="train an EAGLE-3 draft head for a target model",
        description="Train an EAGLE-3 head (training-time test, 7 unrolled steps) and export it "
        "in the public format. Stops at --max-steps, --time-budget or the last epoch; Ctrl-C "
        "saves the head and trainer state after the current step (--resume continues).",
    )
    train.add_argument(
        "--data",
        nargs="+",
        default=[],
        metavar="PATH",
        help='text files, .jsonl ({"text"} or {"messages"}), directories, '
        "or @LIST (a file listing paths)",
    )
    add_cli_args(train, TrainConfig, skip=("data",))
    train.set_defaults(func=train_command)

    ev = sub.add_parser(
        "eval-accept",
        help="accept length of a draft head on held-out files",
        description="Accept length (mean and per position) for chain and tree speculation at "
        "several temperatures, and greedy speculative == plain output.",
    )
    ev.add_argument(
        "--files",
        nargs="+",
        default=[],
        metavar="PATH",
        help="held-out text files, directories or @LIST",
    )
    add_cli_args(ev, EvalConfig, skip=("files",))
    ev.set_defaults(func=eval_command)


def train_command(args: argparse.Namespace) -> int:
    cfg = config_from_cli_args(args, TrainConfig, data=tuple(args.data))
    cfg.validate()
    from specserve.train.eagle3 import train_eagle3

    result = train_eagle3(cfg)
    accs = result.accuracy[-1] if result.accuracy else []
    print(
        f"trained {result.steps} steps; head written to {result.out}; last loss "
        f"{result.losses[-1] if result.losses else float('nan'):.4f}, top-1 per step "
        + " ".join(f"{a:.2f}" for a in accs)
    )
    if result.interrupted:
        print(
            f"interrupted by Ctrl-C at step {result.steps}: head and trainer state saved; "
            "continue with the same command and --resume"
        )
        return 130
    return 0


def eval_command(args: argparse.Namespace) -> int:
    if not args.files:
        raise ValueError("--files needs the held-out files to draw prompts from")
    cfg = config_from_cli_args(args, EvalConfig, files=tuple(args.files))
    for flag, path in (("--model", cfg.model), ("--draft", cfg.draft)):
        if path and not os.path.isdir(path):
            raise ValueError(f"{flag} {path!r} is not a directory")
    from specserve.train.evaluate import evaluate_accept, format_table

    print(format_table(evaluate_accept(cfg)))
    return 0
