"""EAGLE-3 heads name their target layers by one of two conventions (input of layer i, or its
output): written either way, the same layers are read and the same tokens and acceptance
come out; an id past the target is refused naming the flag."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from tiny_eagle import make_tiny_eagle3_head
from tiny_models import make_tiny_checkpoint

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams


def _with_ids(src: str, dst: str, ids: list[int], convention: str | None) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as fh:
        cfg = json.load(fh)
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    if convention is not None:
        cfg["eagle_config"]["aux_layer_convention"] = convention
    with open(path, "w") as fh:
        json.dump(cfg, fh)
    return dst


@pytest.fixture(scope="module")
def heads(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, str]:
    root = tmp_path_factory.mktemp("aux")
    target = make_tiny_checkpoint(root / "t", family="llama", tokenizer=True,
                                  num_hidden_layers=6)
    head = make_tiny_eagle3_head(str(root / "h"), target, draft_vocab_size=128)
    as_input = _with_ids(head, str(root / "in"), [1, 3, 5], None)
    as_output = _with_ids(head, str(root / "out"), [0, 2, 4], "output")
    return target, as_input, as_output


def _run(target: str, head: str, **spec) -> tuple[list[list[int]], tuple, int]:
    with LLM(target, device="cpu", dtype="float32", speculative_config={
            "method": "eagle3", "model": head, "num_speculative_tokens": 3, **spec}) as llm:
        outs = llm.generate([[5, 9, 33, 71], [100, 7, 7, 250, 3]],
                            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        ids = llm.engine.drafter.proposer.aux_layer_ids
        return [o.token_ids for o in outs], ids, sum(o.spec_accepted_tokens for o in outs)


def test_both_conventions_read_the_same_layers(heads) -> None:
    target, as_input, as_output = heads
    tokens_in, ids_in, acc_in = _run(target, as_input)
    tokens_out, ids_out, acc_out = _run(target, as_output)
    assert ids_in == ids_out == (1, 3, 5)
    assert tokens_in == tokens_out and acc_in == acc_out
    # the per-run override: the input-convention head read as "output" shifts by one
    assert _run(target, as_output, aux_layer_convention="input")[1] == (0, 2, 4)


def test_an_id_past_the_target_is_refused(heads) -> None:
    target, as_input, _ = heads
    with pytest.raises(ValueError, match="aux-layer-convention"):
        _run(target, as_input, aux_layer_convention="output")  # 5 + 1 = 6 layers: none
