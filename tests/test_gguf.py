"""GGUF loading against transformers' own GGUF support: logits of tiny random files stored in
every common ggml type, the config read from the metadata, the tokenizer, the engine end to
end, and the errors a user can hit."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_drivers import PagedSession
from tiny_gguf import MIXED, write_tiny_gguf
from tiny_tokenizer import CORPUS, make_tiny_tokenizer

from specserve.models import gguf
from specserve.models.loader import load_model, load_model_config, resolve_model_path
from specserve.sampling_params import SamplingParams

CASES = {
    "llama_mixed_types": ("llama", MIXED, False),
    "llama_tied_q4k": ("llama", {"token_embd": "Q4_K", "blk.0.attn_q": "Q5_K"}, True),
    "qwen2_bias": ("qwen2", {"blk.1.ffn_down": "Q6_K", "blk.0.attn_k": "Q5_1"}, True),
    "qwen3_qk_norm": ("qwen3", {"blk.0.attn_q": "Q8_0", "blk.1.attn_k": "Q4_0"}, False),
}


def _hf_from_gguf(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    family, qtypes, tied = CASES[request.param]
    path = write_tiny_gguf(
        str(tmp_path_factory.mktemp(request.param) / "m.gguf"),
        family,
        qtypes,
        tied,
        seed=len(request.param),
    )
    return {"name": request.param, "path": path, "hf": _hf_from_gguf(path)}


def test_logits_match_transformers(case: dict) -> None:
    config = load_model_config(case["path"])
    model = load_model(config, case["path"], torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (9, 17)]
    session = PagedSession(model, num_pages=16, page_size=4)
    got = session.step({r: p for r, p in enumerate(prompts)})
    with torch.no_grad():
        refs = [case["hf"](torch.tensor([p])).logits[0] for p in prompts]
    for r, (logits, ref) in enumerate(zip(got, refs)):
        assert ref.abs().max() > 0.5  # the file's weights reach the logits
        err = (logits - ref).abs().max().item()
        assert err < 1e-4 * max(1.0, ref.abs().max().item()), f"{case['name']} {r}: {err}"


def test_config_matches_transformers(case: dict) -> None:
    ours = load_model_config(case["path"])
    ref = case["hf"].config
    assert ours.architecture == ref.architectures[0] if ref.architectures else True
    assert (ours.vocab_size, ours.hidden_size, ours.intermediate_size, ours.num_layers) == (
        ref.vocab_size,
        ref.hidden_size,
        ref.intermediate_size,
        ref.num_hidden_layers,
    )
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim) == (
        ref.num_attention_heads,
        ref.num_key_value_heads,
        getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads,
    )
    assert ours.tie_word_embeddings == ref.tie_word_embeddings == CASES[case["name"]][2]
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert ours.max_position_embeddings == ref.max_position_embeddings
    assert ours.qk_norm == (case["name"].startswith("qwen3"))
    assert ours.attention_bias == (case["name"].startswith("qwen2"))
    assert ours.eos_token_ids == (1,) and ours.bos_token_id == 0  # <|eos|>, <|bos|>


def test_engine_greedy_matches_transformers_generate(case: dict) -> None:
    from specserve.llm import LLM

    llm = LLM(
        case["path"], device="cpu", dtype="float32", cache=dict(page_size=4, kv_cache_bytes=4 << 20)
    )
    prompt = [0, 17, 200, 33, 5, 90]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    with torch.no_grad():
        ids = torch.tensor([prompt])
        ref = case["hf"].generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=None,
        )[0, len(prompt) :]
    assert out[0].token_ids == ref.tolist()


@pytest.mark.parametrize(
    "qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
)
def test_dequantize_matches_an_independent_decoder(qtype: str) -> None:
    """Our dequantization (gguf.quants) against transformers' torch decoder of the same bytes,
    and, for the types gguf can quantize, against the values that were quantized (within the
    type's step)."""
    from gguf import GGMLQuantizationType as Q
    from tiny_gguf import _encode
    from transformers.integrations.gguf.dequant import GGML_BLOCK
    from transformers.integrations.gguf.dequant import dequantize as torch_dequantize

    rng = np.random.default_rng(7)
    values = rng.standard_normal((8, 512)).astype(np.float32) * 0.1
    if qtype == "BF16":
        from gguf.quants import quantize

        data, raw = quantize(values, Q.BF16), Q.BF16
    else:
        data, raw = _encode(values, qtype, rng)
    tensor = _FakeTensor(data, raw or Q[qtype], values.shape)
    ours = gguf.dequantize(tensor)
    assert ours.shape == values.shape and ours.dtype == torch.float32
    if qtype in ("F16", "BF16"):
        tol = 1e-3 if qtype == "F16" else 1e-2
        torch.testing.assert_close(ours, torch.from_numpy(values), atol=tol, rtol=0.02)
        return
    if int(Q[qtype]) in GGML_BLOCK:  # transformers decodes no Q5_0 / Q5_1
        raw_bytes = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8)).flatten()
        ref = torch_dequantize(raw_bytes, int(Q[qtype])).reshape(values.shape)
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)
    if qtype not in ("Q4_K", "Q5_K", "Q6_K"):  # random K blocks encode no given values
        bits = int(qtype[1])
        step = np.abs(values).reshape(8, -1, 32).max(-1).repeat(32, -1).reshape(8, 512)
        err = np.abs(ours.numpy() - values)
        assert (err <= 2.0 * step / 2 ** (bits - 1) + 1e-6).all()


