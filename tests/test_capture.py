"""EAGLE-3 aux hidden-state capture vs transformers' output_hidden_states."""

from __future__ import annotations

import pytest
import torch
from engine_drivers import PagedSession
from tiny_models import make_hf_model, make_tiny_checkpoint
from torch import nn

from specserve.config import ModelConfig
from specserve.models.capture import (
    AuxHiddenCapture,
    default_aux_layer_ids,
    final_hidden_id,
    find_decoder_layers,
)
from specserve.models.loader import load_model

NUM_LAYERS = 8
IDS = default_aux_layer_ids(NUM_LAYERS)  # (2, 4, 5)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = make_tiny_checkpoint(
        tmp_path_factory.mktemp("cap"), "qwen3", num_hidden_layers=NUM_LAYERS
    )
    hf = make_hf_model("qwen3", num_hidden_layers=NUM_LAYERS)
    model = load_model(ModelConfig.from_hf(path), path, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (6, 11)]
    with torch.no_grad():
        states = [hf(torch.tensor([p]), output_hidden_states=True).hidden_states for p in prompts]
    # expected capture per prompt: [len, 3 * H], HF hidden_states[i] for i in IDS
    refs = [torch.cat([s[i][0] for i in IDS], dim=-1) for s in states]
    return {"hf": hf, "model": model, "prompts": prompts, "refs": refs}


def test_default_ids() -> None:
    assert default_aux_layer_ids(32) == (2, 16, 29)
    assert IDS == (2, 4, 5)


def _prefill_then_decode(
    model: nn.Module, capture: AuxHiddenCapture, prompts: list[list[int]]
) -> list[torch.Tensor]:
    """Prefill all but the last token of each prompt, then one decode step; per prompt the
    captured states of every position [len, 3H]."""
    session = PagedSession(model)
    heads = {r: p[:-1] for r, p in enumerate(prompts)}
    session.step(heads)
    first = capture.pop().split([len(h) for h in heads.values()])
    session.step({r: p[-1:] for r, p in enumerate(prompts)})
    last = capture.pop()  # [bs, 3H]
    return [torch.cat([first[r], last[r : r + 1]]) for r in range(len(prompts))]


def test_capture_matches_hidden_states(setup: dict) -> None:
    capture = AuxHiddenCapture(setup["model"], IDS)
    try:
        got = _prefill_then_decode(setup["model"], capture, setup["prompts"])
    finally:
        capture.remove()
    for g, ref in zip(got, setup["refs"]):
        assert g.shape == ref.shape
        torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-5)


class _VisionTower(nn.Module):
    """A decoy with a longer layer stack and a patch embedding (not a token table)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, 8, 2)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(12))


class _VisionLanguage(nn.Module):
    def __init__(self, language_model: nn.Module) -> None:
        super().__init__()
        self.vision_tower = _VisionTower()
        self.language_model = language_model


def test_capture_through_a_wrapper(setup: dict) -> None:
    wrapper = _VisionLanguage(setup["model"])
    assert find_decoder_layers(wrapper) is setup["model"].model.layers
    capture = AuxHiddenCapture(wrapper, IDS)
    try:
        got = _prefill_then_decode(wrapper.language_model, capture, setup["prompts"])
    finally:
        capture.remove()
    for g, ref in zip(got, setup["refs"]):
        torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-5)


def test_capture_on_the_transformers_model(setup: dict) -> None:
    """The same hooks work on a model whose layers take `hidden_states` alone."""
    capture = AuxHiddenCapture(setup["hf"], [5, 2])  # given out of order: output low -> high
    try:
        with torch.no_grad():
            setup["hf"](torch.tensor([setup["prompts"][1]]))
        got = capture.pop()
    finally:
        capture.remove()
    ref = setup["refs"][1]
    H = ref.shape[-1] // 3
    torch.testing.assert_close(got[0], torch.cat([ref[:, :H], ref[:, 2 * H :]], -1))


def test_disable_enable_and_bad_ids(setup: dict) -> None:
    model = setup["model"]
    capture = AuxHiddenCapture(model, IDS)
    try:
        capture.disable()
        PagedSession(model).step({0: setup["prompts"][0]})
        with pytest.raises(AssertionError, match="no state recorded"):
            capture.pop()
        capture.enable()
        PagedSession(model).step({0: setup["prompts"][0]})
        torch.testing.assert_close(capture.pop(), setup["refs"][0], atol=1e-5, rtol=1e-5)
    finally:
        capture.remove()
    with pytest.raises(ValueError, match=r"\[0, 8\]"):
        AuxHiddenCapture(model, [2, 9])


def test_final_hidden_state_id(setup: dict) -> None:
    """Id N (one past the last layer) is the model's final, post-norm hidden state:
    transformers' last_hidden_state, next to the layer inputs it is captured with."""
    model = setup["model"]
    capture = AuxHiddenCapture(model, [final_hidden_id(model), 2])
    try:
        hidden = PagedSession(model).step({0: setup["prompts"][0]}, logits=False)[0]
        got = capture.pop()
    finally:
        capture.remove()
    with torch.no_grad():
        want = setup["hf"].model(torch.tensor([setup["prompts"][0]])).last_hidden_state[0]
    H = want.shape[-1]
    torch.testing.assert_close(got[:, H:], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[:, H:], hidden)
    torch.testing.assert_close(got[:, :H], setup["refs"][0][:, :H], atol=1e-5, rtol=1e-5)
