"""What a decode step is measured against, in the same process as the step itself.

- Weight-stream floor: the model's own linear weights (qkv, o, gate_up, down of every decoder
  layer, then the LM head; the module's tensors, not copies) applied as plain matmuls
  `x @ W.T` in sequence for a [bs, in] input, captured in one CUDA graph and replayed. Attention,
  norms and sampling are left out, so a decode step can approach this time but not beat it;
  weight bytes / time is the bandwidth the matmuls achieve. A quantized linear streams the
  bytes its format reads (`linear_stream_bytes`): its packed codes, viewed as an
  activation-dtype matrix (no copy), and its scales, whose bytes over all layers go into one
  more matrix of that size (one extra matmul). A MoE layer contributes its router, its shared
  experts and only the routed experts a step reads: top_k at batch 1, and at larger batches the
  distinct experts the batch's tokens touch, counted on the benchmark's own requests
  (`touched_experts`); each routed expert streams its matrices in their stored format too.
- Device copy bandwidth: read + write bytes of a large device-to-device copy over its time.
- Roofline of a plain decode step: max(bytes it reads (those weights, the touched experts
  included, + the K and V of every request at its context) / copy bandwidth, its flops (the
  weights one token multiplies: top_k experts) / the throughput of one large matmul).
  At large batches and contexts the KV reads dominate, which a weights-only floor misses.
- The transformers peer (`bench/hf_peer.py`), run by `measure_references` at batch 1.
On the CPU there are no graphs: the floor runs eagerly and the numbers are only a smoke test.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from specserve.layers.moe import DeepseekMoE

GIB = 1 << 30
CPU_COPY_BYTES = 64 << 20  # the CPU form copies less: it is a smoke test, not a ceiling


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    """Milliseconds of each of `repeats` calls: CUDA events on a GPU, perf_counter on the CPU."""
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


# -- the weight-stream floor ------------------------------------------------------------------


def linear_stream_bytes(linear: nn.Module) -> int:
    """Bytes one forward of a linear layer reads in its stored format (dense: the weight;
    quantized: packed codes + scales)."""
    return linear.quant_method.stream_bytes(linear)


def floor_weights(model: nn.Module, experts: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Every 2-D weight of the decoder layers in order (qkv, o, gate_up, down per layer), then
    the LM head: the tensors a decode step must stream from memory. Quantized linears give
    their codes as a matrix in the activation dtype, and their scales' bytes one more matrix.
    A MoE layer's routed experts count `experts[j]` each (its j-th MoE block; default: its
    top_k), as 2-D slices of the stacked weights: w13[e] then w2[e]."""
    layers, head = _decoder(model)
    dtype = head.weight.dtype
    weights: list[torch.Tensor] = []
    extra = 0  # scale bytes, streamed as one more matrix

    def stream(tensors: list[torch.Tensor]) -> None:
        nonlocal extra
        codes = tensors[0]  # the same bytes, as a matrix a matmul streams
        weights.append(codes if codes.dtype == dtype
                       else codes.reshape(codes.shape[0], -1).view(dtype))
        extra += sum(t.numel() * t.element_size() for t in tensors[1:])

    j = 0  # MoE blocks so far
    for layer in layers:
        linears, blocks, others = _layer_parts(layer)
        for linear in linears:
            stream(linear.quant_method.stream_tensors(linear))
        weights += others
        for block in blocks:
            n = block.gate.rule.top_k if experts is None else experts[j]
            for e in range(n):
                for tensors in block.experts.stream_tensors(e):
                    stream(tensors)
            j += 1
    if extra:
        width = head.weight.shape[1]
        rows = -(-extra // (width * head.weight.element_size()))
        weights.append(torch.zeros(rows, width, dtype=dtype, device=head.weight.device))
    return [*weights, head.weight]


def token_weight_params(model: nn.Module) -> int:
    """Weights one token multiplies in a decode step, whatever format stores them (the
    matmul flops are 2 per weight): each linear's [out, in], the other 2-D weights (routers),
    top_k routed experts per MoE block, the LM head."""
    layers, head = _decoder(model)
    total = head.weight.numel()
    for layer in layers:
        linears, blocks, others = _layer_parts(layer)
        total += sum(m.output_size * m.input_size for m in linears)
        total += sum(p.numel() for p in others)
        total += sum(b.gate.rule.top_k * 3 * b.experts.inter * b.experts.hidden_size
                     for b in blocks)  # fmt: skip
    return total


def _decoder(model: nn.Module) -> tuple[nn.ModuleList, nn.Module]:
    layers = next((m for name, m in model.named_modules()
                   if name.endswith("layers") and isinstance(m, nn.ModuleList)), None)
    head = getattr(model, "lm_head", None)
    if layers is None or head is None:
        raise ValueError(f"{type(model).__name__} has no decoder `layers` list and `lm_head`; "
                         "the weight-stream floor supports decoder-only language models")
    return layers, head


def _layer_parts(
    layer: nn.Module,
) -> tuple[list[nn.Module], list[DeepseekMoE], list[nn.Parameter]]:
    """(linear layers, MoE blocks, the other 2-D weights: routers) of one decoder layer."""
    from specserve.layers.linear import LinearBase

    linears = [m for m in layer.modules() if isinstance(m, LinearBase)]
    blocks = [m for m in layer.modules() if isinstance(m, DeepseekMoE)]
    owned = {id(p) for m in [*linears, *(b.experts for b in blocks)]
             for p in m.parameters(recurse=False)}  # fmt: skip
    return linears, blocks, [p for p in layer.parameters() if p.dim() == 2 and id(p) not in owned]


def moe_blocks(model: nn.Module) -> list[DeepseekMoE]:
    return [m for m in model.modules() if isinstance(m, DeepseekMoE)]


@torch.inference_mode()
def touched_experts(engine: Any, request_ids: Sequence[str], tokens: int = 1) -> list[int]:
    """Distinct routed experts each MoE block reads in one decode step of these running
    requests (one entry per block; [] for a dense model): each request's newest computed token
    is run again at its position, eagerly, with the routers observed. The KV it rewrites is
    its own slot, with the value it already holds. tokens > 1: each request's newest `tokens`
    computed tokens in one pass, the shape of a speculative verify pass of that many nodes."""
    from specserve.worker.forward_batch import build_attention_metadata

    blocks = moe_blocks(engine.runner.model)
    if not blocks:
        return []
    runner = engine.runner
    reqs = [engine.get_request(rid) for rid in request_ids]
    lasts = [r.num_computed_tokens - 1 for r in reqs]
    positions = [p for last in lasts for p in range(last - tokens + 1, last + 1)]
    ids = [r.all_token_ids[p] for r, last in zip(reqs, lasts)
           for p in range(last - tokens + 1, last + 1)]
    md = build_attention_metadata([tokens] * len(reqs), [p + 1 for p in lasts],
                                  [list(r.page_ids) for r in reqs], runner.page_size,
                                  runner.device)  # fmt: skip
    counts: list[int] = []
    hooks = [b.gate.register_forward_hook(
        lambda _m, _in, out: counts.append(int(out[1].unique().numel()))) for b in blocks]
    try:
        runner.forward(runner.tensor(ids), runner.tensor(positions), md)
    finally:
        for h in hooks:
            h.remove()
    return counts


@dataclass
class FloorPoint:
    batch_size: int
    ms: float  # median of the replays
    weight_bytes: int
    graphed: bool  # one CUDA graph (False: eager launches on the CPU)
    experts_per_layer: list[int] = field(default_factory=list)  # routed experts read (MoE)

    @property
    def bandwidth_gbs(self) -> float:
        """Weight bytes over time; activations are negligible at decode batch sizes."""
        return self.weight_bytes / (self.ms * 1e-3) / 1e9

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bandwidth_gbs": self.bandwidth_gbs}


def _chain(weights: list[torch.Tensor], inputs: dict[tuple, torch.Tensor]) -> None:
    for w in weights:  # w [out, in]; inputs[in, dtype] [bs, in] -> [bs, out], discarded
        torch.mm(inputs[w.shape[1], w.dtype], w.t())


@torch.inference_mode()
def measure_floor(model: nn.Module, batch_sizes: list[int], replays: int = 100,
                  warmup: int = 5, experts: dict[int, list[int]] | None = None
                  ) -> list[FloorPoint]:  # fmt: skip
    """Median time of the weight-stream matmul chain at each batch size; `experts[bs]`: the
    routed experts each MoE block reads at that batch (default: top_k)."""
    points = []
    for bs in batch_sizes:
        touched = (experts or {}).get(bs)
        weights = floor_weights(model, touched)
        device = weights[0].device
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        graphed = device.type == "cuda"
        inputs = {(k, dt): torch.randn(bs, k, device=device, dtype=dt)
                  for k, dt in sorted({(w.shape[1], w.dtype) for w in weights}, key=str)}

        def step(inputs: dict[tuple, torch.Tensor] = inputs,
                 weights: list[torch.Tensor] = weights) -> None:
            _chain(weights, inputs)

        if graphed:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # cuBLAS picks its kernels before capture
                for _ in range(warmup):
                    step()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            run = graph.replay
        else:
            run = step
        time_ms(run, device, warmup)
        ms = statistics.median(time_ms(run, device, replays))
        per_layer = touched or [b.gate.rule.top_k for b in moe_blocks(model)]
        points.append(FloorPoint(bs, ms, nbytes, graphed, list(per_layer)))
        del inputs
        if graphed:
            del graph
    return points


@dataclass
class CopyBandwidth:
    nbytes: int  # size of the copied tensor
    ms: float  # median of the repeats

    @property
    def bandwidth_gbs(self) -> float:
        return 2 * self.nbytes / (self.ms * 1e-3) / 1e9  # each byte read once, written once

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bandwidth_gbs": self.bandwidth_gbs}


@torch.inference_mode()
def measure_copy_bandwidth(device: torch.device, nbytes: int | None = None,
                           repeats: int = 20) -> CopyBandwidth:
    """dst.copy_(src) of `nbytes` bytes (2 GiB on a GPU by default)."""
    nbytes = nbytes or (2 * GIB if device.type == "cuda" else CPU_COPY_BYTES)
    bufs = [torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)]
    bufs.append(torch.empty_like(bufs[0]))

    def copy() -> None:
        bufs[1].copy_(bufs[0])

    time_ms(copy, device, 3)
    ms = statistics.median(time_ms(copy, device, repeats))
    bufs.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # hand the memory back before the engine sizes its KV cache
    return CopyBandwidth(nbytes, ms)


