"""Target-side capture of EAGLE-3 aux hidden states, for any model, without model code.

Convention: the aux state of layer i is the residual stream ENTERING decoder layer i, i.e.
transformers' `output_hidden_states[i]`. Our decoder layers hand that stream to their
`observe_stream` callback (under tensor parallelism their hidden input is a partial sum, so
the stream exists only after the layer's first all-reduce + norm). Any other layer gets a
forward pre-hook reading its call: `hidden_states=` alone, or `(positions, hidden,
residual)` where residual None means `hidden` is the whole stream, else hidden + residual.

Id len(layers), one past the last decoder layer, is the model's FINAL hidden state: what its
forward returns, after the final norm, the state its LM head reads (a forward hook on the
model itself; the MTP drafter's feature).

CUDA graphs: the hooks only record tensors. Call `pop()` inside the captured region, right
after the forward, and keep its result as a graph output: replay refills it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from specserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """Low, middle and high capture layers: (2, N // 2, N - 3)."""
    return (2, num_layers // 2, num_layers - 3)


def final_hidden_id(model: nn.Module) -> int:
    """The capture id of the model's final hidden state (its forward's output)."""
    return len(find_decoder_layers(model))


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The language model's decoder layers, found by structure, not by class.

    Candidates are non-empty ModuleLists of one repeated module type. The decoder stack is the
    one whose parent also holds a token embedding table, which sets it apart from vision or
    audio towers (patch embeddings are not lookup tables); ties go to the longest list.
    """
    token_tables = (nn.Embedding, VocabParallelEmbedding)
    scored: list[tuple[bool, int, nn.ModuleList]] = []
    for parent in model.modules():
        children = list(parent.children())
        has_table = any(isinstance(c, token_tables) for c in children)
        for child in children:
            if (
                isinstance(child, nn.ModuleList)
                and len(child)
                and len({type(m) for m in child}) == 1
            ):
                scored.append((has_table, len(child), child))
    if not scored:
        raise ValueError(
            f"found no decoder layers in {type(model).__name__}: expected an nn.ModuleList of "
            f"decoder layers (e.g. model.layers)"
        )
    return max(scored, key=lambda s: (s[0], s[1]))[2]


def find_embedding_and_head(model: nn.Module) -> tuple[VocabParallelEmbedding, ParallelLMHead]:
    """The language model's token embedding (the table beside its decoder layers) and its LM
    head (the model's one ParallelLMHead), found by structure: a wrapper class needs no hook."""
    layers = find_decoder_layers(model)
    parent = next(m for m in model.modules() if any(c is layers for c in m.children()))
    tables = [c for c in parent.children() if isinstance(c, VocabParallelEmbedding)]
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    if len(tables) != 1 or len(heads) != 1:
        raise ValueError(
            f"{type(model).__name__}: expected one token embedding beside the decoder layers "
            f"and one LM head, found {len(tables)} and {len(heads)}"
        )
    return tables[0], heads[0]


def _residual_stream(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """hidden (+ residual) from a decoder layer's call: (positions, hidden, residual) or a
    `hidden_states=` / `residual=` keyword call."""
    if "hidden_states" in kwargs:
        hidden, residual = kwargs["hidden_states"], kwargs.get("residual")
    else:
        floats = [i for i, a in enumerate(args) if torch.is_tensor(a) and a.is_floating_point()]
        assert floats, "decoder layer called without a floating-point hidden state"
        i = floats[0]
        hidden = args[i]
        residual = kwargs.get("residual", args[i + 1] if len(args) > i + 1 else None)
    if residual is None or not torch.is_tensor(residual):
        return hidden
    return hidden + residual


class AuxHiddenCapture:
    """Records the residual stream entering `layer_ids` on every forward.

    pop() -> [T, len(layer_ids) * H], the states concatenated low -> high, and clears. A
    repeated id (small models: default ids may collide) repeats its state, keeping the width.
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int]) -> None:
        layers = find_decoder_layers(model)
        ids = tuple(sorted(layer_ids))
        if not ids or ids[0] < 0 or ids[-1] > len(layers):
            raise ValueError(
                f"aux layer ids {tuple(layer_ids)} must lie in [0, {len(layers)}] for a model "
                f"with {len(layers)} decoder layers ({len(layers)}: its final hidden state)"
            )
        self.layer_ids = ids
        self.enabled = True
        self._states: dict[int, torch.Tensor] = {}
        self._observed: list[nn.Module] = []
        self._handles = []
        for i in sorted(set(ids)):
            if i == len(layers):  # the final hidden state: the model's own output
                self._handles.append(model.register_forward_hook(self._output(i)))
            elif hasattr(layers[i], "observe_stream"):
                layers[i].observe_stream = self._record(i)
                self._observed.append(layers[i])
            else:
                self._handles.append(
                    layers[i].register_forward_pre_hook(self._hook(i), with_kwargs=True)
                )

    def _record(self, layer_id: int) -> Any:
        def record(stream: torch.Tensor) -> None:
            if self.enabled:
                self._states[layer_id] = stream

        return record

    def _output(self, layer_id: int) -> Any:
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if not torch.is_tensor(output):
                raise TypeError(f"{type(module).__name__}'s forward returns "
                                f"{type(output).__name__}: capturing the final hidden state "
                                "needs a model returning the hidden states [T, H]")
            if self.enabled:
                self._states[layer_id] = output

        return hook

    def _hook(self, layer_id: int) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self.enabled:
                self._states[layer_id] = _residual_stream(args, kwargs)

        return hook

    def enable(self) -> None:
        self.enabled = True

    def disable(self) -> None:
        self.enabled = False
        self._states.clear()

    def pop(self) -> torch.Tensor:
        missing = [i for i in self.layer_ids if i not in self._states]
        assert not missing, f"no state recorded for layers {missing}: forward ran disabled?"
        out = torch.cat([self._states[i] for i in self.layer_ids], dim=-1)
        self._states.clear()
        return out

    def remove(self) -> None:
        """Detach the hooks from the model."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for layer in self._observed:
            layer.observe_stream = None
        self._observed.clear()
