"""Prompt sets for benchmarks: two small built-in sets and .jsonl files.

A .jsonl prompt file holds one object per line, either {"prompt": "..."} (plain text) or
{"messages": [{"role": "user", "content": "..."}, ...]} (chat).
"""

from __future__ import annotations

import itertools
import json
import os
import random
from dataclasses import dataclass
from typing import Any

_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Prompt:
    """Exactly one of text / messages is set."""

    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None

    def __post_init__(self) -> None:
        assert (self.text is None) != (self.messages is None), "set exactly one of text/messages"

    def as_messages(self) -> list[dict[str, str]]:
        """Chat form: a text prompt becomes one user message."""
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.text or ""}]

    def as_text(self) -> str:
        """Completion form: a chat prompt becomes its message contents, one per paragraph."""
        if self.text is not None:
            return self.text
        return "\n\n".join(m["content"] for m in self.messages or ())


_CHAT = (
    "What is the difference between a process and a thread?",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for writing clear commit messages.",
    "How does a hash map handle collisions?",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Write a haiku about a cup of coffee on a rainy morning.",
    "How do vaccines train the immune system?",
    "What are the pros and cons of remote work?",
    "Explain big-O notation to a beginner with an example.",
    "Suggest a simple vegetarian dinner I can cook in twenty minutes.",
    "Why do we have leap years?",
    "What is the difference between TCP and UDP?",
    "Describe how a bill becomes a law in a parliamentary system.",
    "Give a short explanation of how public-key cryptography works.",
    "What should I check before buying a used bicycle?",
)

_CODE = (
    'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n',
    "def is_prime(n: int) -> bool:\n",
    "def binary_search(items: list[int], target: int) -> int:\n    lo, hi = 0, len(items) - 1\n",
    "class Stack:\n    def __init__(self) -> None:\n        self._items = []\n\n"
    "    def push(self, x):\n",
    "import json\n\n\ndef load_config(path: str) -> dict:\n",
    "def merge_sort(xs: list[int]) -> list[int]:\n    if len(xs) <= 1:\n        return xs\n",
    "def word_count(text: str) -> dict[str, int]:\n    counts: dict[str, int] = {}\n",
    "from dataclasses import dataclass\n\n\n@dataclass\nclass Point:\n"
    "    x: float\n    y: float\n\n"
    '    def distance(self, other: "Point") -> float:\n',
    'def flatten(nested: list) -> list:\n    """Flatten arbitrarily nested lists."""\n',
    "import os\n\n\ndef list_python_files(root: str) -> list[str]:\n",
    "def reverse_words(sentence: str) -> str:\n",
    "class LRUCache:\n    def __init__(self, capacity: int) -> None:\n",
    "def gcd(a: int, b: int) -> int:\n    while b:\n",
    "def parse_csv_line(line: str) -> list[str]:\n    fields, current = [], []\n",
    "def matrix_multiply(a: list[list[float]], b: list[list[float]]) -> list[list[float]]:\n",
    'import re\n\nEMAIL = re.compile(r"[^@\\s]+@[^@\\s]+\\.[a-z]+")\n\n\ndef find_emails(text: str)'
    " -> list[str]:\n",
)

_AREAS = (
    "billing",
    "shipping",
    "returns",
    "accounts",
    "privacy",
    "warranty",
    "orders",
    "gift cards",
    "subscriptions",
    "repairs",
    "escalations",
    "security",
)
_RULES = (
    "answer questions about {a} in plain English and cite section {n} of the policy",
    "never promise a {a} exception that section {n} does not allow, and say who can grant one",
    "ask for the order number before discussing {a}, then repeat it back (rule {n})",
    "escalate {a} complaints open for more than {n} days to a team lead with a short summary",
    "keep notes on every {a} conversation and link them to ticket class {n}",
)


def _shared_system_prompt() -> str:
    """A long, fixed system prompt (~6,200 characters: about 1,900 tokens with the bundled
    tiny-code tokenizer) every request of the "shared" set starts with."""
    lines = ["You are the support assistant of Example Outfitters. Follow every rule below."]
    for i in range(64):
        rule = _RULES[i % len(_RULES)].format(a=_AREAS[i % len(_AREAS)], n=i + 3)
        lines.append(f"Rule {i + 1}: {rule}.")
    return "\n".join(lines)


