"""The torch reference backend honours the width-W custom mask (draft tree steps: the mask
covers more KV entries than there are queries), checked against the kernels' own reference."""

from __future__ import annotations

import torch

from specserve.kernels.paged_attention import paged_attention_ref
from specserve.layers.backends.torch_ref import TorchRefBackend
from specserve.worker.forward_batch import build_attention_metadata


def test_wide_custom_mask_matches_independent_reference() -> None:
    g = torch.Generator().manual_seed(0)
    ps, kvh, heads, hd, num_pages = 4, 2, 4, 8, 32
    k_cache = torch.randn(num_pages, ps, kvh, hd, generator=g)
    v_cache = torch.randn(num_pages, ps, kvh, hd, generator=g)
    q_lens, widths, seq_lens = [2, 3], [6, 3], [11, 9]
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables = [perm[:3], perm[3:6]]
    t = sum(q_lens)
    q = torch.randn(t, heads, hd, generator=g)
    k = torch.randn(t, kvh, hd, generator=g)
    v = torch.randn(t, kvh, hd, generator=g)
    for r in range(2):  # each request alone, with its own mask width
        sl = slice(sum(q_lens[:r]), sum(q_lens[: r + 1]))
        m = torch.rand(1, q_lens[r], widths[r], generator=g) > 0.5
        md = build_attention_metadata([q_lens[r]], [seq_lens[r]], [tables[r]], ps, "cpu",
                                      custom_mask=m)
        kc, vc = k_cache.clone(), v_cache.clone()
        got = TorchRefBackend().forward(q[sl], k[sl], v[sl], kc, vc, md, 0.3)
        want = paged_attention_ref(q[sl], kc, vc, md.query_start_loc, md.seq_lens,
                                   md.page_table, 0.3, custom_mask=md.custom_mask)
        assert torch.allclose(got, want, atol=1e-5), r
        # the queries must see prefix entries and only the masked scratch entries: changing
        # an entry the mask hides must not change the output
        hidden_cols = (~m[0]).all(dim=0).nonzero().flatten().tolist()
        if hidden_cols:
            pos = seq_lens[r] - widths[r] + hidden_cols[0]
            if pos < seq_lens[r] - q_lens[r]:  # not one of the entries written this step
                slot = tables[r][pos // ps] * ps + pos % ps
                kc.view(-1, kvh, hd)[slot] += 5.0
                again = TorchRefBackend().forward(q[sl], k[sl], v[sl], kc, vc, md, 0.3)
                assert torch.allclose(again, got, atol=1e-5)
