"""Greedy speculative vs plain output in a low-precision dtype: match rate and divergence causes.

In bf16, kernels of different shapes (a decode step vs a tree-verify forward) round
differently, so a near-tie between the top two logits can flip. For every prompt whose
speculative output differs from the plain one, this reports the position and the plain run's
top-1/top-2 logit margin there (recomputed by a prefill of the common prefix), so a reader can
check that each divergence is a near-tie and not a bug.

    python scripts/spec_match_rate.py --model DIR --draft DIR [--dtype bfloat16] [--num 32]
        [--exact | --exact-attention] [--load-format dummy --draft dummy]   (random weights, e.g. llama-3.1-8b)

It also compares the plain batched run with each prompt run alone (batch 1): "bs1" in the
report. With --exact every engine runs in exact mode (EngineConfig.exact), where all of these
are meant to be identical; with --exact-attention only the attention kernels are invariant
(which share of the default mode's divergences attention makes).
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from specserve.config import CacheConfig
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--configs", default="3x1x0,3x4x16", help="steps x topk x tokens, comma list")
    ap.add_argument("--json-out", default="")
    ap.add_argument("--exact", action="store_true", help="every engine in exact mode")
    ap.add_argument("--exact-attention", action="store_true",
                    help="every engine with batch-invariant attention only (GEMMs as default)")
    args = ap.parse_args()
    mode = dict(dtype=args.dtype, load_format=args.load_format, exact=args.exact,
                exact_attention=args.exact_attention)

    rng = random.Random(0)
    # the plain engine stays up beside each speculative one (divergence margins): both KV
    # pools hold this run's requests and no more, so the graphs find the memory they need
    page = CacheConfig().page_size
    num_pages = args.num * -(-(128 + args.max_tokens + 64) // page)
    llm = LLM(args.model, **mode, num_pages=num_pages)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(8, 128))]
               for _ in range(args.num)]
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    plain = [o.token_ids for o in llm.generate(prompts, sp)]
    runner = llm.engine.runner
    alone = [llm.generate([p], sp)[0].token_ids for p in prompts]
    bs1 = sum(a == b for a, b in zip(plain, alone))
    report = {"dtype": args.dtype, "exact": args.exact, "exact_attention": args.exact_attention,
              "prompts": args.num, "configs": {},
              "bs1": {"match_rate": bs1 / args.num}}
    print(f"exact={args.exact} exact_attention={args.exact_attention} plain batch {args.num} vs batch 1: {bs1}/{args.num} identical")
    for cfg in args.configs.split(","):
        steps, topk, tokens = (int(x) for x in cfg.split("x"))
        spec = LLM(args.model, **mode, num_pages=num_pages,  # this run's requests: the
                   # rest of the memory is the CUDA graphs' (a tree's at every batch bucket)
                   speculative_config=dict(algorithm="eagle3", draft_model=args.draft,
                                    num_steps=steps, topk=topk, num_draft_tokens=tokens))
        outs = spec.generate(prompts, sp)
        divergences = []
        for p, a, b in zip(prompts, plain, outs):
            if a == b.token_ids:
                continue
            i = next(j for j, (x, y) in enumerate(zip(a, b.token_ids)) if x != y)
            logits = _last_logits(runner, p + a[:i])
            top = logits.topk(2).values.tolist()
            divergences.append({"position": i, "plain": a[i], "spec": b.token_ids[i],
                                "top1_minus_top2": top[0] - top[1],
                                "relative_margin": (top[0] - top[1]) / max(abs(top[0]), 1e-6)})
        matched = args.num - len(divergences)
        al = sum(o.spec_accepted_tokens + o.spec_cycles for o in outs) / max(
            sum(o.spec_cycles for o in outs), 1)
        report["configs"][cfg] = {"match_rate": matched / args.num, "accept_length": al,
                                  "divergences": divergences}
        print(f"{cfg}: {matched}/{args.num} identical, AL {al:.2f}; divergence margins "
              f"{[round(d['top1_minus_top2'], 4) for d in divergences]}")
        spec.close()
        del spec
        torch.cuda.empty_cache()
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(report, fh, indent=2)


@torch.inference_mode()
def _last_logits(runner, ids: list[int]) -> torch.Tensor:
    """Logits after `ids` from a fresh eager prefill through spare pages."""
    from specserve.worker.forward_batch import build_attention_metadata

    ps = runner.page_size
    pages = list(range(-(-len(ids) // ps)))  # pages 0..: the engine is idle here
    md = build_attention_metadata([len(ids)], [len(ids)], [pages], ps, runner.device)
    hidden = runner.forward(runner.tensor(ids), runner.tensor(list(range(len(ids)))), md)
    return runner.compute_logits(hidden[-1:])[0].float()


if __name__ == "__main__":
    main()