BUILTIN_SETS = ("chat", "code", "shared")


def _parse_line(obj: Any, where: str) -> Prompt:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if ("prompt" in obj) == ("messages" in obj):
        raise ValueError(f"{where}: give exactly one of 'prompt' or 'messages'")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise ValueError(f"{where}: 'prompt' must be a non-empty string")
        return Prompt(text=obj["prompt"])
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"{where}: 'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise ValueError(f"{where}: messages[{i}] needs a role in {_ROLES}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: messages[{i}].content must be a string")
        out.append({"role": m["role"], "content": m["content"]})
    return Prompt(messages=tuple(out))


def _load_jsonl(path: str) -> list[Prompt]:
    prompts = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err.msg})") from None
            prompts.append(_parse_line(obj, where))
    if not prompts:
        raise ValueError(f"{path} holds no prompts; add one JSON object per line")
    return prompts


def load_prompts(name_or_path: str) -> list[Prompt]:
    """A built-in set ("chat": user questions as messages, "code": Python prefixes as text,
    "shared": the chat questions after one long system prompt, for prefix caching) or a .jsonl
    file."""
    if name_or_path == "chat":
        return [Prompt(messages=({"role": "user", "content": q},)) for q in _CHAT]
    if name_or_path == "code":
        return [Prompt(text=c) for c in _CODE]
    if name_or_path == "shared":
        system = {"role": "system", "content": _shared_system_prompt()}
        return [Prompt(messages=(system, {"role": "user", "content": q})) for q in _CHAT]
    if not os.path.isfile(name_or_path):
        raise ValueError(
            f"unknown prompt set {name_or_path!r}: use one of {BUILTIN_SETS} or a path to a "
            ".jsonl file"
        )
    if not name_or_path.endswith(".jsonl"):
        raise ValueError(f"{name_or_path}: prompt files must be .jsonl (one JSON object a line)")
    return _load_jsonl(name_or_path)


def make_prompts(engine: Any, source: str | None, batch_size: int, context_len: int,
                 seed: int) -> list[list[int]]:
    """`batch_size` prompts of exactly `context_len` tokens: random ids by default; from a prompt
    set, request j concatenates the set's prompts from the j-th on (cycling) and cuts."""
    if source is None:
        rng = random.Random(f"{seed}-{batch_size}-{context_len}")
        vocab = engine.model_config.vocab_size
        return [[rng.randrange(vocab) for _ in range(context_len)] for _ in range(batch_size)]
    if engine.tokenizer is None:
        raise ValueError("--prompts needs a model with a tokenizer (random-weight presets have "
                         "none); leave --prompts out to use random token ids")
    encoded = [engine.tokenizer.encode(p.as_text()) for p in load_prompts(source)]
    flat = [t for ids in encoded for t in ids]
    if not flat:
        raise ValueError(f"prompt set {source!r} encodes to no tokens")
    starts = list(itertools.accumulate((len(ids) for ids in encoded), initial=0))
    stream = flat * (context_len // len(flat) + 2)  # any start still has context_len after it
    return [stream[starts[j % len(encoded)]:][:context_len] for j in range(batch_size)]


def output_lengths(n: int, mean: int, spread: float) -> list[int]:
    """Output tokens of requests 0..n-1: `mean` each, or with `spread` in (0, 1) uniform on
    mean x [1 - spread, 1 + spread], request i's drawn from its own seed (the same in every
    configuration of a benchmark). Equal lengths make requests admitted together finish
    together (plain decoding then prefills their successors in one wave), which variable
    lengths in serving do not."""
    if not 0.0 <= spread < 1.0:
        raise ValueError(f"the output length spread must be in [0, 1), got {spread}")
    return [max(1, round(mean * (1.0 + spread * (2.0 * random.Random(i).random() - 1.0))))
            for i in range(n)]
