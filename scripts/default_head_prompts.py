"""The prompt set of scripts/train_default_head.py: questions built from material on this
machine (Python's standard library and pydoc topics, the man pages' NAME lines, the time-zone
database's countries and cities, the repo's docs and the licence texts), plus arithmetic; a
fixed hold-out by hash. Nothing is downloaded."""

from __future__ import annotations

import gzip
import hashlib
import importlib
import inspect
import random
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DEMO = [
    "What is the capital of France?",
    "Explain what a hash table is in two sentences.",
    "Write a Python function that reverses a string.",
    "Give me three tips for better sleep.",
    "Why is the sky blue?",
]
DEMO_SUBJECTS = ("France", "hash table", "revers", "sleep", "sky")
MODULES = [
    "os",
    "os.path",
    "json",
    "re",
    "math",
    "random",
    "itertools",
    "functools",
    "collections",
    "datetime",
    "pathlib",
    "shutil",
    "string",
    "textwrap",
    "statistics",
    "heapq",
    "bisect",
    "csv",
    "hashlib",
    "base64",
    "urllib.parse",
    "time",
    "glob",
    "fnmatch",
    "copy",
    "operator",
    "difflib",
    "zipfile",
    "tarfile",
    "gzip",
    "sqlite3",
    "logging",
    "argparse",
    "subprocess",
    "threading",
    "queue",
    "socket",
    "struct",
    "uuid",
    "decimal",
    "fractions",
    "calendar",
    "tempfile",
    "io",
    "pickle",
    "enum",
    "dataclasses",
    "typing",
    "contextlib",
    "inspect",
    "unittest",
    "html",
    "email.utils",
]
FUNCTION_TEMPLATES = [
    "What does `{q}` do in Python?",
    "Show how to use Python's `{q}` with a short example.",
    "When would I use `{q}` in a Python program?",
    "Explain the arguments of the Python function `{q}{sig}`.",
]
COMMAND_TEMPLATES = [
    "What does the `{cmd}` command do on Linux?",
    "What is `{cmd}` ({desc}) used for?",
    "Give an example of the `{cmd}` command. It is described as: {desc}.",
]
PLACE_TEMPLATES = [
    "What is the capital of {country}?",
    "Tell me about {country}.",
    "What languages are spoken in {country}?",
    "What is {city} known for?",
    "In which country is the city of {city}?",
]
WRITING_TEMPLATES = [
    "Write a short poem about {thing}.",
    "Give me three facts about {thing}.",
    "Explain {thing} to a ten-year-old.",
    "Write one sentence about {thing}.",
]


def python_prompts(rng: random.Random, n: int) -> list[str]:
    items = []
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        for attr in sorted(getattr(mod, "__all__", None) or dir(mod)):
            obj = getattr(mod, attr, None)
            if (
                attr.startswith("_")
                or not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj))
                or not obj.__doc__
            ):
                continue
            try:
                sig = str(inspect.signature(obj)) if inspect.isfunction(obj) else "(...)"
            except (TypeError, ValueError):
                sig = "(...)"
            items.append((f"{name}.{attr}", sig if len(sig) < 60 else "(...)"))
    rng.shuffle(items)
    return [rng.choice(FUNCTION_TEMPLATES).format(q=q, sig=sig) for q, sig in items[:n]]


def topic_prompts(rng: random.Random, n: int) -> list[str]:
    from pydoc_data.topics import topics

    names = [t for t in sorted(topics) if t.isidentifier() or " " not in t]
    rng.shuffle(names)
    forms = ["Explain Python's `{t}` with an example.", "What is `{t}` in Python?"]
    return [rng.choice(forms).format(t=t.replace("-", " ")) for t in names[:n]]


