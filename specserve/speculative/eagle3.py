"""Eagle3Proposer: EAGLE-3 drafting (a one-layer head over the target's aux hidden states).

Positions, for a running request whose root (last emitted token, KV not yet computed) sits at
target position P:
    draft KV   covers [0, P)          draft position i pairs feature f_i with token t_{i+1}
    state      the head's output at draft position P-1 ("last_out"); it predicts the
               depth-1 candidates
Draft tree step s (1 .. num_steps-1) runs the k frontier nodes of depth s at RoPE position
P + s - 1 and writes their scratch K/V at slot positions P + (s-1)*k + j of the draft layer;
each query sees the draft prefix plus its ancestors among the scratch (a custom mask of width
s*k). After verification the draft is extended over the m emitted tokens with the target
features of the accepted nodes, which overwrites the scratch. The draft layer is one more
layer of the target's KV pool, addressed through the same page tables.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from specserve.config import ModelConfig, SpecConfig
from specserve.kernels.topk import top_log_probs
from specserve.layers.attention_metadata import ForwardContext, set_forward_context
from specserve.layers.rotary import ensure_rope_capacity
from specserve.models.capture import default_aux_layer_ids, find_embedding_and_head
from specserve.models.eagle3 import Eagle3Head, load_eagle3_head
from specserve.speculative.cycle import kv_slots
from specserve.speculative.extend_graphs import ExtendGraphs
from specserve.speculative.features import bind_draft_layers
from specserve.speculative.proposer import DraftShape
from specserve.speculative.tree import DraftTree, TreeAccumulator
from specserve.speculative.verify import VerifyResult
from specserve.worker.forward_batch import build_attention_metadata

DUMMY = "dummy"  # --spec-draft-model dummy: a random head (cost benchmarks)


def load_draft_config(spec: SpecConfig, target_cfg: ModelConfig) -> ModelConfig:
    if not spec.draft_model:
        raise ValueError("speculative algorithm eagle3 needs --spec-draft-model PATH")
    from specserve.models.loader import resolve_model_path

    if spec.draft_model == DUMMY:  # the target's shape, a 32k draft vocabulary
        cfg = dataclasses.replace(target_cfg, draft_vocab_size=min(32000, target_cfg.vocab_size))
        if cfg.mla is not None or cfg.moe is not None:
            # MLA / MoE targets (DeepSeek-V3, Kimi K2): a Llama-style head on the target's
            # hidden size, GQA with 8 KV heads of 128 dims and the dense MLP width, the shape
            # of the public Llama heads for these targets
            cfg = dataclasses.replace(cfg, mla=None, moe=None, num_mtp_layers=0, head_dim=128,
                                      num_kv_heads=math.gcd(8, cfg.num_heads))
    else:
        cfg = ModelConfig.from_hf(resolve_model_path(spec.draft_model))
    DraftShape.from_config(spec)  # validates the tree size
    # the head runs in the activation dtype whatever the target's format: a draft config
    # copied from (or derived from) a quantized target must not carry its quantization
    return dataclasses.replace(cfg, num_layers=1, quantization=None)


def resolve_aux_layer_ids(head_cfg: ModelConfig, convention: str,
                          num_target_layers: int) -> tuple[int, ...]:
    """The decoder layers whose INPUT residual streams the head reads (capture's convention).
    convention (SpecConfig.aux_layer_convention): "auto" takes the head config's own; with
    "output" an id i means the stream leaving layer i, i.e. entering layer i + 1."""
    ids = head_cfg.aux_layer_ids
    if not ids:
        return default_aux_layer_ids(num_target_layers)
    meaning = head_cfg.aux_layer_convention if convention == "auto" else convention
    if meaning not in ("input", "output"):
        raise ValueError(f"eagle_config.aux_layer_convention must be 'input' or 'output', got "
                         f"{meaning!r}")
    if meaning == "output":
        ids = tuple(i + 1 for i in ids)
    if max(ids) >= num_target_layers or min(ids) < 0:
        raise ValueError(
            f"the head reads target layers {tuple(head_cfg.aux_layer_ids)} ({meaning} "
            f"convention) but the target has {num_target_layers} decoder layers; check "
            "--spec-aux-layer-convention")
    return tuple(ids)


class Eagle3Proposer:
    needs_target_features = True
    keeps_state = True
    extend_graphs: ExtendGraphs | None = None  # `extend` through CUDA graphs (graph_extends)

    def __init__(self, spec: SpecConfig, runner) -> None:  # runner: ModelRunner
        self.runner = runner
        self.head = self._load_head(spec, runner)
        self.num_kv_layers = 1
        # RoPE tables cover every position before any graph is captured (no growth later)
        ensure_rope_capacity(self.head, runner.max_positions)
        bind_draft_layers(runner, [self.head.midlayer.attn])
        tlayers = runner.model_config.num_layers
        self.aux_layer_ids = resolve_aux_layer_ids(self.head.config, spec.aux_layer_convention,
                                                   tlayers)
        self.d2t = self.head.d2t if self.head.config.draft_vocab_size else None
        self.state_dim = self.head.config.hidden_size
        self.state_dtype = runner.dtype
        # the draft KV of a page is a function of its tokens (and the next one), given the
        # head's weights and the target features it reads
        self.prefix_cache_key = f"eagle3 head={spec.draft_model} aux={list(self.aux_layer_ids)}"

    @staticmethod
    def _load_head(spec: SpecConfig, runner) -> Eagle3Head:
        from specserve.models.loader import resolve_model_path

        target, tcfg, layer = runner.model, runner.model_config, len(runner.attn_layers)
        if spec.draft_model != DUMMY:
            return load_eagle3_head(resolve_model_path(spec.draft_model), target, tcfg, layer,
                                    runner.dtype, runner.device)
        from specserve.models.presets import random_init

        cfg = load_draft_config(spec, tcfg)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(runner.dtype)
        try:
            with torch.device(runner.device):
                head = Eagle3Head(cfg, tcfg.hidden_size, layer, *find_embedding_and_head(target))
        finally:
            torch.set_default_dtype(previous)
        random_init(head, seed=1)
        if hasattr(head, "lm_head"):
            # confident like a trained head, so trees grow to full depth (cost benchmarks)
            head.lm_head.weight.data.mul_(50.0)
        return head.eval()

    def scratch_slots(self, shape: DraftShape) -> int:
        return shape.topk * (shape.num_steps - 1)

    def release(self, request_id: str) -> None:
        """Nothing to drop: the worker holds each request's state, its pages the draft KV."""

    def _head(self, ids: torch.Tensor, positions: torch.Tensor, g: torch.Tensor,
              md) -> torch.Tensor:
        set_forward_context(ForwardContext(md, self.runner.backend))
        try:
            return self.head(ids, positions, g)
        finally:
            set_forward_context(None)

    # -- inside the cycle (device only) --------------------------------------------------------
    def propose(self, shape: DraftShape, state: torch.Tensor, root_pos: torch.Tensor,
                root_tokens: torch.Tensor, page_table: torch.Tensor,
                valid: torch.Tensor) -> DraftTree:
        """The EAGLE-2 tree from the head's last output: num_steps - 1 head forwards; step s
        writes its k scratch K/V at positions P + (s-1)k .. P + sk - 1 of the draft layer and
        each query sees the draft prefix plus its ancestors among the scratch."""
        head, k, runner = self.head, shape.topk, self.runner
        last_out = state
        bs, hidden = last_out.shape
        scratch_span = torch.arange(max(shape.num_steps - 1, 1) * k, device=last_out.device)
        scratch_slots = kv_slots(page_table, root_pos[:, None] + scratch_span, runner.page_size,
                                 valid)
        logp, draft_ids = top_log_probs(head.compute_logits(last_out), k)
        acc = TreeAccumulator(logp, draft_ids, self.d2t)
        parent_out = last_out[:, None, :].expand(bs, k, hidden)  # [bs, k, H]
        for s in range(1, shape.num_steps):
            cols = torch.arange(s, device=last_out.device) * k + acc.frontier_path  # [bs, k, s]
            mask = torch.zeros(bs, k, s * k, dtype=torch.bool, device=last_out.device)
            mask.scatter_(2, cols, True)
            scratch = scratch_slots[:, (s - 1) * k:s * k]  # slots of P + (s-1)k .. P + sk - 1
            md = runner.graph_metadata(scratch.contiguous(), (root_pos + s * k).int(),
                                       page_table, k, mask)
            positions = (root_pos + s - 1)[:, None].expand(bs, k)
            y = self._head(acc.frontier_tokens.reshape(-1), positions.reshape(-1),
                           parent_out.reshape(bs * k, hidden), md).view(bs, k, hidden)
            child_logp, child_ids = top_log_probs(head.compute_logits(y.flatten(0, 1)), k)
            acc.extend(child_logp.view(bs, k, k), child_ids.view(bs, k, k))
            # each new frontier slot continues from its parent's output
            parent = acc.frontier_path[:, :, -2:-1].expand(-1, -1, hidden)
            parent_out = y.gather(1, parent)
        return acc.build(root_tokens, shape.num_draft_tokens)

    def extend_accepted(self, shape: DraftShape, result: VerifyResult,
                        feats: torch.Tensor | None, root_pos: torch.Tensor,
                        page_table: torch.Tensor, valid: torch.Tensor,
                        window: torch.Tensor) -> torch.Tensor:
        """Draft KV over the emitted tokens: pairs (feature of accepted node j, emitted token j)
        at positions P + j, padded to W tokens per request (padding writes nothing)."""
        assert feats is not None
        bs, w = result.emitted.shape
        hidden = self.head.config.hidden_size
        j = torch.arange(w, device=root_pos.device)
        pos = root_pos[:, None] + j  # [bs, W]
        live = valid[:, None] & (j[None, :] < result.num_emitted[:, None])
        slots = torch.where(live, window[:, :w], -1)
        md = self.runner.graph_metadata(slots, (root_pos + w).int(), page_table, w)
        nodes = result.accepted_nodes.clamp(min=0)
        f = feats.gather(1, nodes[:, :, None].expand(-1, -1, feats.shape[-1]))  # [bs, W, 3H]
        y = self._head(result.emitted.clamp(min=0).reshape(-1), pos.reshape(-1),
                       f.reshape(bs * w, -1), md).view(bs, w, hidden)
        last = (result.num_emitted - 1).clamp(min=0)[:, None, None].expand(-1, 1, hidden)
        return y.gather(1, last).squeeze(1)

    # -- outside the cycle ---------------------------------------------------------------------
    def graph_extends(self, max_tokens: int, max_rows: int, capture: bool = True) -> bool:
        """Capture `extend` per token bucket up to max_tokens over max_rows rows
        (speculative/extend_graphs.py); False where the head's attention does not take them."""
        if not ExtendGraphs.fits(self.head):
            return False
        width = len(self.aux_layer_ids) * self.runner.model_config.hidden_size
        self.extend_graphs = ExtendGraphs(self._head, self.runner, self.head, width, max_tokens,
                                          max_rows, capture)
        return True

    def extend(self, starts: list[int], page_tables: list[list[int]],
               next_tokens: list[list[int]], feats: torch.Tensor | None,
               last: torch.Tensor | None = None) -> torch.Tensor:
        """Draft KV over positions [start, start + m) of each row with pairs (feature f_i,
        token t_{i+1}); returns the head's output at each row's last position [bs, H].
        last [bs] (device): each row's final t_{i+1}, over the host's."""
        assert feats is not None
        runner = self.runner
        q_lens = [len(t) for t in next_tokens]
        ends = runner.tensor(q_lens).cumsum(0) - 1
        if self.extend_graphs is not None:
            y = self.extend_graphs.run(starts, page_tables, next_tokens, feats, last)
            if y is not None:
                return y.index_select(0, ends)
        md = build_attention_metadata(q_lens, [a + q for a, q in zip(starts, q_lens)],
                                      page_tables, runner.page_size, runner.device)
        ids = runner.tensor([t for row in next_tokens for t in row])
        if last is not None:
            ids = ids.index_copy(0, ends, last)
        positions = runner.tensor([a + i for a, q in zip(starts, q_lens) for i in range(q)])
        return self._head(ids, positions, feats, md).index_select(0, ends)
