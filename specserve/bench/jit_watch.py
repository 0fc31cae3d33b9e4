"""Triton kernel compilations while a block runs, per kernel (benchmarks).

A kernel meets a new specialization (a constexpr, an integer argument's divisibility class)
and compiles, a fraction of a second to seconds, inside whatever step launched it: in a timed
run that reads as a slow step. `triton_compiles()` counts them through Triton's post-compile
hook (the hook that was set before is called too, and put back after), so a benchmark can
say how many compilations its timed runs held, and which specialization each was (`details`:
what to warm up at start-up, or to stop specializing on). Without Triton, or a Triton without
the hook, the counts stay empty.
"""

from __future__ import annotations

import ast
import contextlib
from collections.abc import Iterator


class Compiles(dict):
    """{kernel name: compilations}; `details`: one line per compilation, the kernel and each
    argument compiled as other than a plain value: a constexpr's value (an integer 1 is one),
    "D" for an integer specialized as divisible by 16, "unaligned" for a pointer that is not
    16-byte aligned (the aligned ones, the rule, are left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.details: list[str] = []


def _kernel_name(kwargs: dict) -> str:
    fn = kwargs.get("fn")
    name = getattr(fn, "name", None)
    return name if isinstance(name, str) else str(kwargs.get("repr", "?")).split("[")[0]


def _specialization(kwargs: dict) -> str:
    """'kernel(arg=D, BLOCK=64, ...)' from the hook's key (the list of (type, specialization)
    per argument, as Triton writes it, before its options); the raw key, cut, if it does not
    read so."""
    key = str(kwargs.get("key", ""))
    params = getattr(getattr(kwargs.get("fn"), "jit_function", None), "params", None) or []
    try:
        specs = ast.literal_eval(key[: key.index("]") + 1])
        names = [p.name for p in params]
        assert len(names) == len(specs)
    except (ValueError, SyntaxError, AssertionError):
        return f"{_kernel_name(kwargs)}: {key[:300]}"
    parts = []
    for n, (ty, spec) in zip(names, specs):
        if str(ty).startswith("*"):  # a pointer: aligned is the rule
            parts += [] if spec == "D" else [f"{n}=unaligned"]
        elif spec not in ("", None):
            parts.append(f"{n}={spec}")
    return f"{_kernel_name(kwargs)}({', '.join(parts)})"


@contextlib.contextmanager
def triton_compiles() -> Iterator[Compiles]:
    """{kernel name: compilations} of the block, filled as it runs (a Compiles)."""
    counts = Compiles()
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
        counts.details.append(_specialization(kwargs))
        return previous(*args, **kwargs) if previous else None

    runtime.jit_post_compile_hook = hook
    try:
        yield counts
    finally:
        runtime.jit_post_compile_hook = previous
