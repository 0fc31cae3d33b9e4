"""Fixtures shared by the train-eagle3 tests (test_train.py, test_train_head.py): one torch
thread per test, a tiny llama target whose teacher is peaked, and a templated Python-like
corpus. A test module binds them by name (`target = train_fixtures.target`) so pytest finds
them there."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from tiny_models import make_hf_model
from tiny_tokenizer import make_tiny_tokenizer


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls on 2 shared cores run far faster on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny llama whose teacher is peaked (scaled lm_head), so a head can learn it."""
    path = tmp_path_factory.mktemp("train") / "target"
    model = make_hf_model("llama", seed=3, vocab_size=512, num_hidden_layers=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(path)
    make_tiny_tokenizer(str(path), vocab_size=512)
    return str(path)


def _write_corpus(root: Path, seed: int = 0, num_files: int = 4) -> tuple[str, ...]:
    """Python-like files from templates: fixed text (not the repository's own sources, which
    change), regular enough that a few training steps learn something."""
    rng = random.Random(seed)
    names = ["value", "count", "items", "total", "index", "result", "buffer", "offset", "size"]
    root.mkdir(parents=True, exist_ok=True)
    files = []
    for f in range(num_files):
        lines = [f'"""Module {f}."""', "", "import math", ""]
        for i in range(40):
            a, b = rng.sample(names, 2)
            op = rng.choice(["+", "-", "*"])
            lines += [f"def {a}_{b}_{i}({b}, {a}=None):", f"    if {a} is None:",
                      f"        {a} = {b} {op} {rng.randint(0, 9)}",
                      f"    return math.floor({a}) {op} {b}", ""]
        path = root / f"module_{f}.py"
        path.write_text("\n".join(lines))
        files.append(str(path))
    return tuple(files)


@pytest.fixture(scope="module")
def code_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ...]:
    return _write_corpus(tmp_path_factory.mktemp("corpus"))
