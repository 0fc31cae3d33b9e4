"""The communication module on the CPU: 2 gloo processes; the one-shot Triton kernels run under
the interpreter over shared-memory peer buffers, through the same barrier as on GPUs.

Each check runs in both ranks and is compared with an independent reference (the fp32 sum of
every rank's input, regenerated from the seeds; sum + add + RMSNorm in fp32; the model at
TP 1). TRITON_INTERPRET must be set before triton is imported, so the test starts
`python tests/test_comm_gloo.py OUT_DIR` as a subprocess, which spawns the two ranks; each
writes {check: "ok" | traceback} and its model outputs to OUT_DIR.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "tests"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from engine_drivers import PagedSession  # noqa: E402
from tiny_eagle import make_tiny_eagle3_head  # noqa: E402
from tiny_models import make_tiny_checkpoint  # noqa: E402

from specserve.config import CommConfig, ModelConfig  # noqa: E402
from specserve.kernels import allreduce as ar  # noqa: E402

WORLD = 2
HIDDEN = 64
PROMPT = [5, 17, 300, 2, 41, 7]
DECODE_STEPS = 4
CAPTURE_IDS = (0, 1)
WAIT_US = 2000.0  # the flat latency table of the emulator check
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _inputs(rank: int, rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + 7 * rows + hidden)
    return torch.randn(rows, hidden, generator=gen).to(dtype)


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]}"


# -- checks (each runs in both ranks) ---------------------------------------------------------


def check_backends(rank: int, out_dir: Path) -> None:
    """Every backend the CPU can run equals the fp32 sum, for every size class: one chunk,
    several programs, more chunks than programs."""
    from specserve.distributed.communicator import Communicator
    from specserve.distributed.parallel_state import get_tp_group

    comm = Communicator(
        get_tp_group(),
        torch.device("cpu"),
        torch.float32,
        HIDDEN,
        [1, 1100],
        CommConfig(comm_tune="off"),
    )
    assert sorted(comm.backends) == ["gloo", "triton-one-shot"], sorted(comm.backends)
    assert set(comm.unavailable) == {"nccl", "symm-one-shot", "symm-two-shot"}
    assert "no CUDA GPU" in comm.unavailable["nccl"], comm.unavailable
    for name, backend in comm.backends.items():
        for rows in (1, 40, 1100):  # 64, 2560 and 70400 elements (BLOCK 1024, 32 programs)
            half = name != "gloo" and rows == 40
            for dtype in (torch.float32, torch.bfloat16) if half else (torch.float32,):
                ref = ar.all_reduce_ref([_inputs(r, rows, HIDDEN, dtype) for r in range(WORLD)])
                out = backend.all_reduce(_inputs(rank, rows, HIDDEN, dtype))
                assert out.shape == ref.shape and out.dtype == dtype
                _assert_close(out, ref, dtype, f"{name} rows {rows} {dtype}")


def check_fused(rank: int, out_dir: Path) -> None:
    """The fused all-reduce + add + RMSNorm equals sum, add, RMSNorm in fp32: one row, a few,
    more rows than programs; a power-of-two hidden and one that is not; three dtypes."""
    from specserve.distributed.backends import TritonOneShotBackend
    from specserve.distributed.parallel_state import get_tp_group

    backend = TritonOneShotBackend(get_tp_group(), 1 << 20, torch.device("cpu"))
    cases = (
        (64, 1, torch.float32),
        (64, 40, torch.float32),
        (48, 5, torch.float32),
        (48, 5, torch.bfloat16),
        (64, 3, torch.float16),
    )
    for hidden, rows, dtype in cases:
        gen = torch.Generator().manual_seed(hidden + rows)
        res = torch.randn(rows, hidden, generator=gen).to(dtype)
        w = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(dtype)
        parts = [_inputs(r, rows, hidden, dtype) for r in range(WORLD)]
        normed, summed = backend.all_reduce_add_rms_norm(parts[rank], res, w, 1e-6)
        ref_normed, ref_summed = ar.all_reduce_add_rms_norm_ref(parts, res, w, 1e-6)
        what = f"hidden {hidden} rows {rows} {dtype}"
        assert normed.dtype == summed.dtype == dtype
        _assert_close(summed, ref_summed, dtype, what + " residual out")
        _assert_close(normed, ref_normed, dtype, what + " normed")


def check_dispatch(rank: int, out_dir: Path) -> None:
    """Measured at start-up, identical on both ranks, cached by rank 0 and read back."""
    from specserve.distributed import tuning
    from specserve.distributed.communicator import Communicator
    from specserve.distributed.exchange import all_gather_json
    from specserve.distributed.parallel_state import get_tp_group

    tuning.CALLS, tuning.REPEATS = 2, 1  # the interpreter is slow; the choices are not tested
    group, cpu = get_tp_group(), torch.device("cpu")
    base = CommConfig(comm_cache_dir=str(out_dir / "cache"))
    fresh = Communicator(
        group, cpu, torch.float32, HIDDEN, [1, 8], dataclasses.replace(base, comm_tune="refresh")
    )
    assert fresh.source == "measured"
    entries = {(e["op"], e["rows"]): e for e in fresh.table.entries}
    assert set(entries) == {(op, r) for op in ("all_reduce", "add_rms_norm") for r in (1, 8)}
    for (op, rows), e in entries.items():
        # add_rms_norm: the base's and the all-reduce winner's unfused path, and the fused one
        want = (
            {"gloo", "triton-one-shot"}
            if op == "all_reduce"
            else {"gloo", entries["all_reduce", rows]["choice"], "triton-one-shot+fused"}
        )
        assert set(e["us"]) == want and all(v is not None for v in e["us"].values()), e
        assert e["choice"] == min(e["us"], key=e["us"].get)
    big = fresh.table.choose("all_reduce", 9 * HIDDEN * 4)  # past every measured size
    assert big.backend == "gloo" and big.us is None
    cached = Communicator(group, cpu, torch.float32, HIDDEN, [8, 1], base)
    assert cached.source == "cache" and cached.describe() == fresh.describe()
    views = all_gather_json(fresh.describe(), group)
    assert views[0] == views[1], views
    forced = Communicator(
        group, cpu, torch.float32, HIDDEN, [1, 8], dataclasses.replace(base, comm_fuse="on")
    )
    assert forced.table.choose("add_rms_norm", HIDDEN * 4).label == "triton-one-shot+fused"
    if rank == 0:
        assert list((out_dir / "cache").glob("allreduce-*.json"))


def _greedy(path: str, config: CommConfig, capture: bool = False) -> dict[str, list]:
    """Prefill PROMPT, then DECODE_STEPS greedy steps: tokens, logits, aux states."""
    from specserve.distributed import comm
    from specserve.models.capture import AuxHiddenCapture
    from specserve.models.loader import load_model

    mc = ModelConfig.from_hf(path)
    comm.init_comm(
        config, hidden=mc.hidden_size, dtype=torch.float32, device=torch.device("cpu"), rows=[1, 8]
    )
    model = load_model(mc, path, torch.float32, torch.device("cpu"))
    cap = AuxHiddenCapture(model, CAPTURE_IDS) if capture else None
    session = PagedSession(model)
    logits = session.step({0: PROMPT})[0]
    out = {"tokens": [], "logits": [logits[-1].tolist()], "aux": []}
    for _ in range(DECODE_STEPS):
        token = int(logits[-1].argmax())
        out["tokens"].append(token)
        if cap is not None:
            out["aux"].append(cap.pop()[-1].tolist())
        logits = session.step({0: [token]})[0]
        out["logits"].append(logits[-1].tolist())
    return out


def check_model(rank: int, out_dir: Path) -> None:
    """A whole TP=2 model, unfused (gloo all-reduce, then add + norm) and fused (one Triton
    launch per reduction point); the parent compares both with TP 1."""
    from specserve.distributed import comm

    path = str(out_dir / "model")
    runs = {
        "unfused": _greedy(path, CommConfig(comm_backend="gloo", comm_tune="off")),
        "fused": _greedy(
            path, CommConfig(comm_backend="triton-one-shot", comm_tune="off"), capture=True
        ),
    }
    choice = comm.communicator().table.choose("add_rms_norm", HIDDEN * 4)
    assert choice.label == "triton-one-shot+fused", choice
    (out_dir / f"model-rank{rank}.json").write_text(json.dumps(runs))


def check_emulator_pads(rank: int, out_dir: Path) -> None:
    """In a real group the emulator pads every all-reduce point to the table's latency."""
    from specserve.distributed import comm
    from specserve.models.loader import load_model

    path = str(out_dir / "model")
    mc = ModelConfig.from_hf(path)
    config = CommConfig(
        comm_backend="gloo",
        comm_tune="off",
        emulate_comm=str(out_dir / "flat.json"),
        emulate_tp=WORLD,
    )
    comm.init_comm(
        config, hidden=mc.hidden_size, dtype=torch.float32, device=torch.device("cpu"), rows=[1, 8]
    )
    model = load_model(mc, path, torch.float32, torch.device("cpu"))
    session = PagedSession(model)
    emu = comm.emulator()
    assert emu is not None and emu.pad
    t0 = time.perf_counter()
    session.step({0: PROMPT})
    elapsed = time.perf_counter() - t0
    points = 2 * mc.num_layers + 1
    assert emu.calls == points, (emu.calls, points)
    assert elapsed >= points * WAIT_US * 1e-6, elapsed


