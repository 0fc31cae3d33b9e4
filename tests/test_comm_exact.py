"""Exact mode's all-reduce over 3 gloo processes (3 ranks: with 2, any sum order gives the same
bits). Each rank's partials have a wide dynamic range, so the order of additions shows in the
bits. Under --exact the communicator's sum of a message equals, bit for bit, the rank-order
fp32 sum ((p0 + p1) + p2 rounded once) regenerated from the seeds, for every message size, so
a row's sum is the same alone or in any batch; the fused add + RMSNorm path too.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, HIDDEN = 3, 64
ROWS = (1, 5, 64)


def _partial(rank: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    full = torch.randn(max(ROWS), HIDDEN, generator=gen) * torch.logspace(-3, 3, HIDDEN)
    return full[:rows].to(dtype)  # row r is the same in every message


def _rank(rank: int, init: str, out_dir: str) -> None:
    from specserve.config import CommConfig
    from specserve.distributed.communicator import Communicator
    from specserve.kernels.dispatch import set_exact

    result = "ok"
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
        set_exact(True)
        for dtype in (torch.bfloat16, torch.float32):
            comm = Communicator(dist.group.WORLD, torch.device("cpu"), dtype, HIDDEN,
                                list(ROWS), CommConfig())  # fmt: skip
            assert "ordered" in comm.describe()[0], comm.describe()
            for rows in ROWS:
                want = _partial(0, rows, dtype).float()
                for r in range(1, WORLD):
                    want += _partial(r, rows, dtype).float()
                got = comm.all_reduce(_partial(rank, rows, dtype).clone())
                assert torch.equal(got, want.to(dtype)), (dtype, rows)
                residual = torch.ones(rows, HIDDEN, dtype=dtype)
                weight = torch.full((HIDDEN,), 0.5, dtype=dtype)

                def unfused(s, res):
                    h = s + res
                    return h * 2, h

                out, h = comm.all_reduce_add_rms_norm(
                    _partial(rank, rows, dtype).clone(), residual, weight, 1e-6, unfused)
                assert torch.equal(h, want.to(dtype) + residual), (dtype, rows, "fused path")
    except Exception:  # noqa: BLE001 - reported to the test
        result = traceback.format_exc()
    finally:
        set_exact(False)
        Path(out_dir, f"rank{rank}").write_text(result)
        if dist.is_initialized():
            dist.destroy_process_group()


def test_exact_all_reduce_is_rank_ordered_at_every_size(tmp_path: Path) -> None:
    init = f"file://{tmp_path / 'store'}"
    mp.start_processes(_rank, args=(init, str(tmp_path)), nprocs=WORLD, start_method="spawn")
    for rank in range(WORLD):
        assert Path(tmp_path, f"rank{rank}").read_text() == "ok", rank


def test_gloo_sum_order_shows_in_these_inputs() -> None:
    """The inputs discriminate: summing the three partials in another order changes bits."""
    parts = [_partial(r, max(ROWS), torch.float32) for r in range(WORLD)]
    ordered = (parts[0] + parts[1]) + parts[2]
    other = parts[0] + (parts[1] + parts[2])
    assert not torch.equal(ordered, other)
    assert os.environ.get("SPECSERVE_TRITON_COMPILE_ONLY") is None


def test_exact_engine_under_tp2_batched_equals_alone() -> None:
    """--exact with TP 2 (gloo workers, the ordered all-reduce): bf16 greedy output of a
    batch equals each prompt run alone."""
    from specserve import defaults
    from specserve.config import CacheConfig
    from specserve.kernels.dispatch import set_exact
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 17, 300, 2], [41, 7, 99, 3, 250, 12, 8], [400], [9, 9, 9, 9, 9, 9]]
    with LLM(defaults.tiny_code_path(), device="cpu", dtype="bfloat16", exact=True,
             tensor_parallel_size=2, cache=CacheConfig(page_size=4, num_pages=256)) as llm:
        alone = [llm.generate([p], params)[0].token_ids for p in prompts]
        assert [o.token_ids for o in llm.generate(prompts, params)] == alone
    set_exact(False)
