"""Model-free drafters against plain decoding on a "copy" workload, in one invocation.

Each request's prompt is a source file of this repository followed by an instruction to write
it again with one change, so a good continuation mostly copies the prompt: the case n-gram
prompt lookup and suffix decoding are for. For every method (plain, ngram, suffix) one engine
runs the same batch of greedy requests (a warm-up batch first); reported per method and batch
size: output tok/s, mean accept length (tokens per cycle: 1 + accepted / cycles), drafts
accepted per position, and whether the tokens equal plain decoding's.

    python scripts/bench_drafters.py --model tiny-code --device cpu        # the bundled model
    python scripts/bench_drafters.py --model default --device cpu          # SmolLM2-135M GGUF
    python scripts/bench_drafters.py --model llama-3.1-8b --load-format dummy \
        --batch-sizes 1,16 --synthetic-accept-rate 0.6                     # GPU, cost only

Random weights (--load-format dummy) copy nothing (and a preset without a tokenizer gets
token-id prompts of the same shape: a random span, then its start again), so there --synthetic-accept-rate A forces
random acceptance around A (cost only, the tokens are not the target's): the rows then
measure what each drafter's own work costs per cycle (n-gram: a device gather over the
context; suffix: the host tree and its copy) at equal acceptance.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specserve import defaults  # noqa: E402
from specserve.bench.stats import parse_positive_list  # noqa: E402
from specserve.llm import LLM  # noqa: E402
from specserve.sampling_params import SamplingParams  # noqa: E402

SOURCES = ["specserve/speculative/tree.py", "specserve/speculative/cycle.py",
           "specserve/speculative/verify.py", "specserve/engine/scheduler.py",
           "specserve/worker/step_input.py", "specserve/speculative/worker.py"]
RENAMES = [("bs", "batch_size"), ("tokens", "token_ids"), ("mask", "attn_mask"),
           ("req", "request"), ("rows", "batch_rows"), ("rid", "request_id")]


def synthetic_prompts(n: int, max_prompt_tokens: int, vocab: int) -> list[list[int]]:
    """Without a tokenizer (random-weight presets): ids with the copy workload's shape, a
    random span and then its start again."""
    rng = random.Random(0)
    out = []
    for _ in range(n):
        span = [rng.randrange(3, vocab) for _ in range(max_prompt_tokens * 4 // 5)]
        out.append(span + span[: max_prompt_tokens - len(span)])
    return out


def copy_prompts(tokenizer, n: int, max_prompt_tokens: int, chat: bool) -> list[list[int]]:
    """n prompts: a source file (its head, cut to max_prompt_tokens) and the instruction."""
    prompts = []
    for i in range(n):
        path, (old, new) = SOURCES[i % len(SOURCES)], RENAMES[i % len(RENAMES)]
        code = tokenizer.decode(tokenizer.encode((ROOT / path).read_text(),
                                                 add_special_tokens=False)[:max_prompt_tokens])
        ask = (f"Rewrite the following Python code with the name `{old}` renamed to `{new}`. "
               "Output only the code.")
        if chat:
            prompts.append(tokenizer.apply_chat_template(
                [{"role": "user", "content": f"{ask}\n\n```python\n{code}\n```"}]))
        else:  # a base code model: the instruction as a comment, then the start of the copy
            text = f"{code}\n\n# {ask}\n# Rewritten:\n{code.splitlines()[0]}\n"
            prompts.append(tokenizer.encode(text))
    return prompts


def spec_config(method: str, args: argparse.Namespace) -> dict | None:
    if method == "plain":
        return None
    spec: dict = {"method": method, "num_speculative_tokens": args.num_steps}
    if method == "ngram":
        spec.update(prompt_lookup_max=args.prompt_lookup_max, prompt_lookup_min=1)
    if method == "suffix":
        spec.update(topk=args.suffix_topk, num_draft_tokens=args.suffix_num_draft_tokens)
    if args.synthetic_accept_rate:
        spec["synthetic_accept_rate"] = args.synthetic_accept_rate
    return spec


def time_host_work(proposer) -> dict:
    """Wrap a host-drafting proposer's per-step host calls with timers: {name: [s, calls]}."""
    spent: dict = {}
    for name in ("host_states", "observe"):
        fn, spent[name] = getattr(proposer, name), [0.0, 0]

        def timed(*a, _fn=fn, _acc=spent[name]):
            t0 = time.perf_counter()
            out = _fn(*a)
            _acc[0] += time.perf_counter() - t0
            _acc[1] += 1
            return out

        setattr(proposer, name, timed)
    return spent