def _engine_tokens(out_dir: Path, tp: int, config: CommConfig) -> list[list[int]]:
    """Greedy tokens of 2 prompts through the whole engine, EAGLE-3 chain of 3."""
    from specserve.config import ParallelConfig
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    spec = dict(algorithm="eagle3", draft_model=str(out_dir / "head"), num_steps=3, topk=1)
    llm = LLM(
        str(out_dir / "model"),
        device="cpu",
        dtype="float32",
        speculative_config=spec,
        parallel=ParallelConfig(tp_size=tp),
        comm=config,
    )
    try:
        outs = llm.generate(
            [PROMPT, PROMPT[::-1]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        )
    finally:
        llm.close()
    return [o.token_ids for o in outs]


def engine_check(out_dir: Path) -> None:
    """TP 2 through the engine's worker processes (they inherit TRITON_INTERPRET), every
    reduction point on the fused kernel: the parent compares the tokens with TP 1."""
    config = CommConfig(comm_backend="triton-one-shot", comm_tune="off")
    (out_dir / "engine.json").write_text(json.dumps(_engine_tokens(out_dir, WORLD, config)))


CHECKS = {
    f.__name__: f
    for f in (check_backends, check_fused, check_dispatch, check_model, check_emulator_pads)
}


def _worker(rank: int, out_dir: str, port: int) -> None:
    from specserve.distributed import comm, parallel_state

    torch.set_num_threads(1)
    parallel_state.init_distributed(WORLD, rank, "gloo", f"tcp://127.0.0.1:{port}")
    results = {}
    try:
        for name, check in CHECKS.items():
            t0 = time.perf_counter()
            try:
                check(rank, Path(out_dir))
                results[name] = "ok"
                print(f"rank {rank} {name}: {time.perf_counter() - t0:.1f} s", flush=True)
            except Exception:
                results[name] = traceback.format_exc(limit=8)
            comm.reset()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        parallel_state.destroy()


# -- the test (parent process) ----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("comm")
    # 8 heads / 4 kv heads split over 2 ranks; vocab 509 pads the vocabulary shard; 3 layers
    # (the EAGLE-3 head's default aux layers are 2, 1, 0)
    make_tiny_checkpoint(
        out / "model",
        "llama",
        vocab_size=509,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=4,
        tokenizer=True,
    )
    make_tiny_eagle3_head(str(out / "head"), str(out / "model"), draft_vocab_size=128)
    flat = {"latency_us": {str(WORLD): [[256, WAIT_US]]}}
    (out / "flat.json").write_text(json.dumps(flat))
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    }
    proc = subprocess.run(
        [sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CHECKS))
