"""StepInput: everything a rank needs to run one engine step, as plain arrays (torch-free).

The scheduler's plan becomes one StepInput per step (engine/step_builder.py); the model runner
and the speculative worker read nothing else: no Request objects, requests keyed by their id.
It round-trips through msgpack with every array as raw bytes (`encode` / `decode`; no pickle),
so the same value can be sent to other processes.

Row r (one scheduled request) runs tokens token_ids[tok_off[r] : tok_off[r+1]] at positions
starts[r] .. starts[r] + num_new_tokens[r] - 1 and owns the KV pages
page_ids[page_off[r] : page_off[r+1]]. A decode row (num_new_tokens 1, samples) runs its root:
the newest token of the request (token_ids of the row) at position starts[r], the root a
speculative cycle grows its draft from.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import msgpack
import numpy as np

# per-row arrays and their dtypes; token_ids and page_ids are the rows' values concatenated
ROW_ARRAYS: dict[str, type] = {
    "starts": np.int64,  # position of the row's first new token (= KV entries already valid)
    "num_new_tokens": np.int64,
    "next_token_ids": np.int64,  # the token after the chunk, -1 when the row samples it
    "samples": np.bool_,  # the chunk reaches the request's newest token: sample the next one
    "is_decode": np.bool_,
    # the row may speculate this step (a decode runs a verify cycle, a prefill chunk feeds
    # the proposer); False: a plain row. Decided on the engine side, per step
    "speculate": np.bool_,
    "lookahead": np.int64,  # KV slots owned past the chunk for speculative drafts
    # the KV of [0, starts) came from the prefix cache (target and draft layers) when the
    # request was admitted for this chunk: a proposer with state covers those positions
    "from_cache": np.bool_,
    "num_tokens": np.int64,  # the request's length when scheduled: the sampling counter base
    "tokens_left": np.int64,  # output tokens the request may still emit (max_tokens - done)
    "page_counts": np.int64,
    "temperature": np.float32,  # 0 = greedy
    "top_k": np.int64,  # <= 0: off
    "top_p": np.float32,
    "min_p": np.float32,
    "seed": np.int64,
    # logits processing (layers/logits_processor.py); neutral values on rows without it
    "presence_penalty": np.float32,
    "frequency_penalty": np.float32,
    "repetition_penalty": np.float32,  # 1 = off
    "min_left": np.int64,  # outputs still due before the row's suppress ids may be emitted
    "history_counts": np.int64,  # penalized rows that sample: prompt (repetition) + outputs
    "history_outputs": np.int64,  # how many of those are outputs (the last ones)
    "bias_counts": np.int64,
    "suppress_counts": np.int64,  # EOS + stop_token_ids, only while min_left > 0
    "logprobs": np.int64,  # -1: none; k: the emitted tokens' log-probs and top k
    # -1: none; k: log-probs (and top k) of the prompt tokens after the chunk's positions
    # (those below num_prompt - 1); num_prompt: the request's prompt length
    "prompt_logprobs": np.int64,
    "num_prompt": np.int64,
    # a row admitted on a cached prefix, for a drafter that reads whole histories on the host
    # (suffix decoding): the prefix's tokens [0, starts), which no step ran (else 0)
    "prefix_counts": np.int64,
}
FLAT_ARRAYS: dict[str, type] = {"token_ids": np.int64, "page_ids": np.int32,
                                "history_ids": np.int64, "bias_ids": np.int64,
                                "bias_values": np.float32, "suppress_ids": np.int64,
                                "prefix_ids": np.int64}
# the per-row count array of each flat array
FLAT_COUNTS = {"token_ids": "num_new_tokens", "page_ids": "page_counts",
               "history_ids": "history_counts", "bias_ids": "bias_counts",
               "bias_values": "bias_counts", "suppress_ids": "suppress_counts",
               "prefix_ids": "prefix_counts"}
ARRAYS = {**ROW_ARRAYS, **FLAT_ARRAYS}
FORMAT_VERSION = 6
# the logits-processing arrays and their neutral values (StepInput's defaults)
NEUTRAL_ROWS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                "min_left": 0, "history_counts": 0, "history_outputs": 0, "bias_counts": 0,
                "suppress_counts": 0, "logprobs": -1, "prompt_logprobs": -1, "num_prompt": 0}
# sent only when some row uses them (StepInput.eager)
PROCESSING = {*NEUTRAL_ROWS, "history_ids", "bias_ids", "bias_values", "suppress_ids"}
# sent only when some row carries a cached prefix's tokens
PREFIX = {"prefix_counts", "prefix_ids"}
DEFAULT_ROWS = {**NEUTRAL_ROWS, "prefix_counts": 0}


@dataclass
class StepInput:
    request_ids: list[str]
    starts: np.ndarray
    num_new_tokens: np.ndarray
    next_token_ids: np.ndarray
    samples: np.ndarray
    is_decode: np.ndarray
    speculate: np.ndarray
    lookahead: np.ndarray
    from_cache: np.ndarray
    num_tokens: np.ndarray
    tokens_left: np.ndarray
    page_counts: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    seed: np.ndarray
    token_ids: np.ndarray
    page_ids: np.ndarray
    # logits processing: None = neutral on every row (filled in __post_init__)
    presence_penalty: np.ndarray | None = None
    frequency_penalty: np.ndarray | None = None
    repetition_penalty: np.ndarray | None = None
    min_left: np.ndarray | None = None
    history_counts: np.ndarray | None = None
    history_outputs: np.ndarray | None = None
    bias_counts: np.ndarray | None = None
    suppress_counts: np.ndarray | None = None
    logprobs: np.ndarray | None = None
    prompt_logprobs: np.ndarray | None = None
    num_prompt: np.ndarray | None = None
    history_ids: np.ndarray | None = None
    bias_ids: np.ndarray | None = None
    bias_values: np.ndarray | None = None
    suppress_ids: np.ndarray | None = None
    prefix_counts: np.ndarray | None = None
    prefix_ids: np.ndarray | None = None
    # requests whose per-request state (draft KV bookkeeping, a step launched ahead) every
    # rank drops before running this step: finished or aborted since the last step, and
    # preempted by this step's schedule
    finished_ids: list[str] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # the draft mode (DraftShape.name) the rows that speculate use; "" when none does
    spec_mode: str = ""
    # a step with prefill chunks whose decodes run one token each in the chunks' forward,
    # feeding the drafter as they go (no verify forward of their own beside it)
    fold: bool = False
    # the runner may launch the next decode of the rows that sample here before the host
    # reads this step (decode overlap); False where the engine expects the next step to
    # carry prefill chunks, which one forward runs with its decodes instead of a second
    launch_ahead: bool = True

    def __post_init__(self) -> None:
        bs = len(self.request_ids)
        for name, dtype in ARRAYS.items():
            value = getattr(self, name)
            if value is None:
                value = np.full(bs, DEFAULT_ROWS[name]) if name in DEFAULT_ROWS else []
            arr = np.asarray(value, dtype=dtype)
            setattr(self, name, arr)
            assert arr.ndim == 1 and (name in FLAT_ARRAYS or len(arr) == bs), (name, arr.shape)
        for flat, counts in FLAT_COUNTS.items():
            assert len(getattr(self, flat)) == int(getattr(self, counts).sum()), flat
        self._flags()
        self.tok_off = _offsets(self.num_new_tokens)  # [bs + 1]
        self.page_off = _offsets(self.page_counts)  # [bs + 1]

    # -- views ---------------------------------------------------------------------------------
    @property
    def bs(self) -> int:
        return len(self.request_ids)

    @property
    def greedy(self) -> np.ndarray:
        return self.temperature == 0.0

    def _flags(self) -> None:
        """processed [bs]: rows whose logits get processed (penalties, min_tokens,
        logit_bias); eager: some row needs the eager path, processing or log-probs (no CUDA
        graph holds them, and no step is launched ahead for them). Decided once."""
        self.processed = ((self.presence_penalty != 0) | (self.frequency_penalty != 0)
                          | (self.repetition_penalty != 1) | (self.suppress_counts > 0)
                          | (self.bias_counts > 0))
        self.eager = bool(self.processed.any() or (self.logprobs >= 0).any()
                          or (self.prompt_logprobs >= 0).any())

    @property
    def seq_lens(self) -> np.ndarray:
        """[bs] KV entries valid once the row's chunk is computed."""
        return self.starts + self.num_new_tokens

    def tokens(self, r: int) -> np.ndarray:
        return self.token_ids[self.tok_off[r] : self.tok_off[r + 1]]

    def prefix(self, r: int) -> np.ndarray:
        """Row r's cached prefix tokens (empty unless the step carries them)."""
        off = _offsets(self.prefix_counts)
        return self.prefix_ids[off[r] : off[r + 1]]

    def pages(self, r: int) -> np.ndarray:
        return self.page_ids[self.page_off[r] : self.page_off[r + 1]]

    def page_lists(self) -> list[list[int]]:
        flat = self.page_ids.tolist()
        off = self.page_off.tolist()
        return [flat[off[r] : off[r + 1]] for r in range(self.bs)]

    def positions(self) -> np.ndarray:
        """[T] position of every token run, rows concatenated."""
        total = len(self.token_ids)
        within = np.arange(total, dtype=np.int64) - np.repeat(
            self.tok_off[:-1], self.num_new_tokens
        )
        return np.repeat(self.starts, self.num_new_tokens) + within

    def page_table(self, pad: int) -> tuple[np.ndarray, int]:
        """[bs, width] int32 page tables padded with `pad` (width: the longest), and width."""
        width = int(self.page_counts.max()) if self.bs else 0
        table = np.full((self.bs, width), pad, dtype=np.int32)
        cols = np.arange(len(self.page_ids)) - np.repeat(self.page_off[:-1], self.page_counts)
        table[np.repeat(np.arange(self.bs), self.page_counts), cols] = self.page_ids
        return table, width

    def select(self, index: list[int] | np.ndarray) -> StepInput:
        """The rows `index`, in that order, as a StepInput of their own (no release lists)."""
        index = np.asarray(index, dtype=np.int64)
        rows = {name: getattr(self, name)[index] for name in ROW_ARRAYS}
        for flat, counts in FLAT_COUNTS.items():
            rows[flat] = _gather(getattr(self, flat), _offsets(getattr(self, counts)), index)
        return StepInput(request_ids=[self.request_ids[i] for i in index.tolist()],
                         spec_mode=self.spec_mode, fold=self.fold,
                         launch_ahead=self.launch_ahead, **rows)

    # -- wire format ---------------------------------------------------------------------------
    def encode(self) -> bytes:
        """msgpack bytes: lists of ids as strings, every array as its raw little-endian bytes."""
        msg: dict[str, object] = {
            "v": FORMAT_VERSION,
            "request_ids": self.request_ids,
            "finished_ids": self.finished_ids,
            "preempted_ids": self.preempted_ids,
            "spec_mode": self.spec_mode,
            "fold": self.fold,
            "launch_ahead": self.launch_ahead,
        }
        for name, dtype in ARRAYS.items():
            if name in PROCESSING and not self.eager:
                continue  # neutral on every row: decode fills them in
            if name in PREFIX and not self.prefix_counts.any():
                continue
            msg[name] = (
                getattr(self, name).astype(np.dtype(dtype).newbyteorder("<"), copy=False).tobytes()
            )
        return msgpack.packb(msg, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> StepInput:
        msg = msgpack.unpackb(data, raw=False)
        if msg.get("v") != FORMAT_VERSION:
            raise ValueError(f"step message format {msg.get('v')!r}, expected {FORMAT_VERSION}")
        arrays = {
            name: np.frombuffer(msg[name], dtype=np.dtype(dtype).newbyteorder("<"))
            for name, dtype in ARRAYS.items() if name in msg
        }
        return cls(
            request_ids=msg["request_ids"],
            finished_ids=msg["finished_ids"],
            preempted_ids=msg["preempted_ids"],
            spec_mode=msg["spec_mode"],
            fold=msg["fold"],
            launch_ahead=msg["launch_ahead"],
            **arrays,
        )

    def equals(self, other: StepInput) -> bool:
        """Field-by-field equality (arrays compared by value and dtype)."""
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, np.ndarray):
                if a.dtype != b.dtype or not np.array_equal(a, b):
                    return False
            elif a != b:
                return False
        return True


