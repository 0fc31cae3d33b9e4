"""Shared by the MTP engine tests (test_mtp.py, test_mtp_loading.py): the tiny checkpoints
carrying an MTP layer (tests/tiny_mtp.py: DeepSeek-V3, GLM-4.5, GLM-4.7-Flash, GLM-5 and GLM-5
with sparse attention past 4 tokens), a module-scoped fixture that a test module binds by name
(`ckpts = mtp_fixtures.ckpts`) so pytest finds it there; the prompts, greedy sampling and the
mtp speculative config."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_mtp import make_mtp_checkpoint

from specserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, tuple[str, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("mtp")
    return {
        # DeepSeek-V3 ships shared_head.head and embed_tokens copies: here the embedding copy
        # equals the target's (shared after loading) and the head differs (kept)
        "deepseek_v3": make_mtp_checkpoint(str(root / "ds"), "deepseek_v3", own_head=True),
        "glm4_moe": make_mtp_checkpoint(str(root / "glm"), "glm4_moe"),
        "glm4_moe_lite": make_mtp_checkpoint(str(root / "lite"), "glm4_moe_lite"),
        "glm_moe_dsa": make_mtp_checkpoint(str(root / "glm5"), "glm_moe_dsa"),
        # GLM-5 with sparse attention past 4 tokens, its layer 1 sharing layer 0's selection
        # (GLM-5.2's indexer_types): the MTP layer (transformers' layer 3, "full") indexes
        "glm_moe_dsa_sparse": make_mtp_checkpoint(
            str(root / "glm5s"), "glm_moe_dsa", index_topk=4,
            indexer_types=["full", "shared", "full", "full"]),
    }


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def _mtp(k: int = 3, **extra) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, **extra}
