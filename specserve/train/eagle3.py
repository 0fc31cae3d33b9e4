"""`train-eagle3`: train an EAGLE-3 head for a target with training-time test (TTT).

Per batch of token rows ids [B, T] (loss_mask [B, T]):
  1. the frozen target (transformers) gives features f = concat(h[low], h[mid], h[high])
     [B, T, 3Ht], h[i] = the residual stream entering decoder layer i, and teacher logits;
  2. index t (0 <= t < L = T - 1) pairs f_t with token t+1 and predicts token t+2;
  3. K unrolled steps: step 0 reads f_t; step i reads the previous step's output at the same
     index with token t+1+i and predicts token t+2+i (RoPE position t+i); see train/head.py;
  4. loss_i = soft cross-entropy against softmax(teacher at position t+1+i restricted to the
     draft vocabulary), over rows where the predicted token is a loss token and the teacher's
     argmax lies in the draft vocabulary; total = sum_i decay^i * loss_i.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specserve.models.loader import load_model_config
from specserve.tokenizer import load_hf_tokenizer
from specserve.train import data as D
from specserve.train.config import TrainConfig
from specserve.train.head import Eagle3TrainHead, draft_vocab_from_counts, export_head
from specserve.train.target import load_hf_target
from specserve.worker.device import resolve_device

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    out: str
    steps: int
    losses: list[float] = field(default_factory=list)  # weighted TTT loss per step
    accuracy: list[list[float]] = field(default_factory=list)  # per step: top-1 per TTT step
    interrupted: bool = False  # stopped by Ctrl-C (after saving)


class _StopOnInterrupt:
    """While training: the first Ctrl-C (SIGINT) asks the loop to finish its step, save and
    stop; a second one interrupts at once. Only in the main thread (signals go there)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> _StopOnInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log.warning("Ctrl-C: saving after this step (press again to stop without saving)")

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _shift(x: torch.Tensor, i: int) -> torch.Tensor:
    """x[:, i:] padded with zeros back to x's length along dim 1 (index t reads t + i)."""
    if i == 0:
        return x
    pad = torch.zeros_like(x[:, :i])
    return torch.cat([x[:, i:], pad], dim=1)