def run(llm: LLM, prompts: list[list[int]], max_tokens: int, host: dict | None = None) -> dict:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for acc in (host or {}).values():
        acc[:] = [0.0, 0]
    drafter = llm.engine.drafter
    before = (drafter.counters.num_drafts, drafter.counters.num_accepted_tokens,
              list(drafter.counters.accepted_per_pos)) if drafter else (0, 0, [])
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    row = {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens,
           "outputs": [o.token_ids for o in outs]}
    if drafter is not None:
        c = drafter.counters
        cycles, accepted = c.num_drafts - before[0], c.num_accepted_tokens - before[1]
        row["accept_length"] = 1 + accepted / max(cycles, 1)
        row["per_position"] = [(a - b) / max(cycles, 1)
                               for a, b in zip(c.accepted_per_pos, before[2] + [0] * 99)]
    for name, (sec, calls) in (host or {}).items():  # ms per call (one call per step)
        row[f"{name}_ms"] = 1e3 * sec / max(calls, 1)
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-code",
                   help="tiny-code | default (SmolLM2-135M GGUF) | a path or preset")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--methods", default="plain,ngram,suffix")
    p.add_argument("--batch-sizes", default="1",
                   type=lambda t: parse_positive_list(t, int, "--batch-sizes"))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=600)
    p.add_argument("--num-steps", type=int, default=4, help="draft depth (all methods)")
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--suffix-topk", type=int, default=2)
    p.add_argument("--suffix-num-draft-tokens", type=int, default=8)
    p.add_argument("--synthetic-accept-rate", type=float, default=0.0,
                   help="COST ONLY (dummy weights): random acceptance around this rate")
    p.add_argument("--chat", choices=("auto", "on", "off"), default="auto",
                   help="wrap prompts in the chat template (auto: when the model has one)")
    p.add_argument("--out", type=Path, help="write the rows (without outputs) as JSON")
    args = p.parse_args(argv)
    named = {"tiny-code": defaults.tiny_code_path, "default": defaults.default_model_path}
    model = named[args.model]() if args.model in named else args.model
    rows = []
    plain_out: dict[int, list] = {}
    for method in args.methods.split(","):
        llm = LLM(model, load_format=args.load_format, device=args.device, dtype=args.dtype,
                  speculative_config=spec_config(method, args))
        host = None
        if llm.engine.drafter is not None and llm.engine.drafter.host_drafts:
            host = time_host_work(llm.engine.drafter.proposer)
        tok = llm.engine.tokenizer
        chat = args.chat == "on" or (args.chat == "auto" and tok is not None
                                     and bool(tok.hf.chat_template))
        for bs in args.batch_sizes:
            if tok is None:
                prompts = synthetic_prompts(bs, args.max_prompt_tokens,
                                            llm.engine.model_config.vocab_size)
            else:
                prompts = copy_prompts(tok, bs, args.max_prompt_tokens, chat)
            run(llm, [q[: len(q) // 2] for q in prompts], 8)  # warm-up: other prefixes
            row = {"method": method, "batch_size": bs,
                   **run(llm, prompts, args.max_tokens, host)}
            if method == "plain":
                plain_out[bs] = row["outputs"]
            elif bs in plain_out and not args.synthetic_accept_rate:
                row["same_as_plain"] = row["outputs"] == plain_out[bs]
            rows.append(row)
            print(f"{method:7s} bs {bs:3d}  {row['tok_s']:8.1f} tok/s  accept length "
                  f"{row.get('accept_length', 1.0):.2f}  same as plain "
                  f"{row.get('same_as_plain', '-')}"
                  + "".join(f"  {k} {v:.3f}" for k, v in row.items() if k.endswith("_ms")),
                  flush=True)
        llm.close()
    report = {"model": args.model, "device": args.device, "args": vars(args) | {"out": None},
              "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows]}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=str))
    return report


if __name__ == "__main__":
    main()
