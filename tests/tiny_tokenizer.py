"""A tiny byte-level BPE tokenizer trained in a fraction of a second, for tests.

`make_tiny_tokenizer(path)` writes a Hugging Face fast tokenizer directory (tokenizer.json +
tokenizer_config.json, chat template included) that loads with `AutoTokenizer` and with
`specserve.tokenizer.load_tokenizer`. Token ids: 0..3 are the special tokens below, then the
256 byte symbols, then the learned merges, so any UTF-8 text encodes (characters unseen in
training split into byte tokens).
"""

from __future__ import annotations

import os

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>\n"
    "{% elif message['role'] == 'assistant' %}<|assistant|>\n"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "{{ message['content'] }}{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

CORPUS = [
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for i in range(10):\n    print(f'value {i}: {i * i}')\n",
    "class Cache:\n    def __init__(self, size):\n        self.size = size\n"
    "        self.items = {}\n",
    "import os\nimport sys\n\nif __name__ == '__main__':\n    sys.exit(main())\n",
    "The quick brown fox jumps over the lazy dog. A speculative decoder drafts several "
    "tokens and the target model verifies them in one forward pass.",
    "Language models predict the next token. Inference engines batch many requests "
    "together, page the key-value cache, and stream text back to the user.",
    "Once upon a time there was a small model that wanted to answer questions quickly "
    "and correctly. It learned from examples and became helpful.",
    "Café crème, naïve façade, résumé, jalapeño, Zürich, São Paulo, Ærøskøbing.",
    "Emoji: 😀 😃 🚀 🎉 ❤️ 👍 — and a few symbols: € £ ¥ © ™ ∑ π ≈ ∞.",
    "日本語のテキスト、中文文本、한국어 텍스트, русский текст, ελληνικά.",
]


def make_tiny_tokenizer(path: str, vocab_size: int = 512) -> str:
    """Train the tokenizer and save it to `path` (created if missing); return `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    bos = tok.token_to_id("<|bos|>")
    # add_special_tokens=True prepends <|bos|> (the chat template writes its own)
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|eos|>",
        additional_special_tokens=["<|user|>", "<|assistant|>"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return path