# -- the roofline: weights + KV bytes over bandwidth, flops over peak -------------------------


@dataclass
class MatmulPeak:
    n: int  # [n, n] @ [n, n]
    dtype: str
    ms: float  # median of the repeats

    @property
    def tflops(self) -> float:
        return 2 * self.n**3 / (self.ms * 1e-3) / 1e12

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tflops": self.tflops}


@torch.inference_mode()
def measure_matmul_peak(device: torch.device, dtype: torch.dtype, n: int | None = None,
                        repeats: int = 10) -> MatmulPeak:
    """Achieved throughput of one large square matmul: the compute ceiling of the roofline."""
    n = n or (8192 if device.type == "cuda" else 1024)
    mats = [torch.randn(n, n, device=device, dtype=dtype) for _ in range(2)]

    def mm() -> None:
        torch.mm(mats[0], mats[1])

    time_ms(mm, device, 3)
    ms = statistics.median(time_ms(mm, device, repeats))
    mats.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return MatmulPeak(n, str(dtype).removeprefix("torch."), ms)


def decode_roofline(weight_bytes: int, weight_params: int, kv_bytes_per_token: int,
                    num_layers: int, q_dim: int, batch_size: int, context: float,
                    bandwidth_gbs: float, tflops: float) -> dict[str, Any]:
    """The least time one plain decode step of `batch_size` requests, each attending over
    `context` tokens, can take: max(bytes read / bandwidth, flops / peak).
        bytes = the streamed weights + the K and V of every request at its context
        flops = 2 x weight params x batch (the matmuls) + 4 x q_dim x context x layers x batch
                (q.k and p.v, a multiply-add = 2 flops)
    """
    kv_bytes = batch_size * context * kv_bytes_per_token
    flops = 2 * weight_params * batch_size + 4 * q_dim * context * num_layers * batch_size
    memory_ms = (weight_bytes + kv_bytes) / (bandwidth_gbs * 1e9) * 1e3
    compute_ms = flops / (tflops * 1e12) * 1e3
    return {"ms": max(memory_ms, compute_ms), "memory_ms": memory_ms, "compute_ms": compute_ms,
            "bound": "memory" if memory_ms >= compute_ms else "compute",
            "weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "flops": flops,
            "context": context}


