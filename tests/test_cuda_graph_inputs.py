"""StaticInputs (the graph input staging) on the CPU: rows, padding, widths, device values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.worker.cuda_graph import SMALL_ROW_BYTES, StaticInputs, batch_buckets


def make(max_bs: int = 8, pages: int = 6) -> StaticInputs:
    specs = {
        "ids": torch.zeros(max_bs, 1, dtype=torch.long),
        "seq_lens": torch.zeros(max_bs, dtype=torch.int32),
        "valid": torch.zeros(max_bs, dtype=torch.bool),
        "temps": torch.zeros(max_bs, dtype=torch.float32),
        "table": torch.zeros(max_bs, pages, dtype=torch.int32),
        "hidden": torch.zeros(max_bs, 16, dtype=torch.bfloat16),
    }
    pads = {"ids": 0, "seq_lens": 1, "valid": False, "temps": 0.5, "table": 99, "hidden": 0.0}
    return StaticInputs(specs, pads)


def test_small_inputs_share_one_block_and_wide_ones_do_not() -> None:
    st = make()
    block = st._block.untyped_storage().data_ptr()
    for key in ("ids", "seq_lens", "valid", "temps"):
        assert st.buffers[key].untyped_storage().data_ptr() == block, key
    for key in ("table", "hidden"):  # rows wider than SMALL_ROW_BYTES
        assert st.buffers[key][0].numel() * st.buffers[key].element_size() > SMALL_ROW_BYTES
        assert st.buffers[key].untyped_storage().data_ptr() != block, key
    # views do not overlap: writing one leaves the others at their pads
    st.buffers["ids"].fill_(7)
    assert st.buffers["seq_lens"].eq(1).all() and st.buffers["temps"].eq(0.5).all()


def test_load_rows_pads_and_width() -> None:
    st = make()
    rng = np.random.default_rng(0)
    for bs, bucket in [(3, 4), (1, 1), (8, 8), (5, 8), (2, 2)]:
        width = int(rng.integers(1, 7))
        table = rng.integers(0, 50, (bs, width)).astype(np.int32)
        before = st.buffers["table"].clone()
        hidden = torch.randn(bs, 16).to(torch.bfloat16)
        st.load(bs, bucket, {
            "ids": rng.integers(0, 100, (bs, 1)), "seq_lens": list(range(10, 10 + bs)),
            "valid": np.ones(bs, dtype=bool), "temps": torch.full((bs,), 0.25),
            "table": table, "hidden": hidden}, widths={"table": width})
        b = st.buffers
        assert b["seq_lens"][:bs].tolist() == list(range(10, 10 + bs))
        assert b["seq_lens"][bs:bucket].eq(1).all() and not b["valid"][bs:bucket].any()
        assert b["valid"][:bs].all() and b["temps"][:bs].eq(0.25).all()
        assert b["temps"][bs:bucket].eq(0.5).all()
        assert torch.equal(b["table"][:bs, :width], torch.from_numpy(table))
        assert b["table"][bs:bucket, :width].eq(99).all()
        # columns past the width and rows past the bucket are not copied
        assert torch.equal(b["table"][:, width:], before[:, width:])
        assert torch.equal(b["table"][bucket:], before[bucket:])
        assert torch.equal(b["hidden"][:bs], hidden) and b["hidden"][bs:bucket].eq(0).all()


def test_reset_and_buckets() -> None:
    st = make()
    st.load(2, 2, {"ids": [[1], [2]], "seq_lens": [3, 4], "valid": [True, True],
                   "temps": [1.0, 1.0], "table": np.zeros((2, 6), np.int32),
                   "hidden": torch.ones(2, 16)})
    st.reset()
    assert st.buffers["table"].eq(99).all() and st.buffers["seq_lens"].eq(1).all()
    assert batch_buckets(128) == [1, 2, 4, 8, *range(16, 128, 16), 128]
    assert batch_buckets(4) == [1, 2, 4] and batch_buckets(1) == [1]


def test_wrong_row_count_is_an_error() -> None:
    st = make()
    with pytest.raises(ValueError):
        st.load(3, 4, {"ids": [[1], [2]], "seq_lens": [1, 2, 3], "valid": [1, 1, 1],
                       "temps": [1, 1, 1], "table": np.zeros((3, 6), np.int32),
                       "hidden": torch.zeros(3, 16)})
