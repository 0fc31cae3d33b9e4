"""Communication kernels on one GPU: the busy-wait's accuracy (requested vs measured, in a CUDA
graph, with the table swapped after capture), the one-shot all-reduce and the fused
all-reduce + add + RMSNorm over torch symmetric memory at world size 1 (every barrier and
peer-pointer path runs; the sum of one rank is its input), and the emulator through a whole
engine with CUDA graphs. All marked `gpu`."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import time

import pytest
import torch

from specserve.kernels import allreduce as ar
from specserve.kernels.busy_wait import busy_wait, stamp_now

HAS_CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")]
CALLS = 50
# timings need the GPU to themselves: other processes' contexts time-slice it
timed = pytest.mark.skipif(
    bool(os.environ.get("PYTEST_XDIST_WORKER")),
    reason="timing test: run this file alone (gpu_suite.sh step comm)",
)


def _graph_us(fn, calls: int = CALLS, repeats: int = 5) -> float:
    """Median microseconds per call of `fn` captured `calls` times in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


@timed
@pytest.mark.parametrize("us", [5.0, 25.0, 200.0])
def test_busy_wait_accuracy(us: float) -> None:
    ns = torch.tensor([0, round(us * 1e3), round(2 * us * 1e3)], dtype=torch.int32, device="cuda")
    measured = _graph_us(lambda: busy_wait(ns, 1))
    print(f"busy-wait requested {us:.1f} us, measured {measured:.2f} us per call in a graph")
    assert us <= measured <= us + max(3.0, 0.05 * us)


@timed
def test_busy_wait_reads_the_table_at_replay_and_pads_from_a_stamp() -> None:
    ns = torch.tensor([0, 20_000, 60_000], dtype=torch.int32, device="cuda")
    stamp = torch.zeros(1, dtype=torch.int64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    busy_wait(ns, 1)
    stamp_now(stamp)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            stamp_now(stamp)
            busy_wait(ns, 1)  # stands in for a 20 us all-reduce
            busy_wait(ns, 2, stamp)  # pads the interval to 60 us: waits ~40 us more
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def per_call() -> float:
        graph.replay()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / CALLS

    padded = per_call()
    ns[2] = 100_000  # a new table, after capture
    swapped = per_call()
    print(f"padded to 60 us: {padded:.2f} us; after the swap to 100 us: {swapped:.2f} us")
    assert 60 <= padded <= 66 and 100 <= swapped <= 106


@pytest.fixture(scope="module")
def symm_buffers():
    """One symmetric-memory allocation of a world-size-1 NCCL group."""
    import torch.distributed as dist

    from specserve.distributed.peer_memory import cuda_peer_buffers

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0)
    try:
        bufs, keep = cuda_peer_buffers(16 << 20, dist.group.WORLD, torch.device("cuda", 0))
        yield bufs, dist.group.WORLD
        del keep
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_one_shot_world1(symm_buffers, dtype: torch.dtype) -> None:
    bufs, _ = symm_buffers
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 7, 300):  # one chunk, several programs, more chunks than programs
        x = torch.randn(rows, 4096, generator=gen).to("cuda", dtype)
        out = ar.one_shot_all_reduce(x, bufs)
        assert torch.equal(out, x), f"rows {rows}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_world1_equals_reference_and_unfused(symm_buffers, dtype: torch.dtype) -> None:
    from specserve.kernels.fused_ops import fused_add_rms_norm

    bufs, _ = symm_buffers
    gen = torch.Generator().manual_seed(1)
    for hidden in (4096, 5120):
        w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to("cuda", dtype)
        for rows in (1, 5, 40, 300):
            x, res = torch.randn(2, rows, hidden, generator=gen).to("cuda", dtype).unbind(0)
            normed, summed = ar.one_shot_all_reduce_add_rms_norm(x, res, w, 1e-5, bufs)
            ref_n, ref_s = ar.all_reduce_add_rms_norm_ref([x], res, w, 1e-5)
            for out, ref in ((normed, ref_n), (summed, ref_s)):
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                assert err < 2e-2, f"hidden {hidden} rows {rows}: {err}"
            # one rank: the unfused kernel's roundings (its row sum may reduce in another order)
            un_n, un_s = fused_add_rms_norm(x, res, w, 1e-5)
            assert torch.equal(summed, un_s)
            torch.testing.assert_close(normed, un_n, rtol=1e-2, atol=1e-3)


def test_fused_world1_in_a_cuda_graph(symm_buffers) -> None:
    bufs, _ = symm_buffers
    dtype, rows, hidden = torch.bfloat16, 4, 4096
    x = torch.empty(rows, hidden, device="cuda", dtype=dtype)
    res = torch.empty_like(x)
    w = torch.rand(hidden, device="cuda", dtype=dtype) + 0.5
    x.normal_(), res.normal_()
    ar.one_shot_all_reduce_add_rms_norm(x, res, w, 1e-5, bufs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, summed = ar.one_shot_all_reduce_add_rms_norm(x, res, w, 1e-5, bufs)
    for _ in range(3):  # each replay passes both barriers: the flags reset every time
        x.normal_(), res.normal_()
        graph.replay()
        ref_n, ref_s = ar.all_reduce_add_rms_norm_ref([x], res, w, 1e-5)
        assert ((normed.float() - ref_n).abs().max() / ref_n.abs().max()).item() < 2e-2
        assert ((summed.float() - ref_s).abs().max() / ref_s.abs().max()).item() < 2e-2


@pytest.mark.parametrize("kind", ["one-shot", "two-shot"])
def test_torch_symm_mem_world1(symm_buffers, kind: str) -> None:
    from specserve.distributed.backends import SymmMemBackend

    _, group = symm_buffers
    try:
        backend = SymmMemBackend(kind, group, 1 << 20, torch.device("cuda", 0))
        x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
        out = backend.all_reduce(x.clone())
        torch.cuda.synchronize()
    except RuntimeError as err:  # torch's kernels need not support a group of one
        pytest.xfail(f"torch symm-mem {kind} at world size 1: {err}")
    assert torch.equal(out, x)


@timed
def test_emulator_in_engine_graphs(tmp_path) -> None:
    """Decode graphs wait the table's latency at every all-reduce point, tokens unchanged;
    swapping the table after capture changes the replayed waits."""
    from specserve.config import CommConfig
    from specserve.distributed import comm
    from specserve.distributed.emulator import LatencyTable
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    def table(us: float) -> str:
        path = tmp_path / f"flat{us:g}.json"
        path.write_text(json.dumps({"latency_us": {"8": [[256, us]]}}))
        return str(path)

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)  # greedy
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
    kw = dict(load_format="dummy", device="cuda", dtype="float32", cuda_graph_max_bs=4)
    try:
        plain = LLM("tiny-llama", **kw).generate(prompt, params)[0].token_ids
        llm = LLM("tiny-llama", comm=CommConfig(emulate_comm=table(500.0)), **kw)
        llm.generate(prompt, params)  # warm-up
        t0 = time.perf_counter()
        slow = llm.generate(prompt, params)[0].token_ids
        slow_s = time.perf_counter() - t0
        comm.emulator().set_table(LatencyTable.load(table(5.0)))
        t0 = time.perf_counter()
        fast = llm.generate(prompt, params)[0].token_ids
        fast_s = time.perf_counter() - t0
    finally:
        comm.reset()
    assert slow == fast == plain
    # tiny-llama: 4 layers -> 9 all-reduce points per forward, 24 forwards
    assert slow_s >= 24 * 9 * 500e-6
    assert fast_s < slow_s / 3, (slow_s, fast_s)