class _FakeTensor:
    """What gguf.dequantize reads of a ReaderTensor: data bytes, type, ggml-order shape."""

    def __init__(self, data: np.ndarray, qtype: object, shape: tuple[int, ...]) -> None:
        self.data, self.tensor_type, self.name = data, qtype, "t"
        self.shape = np.array(list(reversed(shape)))


def test_permutation_inverts_llama_cpp_order() -> None:
    w = torch.arange(4 * 8 * 3, dtype=torch.float32).reshape(32, 3)  # 4 heads of 8 rows
    stored = w.reshape(4, 2, 4, 3).transpose(1, 2).reshape(32, 3)  # llama.cpp: interleave
    assert torch.equal(gguf.unpermute_rows(stored, 4), w)
    assert not torch.equal(stored, w)


@pytest.fixture(scope="module")
def llama_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_gguf(str(tmp_path_factory.mktemp("tok") / "tok.gguf"), "llama")


def test_tokenizer_round_trip(llama_file: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from specserve.tokenizer import load_tokenizer

    ours = load_tokenizer(llama_file)
    folder, name = os.path.split(llama_file)
    ref = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    original = AutoTokenizer.from_pretrained(make_tiny_tokenizer(str(tmp_path / "t")))
    texts = [*CORPUS, "  leading spaces and\ttabs\n\n", "<|eos|> is plain text here"]
    for text in texts:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == original.encode(text, add_special_tokens=False, split_special_tokens=True)
        assert ours.decode(ids) == text
    assert ours.encode("hi <|eos|>", add_special_tokens=False) != ref.encode(
        "hi <|eos|>", add_special_tokens=False
    )  # user text never becomes the control token
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    text = original.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|bos|><|user|>\nWhat is 2 + 2?")
    assert ours.apply_chat_template(messages) == original.encode(text, add_special_tokens=False)
    assert ours.eos_token_ids == (1,) and ours.bos_token_id == 0


def test_errors_name_the_problem(tmp_path: Path, llama_file: str) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path(str(tmp_path / "absent.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_model_config(str(bad))
    with pytest.raises(ValueError, match="has no place"):
        gguf.hf_name("blk.0.ssm_conv1d.weight")


def test_unsupported_architecture(tmp_path: Path) -> None:
    import gguf as gg

    path = str(tmp_path / "phi.gguf")
    w = gg.GGUFWriter(path, "phi2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'phi2' is not supported"):
        load_model_config(path)


def test_trainer_target_from_gguf_matches_transformers(llama_file: str) -> None:
    from specserve.train.target import load_hf_target

    ours = load_hf_target(llama_file, torch.float32)
    ref = _hf_from_gguf(llama_file)
    ids = torch.tensor([[0, 5, 99, 250, 7, 31]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, atol=1e-4, rtol=1e-4)


def _chat_jsonl(path: Path, n: int) -> str:
    import json

    with open(path, "w") as fh:
        for i in range(n):
            messages = [
                {"role": "user", "content": CORPUS[i % len(CORPUS)][:60]},
                {"role": "assistant", "content": CORPUS[(i + 3) % len(CORPUS)]},
            ]
            fh.write(json.dumps({"messages": messages}) + "\n")
    return str(path)


def test_eval_prompts_from_chat_jsonl(llama_file: str, tmp_path: Path) -> None:
    from specserve.tokenizer import load_tokenizer
    from specserve.train.evaluate import load_prompts

    tok = load_tokenizer(llama_file)
    data = _chat_jsonl(tmp_path / "held.jsonl", 5)
    prompts = load_prompts([data], tok, prompt_tokens=10_000, num_prompts=3)
    assert len(prompts) == 3
    want = tok.apply_chat_template([{"role": "user", "content": CORPUS[1][:60]}])
    assert prompts[1] == want  # the conversation up to its reply, with the generation prompt


def test_train_a_head_for_a_gguf_target(llama_file: str, tmp_path: Path) -> None:
    from specserve.llm import LLM
    from specserve.train.eagle3 import TrainConfig, train_eagle3

    data = _chat_jsonl(tmp_path / "train.jsonl", 8)
    cfg = TrainConfig(
        target=llama_file,
        out=str(tmp_path / "head"),
        data=(data,),
        draft_vocab_size=128,
        aux_layer_ids="0,1,1",
        seq_len=64,
        batch_size=2,
        max_steps=3,
        ttt_steps=2,
        device="cpu",
        progress=False,
    )
    result = train_eagle3(cfg)
    assert result.steps == 3 and all(np.isfinite(result.losses))
    prompts = [[0, 5, 9, 200], [0, 77, 31]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(device="cpu", dtype="float32", cache=dict(page_size=4, kv_cache_bytes=4 << 20))
    plain = LLM(llama_file, **kw).generate(prompts, params)
    spec = LLM(
        llama_file,
        speculative_config=dict(algorithm="eagle3", draft_model=result.out, num_steps=2),
        **kw,
    ).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(o.spec_cycles > 0 for o in spec)
