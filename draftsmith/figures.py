"""What each stage reports about its output, as typed figures.

A descriptor's `figures` is small JSON in its manifest. Code that reads another stage's figures
reads them through these models (`ExportFigures.of(descriptor).drafter_dir`), so a renamed or
missing figure fails in one place with the stage's name, not as a KeyError deep in a stage.
Extra figures are kept (stages add more over time, and per-step metrics are open-ended).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from typing_extensions import Self

from draftsmith.artifacts import Descriptor

# Files of a stage's output that its reports read, named here so that reading them (a cached
# stage's reports, in a process that ran nothing) imports no stage module, and so no torch.
MERGE_COVERAGE_FILE = "vocab_coverage.json"
TRAIN_METRICS_FILE = "metrics.jsonl"


class Figures(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    @classmethod
    def of(cls, descriptor: Descriptor) -> Self:
        try:
            return cls.model_validate(descriptor.figures)
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                                 for e in err.errors())
            raise ValueError(f"{descriptor.stage} output at {descriptor.path}: its figures do "
                             f"not read as {cls.__name__} ({problems}); it was written by "
                             "another draftsmith version: run the stage again") from None

    def extra(self, name: str, default: Any = None) -> Any:
        return (self.model_extra or {}).get(name, default)


class TargetFigures(Figures):
    family: str
    architectures: list[str] = []
    model_type: str | None = None
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int | None = None
    provenance: dict[str, Any] | None = None  # a builtin target's source and weight hashes


class GenerateFigures(Figures):
    backend: str
    cost_usd: float | None = None
    tokens_per_s: float | None = None
    requests_per_s: float | None = None


class MergeFigures(Figures):
    draft_vocab_coverage: float
    draft_vocab_coverage_validation: float | None = None
    draft_vocab_size: int
    end_of_turn_token: str | None = None


class ExtractFigures(Figures):
    aux_layer_ids: list[int]
    dtype: str
    padding_waste: float = 0.0
    tokens_per_s: float | None = None  # the forward passes and writes of the attempt that ran


class TrainFigures(Figures):
    """The best epoch's validation metrics: per-step loss_j, full_acc_j and cond_acc_j ride
    along as extra figures (one of each per TTT step)."""

    tau: float
    acceptance_replayed: float | None = None
    packing_efficiency: float | None = None
    tokens_per_s: float | None = None  # steady training throughput (train/trainer.py)

    def per_step(self, metric: str) -> list[float]:
        extra = self.model_extra or {}
        steps = sorted(int(k.rsplit("_", 1)[1]) for k in extra
                       if k.startswith(f"{metric}_") and k.rsplit("_", 1)[1].isdigit())
        return [extra[f"{metric}_{j}"] for j in steps]

    @property
    def full_acc(self) -> list[float]:
        return self.per_step("full_acc")


class ExportFigures(Figures):
    format: str
    drafter_dir: str
    canonical_aux_layer_ids: list[int] = []
    written_aux_layer_ids: list[int] = []
    target_family: str | None = None
    # A drafter made elsewhere (deploy.drafter): its directory is the user's, not a stage's
    # content-keyed one, so what is deployed from it carries the files' fingerprint.
    external: bool = False


class DeployFigures(Figures):
    engine: str
    drafter_dir: str
    num_steps: int | None = None
    eagle_topk: int | None = None
    num_draft_tokens: int | None = None
    url: str | None = None
    target_path: str | None = None
    target_family: str | None = None
    smoke_acceptance_length: float | None = None
    drafter_files: str | None = None  # a drafter made elsewhere: its files' fingerprint


class BenchmarkFigures(Figures):
    engine: str
    acceptance_length: float
    verdict: str
    report: str
    lossless: bool | None = None
    identical_outputs: Any = None
    target_dtype: str = "float32"
    speedup: float | None = None
    url: str | None = None
    speculative_tokens_per_s: float | None = None
    greedy_tokens_per_s: float | None = None
    single_stream_tokens_per_s: float | None = None
    # A served benchmark's guard (draftsmith/bench/guard.py): served vs replayed acceptance.
    guard: dict[str, Any] | None = None

    @property
    def guard_problem(self) -> str | None:
        """The guard's problem: the engine does not run the drafter as it was trained."""
        return (self.guard or {}).get("problem")

    @property
    def differs_from_greedy(self) -> bool:
        """Greedy speculative outputs that differ from plain greedy decoding: a bug, except in
        reduced precision, where a multi-token verify rounds differently (serve/deploy.py)."""
        return self.lossless is False and self.target_dtype == "float32"
