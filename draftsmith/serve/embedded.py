"""An in-process speculative decoder: a transformers target + an exported EAGLE-3 drafter.

Chain and tree drafting, KV caches for both models, greedy verification (token for token plain
greedy decoding) and sampled verification (each token distributed as the target's own
sampling). It loads the drafter from the exported files (never from training memory), so what
it measures is what gets shipped.

One round, with tokens x_0..x_n known and the target's aux states known for positions 0..n-1:
  1. drafter step 0 over the new anchors t (aux state t, embedding of token t+1); its cache
     keeps these keys for good. The last anchor drafts d_1.
  2. steps 1..k-1 draft d_2..d_k, each feeding its own output hidden and the previous draft.
  3. the target verifies [x_n, d_1..d_k] in one forward; the longest prefix of drafts equal to
     the target's argmax is accepted, plus the target's own next token (the bonus).

Tree drafting (eagle_topk > 1) follows SGLang's EAGLE: every step expands the topk best
frontier nodes into topk children each, scored by cumulative draft log-probability; the
num_draft_tokens - 1 best nodes of all steps form the tree, which the target verifies in one
forward with a tree attention mask. Verification walks down from the root: at each node the
target picks its token (argmax, or a draw at the temperature) and the walk follows the child
holding that token; the first pick with no such child is the bonus. Every emitted token is the
target's own pick, so tree decoding is lossless greedy and distribution-preserving sampled.
"""

from __future__ import annotations

import functools
import inspect
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache, StaticCache

from draftsmith.compiling import (
    CapturedStep,
    EagerOnFailure,
    allocate_static_cache,
    compiled_once,
    cuda_graphs,
    fixed_address,
)
from draftsmith.config import draft_token_budget
from draftsmith.export.convert import read_drafter
from draftsmith.model.aux_hooks import AuxLayerHooks, decoder_of
from draftsmith.model.grouped_attention import use_verify_attention
from draftsmith.model.kinds import Drafter, build_drafter, kind_of
from draftsmith.serve import static_tree
from draftsmith.serve.round_clock import RoundClock
from draftsmith.serve.row_topk import kernel_works, row_topk


def on_device(values: list[int] | list[bool], device: torch.device) -> torch.Tensor:
    """values [N] on `device`, enqueued without waiting for it. torch.tensor(values,
    device=cuda) copies from pageable memory and synchronizes the stream first: the host would
    wait for every kernel already enqueued (a round's drafting, before its verify)."""
    host = torch.tensor(values)  # [N]
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def without_cudnn_attention(decode):
    """`decode` with SDPA's cuDNN backend left out. cuDNN builds an execution plan for each
    new shape it meets, on the host, and a prompt's forwards have a new shape for each prompt
    length: in bf16 on an H100, where SDPA picks cuDNN for a masked prompt, SmolLM2's eager
    prefill took 56 ms at a length not seen before against 18 ms at one seen, and 18 ms
    either way without cuDNN (gpu_speculative/new_shape_cost.py, 2026-12-06); in the
    benchmark stage the drafter's first round of a new length took up to 0.8 s more. The
    other kernels need no plan."""

    @functools.wraps(decode)
    def without_cudnn(*args, **kwargs):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                          SDPBackend.MATH]):
            return decode(*args, **kwargs)

    return without_cudnn


class HostRead:
    """A device tensor's values copied to the host without the host waiting for them until
    `wait()`: it can enqueue more work behind the copy first (the next round's drafting), and
    that work runs on the GPU while the host reads. `.tolist()` would wait for all of it."""

    def __init__(self, values: torch.Tensor):
        self._done: torch.cuda.Event | None = None
        if values.device.type != "cuda":
            self._values = values
            return
        self._values = torch.empty(values.shape, dtype=values.dtype,
                                   pin_memory=True)  # values' shape, on the host
        self._values.copy_(values, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record()

    def wait(self) -> list:
        if self._done is not None:
            self._done.synchronize()
        return self._values.tolist()


def accepted_counts(drafts: torch.Tensor, verified: torch.Tensor) -> torch.Tensor:
    """How many of each chain's drafts [..., k] the target keeps, on the device: those before
    the first that differs from the target's own token there (verified [..., k+1]) -> [...]."""
    return (drafts == verified[..., :-1]).long().cumprod(-1).sum(-1)


class Sampling:
    """Greedy (temperature 0) or temperature sampling, seeded."""

    def __init__(self, temperature: float = 0.0, seed: int = 0):
        self.temperature = temperature
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.float().cpu() / self.temperature, dim=-1)  # [..., V]

    def draw(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def pick(self, logits: torch.Tensor) -> int:
        return int(logits.argmax()) if self.greedy else self.draw(self.probs(logits))

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator))


