"""train-eagle3's pieces under the trainer: the draft vocabulary (a frequency table), chat
loss masks, regenerated text (the target's greedy continuation), and the training head against
the inference head (every TTT step against the engine's drafting positions; every parameter
gets a gradient)."""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path

import pytest
import torch
import train_fixtures

from specserve.config import ModelConfig
from specserve.kv_cache.pool import KVPool
from specserve.layers.attention_metadata import ForwardContext, set_forward_context
from specserve.layers.backends.torch_ref import TorchRefBackend
from specserve.llm import LLM
from specserve.models.eagle3 import load_eagle3_head
from specserve.models.loader import load_model
from specserve.train import data as D
from specserve.train.config import TrainConfig
from specserve.train.head import Eagle3TrainHead, draft_vocab_from_counts, export_head
from specserve.worker.forward_batch import build_attention_metadata

# the fixtures of train_fixtures.py, bound here so that pytest finds them in this module
one_thread = train_fixtures.one_thread
target = train_fixtures.target
code_files = train_fixtures.code_files


# -- draft vocabulary and data ---------------------------------------------------------------------


def test_draft_vocab_matches_naive_frequency_table() -> None:
    rng = random.Random(0)
    vocab, vd = 50, 12
    samples = []
    for _ in range(6):
        ids = [rng.choice([1, 2, 3, 5, 8, 13, 21, 34] + list(range(vocab))) for _ in range(40)]
        mask = [rng.random() < 0.7 for _ in ids]
        samples.append(D.Sample(torch.tensor(ids), torch.tensor(mask)))
    counter = collections.Counter(i for s in samples for i, m in
                                  zip(s.input_ids.tolist(), s.loss_mask.tolist()) if m)
    counts = D.token_counts(samples, vocab)
    assert counts.tolist() == [counter[i] for i in range(vocab)]
    chosen = sorted(sorted(range(vocab), key=lambda i: (-counter[i], i))[:vd])
    d2t, t2d = draft_vocab_from_counts(counts, vd)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert [i + int(d2t[i]) for i in range(vd)] == chosen  # target_id = i + d2t[i]
    assert t2d.tolist() == [i in chosen for i in range(vocab)]
    with pytest.raises(ValueError, match="draft-vocab-size"):
        draft_vocab_from_counts(counts, vocab + 1)


