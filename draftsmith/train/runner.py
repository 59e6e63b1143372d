"""How packed rows run on this device: the drafter (placed by its parallel mode), the frozen
target head, the attention path, the padding that keeps shapes static, and the fallback down
one rung when a compiled path fails. Training and validation both go through it, and so does
the quality benchmark's re-evaluation of a trained drafter."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from draftsmith.config import DrafterConfig, TrainConfig
from draftsmith.errors import ConfigValueError
from draftsmith.extract.store import Sample
from draftsmith.model.eagle3.model import MERGED_ATTENTION
from draftsmith.model.kinds import Drafter, DrafterKind, kind_of
from draftsmith.train.loss import TargetHead
from draftsmith.train.metrics import StepCounts, replay_chain_decoding
from draftsmith.train.packing import PackedRow, concat_row, padding_row
from draftsmith.train.parallel import DDP

log = logging.getLogger(__name__)


def step_weights_of(cfg: TrainConfig) -> list[float]:
    if cfg.step_weights is not None:
        return list(cfg.step_weights)
    return [cfg.step_weight_decay**j for j in range(cfg.ttt_steps)]


def resolve_attention(cfg: TrainConfig, kind: DrafterKind | None = None) -> str:
    """The attention path rows run with (`kind`: the drafter's, when it is known)."""
    if kind is not None and not kind.merged_attention and cfg.attention in MERGED_ATTENTION:
        raise ConfigValueError(f"train.attention={cfg.attention} merges EAGLE-3's TTT steps per "
                               f"document; a {kind.name} drafter trains with flex (CUDA) or "
                               "sdpa: set train.attention=auto")
    if cfg.attention in MERGED_ATTENTION and not cfg.device.startswith("cuda"):
        raise ConfigValueError(f"train.attention={cfg.attention} runs cuDNN / FlashAttention "
                               f"kernels, which need a CUDA device (train.device="
                               f"{cfg.device}): use train.attention=auto or sdpa")
    if cfg.attention in MERGED_ATTENTION and cfg.dtype == "float32":
        # Seen on an H200: cuDNN's kernel given float32 returns NaN, and nothing fails.
        raise ConfigValueError(f"train.attention={cfg.attention} runs half-precision kernels, "
                               f"and train.dtype is float32: set train.dtype=bfloat16, or "
                               f"train.attention=auto for float32")
    if cfg.attention != "auto":
        return cfg.attention
    return "flex" if cfg.device.startswith("cuda") else "sdpa"


class RowRunner:
    """attention and compiled say how rows run now; `fallback` moves them down one rung.
    Rows are padded to batch_tokens on the flex and merged paths (compiled kernels see one
    shape). The drafter's kind decides the loss (draftsmith/model/registry.py) and how many
    positions its counts have (`positions`: TTT steps, or a DFlash block's drafts)."""

    def __init__(self, cfg: TrainConfig, drafter: Drafter, target_head: TargetHead,
                 device: torch.device, mode: DDP, attention: str, compiled: bool,
                 padding_like: Sample | None = None,
                 prepare_samples: Callable[[list], list[Sample]] | None = None,
                 settings: DrafterConfig | None = None):
        self.cfg, self.drafter, self.target_head = cfg, drafter, target_head
        self.device, self.mode = device, mode
        self.attention, self.compiled = attention, compiled
        self.kind = kind_of(drafter)
        self.settings = self.kind.settings_for(settings or DrafterConfig(kind=self.kind.name),
                                               drafter.config)
        self._loss = self.kind.row_loss()
        drafter.compile_layer(compiled)
        self.pad_to = cfg.batch_tokens if attention != "sdpa" else None  # static shapes
        self.positions = self.kind.positions(self.settings, cfg)
        self.step_weights = self.kind.position_weights(self.settings, cfg)
        # FSDP: what a rank without a row runs, so that it joins every collective (made when
        # needed: an 8192-token row of an 8B-shaped target is ~270 MB of zeros).
        self._padding_like = padding_like if mode.sharded else None
        # Online: the target's prefill turns a row's token samples into hidden-state samples.
        self.prepare_samples = prepare_samples

    # ------------------------------------------------------------------ rows

    def row(self, samples: list[Sample], pin: bool = False) -> PackedRow | None:
        """The samples laid out as one row (None for no samples)."""
        if not samples:
            return None
        if self.prepare_samples is not None:
            samples = self.prepare_samples(samples)
        return concat_row(samples, self.cfg.batch_tokens, self.pad_to, pin)

    def padding(self) -> PackedRow | None:
        """FSDP: an all-padding row (zero loss, zero gradients); DDP: None, nothing to join."""
        if self._padding_like is None:
            return None
        return padding_row(self._padding_like, self.pad_to or self.cfg.batch_tokens,
                           self.device)

    def loss(self, row: PackedRow, noise_seed: int = 0, train: bool = True,
             with_runs: bool = False):
        """The kind's row loss with this run's settings (aux noise only in training)."""
        extra = self.kind.loss_options(self.settings, padded=self.pad_to is not None)
        return self._loss(self.drafter, row, self.target_head, self.positions,
                          self.step_weights, self.device, self.attention,
                          self.cfg.aux_noise_std if train else 0.0, noise_seed,
                          with_runs=with_runs, **extra)

    def train_row(self, row: PackedRow | None, noise_seed: int) -> torch.Tensor:
        """Forward and backward of this rank's row of a step; its counts [5, S] on the device.
        No row: DDP adds zero gradients in the sum; FSDP runs a padding row to join the
        collectives (zero loss, zero gradients, counts dropped)."""
        padding = self.padding() if row is None else None
        if row is None and padding is None:
            return StepCounts(self.positions).as_tensor()
        loss, counts = self.loss(row if row is not None else padding, noise_seed)
        loss.backward()
        return counts if row is not None else StepCounts(self.positions).as_tensor()

    @torch.no_grad()
    def evaluate(self, rows: list[list[Sample] | None]) -> StepCounts:
        """Counts over `rows`, with greedy chain decoding replayed over their answers; a None
        row (FSDP: this rank has fewer rows than another) runs padding and counts nothing."""
        self.drafter.eval()
        counts = StepCounts(self.positions)
        for samples in rows:
            row = self.padding() if samples is None else self.row(samples)
            if row is None:
                continue
            _, row_counts, runs = self.loss(row, train=False, with_runs=True)
            if samples is not None:
                counts.add(StepCounts.from_tensor(row_counts))
                rounds, tokens = replay_chain_decoding(runs.cpu(), row.loss_mask,
                                                       row.document_ids)
                counts.replay_rounds += rounds
                counts.replay_tokens += tokens
        self.drafter.train()
        return counts

    # ------------------------------------------------------------------ fallback

    def guarded(self, fn):
        """Run fn; on the first failure of a compiled path fall back one rung and retry."""
        while True:
            try:
                return fn()
            except Exception as err:  # noqa: BLE001 - any compiler error, reported in full
                if not self.fallback(err):
                    raise
                self.mode.reset_after_failure(self.drafter)
                for p in self.drafter.parameters():
                    p.grad = None

    def fallback(self, err: BaseException) -> bool:
        """Move down one rung (merged kernels -> flex; compiled layer -> eager layer -> SDPA);
        False at the bottom, or for an error no rung fixes."""
        if isinstance(err, torch.OutOfMemoryError):  # not a compiler problem: report it
            return False
        if self.attention in MERGED_ATTENTION:
            rung = "flex attention"
            self.attention = "flex"
        elif self.compiled:
            rung = "eager decoder layer with compiled flex attention" \
                if self.attention == "flex" else "eager decoder layer"
            self.compiled = False
            self.drafter.compile_layer(False)
        elif self.attention == "flex":
            rung = "SDPA attention with a dense TTT mask"
            self.attention = "sdpa"
        else:
            return False
        log.warning("train: compiled path failed (%s: %s); falling back to %s", type(err).__name__,
                    str(err).splitlines()[0][:300] if str(err) else "", rung)
        return True