def measure_references(engine: Any, batch_sizes: list[int], floor: bool, compare_hf: bool,
                       prompt: list[int], output_len: int, runs: int, warmup: int,
                       experts: dict[int, list[int]] | None = None) -> dict[str, Any]:
    """The floor at each batch size and the transformers peer at batch 1, as JSON-ready dicts;
    a part not measured carries {"skipped": reason}. `experts`: see measure_floor."""
    from specserve.bench.hf_peer import hf_peer_model, measure_hf_generate
    from specserve.bench.stats import summarize

    out: dict[str, Any] = {}
    if floor:
        points = measure_floor(engine.runner.model, batch_sizes, experts=experts)
        peak = measure_matmul_peak(engine.runner.device, engine.runner.dtype)
        # the weights one token multiplies (a MoE layer: its top_k experts), for the flops
        out["floor"] = {"points": [p.to_dict() for p in points],
                        "weight_params": token_weight_params(engine.runner.model)}
        out["peak"] = peak.to_dict()
    else:
        out["floor"] = {"skipped": "off by default without CUDA; --floor runs an eager CPU form"}
        out["peak"] = {"skipped": "runs with --floor"}
    if not compare_hf:
        out["hf"] = {"skipped": "not asked for (--compare-hf)"}
        return out
    try:
        peer = hf_peer_model(engine)
    except (ValueError, ImportError) as err:
        out["hf"] = {"skipped": str(err)}
        return out
    hf = measure_hf_generate(peer, prompt, output_len, runs, warmup)
    del peer
    out["hf"] = {"mode": hf.mode, "batch_size": 1, "context_len": len(prompt),
                 "tok_s": summarize(hf.tok_s).to_dict(), "tok_s_runs": hf.tok_s}
    return out


