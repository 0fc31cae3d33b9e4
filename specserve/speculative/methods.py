"""The proposer each implemented speculative method (spec_config.METHODS) drafts with."""

from __future__ import annotations

import functools
from collections.abc import Callable

from specserve.config import SpecConfig
from specserve.speculative.proposer import Proposer


def proposer_factory(spec: SpecConfig, model_path: str | None) -> Callable[..., Proposer]:
    """runner -> the proposer of spec.algorithm (imported on use: EAGLE-3 loads a head, MTP
    the layer in the target's files at model_path), seeing its own modes only."""
    spec = spec.for_method(spec.algorithm) if spec.enabled else spec
    if spec.algorithm == "eagle3":
        from specserve.speculative.eagle3 import Eagle3Proposer

        return functools.partial(Eagle3Proposer, spec)
    if spec.algorithm == "mtp":
        from specserve.speculative.mtp import MTPProposer

        return functools.partial(MTPProposer, spec, model_path)
    if spec.algorithm == "ngram":
        from specserve.speculative.ngram import NgramProposer

        return functools.partial(NgramProposer, spec)
    if spec.algorithm == "suffix":
        from specserve.speculative.suffix import SuffixProposer

        return functools.partial(SuffixProposer, spec)
    raise ValueError(f"speculative method {spec.algorithm!r} has no proposer")


def extra_proposers(spec: SpecConfig, model_path: str | None, runner) -> dict[str, Proposer]:
    """method -> the drafter of each extra method the modes name ('ngram:chain4'), built
    with the config that method sees (SpecConfig.for_method)."""
    return {m: proposer_factory(spec.for_method(m), model_path)(runner)
            for m in spec.extra_methods}