def acceptance_probability(p: torch.Tensor, q: torch.Tensor, token: int) -> float:
    """Speculative sampling: keep a token drafted from q with probability min(1, p/q)."""
    return min(1.0, float(p[token] / q[token])) if q[token] > 0 else 0.0


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where a rejected draft's replacement comes from: max(0, p - q), renormalised. Together
    with the acceptance rule, the emitted token is distributed exactly as p."""
    residual = (p - q).clamp(min=0)  # [V]
    total = residual.sum()
    return residual / total if total > 0 else p


@dataclass
class Generation:
    tokens: list[int]
    seconds: float
    round_tokens: list[int] = field(default_factory=list)  # tokens kept per verify forward
    # Wall time of the prompt's forward (to the first token), then drafting and verifying as
    # the round's RoundClock times them (on CUDA, on the GPU's own timeline).
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def verify_rounds(self) -> int:
        return len(self.round_tokens)

    @property
    def acceptance_length(self) -> float:
        """Tokens produced per target verify forward (SGLang's accept length)."""
        return sum(self.round_tokens) / max(self.verify_rounds, 1)


class TargetRunner:
    """The target with a KV cache and forward hooks on the aux layers."""

    cache_kind = "dynamic"  # as deploy.embedded_cache names it

    def __init__(self, model, aux_layer_ids: list[int]):
        self.model = model
        self.aux_layer_ids = aux_layer_ids
        # transformers renamed `past_key_values` to `cache` in 5.x; accept both.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._aux = AuxLayerHooks.shared(decoder_of(model), aux_layer_ids)
        self._closed = False

    def close(self) -> None:
        """Let go of the hooks (off the target once no other runner holds them), so the model
        can be reused. A second close does nothing: the hooks may be another runner's now."""
        if not self._closed:
            self._closed = True
            self._aux.remove()

    @torch.inference_mode()
    def forward(self, input_ids: list[int] | torch.Tensor, cache: DynamicCache,
                position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, last_only: bool = False):
        """Returns logits [T, V] ([1, V] with last_only: a prompt's, whose other rows nobody
        reads, and whose head over every row costs as much as the rest of a short prompt's
        forward on a CPU) and aux states [1, T, K*H] for the new tokens. position_ids [1, T]
        and a boolean attention_mask [1, 1, T, S+T] verify a tree; both default to the causal
        continuation of the cache."""
        ids = (input_ids if isinstance(input_ids, torch.Tensor)
               else on_device(input_ids, self.model.device))[None]  # [1, T]
        extra = {} if position_ids is None else {"position_ids": position_ids,
                                                 "attention_mask": attention_mask}
        if last_only:
            extra["logits_to_keep"] = 1
        logits, aux = self.step(ids, cache, **extra)  # [1, T, V], [1, T, K*H]
        return logits[0], aux  # [T, V] or [1, V], [1, T, K*H]

    def step(self, ids: torch.Tensor, cache, **extra) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of ids [B, T] over `cache`: logits [B, T, V] and the aux layers'
        states [B, T, K*H]. What a compiled or captured step runs, the hooks' read included."""
        return self._step_through(self.model.forward, ids, cache, **extra)

    def _step_through(self, forward, ids: torch.Tensor, cache, **extra):
        logits = forward(input_ids=ids, use_cache=True, **{self._cache_kw: cache},
                         **extra).logits  # [B, T, V]
        return logits, self._aux.take()  # [B, T, V], [B, T, K*H]

    def new_cache(self, capacity: int) -> DynamicCache:
        """An empty cache for one generation of at most `capacity` positions (a dynamic cache
        grows as it goes, so the capacity is only a promise)."""
        return DynamicCache()

    def drop_last(self, cache: DynamicCache, count: int) -> None:
        """Forget the last `count` positions (rejected drafts)."""
        cache.crop(-count)

    def new_batch_cache(self, rows: int, capacity: int) -> DynamicCache:
        """An empty cache for `rows` sequences decoded together (embedded_batch.py)."""
        return DynamicCache()

    def step_for(self, width: int):
        """The `step` that runs forwards of this many tokens."""
        return self.step

    def captured_steps(self) -> list[CapturedOnFailure]:
        """The steps this runner replays from CUDA graphs (none: every forward is eager)."""
        return []

    @torch.inference_mode()
    def forward_batch(self, ids: torch.Tensor, cache, position_ids: torch.Tensor,
                      attention_mask: torch.Tensor, last_only: bool = False):
        """Several sequences at once: ids, position_ids [B, T]; attention_mask bool
        [B, 1, T, K] over the cache's keys (a dynamic cache's earlier ones and these T; every
        slot of a static one). Returns logits [B, T, V] ([B, 1, V] with last_only: the
        prompts' forward, always eager) and aux states [B, T, K*H]."""
        if last_only:
            return self.step(ids, cache, position_ids=position_ids,
                             attention_mask=attention_mask, logits_to_keep=1)
        return self.step_for(ids.shape[1])(ids, cache, position_ids=position_ids,
                                           attention_mask=attention_mask)


@dataclass
class StaticTargetCache:
    """A StaticCache and how many of its slots this generation has written. A tree's cache
    (`StaticTargetRunner.new_tree_cache`) also marks which of them hold its tokens: a
    verified tree leaves its rejected nodes' slots behind, unmarked."""

    kv: StaticCache
    length: int = 0
    valid: torch.Tensor | None = None  # [C] bool: tree decoding's slots that hold its tokens

    @property
    def capacity(self) -> int:
        return self.kv.layers[0].max_cache_len


class StaticTargetRunner(TargetRunner):
    """The target over a StaticCache, allocated once and reused by every generation that fits
    it, so each forward of one width has the same shapes and tensor addresses: what a compiled
    step and its CUDA graph need. transformers (5.x) writes a forward's keys at the cache's
    own counter (`cumulative_length`, one per layer) and builds the causal mask from it, so
    dropping rejected drafts is winding the counter back: their slots are overwritten by the
    next forward and, until then, lie past every query's position, where the mask hides them.

    compile_steps: the forwards whose width is in `step_widths` are compiled (torch.compile)
    and, on CUDA, captured into CUDA graphs and replayed (`captured_step`); None: on CUDA
    only. A prompt's forward (last_only) is then padded to the next of a few widths
    (`prompt_widths`), each captured from the model's eager forward when a cache is made: an
    eager prompt forward launched its kernels one by one, 23 ms for SmolLM2 on an H100
    against 1.6 ms for a captured token. The padding's keys land past the prompt, where the
    next forward overwrites them. A tree's verify forward (`forward_tree`) makes its own
    positions and mask on the device, and is captured as one more step. decode_attention: the
    target's attention at decode widths runs as matmuls (model/grouped_attention.py) until
    close(); False keeps the model's own (SDPA), for comparisons."""

    LENGTH_STEP = 256  # cache lengths are rounded up to this, so similar requests share one
    cache_kind = "static"

    def __init__(self, model, aux_layer_ids: list[int], step_widths: tuple[int, ...] = (),
                 compile_steps: bool | None = None, decode_attention: bool = True):
        super().__init__(model, aux_layer_ids)
        # SDPA's kernel for a few queries over a long static cache is slow (grouped_attention.py
        # says how slow); until close(), the target attends through matmuls at such widths.
        self._attention_before = model.config._attn_implementation
        if decode_attention:
            use_verify_attention(model)
        self._kv: dict[int, StaticCache] = {}  # rows -> cache
        if compile_steps is None:
            compile_steps = cuda_graphs(model.device)
        self._step_widths = set(step_widths) if compile_steps else set()
        # One compiled forward per model (the benchmark's sweep makes an engine per point),
        # under the runner's captured step: a graph of fixed shapes per width, batch size and
        # cache (CapturedStep).
        self._forward = compiled_once(model.forward) if self._step_widths else model.forward
        self._captured = captured_step(self._compiled_step, "embedded target step",
                                       model.device, state=_cache_counters, eager=self.step)
        self._tree_captured = captured_step(self._compiled_tree_step, "embedded target tree step",
                                            model.device, state=_cache_counters,
                                            eager=self._eager_tree_step)
        self._valid: torch.Tensor | None = None  # [C]: a tree's slots, for the one-row cache
        # Others' captured steps that hold the one-row cache (the engine's tree verdicts),
        # let go of with it.
        self.one_row_cache_users: list[CapturedOnFailure] = []
        self._prompt_step = None  # prompts run eagerly at their own width
        if self._step_widths:  # uncompiled: torch.compile would compile each width again
            self._prompt_step = captured_step(self._eager_prompt_step, "embedded target prompt",
                                              model.device, state=_cache_counters)

    def close(self) -> None:
        if not self._closed:
            self.model.set_attn_implementation(self._attention_before)
        super().close()

    def new_cache(self, capacity: int) -> StaticTargetCache:
        """The runner's StaticCache, emptied, when it holds `capacity` positions; a longer one
        (rounded up to LENGTH_STEP) otherwise, which compiled steps record again."""
        return StaticTargetCache(self.new_batch_cache(1, capacity))

    def new_batch_cache(self, rows: int, capacity: int) -> StaticCache:
        """The runner's StaticCache for `rows` sequences, emptied, when it holds `capacity`
        slots; a longer one otherwise (one per batch size, kept)."""
        kv = self._kv.get(rows)
        if kv is None or kv.layers[0].max_cache_len < capacity:
            if kv is not None:  # the old cache's memory goes before the new one is made,
                del self._kv[rows]
                self._captured.forget()  # and the graphs that hold it (a new cache may take
                # its id, which names a graph's cache); other batch sizes' graphs are kept
                if rows == 1:
                    for step in (self._tree_captured, *self.one_row_cache_users):
                        step.forget()
                    if self._prompt_step is not None:
                        self._prompt_step.forget()
            kv = self._kv[rows] = self._static_cache(rows, capacity)
            if rows == 1:
                self._valid = torch.zeros(kv.layers[0].max_cache_len, dtype=torch.bool,
                                          device=self.model.device)  # [C]
                fixed_address(self._valid)  # the captured tree step reads it in place
                if self._prompt_step is not None:
                    self._capture_prompt_widths(kv)
        kv.reset()
        return kv

    @torch.inference_mode()
    def _capture_prompt_widths(self, kv: StaticCache) -> None:
        """Capture the prompt forward at every width the cache takes, now, so that no prompt
        is captured inside a measured generation."""
        device = self.model.device
        for width in prompt_widths(kv.layers[0].max_cache_len):
            self._prompt_step(torch.zeros(1, width, dtype=torch.long, device=device),  # [1, W]
                              kv, torch.zeros(1, dtype=torch.long, device=device))  # [1]
            kv.reset()  # each width from slot 0, as a prompt comes

    def _prompt_width(self, length: int, cache: StaticTargetCache) -> int | None:
        """The captured width a forward of `length` tokens is padded to; None: its own width,
        eagerly (no captured prompt widths, or the padding does not fit the cache)."""
        if self._prompt_step is None:
            return None
        width = prompt_width(length, cache.capacity)
        return width if cache.length + width <= cache.capacity else None

    def step_for(self, width: int):
        return self._captured if width in self._step_widths else self.step

    def captured_steps(self) -> list[CapturedOnFailure]:
        return [self._captured, self._prompt_step, self._tree_captured] \
            if self._step_widths else []

    def _compiled_step(self, ids: torch.Tensor, cache, **extra):
        """`step` through the compiled forward."""
        return self._causal_step(self._forward, ids, cache, **extra)

    def _eager_prompt_step(self, ids: torch.Tensor, cache: StaticCache, last: torch.Tensor):
        """A prompt's forward through the model's own forward (captured per width), its
        logits at the index `last` [1] only: [1, 1, V]."""
        return self._causal_step(self.model.forward, ids, cache, logits_to_keep=last)

    def _causal_step(self, forward, ids: torch.Tensor, cache, **extra):
        """`step` through `forward`. One sequence's forward of several tokens gets its causal
        mask from here (the batched path brings its own)."""
        if ids.shape[1] > 1 and "attention_mask" not in extra:
            extra = {**extra, **self._causal_inputs(ids.shape[1], cache)}
        return self._step_through(forward, ids, cache, **extra)

    @staticmethod
    def _causal_inputs(width: int, kv: StaticCache) -> dict[str, torch.Tensor]:
        """The positions and causal mask of `width` tokens after those the cache holds, made
        on the device from the cache's own counter. transformers would make the same mask,
        but first decide whether it may skip it by reading that counter on the host
        (`q_offset == 0`): a wait for the GPU at every verify step, which a CUDA graph cannot
        hold (the step would fall back to eager) and which splits the compiled graph."""
        layer = kv.layers[0]
        seen = layer.cumulative_length  # [] on the device
        device = layer.keys.device
        positions = seen + torch.arange(width, device=device)  # [T]
        slots = torch.arange(layer.max_cache_len, device=device)  # [L]
        mask = slots[None, :] <= positions[:, None]  # [T, L]
        return {"position_ids": positions[None], "attention_mask": mask[None, None]}

    def _static_cache(self, rows: int, capacity: int) -> StaticCache:
        """A StaticCache of `rows` x `capacity` (rounded up to LENGTH_STEP) positions."""
        length = -(-capacity // self.LENGTH_STEP) * self.LENGTH_STEP
        kv = StaticCache(config=self.model.config, max_cache_len=length)
        if not all(hasattr(layer, "cumulative_length") for layer in kv.layers):
            raise RuntimeError(
                "deploy.embedded_cache=static needs a transformers whose StaticCache writes "
                "at its own cumulative_length (5.x); set deploy.embedded_cache=dynamic")
        if any(layer.is_sliding for layer in kv.layers):
            raise ValueError(
                "deploy.embedded_cache=static: this target has sliding-window layers, "
                "whose static cache is a ring buffer that cannot drop rejected drafts; set "
                "deploy.embedded_cache=dynamic")
        allocate_static_cache(kv, self.model, rows)
        return kv

    @torch.inference_mode()
    def forward(self, input_ids: list[int] | torch.Tensor, cache: StaticTargetCache,
                position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, last_only: bool = False):
        """As TargetRunner.forward, for the causal continuation of the cache only. With
        last_only and captured steps, a prompt runs padded to a captured width."""
        if position_ids is not None or attention_mask is not None:
            raise ValueError("StaticTargetRunner.forward runs the causal continuation of "
                             "the cache; a tree's verify forward is forward_tree")
        if cache.length + len(input_ids) > cache.capacity:
            raise ValueError(
                f"the target's static cache holds {cache.capacity} positions; "
                f"{cache.length} + {len(input_ids)} do not fit (new_cache was given too small "
                "a capacity)")
        ids = (input_ids if isinstance(input_ids, torch.Tensor)
               else on_device(input_ids, self.model.device))[None]  # [1, T]
        step = self.step_for(len(input_ids))
        eager = step == self.step
        padded = self._prompt_width(len(input_ids), cache) if eager and last_only else None
        if padded is not None:
            return self._padded_forward(ids, padded, cache)
        extra = {"logits_to_keep": 1} if eager and last_only else {}
        logits, aux = step(ids, cache.kv, **extra)  # [1, T, V], [1, T, K*H]
        cache.length += len(input_ids)
        return (logits[0, -1:] if last_only else logits[0]), aux  # [T or 1, V], [1, T, K*H]

    def _padded_forward(self, ids: torch.Tensor, width: int, cache: StaticTargetCache):
        """ids [1, T] padded with their last token to `width` and run by the prompt step of
        that width; the padding's positions are dropped from the cache and the outputs.
        Returns copies (the graph's outputs are the next replay's): the last token's logits
        [1, V] and aux states [1, T, K*H]."""
        length = ids.shape[1]
        padded = torch.cat([ids, ids[:, -1:].expand(1, width - length)], dim=1)  # [1, W]
        last = on_device([length - 1], self.model.device)  # [1]
        logits, aux = self._prompt_step(padded, cache.kv, last)  # [1, 1, V], [1, W, K*H]
        cache.length += width
        self.drop_last(cache, width - length)
        return logits[0].clone(), aux[:, :length].clone()  # [1, V], [1, T, K*H]

    def drop_last(self, cache: StaticTargetCache, count: int) -> None:
        """Wind the counters back; the slots are overwritten by the next forward."""
        # In place (the captured steps read the counters' addresses), and in one launch for
        # every layer: a round's host time is mostly launches.
        torch._foreach_sub_([layer.cumulative_length for layer in cache.kv.layers], count)
        cache.length -= count

    # Trees: the verify forward writes the root and every node into the slots after the
    # cache's; the accepted path's slots are marked as the sequence's (`valid`) where they lie,
    # and the counters wound back to the last of them. Moving the kept keys down instead would
    # take a copy per layer and tensor each round; leaving them costs slots, which
    # `tree_capacity` provides for.

    @staticmethod
    def tree_capacity(prompt_length: int, max_new_tokens: int, width: int) -> int:
        """The slots a tree decoding of `width`-token verify forwards may use: a round that
        keeps its root and a node j deep in verify order uses j + 1 slots for 2 tokens or
        more, so at most max(1, width / 2) slots a token, and one verify forward past the
        end."""
        return prompt_length + max_new_tokens * max(1, -(-width // 2)) + width

    def new_tree_cache(self, capacity: int) -> StaticTargetCache:
        """`new_cache` with no slot marked as the sequence's yet (`keep_prefix` marks the
        prompt's, `keep_tree_path_on_device` each round's)."""
        cache = self.new_cache(capacity)
        cache.valid = self._valid
        cache.valid.zero_()
        return cache

    def keep_prefix(self, cache: StaticTargetCache) -> None:
        """Mark every slot written so far (the prompt's) as the sequence's."""
        cache.valid[:cache.length] = True

    @torch.inference_mode()
    def forward_tree(self, root: int, position: int, nodes: torch.Tensor, depths: torch.Tensor,
                     visible: torch.Tensor, cache: StaticTargetCache):
        """The verify forward of a draft tree, from the device tensors that drafting left
        there: the root (the last known token, at `position`) and its N nodes (target ids
        [N], depths [N]) go into the N + 1 slots after the cache's, each attending to the
        sequence's slots and to itself and its ancestors (visible [N+1, N+1]). Returns logits
        [N+1, V] and aux states [1, N+1, K*H]: a captured step's own outputs, which the next
        forward overwrites."""
        width = nodes.shape[0] + 1
        if cache.valid is None:
            raise ValueError("forward_tree needs a cache made by new_tree_cache")
        if cache.length + width > cache.capacity:
            raise ValueError(
                f"the target's static cache holds {cache.capacity} slots; {cache.length} + "
                f"{width} do not fit (new_tree_cache was given too small a capacity: "
                "tree_capacity says how much a generation needs)")
        head = on_device([root, position], self.model.device)  # [2]
        step = self._tree_captured if self._step_widths else self._eager_tree_step
        logits, aux = step(head, cache.kv, nodes, depths, visible, cache.valid)
        cache.length += width
        return logits[0], aux  # [N+1, V], [1, N+1, K*H]

    @staticmethod
    def keep_tree_path_on_device(kv: StaticCache, valid: torch.Tensor, kept: torch.Tensor,
                                 width: int) -> None:
        """After a tree's verify forward of `width` slots, from kept on the device (the root,
        then the accepted path's verify indices, its last one possibly repeated:
        `static_tree.walk`) and without reading it: mark their slots in valid [C] as the
        sequence's and wind the counters back to the slot after the last of them. The
        rejected nodes' slots before it stay unmarked, so no later query sees them; those
        after it are overwritten by the next forward. The cache's length, the host's count,
        is the caller's to set (`tree_length_after`)."""
        counters = [layer.cumulative_length for layer in kv.layers]
        valid.index_fill_(0, counters[0] - width + kept, True)
        # Each counter winds back from its own value: inductor's lowering of a copy from an
        # expression over counters[0] re-read counters[0] after overwriting it, so every
        # other layer went back a further width - 1 slots.
        torch._foreach_add_(counters, [kept[-1] + 1 - width] * len(counters))

    @staticmethod
    def tree_length_after(cache: StaticTargetCache, last_kept: int, width: int) -> int:
        """The slots written once a tree's verify of `width` slots keeps up to verify index
        `last_kept`."""
        return cache.length - width + 1 + last_kept

    def _compiled_tree_step(self, head, kv, nodes, depths, visible, valid):
        return self._tree_step(self._forward, head, kv, nodes, depths, visible, valid)

    def _eager_tree_step(self, head, kv, nodes, depths, visible, valid):
        return self._tree_step(self.model.forward, head, kv, nodes, depths, visible, valid)

    def _tree_step(self, forward, head: torch.Tensor, kv: StaticCache, nodes: torch.Tensor,
                   depths: torch.Tensor, visible: torch.Tensor, valid: torch.Tensor):
        """`forward_tree`'s forward, its ids, positions and mask made on the device from
        head [2] (the root's token and position), nodes [N], depths [N], visible
        [N+1, N+1], valid [C] and the cache's own counter (the root's slot)."""
        width = nodes.shape[0] + 1
        ids = torch.cat([head[:1], nodes])[None]  # [1, T]
        positions = head[1:] + torch.cat([depths.new_zeros(1), depths])  # [T]
        slots = torch.arange(valid.shape[0], device=valid.device)  # [C]
        offset = slots - kv.layers[0].cumulative_length  # [C]: from the root's slot
        in_tree = (offset >= 0) & (offset < width)  # [C]
        tree = visible.index_select(1, offset.clamp(0, width - 1)) & in_tree  # [T, C]
        mask = valid[None] | tree  # [T, C]
        return self._step_through(forward, ids, kv, position_ids=positions[None],
                                  attention_mask=mask[None, None])


EMBEDDED_CACHES = ("auto", "static", "dynamic")
PROMPT_WIDTH_MIN = 16


def prompt_widths(capacity: int) -> list[int]:
    """The widths a prompt's forward is padded to over a static cache of `capacity` slots:
    powers of two from PROMPT_WIDTH_MIN below it, then the capacity itself. A prompt pays at
    most twice its own width, and a cache of 2,048 slots has eight graphs."""
    widths = []
    width = PROMPT_WIDTH_MIN
    while width < capacity:
        widths.append(width)
        width *= 2
    return [*widths, capacity]


def prompt_width(length: int, capacity: int) -> int:
    """The prompt width (`prompt_widths`) a forward of `length` tokens is padded to."""
    return next(width for width in prompt_widths(capacity) if width >= length)


def has_sliding_window_layers(config) -> bool:
    """Whether the target attends over a sliding window in some layers: their static cache is a
    ring buffer, and one mask cannot serve them and the full layers alike."""
    layer_types = getattr(config, "layer_types", None) or []
    return "sliding_attention" in layer_types or bool(
        not layer_types and getattr(config, "sliding_window", None)
        and getattr(config, "use_sliding_window", True))


def resolve_embedded_cache(cache: str, model) -> str:
    """The cache deploy.embedded_cache runs: `auto` is the static cache and compiled steps on
    CUDA, where launching kernels one at a time is most of a step, for targets without
    sliding-window layers; the dynamic cache elsewhere, where the CPU's arithmetic is the cost
    and the static cache's padded attention would only add to it."""
    if cache not in EMBEDDED_CACHES:
        raise ValueError(f"embedded cache {cache!r}: one of {', '.join(EMBEDDED_CACHES)}")
    if cache != "auto":
        return cache
    static = model.device.type == "cuda" and not has_sliding_window_layers(model.config)
    return "static" if static else "dynamic"


def _cache_counters(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """What a target step over a StaticCache (its second argument) advances."""
    return [layer.cumulative_length for layer in args[1].layers]


class CapturedOnFailure(EagerOnFailure):
    """EagerOnFailure over a CapturedStep, which can let go of its graphs."""

    def forget(self) -> None:
        self.compiled.forget()


def captured_step(fn, name: str, device: torch.device, state=None,
                  eager=None) -> CapturedOnFailure:
    """fn (compiled, where it is to be) captured into CUDA graphs on CUDA and replayed
    (`CapturedStep`), and `eager` (fn's uncompiled self) from then on should the compiler or
    a graph fail before the first success. Off CUDA: the same buffers and replays, without
    graphs."""
    return CapturedOnFailure(CapturedStep(fn, state, graphs=device.type == "cuda"),
                             eager or fn, name)


def target_runner(model, aux_layer_ids: list[int], cache: str = "auto",
                  step_widths: tuple[int, ...] = ()) -> TargetRunner:
    """The runner deploy.embedded_cache picks (`resolve_embedded_cache`): StaticTargetRunner
    for the static cache, TargetRunner for the dynamic one."""
    if resolve_embedded_cache(cache, model) == "static":
        return StaticTargetRunner(model, aux_layer_ids, step_widths)
    return TargetRunner(model, aux_layer_ids)


class StaticDraftCache:
    """The drafter's keys and values in buffers of fixed size, reused across rounds and
    generations, so a round's drafter steps have the same shapes and tensor addresses every
    time (what a compiled step and its CUDA graph need). A key sits at the slot of its
    position: step 0's anchors at 0..n-1, a round's chain steps after them (overwritten by the
    next round's anchors). A step attends over every slot, masked to those written before it,
    and its own keys are copied into their slots afterwards."""

    LENGTH_STEP = 256

    def __init__(self, n_kv: int, head_dim: int, capacity: int, dtype, device):
        capacity = -(-capacity // self.LENGTH_STEP) * self.LENGTH_STEP
        self.k = torch.zeros(1, n_kv, capacity, head_dim, dtype=dtype,
                             device=device)  # [1, nkv, C, d]
        self.v = torch.zeros_like(self.k)  # [1, nkv, C, d]
        self.slots = torch.arange(capacity, device=device)  # [C]
        fixed_address(self.k, self.v, self.slots)  # captured drafter steps use them in place

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [1, nkv, T, d] into slots start..start+T-1."""
        end = start + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"the drafter's static cache holds {self.capacity} slots; "
                             f"{start} + {k.shape[2]} do not fit")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v


@dataclass
class DraftTree:
    """Drafted nodes in verify order (parents before children). Node i sits at index i + 1 of
    the verify forward, after the root (the last known token)."""

    tokens: list[int]
    parents: list[int]  # verify index of each node's parent (0: the root)
    depths: list[int]  # 1 for the root's children

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> list[dict[int, int]]:
        """Per verify index, the child's verify index by token."""
        kids: list[dict[int, int]] = [{} for _ in range(len(self) + 1)]
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents, strict=True)):
            kids[parent].setdefault(token, i + 1)
        return kids

    def attention(self, prefix: int, device) -> torch.Tensor:
        """Boolean mask [1, 1, N+1, prefix+N+1]: the root and every node see the cached prefix,
        their ancestors and themselves."""
        size = len(self) + 1
        visible = torch.eye(size, dtype=torch.bool)  # [N+1, N+1]
        for i, parent in enumerate(self.parents, start=1):
            visible[i] |= visible[parent]
        cached = torch.ones(size, prefix, dtype=torch.bool)  # [N+1, prefix]
        return torch.cat([cached, visible], dim=1)[None, None].to(device)  # [1, 1, N+1, S]


@dataclass
class _Budget:
    """When a generation stops: max_new_tokens after the prompt, or its first EOS."""

    prompt_length: int
    max_new_tokens: int
    eos_id: int | None

    def spent(self, tokens: list[int]) -> bool:
        return (len(tokens) - self.prompt_length >= self.max_new_tokens
                or tokens[-1] == self.eos_id)

    def keep(self, tokens: list[int], produced: list[int], result: Generation) -> None:
        """A round's tokens onto `tokens`, as many as the budget takes, and their count onto
        the result's rounds."""
        produced = truncate_output(produced, self.max_new_tokens
                                   - (len(tokens) - self.prompt_length), self.eos_id)
        tokens += produced
        result.round_tokens.append(len(produced))


class EmbeddedSpeculativeEngine:
    """How a round drafts follows the drafter's kind (draftsmith/model/registry.py): EAGLE-3
    step by step (`_draft`, or `_draft_tree` with topk > 1), DFlash a whole block in one
    forward (`_draft_block`); verification is the same for both."""

    def __init__(self, target_model, drafter: Drafter, num_steps: int, topk: int = 1,
                 num_draft_tokens: int | None = None, cache: str = "auto"):
        """cache: the target's KV cache, deploy.embedded_cache (`resolve_embedded_cache`)."""
        if topk < 1 or num_steps < 1:
            raise ValueError(f"num_steps={num_steps} and topk={topk} must be at least 1")
        self.kind = kind_of(drafter)
        problem = self.kind.drafting_problem(drafter.config, num_steps, topk)
        if problem:
            raise ValueError(f"num_steps={num_steps}, topk={topk}: a {self.kind.name} drafter: "
                             f"{problem}")
        self.cache = cache  # as asked; cache_kind is what runs
        self.cache_kind = resolve_embedded_cache(cache, target_model)
        if topk > 1 and self.cache_kind == "static" \
                and getattr(drafter.config, "sliding_window", None):
            if cache == "static":  # the static tree's keys sit at slots, not positions
                raise ValueError(
                    f"deploy.embedded_cache=static with eagle_topk={topk}: this drafter attends "
                    f"over a sliding window ({drafter.config.sliding_window}), which the static "
                    "path's trees do not apply; set deploy.embedded_cache=auto or dynamic")
            self.cache_kind = "dynamic"
        if self.kind.drafting == "block" and self.cache_kind == "static":  # static buffers too
            self._draft = self._draft_block_static
            self._new_drafter_cache = self._static_drafter_caches
        elif self.kind.drafting == "block":
            self._draft = self._draft_block
        elif self.cache_kind == "static":  # a chain over the drafter's own static cache
            self._draft = self._draft_static
            self._new_drafter_cache = self._new_static_drafter_cache
        budget = draft_token_budget(num_steps, topk)
        num_draft_tokens = num_draft_tokens or (num_steps + 1 if topk == 1 else budget + 1)
        if not 2 <= num_draft_tokens <= budget + 1:
            raise ValueError(f"num_draft_tokens={num_draft_tokens}: between 2 and {budget + 1} "
                             f"with num_steps={num_steps} and topk={topk}")
        self.drafter = drafter.eval()
        self.runner = target_runner(target_model, drafter.config.aux_layer_ids, self.cache_kind,
                                    step_widths=(1, num_steps + 1))
        self.num_steps = num_steps
        self.topk = topk
        self.num_draft_tokens = num_draft_tokens
        self.device = target_model.device
        self.draft_to_target = drafter.draft_to_target_ids()  # [D]
        self.vocab_size = drafter.config.vocab_size
        self.round_clock = RoundClock(self.device)
        # A round that drafts the next one before it reads the GPU times two rounds at once.
        self.next_round_clock = RoundClock(self.device)
        # How greedy chain rounds run: over static drafter buffers each round drafts the next
        # on the device, from its own verify, before the host reads its verdicts. Static trees
        # are drafted and verified on the device, greedy or sampled.
        self.device_trees = self.is_tree and self._draft == self._draft_static
        self._greedy_rounds = self._sampled_rounds = self._rounds
        if self.device_trees:
            self._sampled_rounds = self._sampled_tree_rounds
            self._greedy_rounds = self._tree_rounds_drafting_ahead
        elif self._draft == self._draft_static:
            self._greedy_rounds = self._rounds_drafting_ahead
        self._static_caches: list[StaticDraftCache] = []  # one per drafter layer
        # width -> [T, T] causal mask. The captured steps' widths are made here: a compiled
        # step that filled the dict would fail its own guard and compile a second time.
        self._causal: dict[int, torch.Tensor] = {}
        for width in (1, num_steps + 1):
            self._causal_mask(width)
        # A static tree's layout: each candidate's depth, and the mask of a level's own keys
        # (each frontier node sees itself only).
        self._candidate_depths = static_tree.candidate_depths(num_steps, topk, self.device)
        if self.is_tree:
            kernel_works(self.device)  # tried now, eagerly: the compiled round reads the answer
        self._tree_level_mask = torch.eye(topk, dtype=torch.bool, device=self.device)  # [k, k]
        # EAGLE-3: step 0 over anchors and a chain step; DFlash: the context's keys and values
        # and the block's logits. Over static drafter buffers their shapes are fixed, so on
        # CUDA they are compiled (CUDA graphs).
        self.step_functions = (
            (self.context_kv, self.block_logits) if self.kind.drafting == "block"
            else (self.anchor_forward, self.drafter.step))
        # One sequence's greedy drafting of a round (a chain, or a tree's levels and choice),
        # every step with its mask, cache writes and argmax or topk: captured, a round's
        # drafting is one replay and two copies of inputs.
        self.round_steps = self.tree_round_steps if self.is_tree else self.greedy_round_steps
        self.greedy_round = self.round_steps
        self.tree_verdicts = self.tree_verdict_steps
        # The first round's prompt-wide step (EAGLE-3's greedy round, DFlash's context step):
        # padded to a prompt width and captured from the eager step (compiling would compile
        # once per width), or eager at the prompt's own width.
        self.prompt_step = None
        if self.cache_kind == "static" and cuda_graphs(self.device):
            self.step_functions = tuple(
                captured_step(compiled_once(f), f"embedded drafter step {f.__name__}",
                              self.device, eager=f)
                for f in self.step_functions)
            if self.kind.drafting != "block":  # DFlash drafts a block, no chain
                self.greedy_round = captured_step(
                    compiled_once(self.round_steps),
                    f"embedded drafter {self.round_steps.__name__}", self.device,
                    eager=self.round_steps)
            if self.is_tree:
                self.tree_verdicts = captured_step(
                    compiled_once(self.tree_verdict_steps), "embedded tree verdicts",
                    self.device, state=_cache_counters, eager=self.tree_verdict_steps)
                self.runner.one_row_cache_users.append(self.tree_verdicts)
            prompt_step = self.context_kv if self.kind.drafting == "block" else \
                self.round_steps
            self.prompt_step = captured_step(prompt_step, "embedded drafter prompt step",
                                             self.device)

    @classmethod
    def load(cls, target_model, drafter_dir: str | Path, num_steps: int, family: str = "llama",
             topk: int = 1, num_draft_tokens: int | None = None, cache: str = "auto"):
        """Load the drafter from exported files (any layout, validated on read); the
        embedding is the target's."""
        checkpoint = read_drafter(drafter_dir, family)
        drafter = build_drafter(checkpoint.config)
        state = dict(checkpoint.tensors)
        state["embed_tokens.weight"] = decoder_of(target_model).embed_tokens.weight.detach()
        drafter.load_state_dict(state, strict=True)
        dtype = next(target_model.parameters()).dtype
        return cls(target_model, drafter.to(target_model.device, dtype), num_steps, topk,
                   num_draft_tokens, cache)

    def steps_ran(self) -> str:
        """How the fixed-width steps of the static path ran, for the rows that quote their
        timings: CUDA graphs, or eagerly (the dynamic cache, or after a step failed to build)."""
        steps = [*self.runner.captured_steps(), *self._captured_drafter_steps()]
        failed = [step.name for step in steps if step.failed]
        if failed:
            return f"eager after a failed capture: {', '.join(failed)}"
        if not steps:
            return "eager"
        return "cuda graphs" if self.device.type == "cuda" else "replayed without graphs"

    def _captured_drafter_steps(self) -> list[CapturedOnFailure]:
        return [step for step in (*self.step_functions, self.greedy_round, self.prompt_step,
                                  self.tree_verdicts)
                if isinstance(step, CapturedOnFailure)]

    @property
    def is_tree(self) -> bool:
        return self.topk > 1

    def _windowed(self, mask: torch.Tensor | None, query_positions: torch.Tensor,
                  key_positions: torch.Tensor) -> torch.Tensor | None:
        """mask [1, 1, Q, K] (None: every key visible) less the keys outside the drafter's
        sliding window (a speculators drafter's layer_types), as vLLM runs it."""
        window = self.drafter.config.sliding_window
        if window is None:
            return mask
        near = (key_positions[None, :] > query_positions[:, None] - window)[None, None]
        return near if mask is None else mask & near  # [1, 1, Q, K]

    def context_kv(self, aux: torch.Tensor, positions: torch.Tensor) -> list:
        """DFlash: each layer's keys and values [B, nkv, W, d] of the context at aux
        [B, W, K*H] and positions [B, W]."""
        return self.drafter.context_kv(self.drafter.context(aux), positions)

    def block_logits(self, block: torch.Tensor, positions: torch.Tensor, context_kv: list,
                     mask: torch.Tensor) -> torch.Tensor:
        """DFlash: blocks [B, Q] at positions [B, Q] over the context's keys and values ->
        the logits of drafts 1..Q-1 [B, Q-1, D]."""
        hidden = self.drafter.block_hidden(block, positions, context_kv, mask)  # [B, Q, H]
        return self.drafter.lm_head(hidden[:, 1:])  # [B, Q-1, D]

    @torch.inference_mode()
    def _anchor_step(self, tokens: list[int], aux: torch.Tensor, drafted_upto: int, cache):
        """Drafter step 0 over the new anchors drafted_upto..n-1. Returns the last anchor's
        output [1, 1, H] and logits [D] (they draft the token after x_n) and the step-0 cache
        extended with the new anchors (kept across rounds)."""
        n = len(tokens) - 1
        dev = self.device
        new = n - drafted_upto
        ids = torch.tensor([tokens[drafted_upto + 1 : n + 1]], device=dev)  # [1, new]
        positions = torch.arange(drafted_upto, n, device=dev)[None]  # [1, new]
        causal = torch.ones(new, new, dtype=torch.bool, device=dev).tril()  # [new, new]
        mask = torch.cat([torch.ones(new, drafted_upto, dtype=torch.bool, device=dev), causal],
                         dim=-1)[None, None]  # [1, 1, new, n]
        mask = self._windowed(mask, positions[0], torch.arange(n, device=dev))
        out, logits, (k, v) = self.anchor_forward(ids, aux[:, drafted_upto:n], positions,
                                                   cache, mask)
        cache = (k, v) if cache is None else (torch.cat([cache[0], k], 2),
                                              torch.cat([cache[1], v], 2))
        return out[:, -1:], logits[0, -1], cache

    @torch.inference_mode()
    def _draft(self, tokens: list[int], aux: torch.Tensor, drafted_upto: int, cache,
               sampling: Sampling):
        """Step 0, then the chain. Returns the drafts, the draft distributions over the target
        vocab (sampling only) and the drafter's step-0 cache."""
        n = len(tokens) - 1
        dev = self.device
        hidden, logits, cache = self._anchor_step(tokens, aux, drafted_upto, cache)
        drafts: list[int] = []
        draft_probs: list[torch.Tensor] = []
        self.choose_draft(logits, sampling, drafts, draft_probs)
        chain_kv = cache
        for j in range(1, self.num_steps):
            position = torch.tensor([n - 1 + j], device=dev)  # [1]
            mask = self._windowed(None, position, torch.arange(n + j, device=dev))
            out, step_logits, (k, v) = self.drafter.step(
                torch.tensor([[drafts[-1]]], device=dev), hidden, position[None], chain_kv,
                mask)
            chain_kv = (torch.cat([chain_kv[0], k], 2), torch.cat([chain_kv[1], v], 2))
            self.choose_draft(step_logits[0, -1], sampling, drafts, draft_probs)
            hidden = out
        return drafts, draft_probs, cache

    def _new_drafter_cache(self, capacity: int):
        """The drafter's cache for a new generation: built by the first round (dynamic)."""
        return None

    def _static_drafter_caches(self, capacity: int) -> list[StaticDraftCache]:
        """The engine's StaticDraftCache for each drafter layer when they hold `capacity`
        slots, else longer ones."""
        caches = self._static_caches
        if not caches or caches[0].capacity < capacity:
            layers = self.drafter.layers if self.kind.drafting == "block" else \
                [self.drafter.midlayer]
            self._static_caches = []  # the old buffers go before the new ones
            for step in self._captured_drafter_steps():
                step.forget()  # with the graphs that hold them
            caches = [StaticDraftCache(layer.self_attn.n_kv, layer.self_attn.head_dim, capacity,
                                       self.drafter.fc.weight.dtype, self.device)
                      for layer in layers]
            self._static_caches = caches
            if self.prompt_step is not None:
                self._capture_prompt_steps(caches[0])
        return caches

    @torch.inference_mode()
    def _capture_prompt_steps(self, cache: StaticDraftCache) -> None:
        """Capture the first round's prompt step at every prompt width the cache takes, now,
        so that none is captured inside a measured generation. What the captures write into
        the caches is overwritten by each generation's own rounds."""
        dev = self.device
        for width in prompt_widths(cache.capacity):
            anchors = torch.zeros(1, width, self.drafter.fc.weight.shape[1],
                                  dtype=self.drafter.fc.weight.dtype, device=dev)  # [1, W, K*H]
            if self.kind.drafting == "block":  # the context's keys and values
                self.prompt_step(anchors, torch.arange(width, device=dev)[None])  # [1, W]
                continue
            self._causal_mask(width)  # made outside the graph, kept for its replays
            packed = torch.zeros(width + 2, dtype=torch.long, device=dev)  # [W + 2]
            self.prompt_step(packed, anchors, cache.slots, cache.k, cache.v)

    def _prompt_step_width(self, width: int, cache: StaticDraftCache) -> int | None:
        """The captured width a first round over `width` anchors is padded to; None: its own,
        eagerly."""
        if self.prompt_step is None:
            return None
        return prompt_width(width, cache.capacity)

    def _new_static_drafter_cache(self, capacity: int) -> StaticDraftCache:
        """EAGLE-3: the engine's StaticDraftCache (one layer)."""
        return self._static_drafter_caches(capacity)[0]

    def anchor_forward(self, ids, aux, positions, past_kv, mask):
        """Step 0 over anchors: fc over their aux states, then the drafter layer."""
        hidden = self.drafter.project_aux(aux)  # [1, T, H]
        return self.drafter.step(ids, hidden, positions, past_kv, mask)

    def _causal_mask(self, width: int) -> torch.Tensor:
        """[T, T] lower-triangular, made once per width."""
        if width not in self._causal:
            self._causal[width] = torch.ones(width, width, dtype=torch.bool,
                                             device=self.device).tril()  # [T, T]
        return self._causal[width]

    def _static_mask(self, slots: torch.Tensor, seen: int | torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
        """[1, 1, T, C+T]: the queries at `positions` [T] see the slots [C] below `seen` (an
        int, or a device tensor [1] inside a captured step), and the step's own keys causally
        (less what the drafter's sliding window hides)."""
        width = positions.shape[0]
        past = (slots < seen)[None].expand(width, -1)  # [T, C]
        mask = torch.cat([past, self._causal_mask(width)], dim=-1)[None, None]  # [1, 1, T, C+T]
        return self._windowed(mask, positions, torch.cat([slots, positions]))

    def _padded_anchors(self, aux: torch.Tensor, drafted_upto: int, n: int,
                        width: int | None = None) -> tuple[torch.Tensor, int]:
        """A static round's new anchors drafted_upto..n-1: their aux states padded (with the
        last one's) to num_steps + 1, so that every round has one shape, and that width. The
        first round after the prompt keeps the prompt's width (a compiled step would compile
        again for every prompt length), unless `width` pads it to a captured one."""
        new, length = n - drafted_upto, self.num_steps + 1
        if width is None:
            width = length if drafted_upto and new <= length else new
        anchors = aux[:, drafted_upto:n]  # [1, new, K*H]
        if width > new:
            anchors = torch.cat([anchors, anchors[:, -1:].expand(-1, width - new, -1)],
                                dim=1)  # [1, W, K*H]
        return anchors, width

    @torch.inference_mode()
    def _draft_static(self, tokens: list[int], aux: torch.Tensor, drafted_upto: int,
                      cache: StaticDraftCache, sampling: Sampling):
        """`_draft` over a StaticDraftCache. A round's new anchors (accepted drafts and the
        bonus token, at most num_steps + 1) are padded to num_steps + 1, so every round's
        step 0 has one shape; the padding's outputs are dropped and its keys land past the
        anchors, where the chain steps overwrite them and nothing reads them before. The
        first round, over the prompt, is padded to a prompt width when its step is captured
        (`prompt_step`, greedy), and otherwise runs eagerly at the prompt's width."""
        n = len(tokens) - 1
        dev = self.device
        anchor_forward, chain_forward = self.step_functions
        if sampling.greedy:
            drafts = self._static_round(tokens, aux, drafted_upto, cache)  # [1, k]
            return drafts[0], [], cache  # [k], left on the device for the verify
        new = n - drafted_upto
        anchors, width = self._padded_anchors(aux, drafted_upto, n)  # [1, W, K*H]
        ids = torch.tensor([tokens[drafted_upto + 1: n + 1] + [tokens[n]] * (width - new)],
                           device=dev)  # [1, W]
        positions = torch.arange(drafted_upto, drafted_upto + width, device=dev)  # [W]
        if width != self.num_steps + 1:  # the prompt's
            anchor_forward = self.anchor_forward
        out, logits, (k, v) = anchor_forward(
            ids, anchors, positions[None], (cache.k, cache.v),
            self._static_mask(cache.slots, drafted_upto, positions))
        cache.write(drafted_upto, k, v)
        hidden = out[:, new - 1:new]  # [1, 1, H]: the last anchor's
        drafts: list[int] = []
        draft_probs: list[torch.Tensor] = []
        self.choose_draft(logits[0, new - 1], sampling, drafts, draft_probs)
        for j in range(1, self.num_steps):
            position = cache.slots[n - 1 + j: n + j]  # [1]
            out, step_logits, (k, v) = chain_forward(
                torch.tensor([[drafts[-1]]], device=dev), hidden, position[None],
                (cache.k, cache.v), self._static_mask(cache.slots, n - 1 + j, position))
            cache.write(n - 1 + j, k, v)
            self.choose_draft(step_logits[0, -1], sampling, drafts, draft_probs)
            hidden = out  # [1, 1, H]
        return drafts, draft_probs, cache

    @torch.inference_mode()
    def _static_round(self, tokens: list[int], aux: torch.Tensor, drafted_upto: int,
                      cache: StaticDraftCache):
        """A round's drafting on the device over a StaticDraftCache (`round_steps`: a greedy
        chain or a tree), its anchors padded to num_steps + 1 (`_padded_anchors`); the
        prompt's round is padded to a prompt width when captured (`prompt_step`), and
        otherwise runs eagerly at the prompt's width. Returns what `round_steps` returns, left
        on the device for the verify."""
        n = len(tokens) - 1
        new = n - drafted_upto
        anchors, width = self._padded_anchors(aux, drafted_upto, n)  # [1, W, K*H]
        draft_round = self.greedy_round
        if width != self.num_steps + 1:  # the prompt's round
            draft_round, padded = self.round_steps, self._prompt_step_width(width, cache)
            if padded is not None:
                anchors, width = self._padded_anchors(aux, drafted_upto, n, padded)
                draft_round = self.prompt_step
        # The anchors' ids, their first position and the last real anchor's index: one copy
        # to the device a round.
        packed = on_device(tokens[drafted_upto + 1: n + 1] + [tokens[n]] * (width - new)
                           + [drafted_upto, new - 1], self.device)  # [W + 2]
        return draft_round(packed, anchors, cache.slots, cache.k, cache.v)

    def greedy_round_steps(self, packed: torch.Tensor, anchors: torch.Tensor,
                           slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                           ) -> torch.Tensor:
        """A round's greedy drafting over a StaticDraftCache, on the device from end to end:
        step 0 over the round's W anchors, their keys and values into their slots, then the
        chain steps from the last real anchor. packed [W + 2]: the anchors' ids, the first
        anchor's position and the last real anchor's index; anchors [1, W, K*H]; slots [C];
        k, v [1, nkv, C, d]. Returns the drafts as target ids [1, num_steps]."""
        width = anchors.shape[1]
        ids, start, last = packed[None, :width], packed[width:width + 1], packed[width + 1:]
        positions = start + torch.arange(width, device=packed.device)  # [W]
        out, logits, (step_k, step_v) = self.anchor_forward(
            ids, anchors, positions[None], (k, v),
            self._static_mask(slots, start, positions))  # [1, W, H], [1, W, D]
        k.index_copy_(2, positions, step_k)
        v.index_copy_(2, positions, step_v)
        hidden = out.index_select(1, last)  # [1, 1, H]: the last real anchor's
        drafts = [self.draft_target_id(logits[0].index_select(0, last)[0])]  # [1, 1] each
        for j in range(1, self.num_steps):
            hidden, draft = self.greedy_chain_step(drafts[-1], hidden, start + last + j,
                                                   slots, k, v)  # position n - 1 + j
            drafts.append(draft)
        return torch.cat(drafts, dim=1)  # [1, num_steps]

    def tree_round_steps(self, packed: torch.Tensor, anchors: torch.Tensor, slots: torch.Tensor,
                         k: torch.Tensor, v: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A round's tree drafting over a StaticDraftCache, on the device from end to end
        (what `_draft_tree` does with lists and host reads): step 0 over the round's anchors
        as in `greedy_round_steps`, then num_steps - 1 levels, each feeding its topk frontier
        nodes at once. A level's keys and values go into slots of their own past the anchors
        (level l's from n + (l - 1) * topk, overwritten by the next round's anchors), and each
        node sees the anchors, its ancestors' slots and itself. Inputs as greedy_round_steps'.
        Returns the tree (`static_tree.choose_nodes`): its nodes' target ids, their parents'
        verify indices and their depths [N] each, and who sees whom [N+1, N+1]."""
        width, topk, dev = anchors.shape[1], self.topk, packed.device
        ids, start, last = packed[None, :width], packed[width:width + 1], packed[width + 1:]
        positions = start + torch.arange(width, device=dev)  # [W]
        out, logits, (step_k, step_v) = self.anchor_forward(
            ids, anchors, positions[None], (k, v),
            self._static_mask(slots, start, positions))  # [1, W, H], [1, W, D]
        k.index_copy_(2, positions, step_k)
        v.index_copy_(2, positions, step_v)
        n = start + last + 1  # [1]: the root's position, the first slot past the anchors
        scores, draft_ids = static_tree.children(
            torch.zeros(1, dtype=torch.float64, device=dev),
            logits[0].index_select(0, last), topk)  # [k], [k]: the root's children
        tokens = self.draft_to_target.index_select(0, draft_ids)  # [k]
        candidates = [(scores, tokens, torch.full((topk,), -1, device=dev))]  # [k] each
        frontier = torch.arange(topk, device=dev)  # [k]: the frontier's candidate indices
        hidden = out.index_select(1, last).expand(-1, topk, -1)  # [1, k, H]
        seen = torch.zeros(topk, slots.shape[0], dtype=torch.bool, device=dev)  # [k, C]
        before_root = (slots < n)[None]  # [1, C]: the anchors
        for level in range(1, self.num_steps):
            node_slots = n + (level - 1) * topk + torch.arange(topk, device=dev)  # [k]
            mask = torch.cat([before_root | seen, self._tree_level_mask],
                             dim=-1)[None, None]  # [1, 1, k, C+k]
            out, step_logits, (step_k, step_v) = self.drafter.step(
                tokens[None], hidden, (n - 1 + level).expand(topk)[None], (k, v),
                mask)  # [1, k, H], [1, k, D]
            k.index_copy_(2, node_slots, step_k)
            v.index_copy_(2, node_slots, step_v)
            listed = sum(len(c[0]) for c in candidates)
            scores, draft_ids = static_tree.children(
                scores, step_logits[0], topk)  # [k*k], [k*k]: frontier row by row
            tokens = self.draft_to_target.index_select(0, draft_ids)  # [k*k]
            candidates.append((scores, tokens, frontier[:, None].expand(-1, topk).flatten()))
            if level == self.num_steps - 1:
                break  # the last level's children are drafted, not fed
            best = static_tree.best(scores, topk)  # [k]: the next frontier
            rows = best // topk  # [k]: each one's parent row
            seen = seen.index_select(0, rows) | (
                slots[None] == node_slots.index_select(0, rows)[:, None])  # [k, C]
            hidden = out.index_select(1, rows)  # [1, k, H]
            scores, tokens = scores.index_select(0, best), tokens.index_select(0, best)  # [k]
            frontier = listed + best  # [k]
        all_scores, all_tokens, parents = (torch.cat(c) for c in zip(*candidates, strict=True))
        nodes, parents, depths = static_tree.choose_nodes(
            all_scores, all_tokens, parents, self._candidate_depths,
            self.num_draft_tokens - 1)  # [N] each
        return nodes, parents, depths, static_tree.visibility(parents, self.num_steps)

    def greedy_chain_step(self, last: torch.Tensor, hidden: torch.Tensor,
                          position: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One greedy chain step over a StaticDraftCache, on the device from end to end: the
        mask from the step's slot (which is its position too), the drafter step, its keys and
        values into that slot, and its argmax as a target id. last [1, 1], hidden [1, 1, H],
        position [1], slots [C], k, v [1, nkv, C, d] -> the next hidden [1, 1, H] and the
        draft [1, 1]."""
        out, logits, (step_k, step_v) = self.drafter.step(
            last, hidden, position[None], (k, v),
            self._static_mask(slots, position, position))  # [1, 1, H], [1, 1, D]
        k.index_copy_(2, position, step_k)
        v.index_copy_(2, position, step_v)
        return out, self.draft_target_id(logits[0, -1])  # [1, 1, H], [1, 1]

    def draft_target_id(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """The argmax of draft_logits [D] as a target id [1, 1], on the device. Indexing
        draft_to_target with the 0-d argmax would read it on the host: a wait for the GPU
        each step, and inside a CUDA graph capture an error (the first H200 run of the
        captured chain step, 2026-12-06)."""
        return self.draft_to_target.index_select(0, draft_logits.argmax().view(1)).view(1, 1)

    def choose_draft(self, draft_logits: torch.Tensor, sampling: Sampling, drafts: list[int],
                     draft_probs: list[torch.Tensor]) -> None:
        """The next draft from draft_logits [D]: the argmax, or drawn (its distribution over
        the target vocab kept for verification)."""
        if sampling.greedy:
            drafts.append(int(self.draft_to_target[draft_logits.argmax()]))
            return
        q = torch.zeros(self.vocab_size).index_copy_(  # [V]
            0, self.draft_to_target.cpu(), sampling.probs(draft_logits))
        draft_probs.append(q)
        drafts.append(sampling.draw(q))

    @torch.inference_mode()
    def _draft_block(self, tokens: list[int], aux: torch.Tensor, drafted_upto: int, cache,
                     sampling: Sampling):
        """DFlash: the context's keys and values for the new positions drafted_upto..n-1
        join the drafter's cache (kept across rounds, as vLLM keeps them), then one forward
        of the block [x_n, mask x num_steps] at positions n..n+num_steps drafts every token at
        once. Returns the drafts, their distributions (sampling only) and the cache."""
        n = len(tokens) - 1
        dev, drafter = self.device, self.drafter
        context = drafter.context(aux[:, drafted_upto:n])  # [1, new, H]
        new_kv = drafter.context_kv(context, torch.arange(drafted_upto, n, device=dev)[None])
        cache = new_kv if cache is None else [
            (torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
            for (k0, v0), (k1, v1) in zip(cache, new_kv, strict=True)]  # [1, nkv, n, d] each
        length = self.num_steps + 1
        block = drafter.block_ids(torch.tensor([tokens[n]], device=dev), length)  # [1, Q]
        mask = torch.cat([torch.ones(length, n, dtype=torch.bool, device=dev),
                          drafter.within_block(length, dev)], dim=1)[None, None]  # [1,1,Q,n+Q]
        hidden = drafter.block_hidden(block, torch.arange(n, n + length, device=dev)[None],
                                      cache, mask)  # [1, Q, H]
        logits = drafter.lm_head(hidden[0, 1:])  # [num_steps, D]: drafts 1..num_steps
        drafts: list[int] = []
        draft_probs: list[torch.Tensor] = []
        for row in logits:
            self.choose_draft(row, sampling, drafts, draft_probs)
        return drafts, draft_probs, cache

    @torch.inference_mode()
    def _draft_block_static(self, tokens: list[int], aux: torch.Tensor, drafted_upto: int,
                            caches: list[StaticDraftCache], sampling: Sampling):
        """`_draft_block` over a StaticDraftCache per layer, a key at the slot of its
        position. A round's new context positions are padded to num_steps + 1 (the padding's
        keys land at n and after, where the mask hides them until the next round overwrites
        them), and the block attends over every slot, masked to those below n: every round
        has one shape. The prompt's round is padded to a prompt width when its context step
        is captured (`prompt_step`), and otherwise runs eagerly at the prompt's width."""
        n = len(tokens) - 1
        dev, length = self.device, self.num_steps + 1
        context_forward, block_forward = self.step_functions
        anchors, width = self._padded_anchors(aux, drafted_upto, n)  # [1, W, K*H]
        if width != length:  # the prompt's
            context_forward, padded = self.context_kv, self._prompt_step_width(width, caches[0])
            if padded is not None:
                anchors, width = self._padded_anchors(aux, drafted_upto, n, padded)
                context_forward = self.prompt_step
        positions = torch.arange(drafted_upto, drafted_upto + width, device=dev)[None]  # [1, W]
        for cache, (k, v) in zip(caches, context_forward(anchors, positions), strict=True):
            cache.write(drafted_upto, k, v)
        block = self.drafter.block_ids(torch.tensor([tokens[n]], device=dev), length)  # [1, Q]
        past = (caches[0].slots < n)[None].expand(length, -1)  # [Q, C]
        mask = torch.cat([past, self.drafter.within_block(length, dev)],
                         dim=-1)[None, None]  # [1, 1, Q, C+Q]
        logits = block_forward(block, torch.arange(n, n + length, device=dev)[None],
                               [(c.k, c.v) for c in caches], mask)[0]  # [num_steps, D]
        drafts: list[int] = []
        draft_probs: list[torch.Tensor] = []
        if sampling.greedy:  # one wait for the device
            drafts = self.draft_to_target[logits.argmax(-1)].tolist()
        else:
            for row in logits:
                self.choose_draft(row, sampling, drafts, draft_probs)
        return drafts, draft_probs, caches

    @torch.inference_mode()
    def _draft_tree(self, tokens: list[int], aux: torch.Tensor, drafted_upto: int, cache):
        """Step 0, then num_steps - 1 expansions of the topk best frontier nodes. Returns the
        tree of the num_draft_tokens - 1 best nodes and the drafter's step-0 cache."""
        n = len(tokens) - 1
        dev, k = self.device, self.topk
        anchor_out, logits, cache = self._anchor_step(tokens, aux, drafted_upto, cache)
        # Candidates are kept as flat lists; parent -1 is the root.
        scores: list[float] = []
        cand_tokens: list[int] = []
        cand_parents: list[int] = []
        cand_depths: list[int] = []

        def add(parent: int, depth: int, base: float, step_logits: torch.Tensor) -> list[int]:
            logp, ids = row_topk(step_logits[None], k)  # [1, k], [1, k]
            logp, ids = logp[0], ids[0]  # [k], [k]
            added = []
            for lp, i in zip(logp.tolist(), ids.tolist(), strict=True):
                added.append(len(scores))
                scores.append(base + lp)
                cand_tokens.append(int(self.draft_to_target[i]))
                cand_parents.append(parent)
                cand_depths.append(depth)
            return added

        frontier = add(-1, 1, 0.0, logits)
        frontier_hidden = anchor_out.expand(1, k, -1)  # [1, k, H]: every child of the anchor
        fed: list[int] = []  # candidate fed at each column of tree_kv
        tree_kv = None
        for depth in range(2, self.num_steps + 1):
            columns = fed + frontier
            visible = torch.zeros(len(frontier), len(columns), dtype=torch.bool)  # [F, M+F]
            for row, node in enumerate(frontier):
                ancestor = node
                while ancestor != -1:
                    visible[row, columns.index(ancestor)] = True
                    ancestor = cand_parents[ancestor]
            mask = torch.cat([torch.ones(len(frontier), n, dtype=torch.bool), visible],
                             dim=1)[None, None].to(dev)  # [1, 1, F, n+M+F]
            key_positions = torch.tensor([*range(n), *(n - 1 + cand_depths[c] for c in columns)],
                                         device=dev)  # [n+M+F]
            mask = self._windowed(mask, torch.full((len(frontier),), n - 2 + depth, device=dev),
                                  key_positions)
            past = cache if tree_kv is None else (torch.cat([cache[0], tree_kv[0]], 2),
                                                  torch.cat([cache[1], tree_kv[1]], 2))
            ids = torch.tensor([[cand_tokens[c] for c in frontier]], device=dev)  # [1, F]
            positions = torch.full((1, len(frontier)), n - 2 + depth, device=dev)  # [1, F]
            out, step_logits, (key, value) = self.drafter.step(ids, frontier_hidden, positions,
                                                               past, mask)
            tree_kv = (key, value) if tree_kv is None else (torch.cat([tree_kv[0], key], 2),
                                                            torch.cat([tree_kv[1], value], 2))
            fed += frontier
            children = []
            for row, node in enumerate(frontier):
                children += add(node, depth, scores[node], step_logits[0, row])
            best = sorted(children, key=lambda c: -scores[c])[:k]
            frontier_hidden = out[:, [children.index(c) // k for c in best]]  # [1, k, H]
            frontier = best
        # The best nodes of all steps; a parent scores at least as high as its children, and
        # ties go to the shallower node, so every chosen node's parent is chosen too.
        chosen = sorted(range(len(scores)), key=lambda c: (-scores[c], cand_depths[c]))
        chosen = sorted(chosen[: self.num_draft_tokens - 1], key=lambda c: (cand_depths[c], c))
        verify_index = {c: i + 1 for i, c in enumerate(chosen)}
        tree = DraftTree(
            tokens=[cand_tokens[c] for c in chosen],
            parents=[0 if cand_parents[c] == -1 else verify_index[cand_parents[c]]
                     for c in chosen],
            depths=[cand_depths[c] for c in chosen])
        return tree, cache

    @without_cudnn_attention
    def generate(self, prompt: list[int], max_new_tokens: int, eos_id: int | None,
                 sampling: Sampling | None = None) -> Generation:
        """Greedy (lossless: token for token plain greedy decoding) or sampled (each token
        distributed as the target's own sampling at that temperature)."""
        sampling = sampling or Sampling()
        started = time.perf_counter()
        cache = self._new_target_cache(len(prompt), max_new_tokens)
        logits, aux = self.runner.forward(prompt, cache, last_only=True)
        tokens = [*prompt, sampling.pick(logits[-1])]
        result = Generation(tokens=[], seconds=0.0,
                            prefill_seconds=time.perf_counter() - started)
        # A round's anchors are padded to num_steps + 1 slots and a static tree's levels take
        # (num_steps - 1) * topk slots, past the last known token.
        drafter_cache = self._new_drafter_cache(
            len(prompt) + max_new_tokens
            + max(2 * (self.num_steps + 1), (self.num_steps - 1) * self.topk + 1))
        rounds = self._greedy_rounds if sampling.greedy else self._sampled_rounds
        rounds(tokens, aux, cache, drafter_cache, _Budget(len(prompt), max_new_tokens, eos_id),
               sampling, result)
        result.tokens = truncate_output(tokens[len(prompt):], max_new_tokens, eos_id)
        result.seconds = time.perf_counter() - started
        return result

    def size_target_cache(self, prompt_length: int, max_new_tokens: int) -> None:
        """Make the target's cache now at the size this engine's generations of prompts up
        to prompt_length take, so that plain decoding over the same runner runs over the
        cache the speculative generations will use rather than a smaller one they replace."""
        self._new_target_cache(prompt_length, max_new_tokens)

    def _new_target_cache(self, prompt_length: int, max_new_tokens: int):
        """The target's cache for a generation. A chain's verify writes num_steps + 1
        positions past its last known token; a static tree's leaves its rejected nodes'
        slots behind (`StaticTargetRunner.tree_capacity`)."""
        if self.device_trees:
            return self.runner.new_tree_cache(self.runner.tree_capacity(
                prompt_length, max_new_tokens, self.num_draft_tokens))
        return self.runner.new_cache(prompt_length + max_new_tokens + self.num_steps)

    def _rounds(self, tokens: list[int], aux: torch.Tensor, cache, drafter_cache,
                budget: _Budget, sampling: Sampling, result: Generation) -> None:
        """Draft, verify, read the verdicts, keep what was accepted: round after round, until
        the budget is spent. tokens (the prompt and the prefill's token) grows in place; aux
        [1, n, K*H] holds the target's aux states of the positions drafted from."""
        drafted_upto = 0
        clock = self.round_clock
        while not budget.spent(tokens):
            n = len(tokens) - 1
            if self.is_tree:
                clock.start()
                tree, drafter_cache = self._draft_tree(tokens, aux, drafted_upto, drafter_cache)
                clock.end("draft")
                positions = torch.tensor([[n] + [n + d for d in tree.depths]],
                                         device=self.device)  # [1, N+1]
                logits, new_aux = self.runner.forward([tokens[n], *tree.tokens], cache,
                                                      positions, tree.attention(n, self.device))
                clock.end("verify")
                path, next_token = self._verify_tree(
                    tree, functools.partial(pick_row, sampling, logits))
                clock.add_to(result)
                kept = [0, *path]
                _keep_cache_positions(cache, list(range(n)) + [n + i for i in kept])
                accepted_tokens = [tree.tokens[i - 1] for i in path]
            else:
                clock.start()
                drafts, draft_probs, drafter_cache = self._draft(tokens, aux, drafted_upto,
                                                                 drafter_cache, sampling)
                clock.end("draft")
                logits, new_aux = self.runner.forward(self.verify_ids(tokens[n], drafts),
                                                      cache)  # [k+1, V]
                clock.end("verify")
                accepted, next_token = self.verify_chain(drafts, draft_probs, logits, sampling)
                clock.add_to(result)
                kept = slice(0, accepted + 1)
                if len(drafts) > accepted:
                    self.runner.drop_last(cache, len(drafts) - accepted)
                accepted_tokens = drafts[:accepted]
            drafted_upto = n
            budget.keep(tokens, [*accepted_tokens, next_token], result)
            aux = torch.cat([aux, new_aux[:, kept]], dim=1)  # [1, n+a+1, K*H]

    @torch.inference_mode()
    def _sampled_tree_rounds(self, tokens: list[int], aux: torch.Tensor,
                             cache: StaticTargetCache, drafter_cache: StaticDraftCache,
                             budget: _Budget, sampling: Sampling, result: Generation) -> None:
        """Sampled tree rounds over static buffers: the drafter's round makes the tree on the
        device (`tree_round_steps`), the target verifies it in one forward from there
        (`StaticTargetRunner.forward_tree`), and the host reads the tree, walks it drawing
        the target's token from each logits row it passes, and keeps the accepted path's
        slots. (Greedy trees walk on the device: `_tree_rounds_drafting_ahead`.)"""
        drafted_upto = 0
        clock = self.round_clock
        self.runner.keep_prefix(cache)
        while not budget.spent(tokens):
            n = len(tokens) - 1
            clock.start()
            nodes, parents, depths, visible = self._static_round(tokens, aux, drafted_upto,
                                                                 drafter_cache)  # [N] each
            clock.end("draft")
            logits, new_aux = self.runner.forward_tree(tokens[n], n, nodes, depths, visible,
                                                       cache)  # [N+1, V], [1, N+1, K*H]
            clock.end("verify")
            size = nodes.shape[0]
            listed = HostRead(torch.cat([nodes, parents, depths])).wait()
            tree = DraftTree(listed[:size], listed[size:2 * size], listed[2 * size:])
            path, next_token = self._verify_tree(tree,
                                                 functools.partial(pick_row, sampling, logits))
            clock.add_to(result)
            kept = on_device([0, *path], self.device)  # [a+1]
            self.runner.keep_tree_path_on_device(cache.kv, cache.valid, kept, size + 1)
            cache.length = self.runner.tree_length_after(cache, path[-1] if path else 0, size + 1)
            drafted_upto = n
            budget.keep(tokens, [tree.tokens[i - 1] for i in path] + [next_token], result)
            aux = torch.cat([aux, new_aux.index_select(1, kept)], dim=1)  # [1, n+a+1, K*H]

    @torch.inference_mode()
    def _tree_rounds_drafting_ahead(self, tokens: list[int], aux: torch.Tensor,
                                    cache: StaticTargetCache, drafter_cache: StaticDraftCache,
                                    budget: _Budget, sampling: Sampling,
                                    result: Generation) -> None:
        """Greedy tree rounds over static buffers, each drafting the next before it reads the
        GPU, as `_rounds_drafting_ahead` does for chains: the tree is walked on the device
        (`static_tree.walk`), the target's cache keeps the path there
        (`keep_tree_path_on_device`), and the next round's anchors are the kept verify
        positions (the target's picks there for their ids, the verify's aux states, the
        accepted count as the last real anchor). The drafter's graph runs while the host reads
        the verdicts. A generation's last round drafts one tree that is never verified."""
        if budget.spent(tokens):
            return
        dev, width = self.device, self.num_draft_tokens
        clock, next_clock = self.round_clock, self.next_round_clock
        self.runner.keep_prefix(cache)
        clock.start()
        tree = self._static_round(tokens, aux, 0, drafter_cache)  # the prompt's
        clock.end("draft")
        while True:
            n = len(tokens) - 1
            nodes, parents, depths, visible = tree  # [N] each, [N+1, N+1]
            logits, new_aux = self.runner.forward_tree(tokens[n], n, nodes, depths, visible,
                                                       cache)  # [N+1, V], [1, N+1, K*H]
            clock.end("verify")
            verdicts, packed, anchors = self.tree_verdicts(
                logits, cache.kv, nodes, parents, new_aux, cache.valid,
                on_device([n], dev))  # [S+3], [S+3], [1, S+1, K*H]
            verdicts = HostRead(verdicts)
            next_clock.start()
            tree = self.greedy_round(packed, anchors, drafter_cache.slots, drafter_cache.k,
                                     drafter_cache.v)
            next_clock.end("draft")
            a, last_kept, *produced = verdicts.wait()
            cache.length = self.runner.tree_length_after(cache, last_kept, width)
            clock.add_to(result)
            budget.keep(tokens, produced[:a + 1], result)
            if budget.spent(tokens):
                return
            clock, next_clock = next_clock, clock

    def tree_verdict_steps(self, logits: torch.Tensor, kv: StaticCache, nodes: torch.Tensor,
                           parents: torch.Tensor, new_aux: torch.Tensor, valid: torch.Tensor,
                           root: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """After a tree's verify forward, on the device: the target's picks, the greedy walk
        (`static_tree.walk`), the accepted path kept in the target's cache
        (`keep_tree_path_on_device`), and the next round's drafting inputs. logits [N+1, V],
        nodes, parents [N], new_aux [1, N+1, K*H], valid [C], root [1] (the root's position).
        Returns the verdicts for the host [S+3] (the accepted count, the last kept verify
        index, the kept positions' picks: the accepted tokens and the bonus), the drafter
        round's packed ids [S+3] and its anchors [1, S+1, K*H], as `greedy_round_steps` takes
        them. Captured and compiled on CUDA, its few dozen small operations are one replay."""
        picks = logits.argmax(-1)  # [N+1]
        kept, accepted = static_tree.walk(nodes, parents, picks, self.num_steps)  # [S+1], [1]
        self.runner.keep_tree_path_on_device(kv, valid, kept, nodes.shape[0] + 1)
        kept_picks = picks.index_select(0, kept)  # [S+1]: each anchor's next token
        verdicts = torch.cat([accepted, kept[-1:], kept_picks])  # [S+3]
        packed = torch.cat([kept_picks, root, accepted])  # [S+3]
        return verdicts, packed, new_aux.index_select(1, kept)  # [S+3], [S+3], [1, S+1, K*H]

    @torch.inference_mode()
    def _rounds_drafting_ahead(self, tokens: list[int], aux: torch.Tensor,
                               cache: StaticTargetCache, drafter_cache: StaticDraftCache,
                               budget: _Budget, sampling: Sampling, result: Generation) -> None:
        """Greedy chain rounds over static buffers, each drafting the next before it reads
        the GPU. The next round's anchors are this round's verify positions: their ids are the
        target's argmax there (the accepted drafts equal it, then the bonus token), their aux
        states the verify's, and the last real one sits at the accepted count, all on the
        device. So the drafter's graph is enqueued right behind the verify, and it runs while
        the host reads the verdicts and keeps the accepted tokens: the GPU does not wait for
        the host between rounds. The rows past the accepted count are the padding that
        `_draft_static` makes otherwise; what they hold is never read. A generation's last
        round drafts one round that is never verified."""
        if budget.spent(tokens):
            return
        k, dev = self.num_steps, self.device
        clock, next_clock = self.round_clock, self.next_round_clock
        clock.start()
        drafts, _, _ = self._draft(tokens, aux, 0, drafter_cache, sampling)  # [k], the prompt's
        clock.end("draft")
        while True:
            n = len(tokens) - 1
            logits, new_aux = self.runner.forward(self.verify_ids(tokens[n], drafts),
                                                  cache)  # [k+1, V], [1, k+1, K*H]
            clock.end("verify")
            verified = logits.argmax(-1)  # [k+1]
            accepted = accepted_counts(drafts, verified)  # []
            verdicts = HostRead(torch.cat([accepted.view(1), verified, drafts]))  # [2k+2]
            next_clock.start()
            drafts = self.greedy_round(
                torch.cat([verified, on_device([n], dev), accepted.view(1)]),  # [k+3]
                new_aux, drafter_cache.slots, drafter_cache.k, drafter_cache.v)[0]  # [k]
            next_clock.end("draft")
            a, *listed = verdicts.wait()
            clock.add_to(result)
            if a < k:
                self.runner.drop_last(cache, k - a)
            budget.keep(tokens, listed[k + 1:k + 1 + a] + [listed[a]], result)
            if budget.spent(tokens):
                return
            clock, next_clock = next_clock, clock

    @staticmethod
    def accepted_prefix(drafts: list[int], verified: list[int]) -> list[int]:
        """The drafts up to the first that the target's own token (verified) differs from."""
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == verified[accepted]:
            accepted += 1
        return drafts[:accepted]

    @without_cudnn_attention
    @torch.inference_mode()
    def replay(self, prompt: list[int], output: list[int]) -> Generation:
        """The rounds greedy chain (or block) decoding makes when the target's tokens are
        `output` (another engine's greedy output for `prompt`): one target forward gives the
        aux states of every position, each round drafts as `generate` does, and its drafts are
        checked against `output` instead of the target's argmax. The first output token is
        the prefill's, as in `generate`."""
        if self.is_tree:
            raise ValueError(f"replay makes a chain's rounds, and this engine drafts trees "
                             f"(eagle_topk={self.topk}): replay with an engine of eagle_topk=1")
        started = time.perf_counter()
        tokens = [*prompt, *output]
        result = Generation(tokens=list(output), seconds=0.0)
        if len(output) > 1:
            _, aux = self.runner.forward(tokens[:-1], self.runner.new_cache(len(tokens)),
                                         last_only=True)  # [1, L-1, K*H]
            drafter_cache = self._new_drafter_cache(len(tokens) + 2 * (self.num_steps + 1))
            known, drafted_upto = len(prompt) + 1, 0
            while known < len(tokens):
                n = known - 1
                drafts, _, drafter_cache = self._draft(tokens[:known], aux[:, :n], drafted_upto,
                                                       drafter_cache, Sampling())
                drafts = drafts.tolist() if isinstance(drafts, torch.Tensor) else drafts
                accepted = 0
                while (accepted < len(drafts) and known + accepted < len(tokens)
                       and drafts[accepted] == tokens[known + accepted]):
                    accepted += 1
                produced = min(accepted + 1, len(tokens) - known)
                result.round_tokens.append(produced)
                drafted_upto, known = n, known + produced
        result.seconds = time.perf_counter() - started
        return result

    def verify_ids(self, last: int, drafts: list[int] | torch.Tensor) -> list[int] | torch.Tensor:
        """The verify forward's tokens: the last known one, then the drafts. Drafts left on
        the device (a greedy round over static buffers) stay there: the host enqueues the
        verify without waiting for them."""
        if isinstance(drafts, torch.Tensor):
            return torch.cat([on_device([last], drafts.device), drafts])  # [k+1]
        return [last, *drafts]

    @staticmethod
    def verify_chain(drafts: list[int], draft_probs: list[torch.Tensor],
                     logits: torch.Tensor, sampling: Sampling) -> tuple[int, int]:
        """(how many drafts were accepted, the target's own next token). logits [k+1, V]:
        row i is the target's prediction for the position of draft i (row k: the bonus
        position)."""
        if sampling.greedy:
            verified = logits.argmax(-1).tolist()  # k+1
            accepted = len(EmbeddedSpeculativeEngine.accepted_prefix(drafts, verified))
            return accepted, verified[accepted]
        p = sampling.probs(logits)  # [k+1, V]
        for i, (token, q) in enumerate(zip(drafts, draft_probs, strict=True)):
            if sampling.uniform() >= acceptance_probability(p[i], q, token):
                return i, sampling.draw(residual_distribution(p[i], q))
        return len(drafts), sampling.draw(p[len(drafts)])

    @staticmethod
    def _verify_tree(tree: DraftTree, pick) -> tuple[list[int], int]:
        """(verify indices of the accepted path, the target's own next token). pick(i): the
        target's token after verify index i (its argmax, or a draw from its logits row)."""
        children = tree.children()
        path: list[int] = []
        node = 0
        while True:
            token = pick(node)
            child = children[node].get(token)
            if child is None:
                return path, token
            path.append(child)
            node = child


def pick_row(sampling: Sampling, logits: torch.Tensor, row: int) -> int:
    """The target's token after verify index `row` of logits [N+1, V]."""
    return sampling.pick(logits[row])


def _keep_cache_positions(cache: DynamicCache, keep: list[int]) -> None:
    """Keep only these positions of every layer of the target's KV cache (the accepted path
    of a verified tree)."""
    index = torch.tensor(keep)
    for layer in cache.layers:
        index = index.to(layer.keys.device)
        layer.keys = layer.keys[..., index, :]
        layer.values = layer.values[..., index, :]


@without_cudnn_attention
def plain_generate(runner: TargetRunner, prompt: list[int], max_new_tokens: int,
                   eos_id: int | None, sampling: Sampling | None = None) -> Generation:
    """The baseline: the target alone, one token per forward, with the same KV cache. Greedy
    without `sampling` (or at temperature 0), sampled at its temperature otherwise."""
    sampling = sampling or Sampling()
    started = time.perf_counter()
    cache = runner.new_cache(len(prompt) + max_new_tokens)
    logits, _ = runner.forward(prompt, cache, last_only=True)
    tokens = [sampling.pick(logits[-1])]
    prefilled = time.perf_counter()
    while len(tokens) < max_new_tokens and tokens[-1] != eos_id:
        logits, _ = runner.forward([tokens[-1]], cache)
        tokens.append(sampling.pick(logits[-1]))
    ended = time.perf_counter()
    return Generation(tokens=truncate_output(tokens, max_new_tokens, eos_id),
                      seconds=ended - started,
                      round_tokens=[1] * (len(tokens) - 1), prefill_seconds=prefilled - started,
                      verify_seconds=ended - prefilled)


def truncate_output(tokens: list[int], max_new_tokens: int, eos_id: int | None) -> list[int]:
    """At most max_new_tokens, up to and with the first EOS."""
    tokens = tokens[:max_new_tokens]
    if eos_id in tokens:
        tokens = tokens[: tokens.index(eos_id) + 1]
    return tokens
