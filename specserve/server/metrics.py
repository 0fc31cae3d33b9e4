"""Prometheus metrics the server exposes on /metrics (and the benchmark client reads back).

Speculation counters follow vLLM's meanings, so acceptance can be isolated to a benchmark run
from counter deltas:
    mean acceptance length = (num_accepted_tokens + num_drafts) / num_drafts   (bonus included)
    acceptance rate at draft position i = num_accepted_tokens_per_pos[i] / num_drafts
prometheus_client appends `_total` to counter names itself, so counters are declared without
it; the constants below are the exposed sample names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

PREFIX = "specserve:"
REQUEST_SUCCESS = PREFIX + "request_success_total"  # label finished_reason
PROMPT_TOKENS = PREFIX + "prompt_tokens_total"
GENERATION_TOKENS = PREFIX + "generation_tokens_total"
REQUEST_ABORTED = PREFIX + "request_aborted_total"
NUM_PREEMPTIONS = PREFIX + "num_preemptions_total"
# steps whose prefill waited a step behind decodes launched ahead (decode overlap)
NUM_PREFILL_DEFERRALS = PREFIX + "num_prefill_deferrals_total"
TTFT = PREFIX + "time_to_first_token_seconds"
TPOT = PREFIX + "time_per_output_token_seconds"
E2E_LATENCY = PREFIX + "e2e_request_latency_seconds"
NUM_RUNNING = PREFIX + "num_requests_running"
NUM_WAITING = PREFIX + "num_requests_waiting"
KV_CACHE_USAGE = PREFIX + "kv_cache_usage_perc"
SPEC_NUM_DRAFTS = PREFIX + "spec_decode_num_drafts_total"  # draft-verify cycles
SPEC_NUM_DRAFT_TOKENS = PREFIX + "spec_decode_num_draft_tokens_total"  # draft tokens proposed
SPEC_NUM_ACCEPTED = PREFIX + "spec_decode_num_accepted_tokens_total"  # accepted, bonus excluded
SPEC_ACCEPTED_PER_POS = PREFIX + "spec_decode_num_accepted_tokens_per_pos_total"  # label position
# prefix caching, in tokens: each admission queries its request's length and hits its cached
# prefix (hit rate = hits / queries)
PREFIX_CACHE_QUERIES = PREFIX + "prefix_cache_queries_total"
PREFIX_CACHE_HITS = PREFIX + "prefix_cache_hits_total"
SPEC_MODE_STEPS = PREFIX + "spec_decode_mode_steps_total"  # label mode: a draft mode, "off" or "fold"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
# speculation can bring the per-token time well under a millisecond
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05,
                 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)  # fmt: skip
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)  # fmt: skip


def _counter(name: str, doc: str, registry: CollectorRegistry, labels: tuple = ()) -> Counter:
    assert name.endswith("_total")
    return Counter(name[: -len("_total")], doc, labels, registry=registry)


class EngineMetrics:
    """All server metrics, registered on one registry (one per server; tests use their own)."""

    def __init__(self, registry: CollectorRegistry, spec_method: str = "eagle3") -> None:
        """spec_method labels the speculation counters (`method`: the engine's drafter)."""
        r = registry
        self.spec_method = spec_method
        self.request_success = _counter(
            REQUEST_SUCCESS, "Finished requests by finish reason.", r, ("finished_reason",)
        )
        self.prompt_tokens = _counter(PROMPT_TOKENS, "Prompt tokens processed.", r)
        self.generation_tokens = _counter(GENERATION_TOKENS, "Tokens generated.", r)
        self.request_aborted = _counter(REQUEST_ABORTED, "Requests aborted (disconnect).", r)
        self.num_preemptions = _counter(
            NUM_PREEMPTIONS, "Requests preempted (KV freed, recomputed later).", r
        )
        self.num_prefill_deferrals = _counter(
            NUM_PREFILL_DEFERRALS, "Steps whose prefill waited one step behind decodes "
            "launched ahead (it then runs with the next step's decodes in one forward).", r)
        self.ttft = Histogram(TTFT, "Time to first token (s).", buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(
            TPOT, "Time per output token after the first (s).", buckets=_TPOT_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            E2E_LATENCY, "End-to-end request latency (s).", buckets=_E2E_BUCKETS, registry=r
        )
        self.num_running = Gauge(NUM_RUNNING, "Requests running on the engine.", registry=r)
        self.num_waiting = Gauge(NUM_WAITING, "Requests waiting to be scheduled.", registry=r)
        self.kv_cache_usage = Gauge(KV_CACHE_USAGE, "KV cache usage, 0..1.", registry=r)
        # speculation counters, labelled by method: children of this engine's method
        method = ("method",)
        self.spec_num_drafts = _counter(SPEC_NUM_DRAFTS, "Draft-verify cycles.", r,
                                        method).labels(spec_method)
        self.spec_num_draft_tokens = _counter(SPEC_NUM_DRAFT_TOKENS, "Draft tokens proposed.", r,
                                              method).labels(spec_method)
        self.spec_num_accepted = _counter(
            SPEC_NUM_ACCEPTED, "Draft tokens accepted (bonus token excluded).", r, method
        ).labels(spec_method)
        self._seen: dict[str, Any] = {}  # the engine's cumulative counts already counted
        self._per_pos = _counter(
            SPEC_ACCEPTED_PER_POS, "Draft tokens accepted at each draft position.", r,
            ("method", "position"))
        self.prefix_cache_queries = _counter(
            PREFIX_CACHE_QUERIES, "Prefix cache queries, in tokens looked up.", r
        )
        self.prefix_cache_hits = _counter(
            PREFIX_CACHE_HITS, "Prefix cache hits, in tokens found cached.", r
        )
        self.spec_mode_steps = _counter(
            SPEC_MODE_STEPS, "Engine steps per speculation mode chosen ('off': plain).", r,
            ("mode",)
        )

    def spec_accepted_per_pos(self, pos: int) -> Counter:
        return self._per_pos.labels(method=self.spec_method, position=str(pos))

    def record_request(
        self,
        finished_reason: str,
        prompt_tokens: int,
        generation_tokens: int,
        ttft_s: float | None,
        e2e_s: float,
    ) -> None:
        """A request that finished normally ("stop" / "length"). TPOT is per generated token,
        not per stream chunk: (e2e - ttft) / (generation_tokens - 1)."""
        self.request_success.labels(finished_reason=finished_reason).inc()
        self._count_tokens(prompt_tokens, generation_tokens)
        self.e2e.observe(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if generation_tokens > 1:
                self.tpot.observe((e2e_s - ttft_s) / (generation_tokens - 1))

    def record_abort(self, prompt_tokens: int, generation_tokens: int) -> None:
        """A request ended by the client (disconnect) or by an error before finishing."""
        self.request_aborted.inc()
        self._count_tokens(prompt_tokens, generation_tokens)

    def _count_tokens(self, prompt_tokens: int, generation_tokens: int) -> None:
        assert prompt_tokens >= 0 and generation_tokens >= 0
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)

    def record_spec_step(
        self, accepted: Sequence[int], num_draft_tokens: int | Sequence[int]
    ) -> None:
        """One verify step over a batch: request r proposed num_draft_tokens[r] draft tokens and
        accepted the first accepted[r] of them (bonus excluded). A chain (or tree path) accepted
        to length a counts one accepted token at each position 0..a-1."""
        if isinstance(num_draft_tokens, int):
            num_draft_tokens = [num_draft_tokens] * len(accepted)
        assert len(num_draft_tokens) == len(accepted)
        if not accepted:
            return
        assert all(0 <= a <= d for a, d in zip(accepted, num_draft_tokens)), "accepted > drafted"
        self.spec_num_drafts.inc(len(accepted))
        self.spec_num_draft_tokens.inc(sum(num_draft_tokens))
        self.spec_num_accepted.inc(sum(accepted))
        for pos in range(max(accepted)):
            # requests whose accepted run reaches draft position pos
            hits = sum(1 for a in accepted if a > pos)
            self.spec_accepted_per_pos(pos).inc(hits)

    def observe_engine_stats(self, stats: dict[str, Any]) -> None:
        """Engine.stats() after a step or command: the gauges, and the counters the engine
        keeps cumulatively (speculation, preemptions, prefix caching) advanced by their
        deltas."""
        self.set_scheduler_state(
            stats.get("num_running", 0),
            stats.get("num_waiting", 0),
            float(stats.get("kv_usage", 0.0)),
        )
        seen = self._seen
        for key, counter in (
            ("num_drafts", self.spec_num_drafts),
            ("num_draft_tokens", self.spec_num_draft_tokens),
            ("num_accepted_tokens", self.spec_num_accepted),
            ("num_preemptions", self.num_preemptions),
            ("num_prefill_deferrals", self.num_prefill_deferrals),
            ("prefix_cache_queries", self.prefix_cache_queries),
            ("prefix_cache_hits", self.prefix_cache_hits),
        ):
            if key in stats:
                delta = stats[key] - seen.get(key, 0)
                if delta > 0:
                    counter.inc(delta)
                seen[key] = stats[key]
        per_pos = list(stats.get("accepted_per_pos") or [])
        before = seen.get("accepted_per_pos", [])
        for pos, value in enumerate(per_pos):
            delta = value - (before[pos] if pos < len(before) else 0)
            if delta > 0:
                self.spec_accepted_per_pos(pos).inc(delta)
        seen["accepted_per_pos"] = per_pos
        for mode, value in (stats.get("mode_steps") or {}).items():
            key = f"mode_steps/{mode}"
            delta = value - seen.get(key, 0)
            if delta > 0:
                self.spec_mode_steps.labels(mode=mode).inc(delta)
            seen[key] = value

    def set_scheduler_state(self, running: int, waiting: int, kv_cache_usage: float) -> None:
        """Gauges, sampled once per engine step."""
        self.num_running.set(running)
        self.num_waiting.set(waiting)
        self.kv_cache_usage.set(kv_cache_usage)


@dataclass(frozen=True)
class SpecCounters:
    """The speculation counters read back from a /metrics scrape (summed over other labels).
    Subtract two scrapes to isolate a run: `after - before`."""

    num_drafts: float
    num_draft_tokens: float
    num_accepted: float
    accepted_per_pos: tuple[float, ...]  # index = draft position

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        width = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        mine = self.accepted_per_pos + (0.0,) * (width - len(self.accepted_per_pos))
        theirs = other.accepted_per_pos + (0.0,) * (width - len(other.accepted_per_pos))
        return SpecCounters(
            self.num_drafts - other.num_drafts,
            self.num_draft_tokens - other.num_draft_tokens,
            self.num_accepted - other.num_accepted,
            tuple(a - b for a, b in zip(mine, theirs)),
        )

    def acceptance(self) -> dict[str, Any] | None:
        """Acceptance over these counts; None when no draft-verify cycle ran (or the counters
        went backwards, i.e. the server restarted between scrapes)."""
        counts = (self.num_drafts, self.num_draft_tokens, self.num_accepted, *self.accepted_per_pos)
        if self.num_drafts <= 0 or min(counts) < 0:
            return None
        per_pos = [a / self.num_drafts for a in self.accepted_per_pos]
        return {
            "num_drafts": int(self.num_drafts),
            "num_draft_tokens": int(self.num_draft_tokens),
            "num_accepted_tokens": int(self.num_accepted),
            # tokens emitted per cycle: the accepted drafts plus the one bonus token
            "mean_acceptance_length": (self.num_accepted + self.num_drafts) / self.num_drafts,
            "draft_acceptance_rate": (
                self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else 0.0
            ),
            "per_position_acceptance": per_pos,
        }


def parse_spec_counters(text: str) -> SpecCounters | None:
    """Read the speculation counters from Prometheus text exposition; None when the server
    exports no drafts counter (speculation off, or another server)."""
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == SPEC_ACCEPTED_PER_POS and "position" in sample.labels:
                pos = int(sample.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + sample.value
            elif sample.name in (SPEC_NUM_DRAFTS, SPEC_NUM_DRAFT_TOKENS, SPEC_NUM_ACCEPTED):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    if SPEC_NUM_DRAFTS not in totals:
        return None
    width = max(per_pos) + 1 if per_pos else 0
    return SpecCounters(
        totals[SPEC_NUM_DRAFTS],
        totals.get(SPEC_NUM_DRAFT_TOKENS, 0.0),
        totals.get(SPEC_NUM_ACCEPTED, 0.0),
        tuple(per_pos.get(i, 0.0) for i in range(width)),
    )
