"""One rank's worker: the model runner and, with speculation, the speculative worker over it.

Rank 0 builds it in the engine process, every other TP rank in its worker process
(engine/tp_worker.py), from the same resolved EngineConfig: each holds its shard of the
weights and of the KV pool and runs every StepInput itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from specserve.config import EngineConfig, ModelConfig
from specserve.distributed import comm
from specserve.distributed.comm import configure_shard_emulation
from specserve.engine.memory import drafter_bytes, drafter_configs, verify_sampling_bytes
from specserve.layers.quantization import check_device, resolve_quantization
from specserve.models.loader import load_model_config, resolve_model_path
from specserve.models.presets import PRESET_FORMATS, PRESETS
from specserve.speculative.proposer import Proposer
from specserve.speculative.worker import SpecWorker
from specserve.worker.device import resolve_device, resolve_dtype
from specserve.worker.model_runner import ModelRunner
from specserve.worker.step_input import StepInput, StepOutput

ProposerFactory = Callable[[ModelRunner], Proposer]


def resolve_model(config: EngineConfig) -> tuple[str | None, ModelConfig]:
    """(checkpoint directory or GGUF file, or None for a dummy preset; its normalised
    config)."""
    if config.load_format == "dummy" and config.model in PRESETS:
        return None, model_config_of(config, None)
    path = resolve_model_path(config.model)
    return path, model_config_of(config, path)


def model_config_of(config: EngineConfig, model_path: str | None) -> ModelConfig:
    """The model's normalised config with the quantization --quantization resolves to (the
    checkpoint's, or random weights' format): one answer for every rank."""
    model_config = (ModelConfig.from_hf(PRESETS[config.model]) if model_path is None
                    else load_model_config(model_path))
    quant = resolve_quantization(model_config.quantization, config.quantization,
                                 dummy=config.load_format == "dummy",
                                 model_formats=PRESET_FORMATS.get(config.model))  # fmt: skip
    check_device(quant, resolve_device(config.device))
    if quant is model_config.quantization:
        return model_config
    return dataclasses.replace(model_config, quantization=quant)


class LocalWorker:
    def __init__(self, runner: ModelRunner, drafter: SpecWorker | None) -> None:
        self.runner = runner
        self._drafter = drafter  # built once; None without a proposer
        self.drafter = drafter  # the active one (None while speculation is switched off)

    def execute(self, step: StepInput) -> StepOutput:
        worker = self.drafter if self.drafter is not None else self.runner
        return worker.execute(step)

    def control(self, op: str, **args: Any) -> Any:
        """A change of worker state (or a measurement) every rank applies at the same point
        between steps; returns this rank's answer (None for state changes)."""
        if op == "profile_costs":  # every rank runs the same steps: their collectives meet
            from specserve.speculative.profile import profile_costs

            return profile_costs(self._drafter, list(args["batch_sizes"]))
        if op == "profile_mixed":
            from specserve.speculative.profile import MIXED_CHUNKS, profile_mixed

            chunks = tuple(int(n) for n in args.get("chunks", MIXED_CHUNKS))
            return profile_mixed(self._drafter, int(args["batch_size"]), chunks)
        if op == "set_speculation":
            enabled = bool(args["enabled"])
            self.drafter = self._drafter if enabled else None
            self.runner.discard_launched()
            if self._drafter is not None:
                self._drafter.discard_launched()
                self._drafter.release_all()  # nothing is in flight: no draft state is valid
        else:
            raise ValueError(f"unknown worker control operation {op!r}")

    def close(self) -> None:
        """Release the model, KV pool and graphs now, even where other objects still hold
        the runner (the layers' cache views, graph pools, capture hooks), and the process's
        communication set-up (communicator, emulator)."""
        if self._drafter is not None:
            self._drafter.close()
        if self.runner is not None:
            self.runner.close()
        self.runner = None  # type: ignore[assignment]
        self.drafter = self._drafter = None
        comm.reset()


def build_local_worker(config: EngineConfig, model_path: str | None,
                       proposer: ProposerFactory | None = None) -> LocalWorker:
    """config: the engine's resolved config (max_model_len set). proposer: builds the drafter
    from the runner (a class with a `num_kv_layers` attribute); default: the one
    config.spec.algorithm names."""
    configure_shard_emulation(config.comm)  # before any shape is derived from the TP size
    model_config = model_config_of(config, model_path)
    draft_kv = []  # the proposer's own KV layers, after the target's in one pool
    if proposer is not None:
        draft_kv = list(getattr(proposer, "kv_specs", ()))
        if len(draft_kv) != proposer.num_kv_layers:
            raise ValueError("a proposer with KV layers of its own lists their KVCacheSpecs as "
                             "`kv_specs` (one per layer)")
    elif config.spec.algorithm == "mtp":
        from specserve.speculative.mtp import mtp_kv_specs

        draft_kv = mtp_kv_specs(model_config)
    elif config.spec.algorithm == "eagle3":
        from specserve.models.eagle3 import eagle3_kv_specs
        from specserve.speculative.eagle3 import load_draft_config

        draft_kv = eagle3_kv_specs(load_draft_config(config.spec, model_config))
    if "mtp" in config.spec.extra_methods:  # an extra drafter's layers after the primary's
        from specserve.speculative.mtp import check_mtp_target, mtp_kv_specs

        check_mtp_target(config.spec.for_method("mtp"), None if config.load_format == "dummy"
                         else model_path, model_config)  # the target has the layer
        draft_kv = draft_kv + mtp_kv_specs(model_config)
    # the drafters' weights are built after the KV pool: its budget leaves room for them
    reserve = 0 if proposer is not None else drafter_bytes(
        drafter_configs(config, model_config, model_path),
        resolve_dtype(config.dtype, model_config, resolve_device(config.device)),
        config.parallel.tp_size)
    if config.spec.enabled:  # and for sampling over the widest verify at the largest batch
        from specserve.speculative.proposer import draft_shapes

        spec = config.spec
        width = max(s.num_draft_tokens for m in (spec.algorithm, *spec.extra_methods)
                    for s in draft_shapes(spec.for_method(m)))
        rows = min(config.cuda_graph_max_bs, config.scheduler.max_num_seqs) * width
        reserve += verify_sampling_bytes(rows, model_config.vocab_size)
    runner = ModelRunner(config, model_config, model_path, draft_kv, reserve)
    if proposer is None and config.spec.enabled:
        from specserve.speculative.methods import proposer_factory

        proposer = proposer_factory(config.spec, model_path)
    drafter = None
    if proposer is not None:
        from specserve.speculative.methods import extra_proposers

        drafter = SpecWorker(config.spec, runner, proposer(runner),
                             extra_proposers(config.spec, model_path, runner))
    return LocalWorker(runner, drafter)
