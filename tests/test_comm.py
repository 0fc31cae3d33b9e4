"""The communication module in one process: latency tables and the cost emulator (on the CPU
its wait spins on the host clock), the dispatch table, the backend rules, and that TP 1
without the emulator runs exactly the plain path. Two-process checks: test_comm_gloo.py."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from engine_drivers import PagedSession
from tiny_models import make_tiny_checkpoint

from specserve.config import CommConfig, ModelConfig
from specserve.distributed import comm, emulator
from specserve.distributed.backends import availability
from specserve.distributed.dispatch import Choice, DispatchTable, message_rows, pick
from specserve.distributed.emulator import GRANULE, CommEmulator, LatencyTable, table_names
from specserve.distributed.parallel_state import get_tp_size

CPU = torch.device("cpu")
LAYERS = 3
HIDDEN = 64


@pytest.fixture(autouse=True)
def _lone_process():
    comm.reset()
    yield
    comm.reset()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("comm"), "llama", num_hidden_layers=LAYERS)


def _flat(tmp_path, us: float, world: int = 8, name: str = "flat") -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"name": name, "latency_us": {str(world): [[256, us]]}}))
    return str(path)


def test_interpolation_by_hand() -> None:
    t = LatencyTable.from_dict(
        {"latency_us": {"8": [[1000, 10], [3000, 30], [5000, 34]], "2": [[4096, 5]]}}, "t"
    )
    assert t.latency_us(8, 500) == 10  # below the first point: its latency
    assert t.latency_us(8, 1000) == 10
    assert t.latency_us(8, 2000) == 20  # linear in bytes between points
    assert t.latency_us(8, 4000) == 32
    assert t.latency_us(8, 7000) == pytest.approx(38)  # past the last: its slope, 4 us / 2000 B
    assert t.latency_us(2, 1) == t.latency_us(2, 10**7) == 5  # one point: flat
    np.testing.assert_allclose(t.latency_us(8, np.array([500, 2000, 7000])), [10, 20, 38])
    with pytest.raises(ValueError, match=r"no world size 4: choose --emulate-tp from \[2, 8\]"):
        t.latency_us(4, 1)


@pytest.mark.parametrize(
    "points, match",
    [
        ([[4096, 5], [1024, 6]], "sizes must increase"),
        ([[4096, -1]], "bytes > 0, us > 0"),
        ([], "bytes > 0, us > 0"),
    ],
)
def test_bad_tables(tmp_path, points: list, match: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"latency_us": {"8": points}}))
    with pytest.raises(ValueError, match=match):
        LatencyTable.load(str(path))
    with pytest.raises(ValueError, match="pcie-oneshot"):  # names the shipped tables
        LatencyTable.load("no-such-table")


def test_shipped_tables_have_sources() -> None:
    assert {"pcie-nccl-8gpu", "pcie-oneshot", "nvlink-h100"} <= set(table_names())
    for name in table_names():
        t = LatencyTable.load(name)
        assert t.name == name and t.description and t.sources
        for world in t.points:
            assert t.latency_us(world, 8192) > 0
    # the naive PCIe table is the slow one at a decode and a verify message of Llama-3.1-8B
    slow, fast = LatencyTable.load("pcie-nccl-8gpu"), LatencyTable.load("pcie-oneshot")
    for nbytes in (8192, 4 * 8192):
        assert slow.latency_us(8, nbytes) > 3 * fast.latency_us(8, nbytes)


def test_emulator_waits_once_per_all_reduce_point(monkeypatch, tmp_path, model_path) -> None:
    """2 per decoder layer + the embedding, each the table's latency for its message (the CPU
    wait spins on the host clock, so the forward takes at least their sum)."""
    from specserve.models.loader import load_model

    waits: list[tuple[int, int]] = []
    real = emulator.busy_wait

    def spy(ns: torch.Tensor, index: int, stamp: torch.Tensor | None = None) -> None:
        waits.append((index, int(ns[index])))
        real(ns, index, stamp)

    monkeypatch.setattr(emulator, "busy_wait", spy)
    comm.init_comm(
        CommConfig(emulate_comm=_flat(tmp_path, 1500.0)),
        hidden=HIDDEN,
        dtype=torch.float32,
        device=CPU,
        rows=[1, 16],
    )
    model = load_model(ModelConfig.from_hf(model_path), model_path, torch.float32, CPU)
    session = PagedSession(model)
    t0 = time.perf_counter()
    session.step({0: [1, 2, 3, 4, 5]})
    elapsed = time.perf_counter() - t0
    points = 2 * LAYERS + 1
    index = -(-5 * HIDDEN * 4 // GRANULE)  # 5 rows of fp32
    assert waits == [(index, 1_500_000)] * points
    assert elapsed >= points * 1.5e-3
    waits.clear()
    session.step({0: [6], 1: [7, 8]})  # 3 rows
    assert waits == [(-(-3 * HIDDEN * 4 // GRANULE), 1_500_000)] * points
    assert comm.emulator().calls == 2 * points


def test_set_table_rewrites_the_device_array_in_place(tmp_path) -> None:
    emu = CommEmulator(LatencyTable.load("pcie-nccl-8gpu"), 8, CPU, pad=False, max_bytes=1 << 16)
    first = emu._ns[-1]
    assert emu.latency_ns(8192) == round(
        LatencyTable.load("pcie-nccl-8gpu").latency_us(8, 8192) * 1e3
    )
    emu.set_table(LatencyTable.load(_flat(tmp_path, 7.0)))
    assert emu._ns[-1] is first  # a captured graph keeps reading the same memory
    assert emu.latency_ns(8192) == 7000 and emu.latency_ns(1 << 16) == 7000
    assert emu.latency_ns(1 << 20) == 7000  # grows past max_bytes outside a capture
    with pytest.raises(ValueError, match="choose --emulate-tp"):
        emu.set_table(LatencyTable.load(_flat(tmp_path, 7.0, world=2, name="w2")))


def test_emulator_changes_no_token(tmp_path) -> None:
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompt = [[3, 14, 15, 92, 65]]
    kw = dict(load_format="dummy", device="cpu")
    plain = LLM("tiny-llama", **kw).generate(prompt, params)[0].token_ids
    llm = LLM("tiny-llama", comm=CommConfig(emulate_comm=_flat(tmp_path, 20.0)), **kw)
    emulated = llm.generate(prompt, params)[0].token_ids
    assert emulated == plain and len(plain) == 6
    llm.close()  # a closed engine leaves no emulator behind for models built later
    assert comm.emulator() is None


def test_shard_emulation_builds_rank0_of_tp_n(tmp_path) -> None:
    """--emulate-compute shard: one process holds rank 0's shard of a TP-2 model and runs it,
    speculation included (cost only), then a new engine is a lone rank again."""
    from specserve.llm import LLM
    from specserve.models.llama import LlamaForCausalLM
    from specserve.sampling_params import SamplingParams

    config = CommConfig(
        emulate_comm=_flat(tmp_path, 5.0, world=2), emulate_tp=2, emulate_compute="shard"
    )
    llm = LLM(
        "tiny-llama",
        load_format="dummy",
        device="cpu",
        comm=config,
        speculative_config=dict(algorithm="eagle3", draft_model="dummy", synthetic_accept_len=2),
    )
    assert get_tp_size() == 2
    model = llm.engine.runner.model
    assert isinstance(model, LlamaForCausalLM)
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)  # 4 and 2 heads over 2 ranks
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and comm.emulator().calls > 0
    LLM("tiny-llama", load_format="dummy", device="cpu")
    assert get_tp_size() == 1 and comm.emulator() is None


@pytest.mark.parametrize(
    "config, match",
    [
        (CommConfig(emulate_compute="shard"), "needs --emulate-comm"),
        (CommConfig(emulate_comm="nope"), "no communication table 'nope'"),
        (CommConfig(emulate_comm="pcie-oneshot", emulate_tp=3), "choose --emulate-tp from"),
    ],
)
def test_bad_comm_config(config: CommConfig, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        comm.init_comm(config, hidden=HIDDEN, dtype=torch.float32, device=CPU, rows=[1])


def test_bench_rejects_a_bad_table_before_loading() -> None:
    from specserve.cli import main

    assert (
        main(
            [
                "bench",
                "latency",
                "--model",
                "tiny-llama",
                "--device",
                "cpu",
                "--emulate-comm",
                "pcie-oneshot,nope",
            ]
        )
        == 2
    )


def test_tp1_runs_exactly_the_plain_path(monkeypatch, model_path) -> None:
    """No communicator, no emulator: no collective is called, reduce_add is forward."""
    import torch.distributed as dist

    from specserve.layers.norm import RMSNorm
    from specserve.models.loader import load_model

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective ran at TP 1")

    monkeypatch.setattr(dist, "all_reduce", no_collective)
    comm.init_comm(CommConfig(), hidden=HIDDEN, dtype=torch.float32, device=CPU, rows=[1])
    assert comm.communicator() is None and comm.emulator() is None
    x, r = torch.randn(2, 3, HIDDEN).unbind(0)
    assert comm.all_reduce(x) is x
    norm = RMSNorm(HIDDEN)
    norm.weight.data.uniform_(0.5, 1.5)
    for got, want in zip(norm.reduce_add(x, r), norm(x, r)):
        assert torch.equal(got, want)
    model = load_model(ModelConfig.from_hf(model_path), model_path, torch.float32, CPU)
    PagedSession(model).step({0: [1, 2, 3]})


def test_backend_rules() -> None:
    base = {
        "device": "cuda",
        "world": 2,
        "dtype": "bfloat16",
        "peer_access": True,
        "symm_mem": True,
        "cuda_version": "12.8",
        "triton": True,
        "interpreter": False,
    }
    assert not any(
        availability(base)[n] for n in ("nccl", "symm-one-shot", "symm-two-shot", "triton-one-shot")
    )
    cpu = availability({**base, "device": "cpu", "dtype": "float32"})
    assert cpu["gloo"] == "" and "no CUDA GPU" in cpu["nccl"]
    assert "TRITON_INTERPRET" in cpu["triton-one-shot"] and "peer access" in cpu["symm-two-shot"]
    assert availability({**base, "device": "cpu", "interpreter": True})["triton-one-shot"] == ""
    half = availability({**base, "dtype": "float16"})
    assert "no float16 kernels" in half["symm-one-shot"] and half["triton-one-shot"] == ""
    for over, word in (
        ({"world": 1}, "found 1"),
        ({"peer_access": False}, "peer access"),
        ({"cuda_version": "12.1"}, "CUDA >= 12.3"),
        ({"symm_mem": False}, "not importable"),
    ):
        rules = availability({**base, **over})
        assert word in rules["symm-one-shot"] and word in rules["symm-two-shot"], (over, rules)
    assert "triton is not usable" in availability({**base, "triton": False})["triton-one-shot"]


def test_dispatch_table_takes_the_next_measured_size() -> None:
    entries = [
        {"op": "all_reduce", "nbytes": n, "rows": n // 10, "us": us, "choice": pick(us)}
        for n, us in (
            (100, {"nccl": 9.0, "symm-one-shot": 3.0}),
            (1000, {"nccl": 12.0, "symm-one-shot": None, "symm-two-shot": 12.0}),
        )
    ]
    table = DispatchTable(entries, "nccl")
    assert table.choose("all_reduce", 50) == Choice("symm-one-shot", False, 3.0)
    assert table.choose("all_reduce", 100).backend == "symm-one-shot"
    assert table.choose("all_reduce", 101) == Choice("nccl", False, 12.0)  # tie: the first
    assert table.choose("all_reduce", 1001) == Choice("nccl")  # past every size: the group's own
    assert table.choose("add_rms_norm", 10) == Choice("nccl")
    assert Choice.parse("triton-one-shot+fused") == Choice("triton-one-shot", True)


def test_message_rows() -> None:
    # batch buckets x widths, plus powers of two up to the prefill budget
    assert message_rows([1, 3], [1, 5], 8) == [1, 2, 3, 4, 5, 8, 15]


def test_bench_latency_runs_each_table(tmp_path, capsys) -> None:

    slow, fast = _flat(tmp_path, 3000.0, name="slow"), _flat(tmp_path, 10.0, name="fast")
    out = tmp_path / "report.json"
    args = [
        "bench",
        "latency",
        "--no-progress",
        "--model",
        "tiny-llama",
        "--device",
        "cpu",
        "--batch-sizes",
        "1",
        "--context-len",
        "8",
        "--output-len",
        "3",
        "--runs",
        "1",
        "--warmup",
        "0",
        "--emulate-comm",
        f"{slow},{fast}",
        "--json-out",
        str(out),
    ]
    from specserve.cli import build_parser

    parsed = build_parser().parse_args(args)
    assert parsed.func(parsed) == 0
    assert "-- emulated communication: table slow, TP 8, compute full" in capsys.readouterr().out
    report = json.loads(out.read_text())
    points = {
        p["comm_table"]: p["modes"]["baseline"]["ms_per_step"]["mean"] for p in report["points"]
    }
    assert list(points) == ["slow", "fast"]
    # 4 layers: 9 all-reduce points per step, each 2.99 ms longer with the slow table
    assert points["slow"] - points["fast"] >= 9 * 2.99 * 0.95


def test_quiet_zeroes_every_wait_then_restores_the_table_in_place() -> None:
    """Graph capture runs inside quiet(): its warm-ups wait nothing, and the graphs, which
    read the same device arrays at replay, wait the table's latencies after."""
    table = LatencyTable.load("pcie-nccl-8gpu")
    emu = CommEmulator(table, 8, CPU, pad=False, max_bytes=1 << 16)
    first, real = emu._ns[-1], emu.latency_ns(8192)
    assert real > 0
    with emu.quiet():
        assert emu.latency_ns(8192) == 0
        with emu.quiet():  # nested: still quiet after the inner one ends
            pass
        assert emu.latency_ns(8192) == 0
        assert emu.latency_ns(1 << 20) == 0  # an array grown inside is quiet too
    assert emu._ns[0] is first and emu.latency_ns(8192) == real
    assert emu.latency_ns(1 << 20) == round(table.latency_us(8, 1 << 20) * 1e3)
    with torch.inference_mode():  # arrays made under the engine's inference mode
        emu = CommEmulator(table, 8, CPU, pad=False, max_bytes=1 << 16)
    with emu.quiet():  # entered and left outside it (a capture loop)
        assert emu.latency_ns(8192) == 0
    assert emu.latency_ns(8192) == real


