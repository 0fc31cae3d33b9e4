"""Plain steps' chunks measured at one load and read at another (engine/chunk_cost.py
forget_chunks, the adaptive policy's off trial): the bundled pair's model engine
(specserve/bench/policy_sim.py) fitted to an H100 run."""

from __future__ import annotations

import pytest

from specserve.bench.policy_sim import SimConfig, sweep
from specserve.engine.chunk_cost import ChunkCost

MODES = {"chain3": (1, 3), "chain1": (1, 1), "chain2": (1, 2), "tree4x3x8": (4, 3)}


def test_a_kinds_forgotten_chunks_read_the_recent_steps() -> None:
    """forget_chunks drops a kind's own mean chunk and its group's (an off trial's start):
    mean_chunk then reads every kind's recent steps until the kind's own come again."""
    groups = {"off": "plain", "fold": "plain"}
    cc = ChunkCost(decay=1.0, group=lambda k: groups.get(k, "spec"))
    for n in (128, 128, 128):
        cc.observe("off", n, 1e-3)
    for n in (512, 640):
        cc.observe("tree", n, 2e-3)
    assert cc.mean_chunk("off") == pytest.approx(128.0)
    cc.forget_chunks("off")
    assert cc.mean_chunk("off") == pytest.approx(cc.mean_tokens) and cc.mean_tokens > 200
    assert cc.mean_chunk("tree") == pytest.approx(576.0)  # another group's: untouched
    cc.observe("off", 500, 1e-3)
    assert cc.mean_chunk("off") == pytest.approx(500.0)


PAIR_MS = {  # the bundled pair's start-up table, H100 at af41110 (ms)
    "off": {1: 0.44, 2: 0.467, 4: 0.46, 8: 0.513, 16: 0.483, 32: 0.463, 64: 0.502},
    "chain3": {1: 0.92, 2: 0.998, 4: 1.049, 8: 0.989, 16: 1.035, 32: 1.065, 64: 1.177},
    "chain1": {1: 0.724, 2: 0.775, 4: 0.73, 8: 0.79, 16: 0.79, 32: 0.805, 64: 0.859},
    "chain2": {1: 0.87, 2: 0.905, 4: 0.887, 8: 0.895, 16: 0.886, 32: 0.906, 64: 1.041},
    "tree4x3x8": {1: 1.017, 2: 1.1, 4: 1.162, 8: 1.109, 16: 1.2, 32: 1.243, 64: 1.369},
}


@pytest.mark.slow
def test_off_gets_a_trial_where_its_chunks_were_measured_at_a_lighter_load() -> None:
    """The bundled pair's model engine as that H100 run measured it (mixed-step lines and
    decode-step scales of its static runs, its start-up priors; scripts/simulate_spec_policy.py
    --fit-static --profiled-priors), loads 16, 64, 128 in turn, 8 seeds: at C = 128 plain
    decoding wins by a third, but off's mean chunk came from C = 16 (one prompt a mixed
    step, not the four it carries at 128), so most plain steps scored as mixed and the policy
    kept the tree: mean 0.87 of the best (0.73 at worst), C = 64 0.94. With one dwell off
    where off's share reads 0.3 or more: 0.998 and 0.97 (mean), C = 16 (off 0.77x the
    tree) unchanged. One seed's C = 64 stays at 0.84: a trial that came before the load
    settled."""
    cfg = SimConfig(
        costs={m: {b: t / 1e3 for b, t in row.items()} for m, row in PAIR_MS.items()},
        modes=MODES, verify_tokens={"chain3": 4, "chain1": 2, "chain2": 3, "tree4x3x8": 8},
        accept_rate=0.6, prompt_len=128, output_len=96, output_spread=0.5,
        mixed_lines={"off": (1.38, 0.0), "chain3": (0.47, 0.0084), "chain1": (1.69, 0.0025),
                     "chain2": (1.44, 0.0044), "tree4x3x8": (1.24, 0.0060)},
        step_scale={"off": 1.68, "chain3": 1.13, "chain1": 1.62, "chain2": 1.43,
                    "tree4x3x8": 1.19},
        mixed_priors={"off": {128: 1.016, 512: 1.079}, "chain3": {128: 1.113, 512: 1.026},
                      "chain1": {128: 1.128, 512: 0.998}, "chain2": {128: 1.094, 512: 1.02},
                      "tree4x3x8": {128: 1.129, 512: 0.886}})
    got = [[p["adaptive_vs_best"] for p in sweep(cfg, [16, 64, 128], repeats=3, seed=seed)]
           for seed in range(0, 8000, 1000)]
    means = [sum(col) / len(col) for col in zip(*got)]
    assert means[0] >= 0.96 and means[1] >= 0.96 and means[2] >= 0.99, (means, got)
    assert min(min(row) for row in got) >= 0.8, got
