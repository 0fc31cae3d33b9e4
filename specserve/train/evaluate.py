"""`eval-accept`: how well a draft head predicts its target, measured by the engine itself.

Prompts are the first `prompt_tokens` tokens of each held-out file, or the chat prompts of
held-out .jsonl conversations. For every speculation
config (steps/topk/tokens) and temperature the engine generates `max_tokens` per prompt and we
report the accept length (tokens emitted per draft-verify cycle, bonus included, pooled over
all cycles) and the acceptance rate per draft position (cycles that accepted >= d+1 drafts /
cycles). At temperature 0 it also checks losslessness: speculative output == plain output.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from dataclasses import asdict

import torch
from tqdm import tqdm

from specserve.train.config import EvalConfig, parse_specs, parse_temperatures


def load_prompts(files: list[str], tokenizer, prompt_tokens: int, num_prompts: int
                 ) -> list[list[int]]:
    """The first prompt_tokens tokens of each file long enough, in the order given. A .jsonl
    file of {"messages": [...]} lines gives one chat prompt a line instead: the conversation
    before its first assistant turn, through the chat template (whatever its length)."""
    prompts = []
    for file in files:
        if file.endswith(".jsonl"):
            prompts += _chat_prompts(file, tokenizer)[:num_prompts - len(prompts)]
        else:
            with open(file, encoding="utf-8", errors="replace") as fh:
                ids = tokenizer.encode(fh.read())
            if len(ids) >= prompt_tokens:
                prompts.append(ids[:prompt_tokens])
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise ValueError(f"no file among {len(files)} has {prompt_tokens} tokens: lower "
                         "--prompt-tokens or pass longer files")
    return prompts


def _chat_prompts(file: str, tokenizer) -> list[list[int]]:
    prompts = []
    with open(file, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            messages = json.loads(line).get("messages")
            if not isinstance(messages, list):
                raise ValueError(f"{file}:{lineno}: eval-accept reads {{\"messages\": [...]}} "
                                 "lines from .jsonl files")
            first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"),
                         len(messages))
            if first == 0:
                raise ValueError(f"{file}:{lineno}: the conversation opens with an assistant "
                                 "turn: there is no prompt before it")
            prompts.append(tokenizer.apply_chat_template(messages[:first]))
    return prompts


def _release_memory() -> None:
    """Free the last engine's KV pool before the next one sizes itself from free memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def evaluate_accept(cfg: EvalConfig) -> dict:
    """Run every config x temperature on the hold-out prompts; return the results dict."""
    from specserve import defaults
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams
    from specserve.train.data import expand_paths

    model = cfg.model or defaults.default_model_path()
    draft = cfg.draft or (defaults.default_draft_path() if not cfg.model else "")
    if not draft:
        raise ValueError("--draft DIR (an EAGLE-3 head for --model) is required")
    temps = parse_temperatures(cfg.temperatures)
    shapes = parse_specs(cfg.specs)
    engine = dict(device=cfg.device, dtype=cfg.dtype, seed=cfg.seed,
                  enforce_eager=cfg.enforce_eager,
                  cache=dict(gpu_memory_utilization=cfg.gpu_memory_utilization))
    _release_memory()
    plain = LLM(model, **engine)
    prompts = load_prompts(expand_paths(cfg.files), plain.tokenizer, cfg.prompt_tokens,
                           cfg.num_prompts)

    def params(temp: float) -> list[SamplingParams]:
        return [SamplingParams(temperature=temp, max_tokens=cfg.max_tokens, ignore_eos=True,
                               seed=cfg.seed + i) for i in range(len(prompts))]

    bar = tqdm(total=1 + len(shapes) * len(temps), desc="eval-accept", unit="pass",
               disable=not cfg.progress)
    bar.set_postfix_str(f"plain greedy, {len(prompts)} prompts")
    t0 = time.perf_counter()
    reference = [o.token_ids for o in plain.generate(prompts, params(0.0))]
    plain_s = time.perf_counter() - t0
    bar.update(1)
    del plain
    _release_memory()
    rows = []
    for shape in shapes:
        llm = LLM(model, speculative_config=shape.spec(draft), **engine)
        for temp in temps:
            bar.set_postfix_str(f"{shape.label} temperature {temp:g}")
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params(temp))
            seconds = time.perf_counter() - t0
            cycles = sum(o.spec_cycles for o in outs)
            accepted = sum(o.spec_accepted_tokens for o in outs)
            per_pos = [sum(o.spec_accepted_per_pos[d] for o in outs
                           if d < len(o.spec_accepted_per_pos)) / max(cycles, 1)
                       for d in range(shape.steps)]
            row = dict(spec=shape.label, **asdict(shape), temperature=temp,
                       accept_length=(accepted + cycles) / max(cycles, 1),
                       accept_per_pos=per_pos, cycles=cycles,
                       generated=sum(len(o.token_ids) for o in outs), seconds=seconds)
            if temp == 0:
                row["greedy_match"] = sum(o.token_ids == r for o, r in zip(outs, reference))
            rows.append(row)
            bar.update(1)
            if cfg.progress:
                bar.write(f"{shape.label} temperature {temp:g}: accept length "
                          f"{row['accept_length']:.2f}", file=sys.stderr)
        del llm
        _release_memory()
    bar.close()
    result = dict(model=model, draft=draft, num_prompts=len(prompts),
                  prompt_tokens=cfg.prompt_tokens, max_tokens=cfg.max_tokens,
                  plain_greedy_seconds=plain_s, results=rows)
    if cfg.out:
        with open(cfg.out, "w") as fh:
            json.dump(result, fh, indent=2)
    return result


def format_table(result: dict) -> str:
    """A markdown table of the results."""
    lines = ["| config | temp | accept length | acceptance per position | greedy == plain |",
             "| --- | --- | --- | --- | --- |"]
    n = result["num_prompts"]
    for r in result["results"]:
        per_pos = " ".join(f"{p:.2f}" for p in r["accept_per_pos"])
        match = f"{r['greedy_match']}/{n}" if "greedy_match" in r else "-"
        lines.append(f"| {r['spec']} | {r['temperature']:g} | {r['accept_length']:.2f} | "
                     f"{per_pos} | {match} |")
    return "\n".join(lines)