def test_chat_loss_mask_covers_assistant_turns_only(tmp_path: Path, target: str) -> None:
    from transformers import AutoTokenizer

    chat = {"messages": [{"role": "user", "content": "add two numbers"},
                         {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
                         {"role": "user", "content": "and print"},
                         {"role": "assistant", "content": "print(add(1, 2))"}]}
    file = tmp_path / "chat.jsonl"
    file.write_text(json.dumps(chat) + "\n" + json.dumps({"text": "x = 1\n"}) + "\n")
    records = D.read_records([str(file)])
    tok = AutoTokenizer.from_pretrained(target)
    chat_sample, text_sample = D.tokenize_records(tok, records)
    ids, mask = chat_sample.input_ids.tolist(), chat_sample.loss_mask.tolist()
    # contiguous masked runs, decoded, are exactly each reply plus its end-of-turn marks
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs, cur = runs + [cur], []
    runs += [cur] if cur else []
    got = [tok.decode(r, skip_special_tokens=False) for r in runs]
    assert got == [m["content"] + "<|eos|>\n" for m in chat["messages"][1::2]]
    assert text_sample.loss_mask.all() and text_sample.input_ids[0] == tok.bos_token_id
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        D.read_records([str(bad)])


def test_regenerated_text_is_the_targets_greedy_continuation(target: str,
                                                            code_files: tuple[str, ...]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    records = [D.Record(text=open(f).read()) for f in code_files[:2]]
    llm = LLM(target, device="cpu", dtype="float32")
    samples = D.regenerate(records, llm, tok, seq_len=24, prompt_tokens=8, temperature=0.0,
                           max_samples=3)
    assert len(samples) == 3
    hf = AutoModelForCausalLM.from_pretrained(target).eval()
    for s in samples:
        prompt = s.input_ids[:8]
        assert not s.loss_mask[:8].any() and s.loss_mask[8:].all()
        ref = hf.generate(prompt[None], max_new_tokens=16, do_sample=False,
                          attention_mask=torch.ones(1, 8, dtype=torch.long))[0, 8:].tolist()
        gen = s.input_ids[8:].tolist()
        assert gen == ref[:len(gen)] and (len(gen) == 16 or ref[len(gen) - 1] in
                                          llm.tokenizer.eos_token_ids)


# -- the training head against the inference head -----------------------------------------------


def _random_head(target: str, vd: int, seed: int) -> tuple[Eagle3TrainHead, ModelConfig]:
    from transformers import AutoModelForCausalLM

    tcfg = ModelConfig.from_hf(target)
    hf = AutoModelForCausalLM.from_pretrained(target)
    torch.manual_seed(seed)
    cfg = TrainConfig(draft_vocab_size=vd).head_config(tcfg, (1, 2, 3))
    head = Eagle3TrainHead(cfg, tcfg.hidden_size, hf.get_input_embeddings().weight)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    counts = torch.randint(0, 100, (tcfg.vocab_size,))
    head.set_draft_vocab(*draft_vocab_from_counts(counts, vd))
    return head, tcfg


def test_ttt_steps_equal_inference_drafting(tmp_path: Path, target: str) -> None:
    """Step 0 == the head's extend over real features; TTT step s at index P-1 == chain draft
    step s after a prefix of P positions (RoPE P+s-1, sees the prefix and its own chain)."""
    head, tcfg = _random_head(target, vd=96, seed=1)
    export_head(head, str(tmp_path / "head"), "float32", tcfg.num_layers)
    model = load_model(tcfg, target, torch.float32, "cpu")
    infer = load_eagle3_head(str(tmp_path / "head"), model, tcfg, 0, torch.float32,
                             torch.device("cpu"))
    assert infer.config.aux_layer_ids == (1, 2, 3)
    assert torch.equal(infer.d2t, head.d2t)
    page_size, num_pages = 4, 24
    pool = KVPool([infer.midlayer.attn.kv_spec], num_pages, page_size, torch.float32, "cpu")
    pool.bind([infer.midlayer.attn])
    pages = list(range(num_pages))
    random.Random(0).shuffle(pages)

    def draft(ids: list[int], pos: list[int], g: torch.Tensor, seq_len: int) -> torch.Tensor:
        md = build_attention_metadata([len(ids)], [seq_len], [pages], page_size, "cpu")
        set_forward_context(ForwardContext(md, TorchRefBackend()))
        try:
            return infer(torch.tensor(ids), torch.tensor(pos), g)
        finally:
            set_forward_context(None)

    seq, steps = 30, 4
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(4, tcfg.vocab_size, (seq,), generator=gen)
    feats = torch.randn(seq, 3 * tcfg.hidden_size, generator=gen)
    # training: index t pairs feature t with token t+1 (L = seq - 1 indices)
    outs, cache, g = [], None, feats[None, :-1]
    with torch.no_grad():
        for s in range(steps + 1):
            ids = torch.cat([tokens[1 + s:], torch.zeros(s, dtype=torch.long)])[None]
            g, cache = head.step(ids, g, s, cache)
            outs.append((g[0], head.logits(g)[0]))
        L = seq - 1
        ext = draft(tokens[1:].tolist(), list(range(L)), feats[:L], L)
        torch.testing.assert_close(ext, outs[0][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(infer.compute_logits(ext), outs[0][1], rtol=1e-4, atol=1e-4)
        for prefix in (1, 6, L - steps):
            t = prefix - 1
            y = draft(tokens[1:prefix + 1].tolist(), list(range(prefix)), feats[:prefix],
                      prefix)[-1:]
            for s in range(1, steps + 1):  # chain step s: token t+1+s at RoPE position t+s
                y = draft([int(tokens[t + 1 + s])], [t + s], y, prefix + s)
                torch.testing.assert_close(y[0], outs[s][0][t], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(infer.compute_logits(y)[0], outs[s][1][t],
                                           rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_every_head_parameter_gets_a_gradient(target: str, device: str) -> None:
    """On CUDA the inference layers dispatch to fused kernels without a backward; the training
    head must not use them, or everything below the final norm silently stops learning."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    head, tcfg = _random_head(target, vd=64, seed=4)
    head = head.to(device)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(4, tcfg.vocab_size, (2, 12), generator=gen).to(device)
    g = torch.randn(2, 12, 3 * tcfg.hidden_size, generator=gen).to(device)
    cache, loss = None, torch.zeros((), device=device)
    for s in range(3):
        with torch.autocast(device, torch.bfloat16, enabled=device == "cuda"):
            g, cache = head.step(ids, g, s, cache)
            loss = loss + head.logits(g).logsumexp(-1).mean()
    loss.backward()
    for name, p in head.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name} got no gradient"