def test_check(run: Path, name: str) -> None:
    for rank in range(WORLD):
        result = json.loads((run / f"rank{rank}.json").read_text())[name]
        assert result == "ok", f"rank {rank}:\n{result}"


@pytest.mark.slow
def test_fused_model_gives_the_unfused_tokens_and_tp1_logits(run: Path) -> None:
    from specserve.distributed import comm

    try:
        ref = _greedy(str(run / "model"), CommConfig(), capture=True)  # TP 1, this process
    finally:
        comm.reset()
    for rank in range(WORLD):
        runs = json.loads((run / f"model-rank{rank}.json").read_text())
        assert runs["fused"]["tokens"] == runs["unfused"]["tokens"] == ref["tokens"]
        for name in ("fused", "unfused"):
            torch.testing.assert_close(
                torch.tensor(runs[name]["logits"]),
                torch.tensor(ref["logits"]),
                atol=2e-5,
                rtol=1e-5,
            )
        torch.testing.assert_close(
            torch.tensor(runs["fused"]["aux"]), torch.tensor(ref["aux"]), atol=2e-5, rtol=1e-5
        )


@pytest.mark.slow
def test_engine_tp2_fused_gives_the_tp1_tokens(run: Path) -> None:
    from specserve.distributed import comm

    try:
        ref = _engine_tokens(run, 1, CommConfig())
    finally:
        comm.reset()
    assert json.loads((run / "engine.json").read_text()) == ref


if __name__ == "__main__":
    import torch.multiprocessing as mp

    assert os.environ.get("TRITON_INTERPRET") == "1", "run through test_check"
    mp.spawn(_worker, args=(sys.argv[1], _free_port()), nprocs=WORLD, join=True)
    engine_check(Path(sys.argv[1]))