def test_graph_capture_waits_no_emulated_latency(monkeypatch, tmp_path) -> None:
    """Both capture loops (batch graphs: decode and speculative cycles; token graphs) run
    their warm-ups and captures with the emulator quiet, and leave it waiting the table."""
    from specserve.worker.cuda_graph import BatchGraphs, batch_buckets
    from specserve.worker.token_graphs import TokenGraphs

    seen: list[int] = []

    def spy(self, *args) -> None:  # stands in for a bucket's warm-ups and capture
        seen.append(comm.emulator().latency_ns(256))

    monkeypatch.setattr(BatchGraphs, "_capture", spy)
    monkeypatch.setattr(TokenGraphs, "_capture", spy)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    comm.init_comm(CommConfig(emulate_comm=_flat(tmp_path, 1500.0)), hidden=HIDDEN,
                   dtype=torch.float32, device=CPU, rows=[1, 16])
    try:
        BatchGraphs(lambda **views: (), {"x": torch.zeros(4, 1)}, {"x": 0}, 4, "test",
                    pool=object())
        graphs = TokenGraphs(lambda ids, pos, md: ids, 64, 4, 2, 128, 1, 1, 16, 0, CPU,
                             capture=False)
        graphs.capture = True
        graphs.add_variant("plain", lambda ids, pos, md: ids)
        assert len(seen) == len(batch_buckets(4)) + len(graphs.buckets) and set(seen) == {0}
        assert comm.emulator().latency_ns(256) == 1_500_000
    finally:
        comm.reset()
