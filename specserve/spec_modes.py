"""Draft mode names (torch-free): a shape ('chain3', 'tree4x3x8'), optionally prefixed with
the method that drafts it ('ngram:chain4', 'suffix:tree2x3x6'). Unprefixed names are the
primary method's shapes; a prefix names an extra drafter the same engine holds, one that
needs no model of its own (EXTRA_METHODS: ngram, suffix, mtp)."""

from __future__ import annotations

import re

# methods an engine can hold besides its primary one: they draft from the request's tokens
# or the target's own MTP layer (the engine checks the target has one)
EXTRA_METHODS = ("ngram", "suffix", "mtp")


def max_tree_nodes(num_steps: int, topk: int) -> int:
    """Most tokens a draft tree of this shape can propose, the root included."""
    return 1 + topk + (num_steps - 1) * topk**2


def mode_name(topk: int, num_steps: int, num_draft_tokens: int) -> str:
    """'chain3' (topk 1, every node verified) or 'tree4x3x8' (topk x steps x tokens)."""
    if topk == 1 and num_draft_tokens == num_steps + 1:
        return f"chain{num_steps}"
    return f"tree{topk}x{num_steps}x{num_draft_tokens}"


def parse_mode(name: str) -> tuple[int, int, int]:
    """(topk, num_steps, num_draft_tokens) of a draft shape name (see mode_name); ValueError
    saying how to write one, or when the tree cannot hold that many tokens."""
    chain = re.fullmatch(r"chain(\d+)", name)
    tree = re.fullmatch(r"tree(\d+)x(\d+)x(\d+)", name)
    if chain:
        topk, steps, tokens = 1, int(chain.group(1)), int(chain.group(1)) + 1
    elif tree:
        topk, steps, tokens = (int(g) for g in tree.groups())
    else:
        raise ValueError(f"draft mode {name!r}: write chainS (S draft steps) or treeKxSxN "
                         "(top-k K, S steps, N tokens verified), e.g. chain3,tree4x3x8")
    if topk < 1 or steps < 1 or not 2 <= tokens <= max_tree_nodes(steps, topk):
        raise ValueError(f"draft mode {name!r}: needs K, S >= 1 and N in [2, "
                         f"{max_tree_nodes(max(steps, 1), max(topk, 1))}]")
    return topk, steps, tokens


def split_mode(name: str) -> tuple[str | None, str]:
    """('ngram', 'chain4') for 'ngram:chain4'; (None, 'chain3') for an unprefixed name."""
    method, sep, shape = name.partition(":")
    return (method.strip(), shape.strip()) if sep else (None, name)


def full_mode_name(method: str | None, shape: str, primary: str) -> str:
    """The key of a mode: the shape for the primary method, 'method:shape' otherwise."""
    return shape if method in (None, primary) else f"{method}:{shape}"


def check_mode(name: str, primary: str, known: dict[str, bool]) -> tuple[str, str]:
    """(method, shape) of one --spec-modes entry, or ValueError naming it. known: method ->
    implemented (spec_config.METHODS)."""
    method, shape = split_mode(name)
    try:
        topk, steps, tokens = parse_mode(shape)
    except ValueError as exc:
        raise ValueError(f"{exc} (in {name!r})" if method else str(exc)) from None
    if method is None or method == primary:
        method = primary
    elif method not in known:
        raise ValueError(f"draft mode {name!r}: unknown method {method!r}; a prefix names a "
                         f"drafter needing no model of its own: {', '.join(EXTRA_METHODS)}")
    elif method not in EXTRA_METHODS:
        raise ValueError(f"draft mode {name!r}: method {method} needs a model of its own and "
                         f"can only be the primary method; extra drafters: "
                         f"{', '.join(EXTRA_METHODS)}")
    if method == "ngram" and (topk != 1 or tokens != steps + 1):
        raise ValueError(f"draft mode {name!r}: ngram drafts a chain, not a tree (chainS)")
    return method, shape
