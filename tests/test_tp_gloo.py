"""Tensor parallelism on the CPU: 2 gloo processes with tp 2 give the logits of tp 1."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from engine_drivers import PagedSession
from tiny_models import make_tiny_checkpoint

from specserve.config import ModelConfig
from specserve.distributed import parallel_state
from specserve.models.loader import load_model

TP = 2
# qwen2: q/k/v bias, tied embeddings, vocab 509 (not divisible by 2: padded vocab shard);
# qwen3: per-head q/k norm and head_dim 32; llama: one kv head per rank
CASES = (
    ("qwen2", {"vocab_size": 509, "tie_word_embeddings": True}),
    ("qwen3", {}),
    ("llama", {"num_key_value_heads": 2, "num_attention_heads": 8}),
)
PROMPTS = ([5, 17, 300, 2, 2, 41, 7, 99, 100], [8, 1, 250, 77])


def _run(path: str, device: str = "cpu") -> list[torch.Tensor]:
    """A batched prefill, then two decode steps; all logits in order."""
    model = load_model(ModelConfig.from_hf(path), path, torch.float32, torch.device(device))
    session = PagedSession(model)
    out = session.step(dict(enumerate(PROMPTS)))
    for token in (3, 11):
        out += session.step({0: [token], 1: [token + 1]})
    return [x.cpu() for x in out]


def _worker(rank: int, paths: list[str], port: int, out_dir: str, backend: str) -> None:
    torch.set_num_threads(1)
    parallel_state.init_distributed(TP, rank, backend, f"tcp://127.0.0.1:{port}")
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    try:
        results = [_run(p, device) for p in paths]
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        parallel_state.destroy()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_tp(tmp_path: Path, backend: str, tol: float) -> None:
    paths = [
        make_tiny_checkpoint(tmp_path / f"{family}{i}", family, **overrides)
        for i, (family, overrides) in enumerate(CASES)
    ]
    mp.spawn(_worker, args=(paths, _free_port(), str(tmp_path), backend), nprocs=TP, join=True)
    device = "cuda" if backend == "nccl" else "cpu"
    expected = [_run(p, device) for p in paths]  # tp 1, in this process
    for rank in range(TP):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for (family, _), exp, res in zip(CASES, expected, got):
            assert len(res) == len(exp)
            for e, g in zip(exp, res):
                assert g.shape == e.shape
                err = (g - e).abs().max().item()
                assert err < tol, f"{family} rank {rank}: max abs diff {err}"


def test_tp2_logits_equal_tp1(tmp_path: Path) -> None:
    _check_tp(tmp_path, "gloo", 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < TP, reason="needs 2 CUDA GPUs"
)
def test_tp2_nccl_logits_equal_tp1(tmp_path: Path) -> None:
    _check_tp(tmp_path, "nccl", 1e-4)
