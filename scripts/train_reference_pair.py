#!/usr/bin/env python3
"""Recipe: a Python-code target model and its EAGLE-3 head, from the machine's own sources.

Stages (each timed; results.json and report.md are rewritten after every stage):
  1. collect   *.py files of the standard library and the installed packages; a FIXED hold-out
               set (sha1 of the path relative to its root, mod 1000 < --holdout-permille) is
               listed in holdout.txt and never trained on (nor is any file with the same text)
  2. tokenizer byte-level BPE (tokenizers), BOS prepended, a chat-free template (the messages'
               contents, concatenated), shared by every pair
  3. target    a Llama-architecture model (transformers LlamaForCausalLM), bf16 autocast on a
               GPU, trained for a time budget on the packed token stream; saved in bf16
  4. head      `train-eagle3` on the target (specserve.train.eagle3), saved in bf16: the
               training files plus rows whose continuation the target wrote itself (greedy)
  5. eval      `eval-accept` on the hold-out files (specserve.train.evaluate)
Presets size the pairs: `tiny` is the bundled default model (~25 MB), `reference` the largest
that trains well in minutes on one H200, `toy` runs in seconds on a CPU (for tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import site
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.train.config import EvalConfig, TrainConfig  # noqa: E402
from specserve.train.eagle3 import train_eagle3  # noqa: E402
from specserve.train.evaluate import evaluate_accept, format_table  # noqa: E402

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>"]
CHAT_FREE_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}" \
                     "{% endfor %}"


@dataclass(frozen=True)
class Preset:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    inter: int
    seq_len: int  # target training rows
    batch: int
    lr: float
    target_seconds: float
    head_seq_len: int
    head_batch: int
    head_lr: float
    head_seconds: float
    draft_vocab: int
    head_regen: int  # rows whose continuation the target writes itself (greedy), added to data


PRESETS = {
    "toy": Preset(64, 4, 4, 2, 192, 128, 8, 3e-3, 4, 64, 4, 3e-3, 4, 256, 8),
    "tiny": Preset(256, 8, 4, 2, 768, 1024, 64, 2e-3, 100, 256, 64, 2e-3, 90, 4096, 2000),
    "reference": Preset(512, 12, 8, 4, 1536, 1024, 64, 1.2e-3, 150, 256, 64, 1e-3, 90, 4096,
                        2000),
}


# -- 1. collect ----------------------------------------------------------------------------------


def source_roots() -> list[Path]:
    paths = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
             sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    roots: list[Path] = []
    for p in paths:
        r = Path(p).resolve()
        if r.is_dir() and r not in roots:
            roots.append(r)
    return roots


def _rel(path: Path, roots: list[Path]) -> str:
    """The path relative to the deepest root holding it (site-packages inside stdlib...)."""
    best = max((r for r in roots if path.is_relative_to(r)), key=lambda r: len(r.parts))
    return path.relative_to(best).as_posix()


def collect(roots: list[Path], permille: int, max_bytes: int
            ) -> tuple[list[Path], list[tuple[str, Path]]]:
    """(training files up to max_bytes, hold-out (relative path, file)), deterministic."""
    seen: dict[Path, str] = {}
    for root in roots:
        for path in root.rglob("*.py"):
            real = path.resolve()
            if real.is_file() and real not in seen and 200 <= real.stat().st_size <= 200_000:
                seen[real] = _rel(path, roots)
    keyed = sorted((hashlib.sha1(rel.encode()).hexdigest(), rel, p) for p, rel in seen.items())
    holdout = [(rel, p) for h, rel, p in keyed if int(h, 16) % 1000 < permille]  # hash order
    held_text = {hashlib.sha1(p.read_bytes()).digest() for _, p in holdout}
    train, total, texts = [], 0, set(held_text)
    for h, _, p in keyed:
        if int(h, 16) % 1000 < permille:
            continue
        data = p.read_bytes()
        digest = hashlib.sha1(data).digest()
        if digest in texts:  # a copy of a hold-out file, or of a file already taken
            continue
        texts.add(digest)
        train.append(p)
        total += len(data)
        if total >= max_bytes:
            break
    return train, holdout


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


# -- 2. tokenizer --------------------------------------------------------------------------------


def train_tokenizer(files: list[Path], vocab_size: int, max_bytes: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    def texts():
        total = 0
        for p in files:
            text = _read(p)
            total += len(text)
            yield text
            if total >= max_bytes:
                return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts(), trainer=trainer)
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>",
                                   eos_token="<|eos|>", pad_token="<|eos|>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_FREE_TEMPLATE
    fast.save_pretrained(out)
    return fast


def token_stream(tok, files: list[Path]) -> torch.Tensor:
    """Every file as <|bos|> text <|eos|>, concatenated: [N] int32."""
    ids: list[int] = []
    for a in range(0, len(files), 512):
        batch = [_read(p) for p in files[a:a + 512]]
        for row in tok(batch, add_special_tokens=True)["input_ids"]:
            ids += row
            ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.int32)


# -- 3. target -----------------------------------------------------------------------------------


def train_target(p: Preset, stream: torch.Tensor, tok, out: Path, device: torch.device,
                 seconds: float, seed: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=p.hidden, intermediate_size=p.inter,
                      num_hidden_layers=p.layers, num_attention_heads=p.heads,
                      num_key_value_heads=p.kv_heads, max_position_embeddings=2048,
                      rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to(device).train()
    decay = [q for q in model.parameters() if q.ndim >= 2]
    rest = [q for q in model.parameters() if q.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=p.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    data = stream.to(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    amp = device.type == "cuda"
    start, step, losses = time.perf_counter(), 0, []
    while (progress := (time.perf_counter() - start) / seconds) < 1.0:
        lr_scale = min(1.0, progress / 0.02) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
        for group in opt.param_groups:
            group["lr"] = p.lr * lr_scale
        offsets = torch.randint(0, data.numel() - p.seq_len, (p.batch, 1), generator=gen,
                                device=device)
        x = data[offsets + torch.arange(p.seq_len, device=device)].long()  # [B, T]
        with torch.autocast(device.type, torch.bfloat16, enabled=amp):
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0 or step == 1:
            losses.append((step, round(loss.item(), 4)))
            print(f"  target step {step} loss {losses[-1][1]:.3f}", flush=True)
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    params = sum(q.numel() for q in model.parameters())
    return dict(steps=step, tokens=step * p.batch * p.seq_len, params=params,
                final_loss=losses[-1][1] if losses else None, loss_curve=losses)


# -- the recipe ----------------------------------------------------------------------------------


def _environment() -> dict:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    sha = os.environ.get("SPECSERVE_GIT_SHA", "") or sha  # a copied tree names its commit
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"
    return dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), git_sha=sha or "unknown",
                gpu=gpu, torch=torch.__version__, python=sys.version.split()[0])


def _dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def run_pair(name: str, p: Preset, args: argparse.Namespace, ctx: dict) -> dict:
    out = Path(args.out) / name
    res: dict = dict(preset=dataclasses.asdict(p))
    t0 = time.perf_counter()
    res["target"] = train_target(p, ctx["stream"], ctx["tok"], out / "target", ctx["device"],
                                 p.target_seconds * args.time_scale, args.seed)
    res["target_seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    head = train_eagle3(TrainConfig(
        target=str(out / "target"), out=str(out / "head"), data=(f"@{ctx['head_list']}",),
        draft_vocab_size=p.draft_vocab, seq_len=p.head_seq_len, batch_size=p.head_batch,
        epochs=1000, time_budget=p.head_seconds * args.time_scale, lr=p.head_lr,
        device=args.device, save_every=0, seed=args.seed, progress=args.progress,
        regenerate=p.head_regen > 0, regen_max_samples=p.head_regen, regen_temperature=0.0,
        regen_prompt_tokens=p.head_seq_len // 4))
    for extra in ("trainer_state.pt", "regenerated.pt"):  # keep only the export
        (out / "head" / extra).unlink(missing_ok=True)
    res["head"] = dict(steps=head.steps, final_loss=head.losses[-1],
                       final_top1_per_step=[round(a, 3) for a in head.accuracy[-1]])
    res["head_seconds"] = time.perf_counter() - t0
    res["size_mb"] = dict(target=_dir_mb(out / "target"), head=_dir_mb(out / "head"))
    if not args.eval:  # the pair is all the caller wants (a sweep of its own follows)
        return res
    t0 = time.perf_counter()
    try:
        res["eval"] = evaluate_pair(out, args, ctx["holdout"])
    except Exception as exc:  # keep the trained pair and the timings
        res["eval_error"] = repr(exc)
        print(f"  eval failed: {exc!r}", flush=True)
    res["eval_seconds"] = time.perf_counter() - t0
    return res


def evaluate_pair(out: Path, args: argparse.Namespace, holdout: list[Path]) -> dict:
    """eval-accept on the GPU; on the CPU (fewer prompts) if the GPU run fails."""
    cfg = EvalConfig(model=str(out / "target"), draft=str(out / "head"),
                     files=tuple(str(f) for f in holdout), num_prompts=args.eval_prompts,
                     prompt_tokens=args.eval_prompt_tokens, max_tokens=args.eval_max_tokens,
                     device=args.device, dtype="float32", enforce_eager=True,
                     out=str(out / "eval.json"))
    try:
        result = evaluate_accept(cfg)
    except Exception as exc:  # the recipe must still finish and report
        if args.device == "cpu":
            raise
        print(f"  eval on {args.device} failed ({exc!r}); repeating on the CPU", flush=True)
        result = evaluate_accept(dataclasses.replace(
            cfg, device="cpu", num_prompts=max(4, args.eval_prompts // 4)))
        result["note"] = f"GPU evaluation failed ({exc!r}); evaluated on the CPU"
    print(format_table(result), flush=True)
    return result


def write_report(out: Path, results: dict) -> None:
    with open(out / "results.json", "w") as fh:
        json.dump(results, fh, indent=2)
    lines = [f"# Reference pairs ({results['env']['date']})", "",
             "```", json.dumps(results["env"]), json.dumps(results["stages"]), "```"]
    for name, res in results["pairs"].items():
        lines += ["", f"## {name}", "", "```", json.dumps({k: v for k, v in res.items()
                                                          if k != "eval"}), "```"]
        if "eval" in res:
            lines += ["", format_table(res["eval"])]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--pairs", default="tiny,reference", help="presets to build, in order")
    ap.add_argument("--source-dirs", nargs="*", default=None,
                    help="roots to collect *.py from (default: stdlib + site-packages)")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--max-corpus-mb", type=float, default=120.0)
    ap.add_argument("--tokenizer-corpus-mb", type=float, default=24.0)
    ap.add_argument("--head-corpus-mb", type=float, default=24.0)
    ap.add_argument("--holdout-permille", type=int, default=10)
    ap.add_argument("--time-scale", type=float, default=1.0, help="scales every time budget")
    ap.add_argument("--eval", action=argparse.BooleanOptionalAction, default=True,
                    help="run stage 5 (--no-eval: stop once the pair is saved)")
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--eval-prompt-tokens", type=int, default=128)
    ap.add_argument("--eval-max-tokens", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=False)
    args = ap.parse_args(argv)
    names = args.pairs.split(",")
    if unknown := [n for n in names if n not in PRESETS]:
        raise ValueError(f"unknown presets {unknown}; choose from {sorted(PRESETS)}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = dict(env=_environment(), args=vars(args), stages={}, pairs={})
    t0 = time.perf_counter()
    roots = [Path(d).resolve() for d in args.source_dirs] if args.source_dirs else source_roots()
    train, holdout = collect(roots, args.holdout_permille, int(args.max_corpus_mb * 1e6))
    (out / "holdout.txt").write_text("".join(f"{rel}\n" for rel, _ in holdout))
    mb = 1e6
    head_files, total = [], 0
    for f in train:  # the head trains on a prefix of the (hash-ordered) training files
        head_files.append(str(f))
        total += f.stat().st_size
        if total >= args.head_corpus_mb * mb:
            break
    (out / "head_files.txt").write_text("".join(f"{f}\n" for f in head_files))
    results["corpus"] = dict(roots=[str(r) for r in roots], train_files=len(train),
                             train_mb=sum(f.stat().st_size for f in train) / mb,
                             holdout_files=len(holdout), head_files=len(head_files))
    results["stages"]["collect_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    tok = train_tokenizer(train, args.vocab_size, int(args.tokenizer_corpus_mb * mb),
                          out / "tokenizer")
    results["stages"]["tokenizer_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    stream = token_stream(tok, train)
    results["corpus"]["train_tokens"] = stream.numel()
    results["stages"]["tokenize_s"] = time.perf_counter() - t0
    print(json.dumps(results["corpus"]), json.dumps(results["stages"]), flush=True)
    ctx = dict(tok=tok, stream=stream, device=torch.device(args.device),
               head_list=str(out / "head_files.txt"), holdout=[p for _, p in holdout])
    for name in names:
        print(f"== pair {name}", flush=True)
        results["pairs"][name] = run_pair(name, PRESETS[name], args, ctx)
        write_report(out, results)
    write_report(out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
