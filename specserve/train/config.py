"""The configs of `train-eagle3` and `eval-accept` (their flags are generated from the fields).

Imports no torch: the CLI builds and checks these before loading a model.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from specserve.config import ModelConfig
from specserve.config_flags import ConfigError, check_fields, option
from specserve.spec_config import SpecConfig

MIN_WINDOW = 8  # shorter training rows carry too few TTT targets to be worth a row
DEFAULT_SPECS = "3/1/4,5/1/6,5/4/16"  # chain 3, chain 5, tree topk 4 / 16 tokens (depth 5)


@dataclass(frozen=True)
class TrainConfig:
    target: str = option(
        "", "target model: a transformers checkpoint directory (with its tokenizer) or a GGUF file"
    )
    out: str = option("", "output directory: the head in the public EAGLE-3 format + state")
    data: tuple[str, ...] = ()  # files, directories or @LIST (flag built by the CLI)
    draft_vocab_size: int = option(32000, "draft vocabulary size (capped at the target's)", min=1)
    aux_layer_ids: str = option(
        "",
        "three target layers feeding the head, e.g. 2,16,29: the residual stream ENTERING "
        "each (= HF hidden_states index); default 2,N//2,N-3",
    )
    seq_len: int = option(
        2048, "tokens per training row (longer documents are split)", min=MIN_WINDOW
    )
    batch_size: int = option(4, "rows per step", min=1)
    epochs: int = option(1, "passes over the data", min=1)
    max_steps: int = option(0, "stop after this many steps (0 = run the epochs)", min=0)
    time_budget: float = option(
        0.0,
        "stop after this many seconds (0 = none); the learning "
        "rate schedule then follows elapsed time",
        min=0.0,
    )
    lr: float = option(1e-4, "peak learning rate (AdamW, betas 0.9/0.95)", above=0.0)
    warmup: float = option(0.015, "warmup as a fraction of training, in [0, 1)", min=0.0)
    weight_decay: float = option(0.0, "AdamW weight decay on matrices", min=0.0)
    grad_clip: float = option(0.5, "gradient-norm clip", above=0.0)
    ttt_steps: int = option(7, "training-time-test steps unrolled per position", min=1)
    step_decay: float = option(0.8, "loss weight of TTT step i is decay**i", above=0.0, max=1.0)
    device: str = option("auto", "auto | cpu | cuda")
    dtype: str = option(
        "auto",
        "compute dtype: auto = bf16 autocast on GPU, fp32 on CPU",
        choices=("auto", "float32", "bfloat16"),
    )
    export_dtype: str = option(
        "bfloat16", "dtype of the exported weights", choices=("bfloat16", "float32")
    )
    save_every: int = option(
        1000,
        "write a checkpoint (and export) every N steps (0 = at the end); Ctrl-C also writes one",
        min=0,
    )
    resume: bool = option(False, "continue from OUT/trainer_state.pt")
    seed: int = option(0, "data-order seed", min=0)
    progress: bool = option(True, "show the progress bar")
    regenerate: bool = option(False, "regenerate responses with the target (specserve engine)")
    regen_prompt_tokens: int = option(
        64, "regeneration of plain text: prompt tokens per row", min=1
    )
    regen_temperature: float = option(0.8, "regeneration sampling temperature", min=0.0)
    regen_max_samples: int = option(
        0,
        "0: train on regenerated responses only; N: regenerate N rows and keep the data too",
        min=0,
    )

    def __post_init__(self) -> None:
        check_fields(self)
        if self.warmup >= 1:
            raise ConfigError(TrainConfig, "warmup", f"must be < 1, got {self.warmup}")

    def validate(self) -> None:
        """What the paths name: ValueError naming the flag."""
        gguf = self.target.lower().endswith(".gguf")
        if not os.path.isfile(self.target if gguf else os.path.join(self.target, "config.json")):
            raise ValueError(
                f"--target {self.target!r} is neither a model directory with "
                "config.json nor a GGUF file"
            )
        if not self.out:
            raise ValueError("--out DIR is required")
        if not self.data:
            raise ValueError("--data needs at least one file, directory or @LIST")

    def aux_ids(self, num_layers: int) -> tuple[int, ...]:
        if not self.aux_layer_ids:
            from specserve.models.capture import default_aux_layer_ids

            return default_aux_layer_ids(num_layers)
        try:
            ids = tuple(int(x) for x in self.aux_layer_ids.split(","))
        except ValueError as e:
            raise ValueError(
                f"--aux-layer-ids takes three integers like 2,4,5, got {self.aux_layer_ids!r}"
            ) from e
        if len(ids) != 3 or not all(0 <= i < num_layers for i in ids):
            raise ValueError(
                f"--aux-layer-ids needs three layer ids in [0, {num_layers}), "
                f"got {self.aux_layer_ids!r}"
            )
        return ids

    def head_config(self, target: ModelConfig, aux_ids: tuple[int, ...]) -> ModelConfig:
        """One Llama decoder layer shaped like the target, with its own draft vocabulary."""
        return dataclasses.replace(
            target,
            architecture="LlamaForCausalLMEagle3",
            num_layers=1,
            draft_vocab_size=min(self.draft_vocab_size, target.vocab_size),
            target_hidden_size=target.hidden_size,
            aux_layer_ids=aux_ids,
            tie_word_embeddings=False,
            attention_bias=False,
            qk_norm=False,
            norm_before_residual=False,
        )


@dataclass(frozen=True)
class SpecShape:
    steps: int
    topk: int
    tokens: int

    @property
    def label(self) -> str:
        if self.topk == 1:
            return f"chain{self.steps}"
        return f"tree{self.topk}x{self.tokens}(d{self.steps})"

    def spec(self, draft: str) -> SpecConfig:
        return SpecConfig(
            algorithm="eagle3",
            draft_model=draft,
            num_steps=self.steps,
            topk=self.topk,
            num_draft_tokens=self.tokens,
        )


def parse_specs(text: str) -> list[SpecShape]:
    """'5/1/6,5/4/16' -> shapes, each a valid speculation config (ValueError naming --specs)."""
    shapes = []
    for item in text.split(","):
        try:
            steps, topk, tokens = (int(x) for x in item.strip().split("/"))
            shape = SpecShape(steps, topk, tokens)
            shape.spec("check")
        except ValueError as e:
            raise ValueError(
                f"--specs items are steps/topk/tokens like 5/4/16, got {item!r} ({e})"
            ) from None
        shapes.append(shape)
    return shapes


def parse_temperatures(text: str) -> list[float]:
    try:
        temps = [float(t) for t in text.split(",")]
    except ValueError:
        temps = []
    if not temps or any(not 0 <= t < float("inf") for t in temps):
        raise ValueError(f"--temperatures takes comma-separated numbers >= 0, got {text!r}")
    return temps


@dataclass(frozen=True)
class EvalConfig:
    model: str = option("", "target model directory or GGUF file (default: the default model)")
    draft: str = option("", "EAGLE-3 head directory (default: the default model's bundled head)")
    files: tuple[str, ...] = ()  # hold-out files (flag built by the CLI)
    num_prompts: int = option(32, "prompts taken from the files (one per file)", min=1)
    prompt_tokens: int = option(128, "prompt length in tokens (files shorter are skipped)", min=1)
    max_tokens: int = option(128, "tokens generated per prompt", min=1)
    specs: str = option(DEFAULT_SPECS, "comma-separated steps/topk/tokens configs")
    temperatures: str = option("0,1", "comma-separated sampling temperatures")
    device: str = option("auto", "auto | cpu | cuda")
    dtype: str = option("auto", "engine dtype", choices=("auto", "float32", "bfloat16", "float16"))
    gpu_memory_utilization: float = option(
        0.5, "fraction of free GPU memory for the KV cache", above=0.0, max=1.0
    )
    enforce_eager: bool = option(False, "no CUDA graphs (faster start, slower steps)")
    seed: int = option(0, "base sampling seed (prompt i uses seed + i)", min=0)
    out: str = option("", "also write the results as JSON here")
    progress: bool = option(True, "a progress bar over the generate passes")

    def __post_init__(self) -> None:
        check_fields(self)
        parse_specs(self.specs)
        parse_temperatures(self.temperatures)
