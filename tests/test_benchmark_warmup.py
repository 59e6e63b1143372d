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
        plain = plain_decoding(engine.runner, PROMPTS, cfg, None)
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