class Eagle3Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        on_gpu = self.device.type == "cuda"
        self.amp_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                          "auto": torch.bfloat16 if on_gpu else torch.float32}[cfg.dtype]
        self.target_cfg = load_model_config(cfg.target)
        self.tokenizer = load_hf_tokenizer(cfg.target)
        self.target = load_hf_target(cfg.target, self.amp_dtype).to(self.device)
        self.target.eval().requires_grad_(False)
        self.aux_ids = cfg.aux_ids(self.target_cfg.num_layers)
        self.head_cfg = cfg.head_config(self.target_cfg, self.aux_ids)
        torch.manual_seed(cfg.seed)  # the head's initial weights
        embed = self.target.get_input_embeddings().weight
        # the target's table, frozen and shared (no copy when the dtypes already agree)
        self.head = Eagle3TrainHead(self.head_cfg, self.target_cfg.hidden_size,
                                    embed.to(self.amp_dtype)).to(self.device)
        self.vocab_ready = False
        decay = [p for p in self.head.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.head.parameters() if p.ndim < 2]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(0.9, 0.95), fused=on_gpu)

    # -- data ------------------------------------------------------------------------------------
    def load_rows(self) -> list[D.Sample]:
        cfg = self.cfg
        records = D.read_records(cfg.data)
        samples: list[D.Sample] = []
        if not cfg.regenerate or cfg.regen_max_samples:  # the data as given
            samples = D.tokenize_records(self.tokenizer, records)
        if cfg.regenerate:  # plus (or instead) the target's own responses
            samples += self.regenerated(records)
        rows = D.windows(samples, cfg.seq_len)
        if len(rows) < cfg.batch_size:
            raise ValueError(f"the data makes {len(rows)} rows of up to {cfg.seq_len} tokens, "
                             f"fewer than --batch-size {cfg.batch_size}: add data or lower it")
        return rows

    def regenerated(self, records: list[D.Record]) -> list[D.Sample]:
        """The target's own responses, kept in OUT/regenerated.pt for --resume."""
        cfg = self.cfg
        cache = os.path.join(cfg.out, "regenerated.pt")
        if cfg.resume and os.path.isfile(cache):
            return [D.Sample(i, m) for i, m in torch.load(cache, weights_only=True)]
        from specserve.llm import LLM

        llm = LLM(cfg.target, device=str(self.device))
        samples = D.regenerate(records, llm, self.tokenizer, cfg.seq_len,
                               cfg.regen_prompt_tokens, cfg.regen_temperature, cfg.seed,
                               cfg.regen_max_samples)
        del llm
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        os.makedirs(cfg.out, exist_ok=True)
        torch.save([(s.input_ids, s.loss_mask) for s in samples], cache)
        return samples

    # -- one step --------------------------------------------------------------------------------
    @torch.no_grad()
    def features(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids [B, T] -> features [B, T, 3Ht], teacher probs over the draft vocabulary
        [B, T, Vd] (position j predicts token j+1), teacher-argmax-in-draft-vocab [B, T]."""
        out = self.target(input_ids=ids, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i] for i in self.aux_ids], dim=-1)
        logits = out.logits.float()
        in_draft = self.head.t2d[logits.argmax(-1)]
        probs = logits[..., self.head.draft_token_ids()].softmax(-1)
        return feats, probs, in_draft

    def loss(self, ids: torch.Tensor, loss_mask: torch.Tensor
             ) -> tuple[torch.Tensor, list[float]]:
        """Weighted TTT loss and top-1 accuracy per unrolled step, for one batch."""
        feats, teacher, in_draft = self.features(ids)
        ids1, teacher1 = ids[:, 1:], teacher[:, 1:]  # index t: token t+1, teacher at t+1
        target_ok = in_draft[:, 1:] & F.pad(loss_mask[:, 2:], (0, 1))  # token t+2 is trained
        g, cache = feats[:, :-1], None  # [B, L, 3Ht]
        total = torch.zeros((), device=ids.device)
        accs = []
        for i in range(self.cfg.ttt_steps):
            with torch.autocast(self.device.type, self.amp_dtype,
                                enabled=self.amp_dtype != torch.float32):
                g, cache = self.head.step(_shift(ids1, i), g, i, cache)
                logq = self.head.logits(g).log_softmax(-1)  # [B, L, Vd]
            valid = _shift(target_ok, i)
            p = _shift(teacher1, i)
            n = valid.sum().clamp(min=1)
            ce = -(p * logq).sum(-1)  # [B, L]
            total = total + self.cfg.step_decay**i * (ce * valid).sum() / n
            hit = (logq.argmax(-1) == p.argmax(-1)) & valid
            accs.append(hit.sum() / n)
        return total, torch.stack(accs).tolist()

    def lr_at(self, progress: float) -> float:
        """Linear warmup, then cosine down to a tenth, over training progress in [0, 1]."""
        cfg = self.cfg
        if progress < cfg.warmup:
            return cfg.lr * max(progress / cfg.warmup, 1e-3)
        frac = (progress - cfg.warmup) / max(1 - cfg.warmup, 1e-9)
        return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(frac, 1.0))))

    # -- the loop --------------------------------------------------------------------------------
    def init_draft_vocab(self, rows: list[D.Sample]) -> None:
        """The most frequent loss-token ids of the data become the draft vocabulary."""
        counts = D.token_counts(rows, self.target_cfg.vocab_size)
        d2t, t2d = draft_vocab_from_counts(counts, self.head_cfg.draft_vocab_size)
        self.head.set_draft_vocab(d2t.to(self.device), t2d.to(self.device))
        self.vocab_ready = True

    def train(self, rows: list[D.Sample] | None = None) -> TrainResult:
        cfg = self.cfg
        os.makedirs(cfg.out, exist_ok=True)
        rows = self.load_rows() if rows is None else rows
        per_epoch = len(rows) // cfg.batch_size
        total = cfg.max_steps or cfg.epochs * per_epoch
        step = 0
        state_path = os.path.join(cfg.out, "trainer_state.pt")
        if cfg.resume and os.path.isfile(state_path):
            step = self.restore(state_path)
            log.info("resumed from %s at step %d", state_path, step)
        elif not self.vocab_ready:
            self.init_draft_vocab(rows)
        result = TrainResult(cfg.out, step)
        bar = tqdm(total=total, initial=step, desc="train-eagle3", disable=not cfg.progress)
        start = time.perf_counter()
        with _StopOnInterrupt() as stop:
            step = self._loop(rows, step, total, start, result, bar, stop)
        bar.close()
        result.steps = step
        result.interrupted = stop.requested
        self.save(step)
        return result

    def _loop(self, rows: list[D.Sample], step: int, total: int, start: float,
              result: TrainResult, bar: tqdm, stop: _StopOnInterrupt) -> int:
        """Steps until `total`, the time budget, or a Ctrl-C; returns the step reached."""
        cfg = self.cfg
        per_epoch = len(rows) // cfg.batch_size
        while step < total:
            epoch, skip = divmod(step, per_epoch)
            for ids, mask in D.batches(rows, cfg.batch_size, cfg.seed, epoch, pad_id=0):
                if skip:  # resume: batches this epoch already consumed
                    skip -= 1
                    continue
                elapsed = time.perf_counter() - start
                progress = step / total
                if cfg.time_budget:
                    progress = max(progress, elapsed / cfg.time_budget)
                if progress >= 1.0:
                    total = step
                    break
                for group in self.opt.param_groups:
                    group["lr"] = self.lr_at(progress)
                loss, accs = self.loss(ids.to(self.device), mask.to(self.device))
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.head.parameters(), cfg.grad_clip)
                self.opt.step()
                step += 1
                result.losses.append(loss.item())
                result.accuracy.append(accs)
                bar.update(1)
                bar.set_postfix(loss=f"{result.losses[-1]:.3f}",
                                acc="/".join(f"{a:.2f}" for a in accs))
                if cfg.save_every and step % cfg.save_every == 0:
                    self.save(step)
                if stop.requested:
                    return step
                if step >= total:
                    break
        return step

    def save(self, step: int) -> None:
        """Trainer state (for --resume), then the exported head, each replaced atomically."""
        path = os.path.join(self.cfg.out, "trainer_state.pt")
        state = {"step": step, "head": self.head.state_dict(), "opt": self.opt.state_dict()}
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
        export_head(self.head, self.cfg.out, self.cfg.export_dtype, self.target_cfg.num_layers)

    def restore(self, path: str) -> int:
        state = torch.load(path, map_location=self.device, weights_only=True)
        try:
            self.head.load_state_dict(state["head"])
            self.opt.load_state_dict(state["opt"])
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"{path} was written for another target or head size; drop "
                             f"--resume or use a new --out ({e})") from e
        return int(state["step"])


def train_eagle3(cfg: TrainConfig) -> TrainResult:
    """Train and export a head as `cfg` says (the `specserve train-eagle3` command)."""
    cfg.validate()
    return Eagle3Trainer(cfg).train()