def describe_references(report: dict[str, Any], speedup: dict[str, float] | None) -> list[str]:
    """Summary lines of the copy bandwidth, floor and transformers parts of a report;
    `speedup`: specserve's batch-1 tok/s over transformers' per mode."""
    copy, floor, hf, peak = report["copy"], report["floor"], report["hf"], report["peak"]
    lines = [f"copy bandwidth: skipped ({copy['skipped']})" if "skipped" in copy else
             f"copy bandwidth: {copy['bandwidth_gbs']:.0f} GB/s (read + write, "
             f"{copy['nbytes'] / GIB:.2f} GiB)"]
    if "skipped" not in peak:
        lines.append(f"matmul peak: {peak['tflops']:.3g} TFLOP/s ({peak['dtype']}, "
                     f"{peak['n']}^3)")
    lines += [f"floor bs {f['batch_size']}: {f['ms']:.3f} ms, {f['weight_bytes'] / 1e9:.3f} GB "
              f"at {f['bandwidth_gbs']:.0f} GB/s" + ("" if f["graphed"] else " (eager, no graph)")
              + (f", routed experts read per MoE layer {f['experts_per_layer']}"
                 if f.get("experts_per_layer") else "")
              for f in floor.get("points", ())]
    if "skipped" in floor:
        lines.append(f"floor: skipped ({floor['skipped']})")
    if "skipped" in hf:
        return [*lines, f"transformers: skipped ({hf['skipped']})"]
    ratios = ", ".join(f"{m} {v:.2f}x" for m, v in (speedup or {}).items()) or "n/a (no bs 1)"
    return [*lines, f"{hf['mode']}, bs 1 ctx {hf['context_len']}: {hf['tok_s']['mean']:.1f} "
                    f"tok/s; specserve over it: {ratios}"]