@dataclass
class StepOutput:
    """What a step produced, per row of its StepInput (plain lists: serializable as is)."""

    token_ids: list[list[int]]  # tokens emitted ([] for a mid-prefill chunk)
    # KV entries that became valid per row; None: every row's num_new_tokens (a verify keeps
    # the root plus the accepted drafts)
    num_computed: list[int] | None = None
    # draft tokens proposed per row (0: the row did not speculate); None: no row did. A
    # speculating row accepted len(token_ids[r]) - 1 of them.
    num_drafted: list[int] | None = None
    # positions whose draft KV (the proposer's own layers) is valid per row after the step;
    # None: the worker keeps no draft KV in the pages (plain, or a stateless proposer)
    draft_computed: list[int] | None = None
    # per row, per emitted token (aligned with token_ids) of rows that asked (logprobs >= 0):
    # [log-prob, [top ids], [top log-probs]] of the raw distribution; None: no row asked
    logprobs: list[list[list] | None] | None = None
    # per row that asked (prompt_logprobs >= 0): the entries of prompt positions
    # starts + 1 .. (the tokens after the chunk's positions, within the prompt); else None
    prompt_logprobs: list[list[list] | None] | None = None
    # a tree mode's step: per row, what a chain of the same drafter would have accepted,
    # 2 r + o (speculative/verify.chain_runs; -1 for rows that did not speculate); else None
    chain_runs: list[int] | None = None


def _offsets(counts: np.ndarray) -> np.ndarray:
    off = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=off[1:])
    return off


def _gather(flat: np.ndarray, off: np.ndarray, index: np.ndarray) -> np.ndarray:
    """The segments off[i] : off[i+1] of flat for i in index, concatenated."""
    if len(index) == 0:
        return flat[:0]
    counts = off[index + 1] - off[index]
    within = np.arange(int(counts.sum())) - np.repeat(_offsets(counts)[:-1], counts)
    return flat[np.repeat(off[index], counts) + within]