def command_prompts(rng: random.Random, n: int) -> list[str]:
    pages = sorted(Path("/usr/share/man/man1").glob("*.1.gz"))
    rng.shuffle(pages)
    out = []
    for page in pages:
        if len(out) == n:
            break
        try:
            text = gzip.open(page, "rt", errors="replace").read(6000)
        except OSError:
            continue
        m = re.search(r"^\.SH\s+\"?NAME\"?\s*\n(.+?)\n", text, re.M)
        if not m or "\\-" not in m.group(1):
            continue
        cmd, desc = (s.strip() for s in m.group(1).split("\\-", 1))
        cmd = cmd.split(",")[0].replace("\\", "")
        desc = re.sub(r"\\f[BIRP]|\\", "", desc).strip().rstrip(".")
        if cmd.isascii() and 2 <= len(desc) <= 90 and re.fullmatch(r"[\w.+-]+", cmd):
            out.append(
                rng.choice(COMMAND_TEMPLATES).format(cmd=cmd, desc=desc[0].lower() + desc[1:])
            )
    return out


def place_prompts(rng: random.Random, n: int) -> list[str]:
    zoneinfo = Path("/usr/share/zoneinfo")
    countries = [
        line.split("\t")[1].strip()
        for line in (zoneinfo / "iso3166.tab").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    cities = sorted(
        {
            p.name.replace("_", " ")
            for region in ("Europe", "Asia", "America", "Africa", "Australia")
            for p in (zoneinfo / region).glob("*")
            if p.is_file()
        }
    )
    out = []
    for _ in range(n):
        form = rng.choice(PLACE_TEMPLATES)
        out.append(form.format(country=rng.choice(countries), city=rng.choice(cities)))
    return out


def doc_prompts(rng: random.Random, n: int) -> list[str]:
    paras = []
    for doc in [
        ROOT / "README.md",
        ROOT / "docs" / "architecture.md",
        *sorted(Path("/usr/share/common-licenses").glob("*"))[:6],
    ]:
        if doc.is_file():
            for p in doc.read_text(errors="replace").split("\n\n"):
                p = " ".join(p.split())
                if 200 <= len(p) <= 700 and not p.startswith(("|", "```", "#")):
                    paras.append(p)
    rng.shuffle(paras)
    forms = ["Summarize this in one sentence: {p}", "What is the main point of this text? {p}"]
    return [rng.choice(forms).format(p=p) for p in paras[:n]]


def writing_prompts(rng: random.Random, n: int, things: list[str]) -> list[str]:
    return [rng.choice(WRITING_TEMPLATES).format(thing=rng.choice(things)) for _ in range(n)]


def arithmetic_prompts(rng: random.Random, n: int) -> list[str]:
    forms = [
        "What is {a} + {b}?",
        "What is {a} times {b}?",
        "If I have {a} apples and give away {b}, how many do I have left?",
        "A train travels {a} km in {b} hours. What is its average speed?",
    ]
    return [rng.choice(forms).format(a=rng.randint(2, 99), b=rng.randint(1, 20)) for _ in range(n)]


def build_prompts(seed: int, scale: float) -> list[str]:
    rng = random.Random(seed)
    k = lambda n: max(1, int(n * scale))  # noqa: E731
    from pydoc_data.topics import topics

    things = [t for t in topics if t.isalpha()] + [
        line.split("\t")[1].strip()
        for line in Path("/usr/share/zoneinfo/iso3166.tab").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    prompts = (
        python_prompts(rng, k(170))
        + topic_prompts(rng, k(40))
        + command_prompts(rng, k(130))
        + place_prompts(rng, k(90))
        + doc_prompts(rng, k(30))
        + writing_prompts(rng, k(60), things)
        + arithmetic_prompts(rng, k(30))
    )
    keep = [
        p for p in dict.fromkeys(prompts) if not any(s.lower() in p.lower() for s in DEMO_SUBJECTS)
    ]
    rng.shuffle(keep)
    return keep


def held_out(prompt: str, permille: int = 100) -> bool:
    return int(hashlib.sha1(prompt.encode()).hexdigest(), 16) % 1000 < permille
