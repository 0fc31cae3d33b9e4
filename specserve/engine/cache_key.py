"""What the KV pages the active workers write are a function of: the prefix cache's key."""

from __future__ import annotations

import json

from specserve.config import EngineConfig


def cache_identity(config: EngineConfig, dtype: object, drafter) -> tuple[str, bool] | None:
    """(identity, next-token keying) of the KV pages the target (in `dtype`) and the
    drafter (a SpecWorker or None) write; None when a drafter's own KV is not known to be a
    function of the tokens (no cache key)."""
    target = {"model": config.model, "load_format": config.load_format, "dtype": str(dtype),
              "seed": config.seed if config.load_format == "dummy" else None}
    if drafter is None or not drafter.stateful:
        return json.dumps(target), False  # no draft KV in the pages
    # every drafter keeping state in the pages (a page is cached once all cover it)
    keys = [getattr(d.proposer, "prefix_cache_key", None) for d in drafter.stateful]
    if None in keys:
        return None
    return json.dumps({**target, "draft": keys[0] if len(keys) == 1 else keys}), True
