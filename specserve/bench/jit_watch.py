"""Triton kernel compilations while a block runs, per kernel (benchmarks).

A kernel meets a new specialization (a constexpr, an integer argument's divisibility class)
and compiles, a fraction of a second to seconds, inside whatever step launched it: in a timed
run that reads as a slow step. `triton_compiles()` counts them through Triton's post-compile
hook (the hook that was set before is called too, and put back after), so a benchmark can
say how many compilations its timed runs held. Without Triton, or a Triton without the hook,
the counts stay empty.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


def _kernel_name(kwargs: dict) -> str:
    fn = kwargs.get("fn")
    name = getattr(fn, "name", None)
    return name if isinstance(name, str) else str(kwargs.get("repr", "?")).split("[")[0]


@contextlib.contextmanager
def triton_compiles() -> Iterator[dict[str, int]]:
    """{kernel name: compilations} of the block, filled as it runs."""
    counts: dict[str, int] = {}
    try:
        from triton import knobs
    except ImportError:
        yield counts
        return
    runtime = knobs.runtime
    if not hasattr(runtime, "jit_post_compile_hook"):
        yield counts
        return
    previous = runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        name = _kernel_name(kwargs)
        counts[name] = counts.get(name, 0) + 1
        return previous(*args, **kwargs) if previous else None

    runtime.jit_post_compile_hook = hook
    try:
        yield counts
    finally:
        runtime.jit_post_compile_hook = previous
