"""The benchmark's warm-up makes the embedded engine's static caches at the length every
measured prompt fits. A cache that grows during the measurement is, on CUDA, compiled steps
recorded again inside it: the first H100 measurement counted 45 s of that in one prompt's
plain decoding and reported a speedup of 1.48 where the warm engine gave 1.19."""

from __future__ import annotations

import pytest

from draftsmith.bench import benchmark
from draftsmith.bench.benchmark import measure_batched, measure_embedded, plain_decoding
from draftsmith.config import BenchmarkConfig
from draftsmith.serve import embedded
from draftsmith.serve.embedded import EmbeddedSpeculativeEngine
from tests.test_embedded import (  # noqa: F401 (fixtures)
    NUM_STEPS,
    drafter,
    exported_drafter,
    target_model,
)

# A short prompt first, as the suite's chat prompts come first, and one whose cache needs the
# next length step (StaticTargetRunner.LENGTH_STEP = 256 positions) later.
PROMPTS = [[5, 6, 7], [11 + i % 400 for i in range(300)], [9, 8, 7, 6, 5], [3, 4]]


@pytest.fixture
def caches_made(monkeypatch):
    """Each static cache the engine makes, target's and drafter's, named with the phase it
    was made in: the warm-up, or the measurement (once its progress line has begun)."""
    made: list[tuple[str, str]] = []
    phase = ["warm-up"]

    class MeasuredProgress(benchmark.Progress):
        def __init__(self, *args, **kwargs):
            phase[0] = "measured"
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(benchmark, "Progress", MeasuredProgress)
    target_cache = embedded.StaticTargetRunner._static_cache
    draft_cache_init = embedded.StaticDraftCache.__init__

    def record_target(self, rows, capacity):
        made.append((phase[0], f"target, {rows} rows"))
        return target_cache(self, rows, capacity)

    def record_draft(self, *args, **kwargs):
        made.append((phase[0], "drafter"))
        draft_cache_init(self, *args, **kwargs)

    monkeypatch.setattr(embedded.StaticTargetRunner, "_static_cache", record_target)
    monkeypatch.setattr(embedded.StaticDraftCache, "__init__", record_draft)

    def start_warm_up() -> None:
        phase[0] = "warm-up"
    return made, start_warm_up


def test_no_measured_prompt_makes_a_static_cache(target_model, exported_drafter,  # noqa: F811
                                                 caches_made, caplog):
    """And each warm-up says it runs and how long it took: on a fresh GPU it compiles for
    minutes with nothing else in the log."""
    caplog.set_level("INFO", logger="draftsmith.bench.benchmark")
    made, start_warm_up = caches_made
    engine = EmbeddedSpeculativeEngine.load(target_model, exported_drafter, NUM_STEPS,
                                            cache="static")
    try:
        cfg = BenchmarkConfig(max_new_tokens=6, warmup_prompts=1)
        plain = plain_decoding(engine, PROMPTS, cfg, None)
        start_warm_up()
        _, per_prompt = measure_embedded(engine, PROMPTS, cfg, None, "chain", plain)
        start_warm_up()
        batched = measure_batched(engine, PROMPTS, cfg, None, 2, [run.tokens for run in plain])
    finally:
        engine.runner.close()
    assert all(row["identical"] for row in per_prompt)
    assert batched["identical_outputs"] == f"{len(PROMPTS)}/{len(PROMPTS)}"
    assert ("warm-up", "target, 1 rows") in made and ("warm-up", "drafter") in made
    assert [kind for phase, kind in made if phase == "measured"] == []
    said = [r.getMessage() for r in caplog.records]
    for label in ("benchmark plain decoding", "benchmark chain", "benchmark batch 2"):
        assert any(m.startswith(f"{label}: warming up") for m in said), (label, said)
        assert any(m.startswith(f"{label}: warm after") for m in said), (label, said)


def test_plain_decoding_runs_over_the_cache_a_tree_decodes_over(
        target_model, exported_drafter, monkeypatch):  # noqa: F811
    """A tree's generation takes a larger target cache than plain decoding (its rejected
    nodes' slots stay behind). Plain decoding, measured first, runs over that cache from its
    warm-up on, so that no later pass, the speed pairs' plain ones included, meets a cache
    its step has not run over. (Plain decoding once ran over a smaller cache, which the
    tree's first generation replaced: on an H200 the plain step was compiled again for it
    inside the second speed pair's plain pass, 43 s, and that pair said 4.4x.)"""
    made, used = [], []  # the static caches made, and each plain generation's
    plain_generate = benchmark.plain_generate
    target_cache = embedded.StaticTargetRunner._static_cache

    def record_plain(runner, *args, **kwargs):
        generation = plain_generate(runner, *args, **kwargs)
        used.append(id(runner._kv[1]))
        return generation

    def record_cache(self, rows, capacity):
        made.append(capacity)
        return target_cache(self, rows, capacity)

    monkeypatch.setattr(benchmark, "plain_generate", record_plain)
    monkeypatch.setattr(embedded.StaticTargetRunner, "_static_cache", record_cache)
    engine = EmbeddedSpeculativeEngine.load(target_model, exported_drafter, NUM_STEPS, topk=2,
                                            num_draft_tokens=6, cache="static")
    try:
        # 300 + 80 plain positions fit 512 slots; the tree's 300 + 80 * 3 + 6 do not.
        cfg = BenchmarkConfig(max_new_tokens=80, warmup_prompts=1, repeats=2)
        plain = plain_decoding(engine, PROMPTS, cfg, None)
        summary, per_prompt = measure_embedded(engine, PROMPTS, cfg, None, "tree", plain)
        benchmark.repeated_speedups(engine, PROMPTS, cfg, None, summary)
    finally:
        engine.runner.close()
    assert all(row["identical"] for row in per_prompt)
    assert made == [300 + 80 * 3 + 6], made  # one cache, the tree's, before plain decoding
    assert len(set(used)) == 1 and len(used) == 1 + 2 * len(PROMPTS), used
