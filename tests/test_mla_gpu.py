"""The MLA layer on the Triton backend on CUDA (marker `gpu`), fp32 so the 1e-4 bound holds:
test_mla.py's checks against transformers (every config and form, each schedule, a tree
verify), and a decode forward captured in a CUDA graph replayed over steps."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from engine_drivers import PagedSession
from mla_reference import (
    CASES,
    CONFIGS,
    FORMS,
    LayerOnly,
    Pair,
    check_schedule,
    make_inputs,
    tree_verify,
)

from specserve.layers.attention_metadata import (
    AttentionMetadata,
    ForwardContext,
    set_forward_context,
)

HAS_CUDA = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_layer_matches_transformers_gpu(name: str, form: str) -> None:
    from specserve.layers.backends.triton_backend import TritonBackend

    pair = Pair(name, form, "cuda")
    for i, (kind, lens, page_size) in enumerate(CASES):
        check_schedule(pair, kind, lens, page_size, "cuda", TritonBackend(), seed=i)
    tree_verify(Pair(name, "auto", "cuda"), "cuda", TritonBackend())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA and triton")
def test_cuda_graph_decode_gpu() -> None:
    """One decode forward of the layer captured in a CUDA graph (metadata without host
    lengths, as the runner's graphs build it), replayed over steps with new positions, slots,
    sequence lengths and page tables: each replay equals transformers at that position."""
    from specserve.layers.backends.triton_backend import TritonBackend

    pair = Pair("yarn_interleaved", "auto", "cuda")
    prompts, steps, h = [5, 9, 14], 6, pair.cfg.hidden_size
    xs = make_inputs([p + steps for p in prompts], h, "cuda", 9)
    session = PagedSession(
        LayerOnly(pair.ours, torch.cat([x[:p] for x, p in zip(xs, prompts)])), page_size=4
    )
    session.backend = TritonBackend()
    session.step(
        {r: list(range(sum(prompts[:r]), sum(prompts[: r + 1]))) for r in range(len(prompts))},
        logits=False,
    )
    pair.ours.rotary.ensure_capacity(256)
    bs, dev = len(prompts), "cuda"
    hidden = torch.zeros(bs, h, device=dev)
    positions = torch.zeros(bs, dtype=torch.long, device=dev)
    slots = torch.zeros(bs, dtype=torch.long, device=dev)
    seq_lens = torch.ones(bs, dtype=torch.int32, device=dev)
    page_table = torch.zeros(bs, 16, dtype=torch.int32, device=dev)
    md = AttentionMetadata(
        slots, torch.arange(bs + 1, dtype=torch.int32, device=dev), seq_lens, page_table, 1, 256
    )
    set_forward_context(ForwardContext(md, session.backend))
    try:
        with torch.no_grad():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                pair.ours(positions, hidden)  # warm-up (compiles the kernels)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = pair.ours(positions, hidden)
    finally:
        set_forward_context(None)
    want = [pair.reference(x) for x in xs]
    for step in range(steps):
        for r, p in enumerate(prompts):
            pos = p + step
            pages = session.pages[r]
            while len(pages) * 4 <= pos:
                pages.append(session.free.pop())
            hidden[r] = xs[r][pos]
            positions[r] = pos
            slots[r] = pages[pos // 4] * 4 + pos % 4
            seq_lens[r] = pos + 1
            page_table[r, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        graph.replay()
        for r, p in enumerate(prompts):
            err = (out[r] - want[r][p + step]).abs().max().item()
            assert err < 1e-4, f"step {step} request {r}: max abs diff {err:.3g}"
