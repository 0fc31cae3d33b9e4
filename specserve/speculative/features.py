"""Target features of several drafters from one capture: the worker hooks the target once,
over the union of the aux layer ids its drafters read (AuxHiddenCapture concatenates them low
-> high), and each drafter reads its own layers' columns through a `FeatureView`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.models.capture import AuxHiddenCapture


class FeatureView:
    """AuxHiddenCapture's interface (enable / disable / pop / remove) for a subset of its
    layers; pop() -> [T, len(layer_ids) * H], the drafter's layers low -> high."""

    def __init__(self, capture: AuxHiddenCapture, layer_ids: Sequence[int], hidden: int,
                 device: torch.device) -> None:
        self.capture = capture
        ids = sorted(layer_ids)  # AuxHiddenCapture's order; a repeated id repeats its block
        self.cols = None
        if ids != list(capture.layer_ids):
            pos = [capture.layer_ids.index(i) for i in ids]
            self.cols = torch.tensor([p * hidden + c for p in pos for c in range(hidden)],
                                     device=device)

    def enable(self) -> None:
        self.capture.enable()

    def disable(self) -> None:
        self.capture.disable()

    def select(self, feats: torch.Tensor) -> torch.Tensor:
        """This drafter's columns of features popped from the shared capture."""
        return feats if self.cols is None else feats.index_select(-1, self.cols)

    def pop(self) -> torch.Tensor:
        return self.select(self.capture.pop())

    def remove(self) -> None:
        self.capture.remove()


def bind_draft_layers(runner, modules: list) -> None:
    """Bind a drafter's attention modules to the pool's draft layers, after the target's and
    after any drafter bound before it (the order the worker lists its KV specs in)."""
    first = len(runner.attn_layers) + getattr(runner, "draft_layers_bound", 0)
    runner.kv_pool.bind(modules, first_layer=first)
    runner.draft_layers_bound = first - len(runner.attn_layers) + len(modules)
