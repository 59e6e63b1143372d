"""Several prompts decoded at once by the embedded engine: plain and speculative (chains).

A KV cache has one length for the whole batch, so every forward adds the same number of slots
to every row. Rows, though, accept different numbers of drafts a round, prompts differ in
length, and rows finish at different times. So a row does not keep its keys at its positions:
`Slots` records, per row and slot, the position of the token whose key the slot holds and
whether that key still counts. A rejected draft's slot, a short prompt's padding and a finished
row's new slots are dead, and no query sees them; a query sees its row's live slots at
positions up to its own, which is causal attention over the row's tokens, holes and all.
Nothing is copied or compacted: a generation takes the prompts' width plus at most
num_steps + 1 slots a round.

The target runs through transformers with that mask as a 4D attention mask (which it takes as
it is) and explicit position ids, over a DynamicCache, or with deploy.embedded_cache=static over
one StaticCache of the batch's size, whose forwards of width 1 and num_steps + 1 keep their
shapes (compiled on CUDA). The drafter's keys sit in buffers of its own (`DraftKV`).

Every row's tokens are its own: with greedy verification they are plain greedy decoding of its
prompt, and sampled, each row draws from a Sampling of its own in the order batch 1 would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from draftsmith.compiling import fixed_address
from draftsmith.serve.embedded import (
    EmbeddedSpeculativeEngine,
    Generation,
    HostRead,
    Sampling,
    TargetRunner,
    accepted_counts,
    has_sliding_window_layers,
    on_device,
    truncate_output,
    without_cudnn_attention,
)
from draftsmith.serve.round_clock import RoundClock


class Slots:
    """Per row and cache slot, the position of the token whose key the slot holds and whether
    that key counts (live). Slots past `used` are dead."""

    def __init__(self, rows: int, capacity: int, device, window: int | None = None):
        self.position = torch.zeros(rows, capacity, dtype=torch.long, device=device)  # [B, C]
        self.live = torch.zeros(rows, capacity, dtype=torch.bool, device=device)  # [B, C]
        self.used = 0
        self.window = window  # a sliding window over positions (the drafter's), or None

    @property
    def capacity(self) -> int:
        return self.live.shape[1]

    def append(self, positions: torch.Tensor, live: torch.Tensor) -> int:
        """Claim the next T slots for tokens at positions [B, T], live [B, T]; returns the
        first one."""
        start, end = self.used, self.used + positions.shape[1]
        if end > self.capacity:
            raise ValueError(f"a batch's cache holds {self.capacity} slots; {start} + "
                             f"{positions.shape[1]} do not fit")
        self.position[:, start:end] = positions
        self.live[:, start:end] = live
        self.used = end
        return start

    def keep(self, start: int, kept: torch.Tensor) -> None:
        """Of the slots from `start`, those where kept [B, T] is False die."""
        self.live[:, start:start + kept.shape[1]] &= kept

    def rewind(self, used: int) -> None:
        """Free the slots from `used` on (their keys are overwritten by the next append)."""
        self.live[:, used:] = False
        self.used = used

    def visible(self, key_positions: torch.Tensor, key_live: torch.Tensor,
                query_positions: torch.Tensor) -> torch.Tensor:
        """[B, T, K]: which keys (positions, live [B, K]) each query (positions [B, T]) sees."""
        keys, queries = key_positions[:, None, :], query_positions[:, :, None]
        seen = key_live[:, None, :] & (keys <= queries)  # [B, T, K]
        if self.window is not None:
            seen &= keys > queries - self.window
        return seen

    def mask(self, query_positions: torch.Tensor, keys: int) -> torch.Tensor:
        """[B, 1, T, keys]: what queries at positions [B, T] see of the first `keys` slots."""
        return self.visible(self.position[:, :keys], self.live[:, :keys],
                            query_positions)[:, None]


class BatchTarget:
    """The target over one KV cache for a batch (`TargetRunner.new_batch_cache`) and its
    Slots. A dynamic cache's keys are its used slots; a static one's are all of them, the
    unwritten ones dead."""

    def __init__(self, runner: TargetRunner, rows: int, capacity: int):
        if has_sliding_window_layers(runner.model.config):
            raise ValueError("batched decoding masks every layer alike, and this target has "
                             "sliding-window layers; decode one prompt at a time "
                             "(benchmark.batch_sizes: [])")
        self.runner = runner
        self.kv = runner.new_batch_cache(rows, capacity)
        self.static = runner.cache_kind == "static"
        length = self.kv.layers[0].max_cache_len if self.static else capacity
        self.slots = Slots(rows, length, runner.model.device)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, live: torch.Tensor,
                last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, positions, live [B, T] -> logits [B, T, V] ([B, 1, V] with last_only) and aux
        states [B, T, K*H]."""
        self.slots.append(positions, live)
        mask = self.slots.mask(positions, self.slots.capacity if self.static
                               else self.slots.used)  # [B, 1, T, K]
        return self.runner.forward_batch(ids, self.kv, positions, mask, last_only)


class DraftKV:
    """The drafter's keys and values for a batch: per layer a buffer [B, nkv, C, d], and one
    Slots for all layers. `static` attends over every slot (fixed shapes for compiled steps);
    otherwise over the used ones only. Capacities are rounded up to LENGTH_STEP, so that
    generations of similar lengths share one."""

    LENGTH_STEP = 256

    def __init__(self, layers: int, rows: int, n_kv: int, head_dim: int, capacity: int,
                 dtype, device, window: int | None, static: bool):
        capacity = -(-capacity // self.LENGTH_STEP) * self.LENGTH_STEP
        self.slots = Slots(rows, capacity, device, window)
        self.k = [torch.zeros(rows, n_kv, capacity, head_dim, dtype=dtype, device=device)
                  for _ in range(layers)]  # [B, nkv, C, d] each
        self.v = [torch.zeros_like(k) for k in self.k]  # [B, nkv, C, d] each
        fixed_address(*self.k, *self.v)  # captured drafter steps read them in place
        self.static = static

    @property
    def keys(self) -> int:
        return self.slots.capacity if self.static else self.slots.used

    def past(self, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        if self.static:  # every slot: the buffers themselves, which captured steps read
            return self.k[layer], self.v[layer]
        return self.k[layer][:, :, :self.keys], self.v[layer][:, :, :self.keys]

    def write(self, start: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Each layer's (k, v) [B, nkv, T, d] into slots start..start+T-1."""
        for layer, (k, v) in enumerate(kv):
            self.k[layer][:, :, start:start + k.shape[2]] = k
            self.v[layer][:, :, start:start + v.shape[2]] = v

    def step_mask(self, positions: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """[B, 1, T, keys+T] for queries that attend to the cache and then to their own keys
        (positions, live [B, T]), before those are written."""
        past = self.slots.mask(positions, self.keys)[:, 0]  # [B, T, keys]
        own = self.slots.visible(positions, live, positions)  # [B, T, T]
        return torch.cat([past, own], dim=-1)[:, None]  # [B, 1, T, keys+T]


@dataclass
class BatchGeneration:
    """A batch's generations: each row's tokens and tokens per round, and the batch's wall
    time (the prompts' forward, drafting, verifying) and forwards after the prompts'."""

    rows: list[Generation]
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    forwards: int = 0


@dataclass
class _Rows:
    """Per-row decoding state on the host and, by position, on the device."""

    prompts: list[list[int]]
    max_new_tokens: int
    eos_id: int | None
    device: torch.device
    extra_positions: int = 0  # positions written past the last known token (drafts)
    tokens: list[list[int]] = field(init=False)  # each row's prompt and output
    running: list[bool] = field(init=False)

    def __post_init__(self):
        if not self.prompts or any(len(p) == 0 for p in self.prompts):
            raise ValueError("batched decoding needs at least one prompt, none of them empty")
        self.tokens = [list(p) for p in self.prompts]
        self.running = [True] * len(self.prompts)

    @property
    def width(self) -> int:
        return max(len(p) for p in self.prompts)

    @property
    def positions(self) -> int:
        """Positions a row can reach: its prompt, its output and the drafts past them."""
        return self.width + self.max_new_tokens + self.extra_positions + 1

    def left_padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prompts as ids, positions and live [B, P], padding on the left (so each row's
        last token is the last column); padding sits at position 0, dead."""
        width = self.width
        ids = torch.zeros(len(self.prompts), width, dtype=torch.long)  # [B, P]
        positions = torch.zeros_like(ids)  # [B, P]
        live = torch.zeros(len(self.prompts), width, dtype=torch.bool)  # [B, P]
        for row, prompt in enumerate(self.prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            positions[row, width - len(prompt):] = torch.arange(len(prompt))
            live[row, width - len(prompt):] = True
        return ids.to(self.device), positions.to(self.device), live.to(self.device)

    def last_positions(self) -> torch.Tensor:
        """Each row's last known token's position [B]."""
        return on_device([len(t) - 1 for t in self.tokens], self.device)

    def live(self) -> torch.Tensor:
        return on_device(self.running, self.device)  # [B]

    def add(self, row: int, produced: list[int]) -> list[int]:
        """Append a round's tokens to a running row, cut at max_new_tokens and EOS; the row
        stops when either is reached. Returns what was kept."""
        made = len(self.tokens[row]) - len(self.prompts[row])
        kept = truncate_output(produced, self.max_new_tokens - made, self.eos_id)
        self.tokens[row] += kept
        if (len(self.tokens[row]) - len(self.prompts[row]) >= self.max_new_tokens
                or self.eos_id in kept):
            self.running[row] = False
        return kept

    def generations(self) -> list[Generation]:
        return [Generation(tokens=t[len(p):], seconds=0.0)
                for t, p in zip(self.tokens, self.prompts, strict=True)]


def _first_tokens(logits: torch.Tensor, samplings: list[Sampling]) -> list[int]:
    """The token after each prompt from the last logits [B, V]."""
    if all(s.greedy for s in samplings):
        return logits.argmax(-1).tolist()
    return [s.pick(row) for s, row in zip(samplings, logits, strict=True)]


def _samplings(count: int, samplings: list[Sampling] | None) -> list[Sampling]:
    samplings = samplings or [Sampling() for _ in range(count)]
    if len(samplings) != count:
        raise ValueError(f"{count} prompts and {len(samplings)} samplings: give one per prompt")
    return samplings


@without_cudnn_attention
@torch.inference_mode()
def plain_generate_batch(runner: TargetRunner, prompts: list[list[int]], max_new_tokens: int,
                         eos_id: int | None, samplings: list[Sampling] | None = None
                         ) -> BatchGeneration:
    """The baseline for a batch: the target alone, one token for every row a forward."""
    samplings = _samplings(len(prompts), samplings)
    started = time.perf_counter()
    state = _Rows(prompts, max_new_tokens, eos_id, runner.model.device)
    target = BatchTarget(runner, len(prompts), state.width + max_new_tokens)
    logits, _ = target.forward(*state.left_padded(), last_only=True)  # [B, 1, V]
    for row, token in enumerate(_first_tokens(logits[:, -1], samplings)):
        state.add(row, [token])
    result = BatchGeneration(rows=[], prefill_seconds=time.perf_counter() - started)
    while any(state.running):
        live = state.live()  # [B]
        ids = torch.tensor([[t[-1]] for t in state.tokens], device=state.device)  # [B, 1]
        logits, _ = target.forward(ids, state.last_positions()[:, None], live[:, None])
        running = [row for row, on in enumerate(state.running) if on]
        picked = _first_tokens(logits[:, -1], samplings)
        for row in running:
            state.add(row, [picked[row]])
        result.forwards += 1
    result.seconds = time.perf_counter() - started
    result.verify_seconds = result.seconds - result.prefill_seconds
    result.rows = state.generations()
    for generation in result.rows:
        generation.round_tokens = [1] * max(len(generation.tokens) - 1, 0)
    return result


class BatchedSpeculativeDecoder:
    """An EmbeddedSpeculativeEngine's target and drafter over a batch: every round drafts
    num_steps tokens for every running row (EAGLE-3 step by step, DFlash a block in one
    forward) and verifies them all in one forward of the target. Chains only."""

    def __init__(self, engine: EmbeddedSpeculativeEngine):
        if engine.is_tree:
            raise ValueError(f"batched speculative decoding drafts chains; eagle_topk is "
                             f"{engine.topk}: set deploy.eagle_topk=1, or decode one prompt "
                             "at a time")
        self.engine = engine
        self.drafter = engine.drafter
        self.num_steps = engine.num_steps
        self.block = engine.kind.drafting == "block"
        self.device = engine.device
        self._draft_kvs: dict[int, DraftKV] = {}  # rows -> the drafter's keys, reused

    def _draft_kv(self, rows: int, capacity: int) -> DraftKV:
        """The decoder's DraftKV for `rows`, emptied, when it holds `capacity` slots; a longer
        one otherwise."""
        kv = self._draft_kvs.get(rows)
        if kv is not None and kv.slots.capacity >= capacity:
            kv.slots.rewind(0)
            return kv
        self._draft_kvs.pop(rows, None)  # the old buffers go before the new ones
        if self.block:
            layers = list(self.drafter.layers)
            attention, window = layers[0].self_attn, None
        else:
            layers = [self.drafter.midlayer]
            attention, window = layers[0].self_attn, self.drafter.config.sliding_window
        kv = self._draft_kvs[rows] = DraftKV(
            len(layers), rows, attention.n_kv, attention.head_dim, capacity,
            self.drafter.fc.weight.dtype, self.device, window,
            static=self.engine.cache_kind == "static")
        return kv

    @without_cudnn_attention
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_id: int | None,
                 samplings: list[Sampling] | None = None) -> BatchGeneration:
        """Greedy (each row token for token its plain greedy decoding) or sampled (each
        row's tokens distributed as the target's own sampling, by its own Sampling)."""
        samplings = _samplings(len(prompts), samplings)
        started = time.perf_counter()
        k, dev = self.num_steps, self.device
        state = _Rows(prompts, max_new_tokens, eos_id, dev, extra_positions=k + 1)
        rows = len(prompts)
        # Slots: the prompts, then num_steps + 1 a round, one round at least per token.
        target = BatchTarget(self.engine.runner, rows, state.width + max_new_tokens * (k + 1))
        drafter_kv = self._draft_kv(rows, state.width + max_new_tokens * (k + 1) + k)
        token_at = torch.zeros(rows, state.positions, dtype=torch.long, device=dev)  # [B, L]
        ids, positions, live = state.left_padded()  # [B, P] each
        logits, aux = target.forward(ids, positions, live, last_only=True)  # [B, 1, V]
        aux_at = torch.zeros(rows, state.positions, aux.shape[-1], dtype=aux.dtype,
                             device=dev)  # [B, L, K*H]
        for row, prompt in enumerate(prompts):
            token_at[row, :len(prompt)] = ids[row, state.width - len(prompt):]
            aux_at[row, :len(prompt)] = aux[row, state.width - len(prompt):]
        for row, token in enumerate(_first_tokens(logits[:, -1], samplings)):
            state.add(row, [token])
            token_at[row, len(prompts[row])] = token
        result = BatchGeneration(rows=[], prefill_seconds=time.perf_counter() - started)
        round_tokens: list[list[int]] = [[] for _ in prompts]
        drafted_upto = torch.zeros(rows, dtype=torch.long, device=dev)  # [B]
        # Greedy rounds draft the next round before they read the GPU (as
        # EmbeddedSpeculativeEngine's do): its anchors are on the device by then, and the
        # drafter's launches go out while the GPU verifies. Two clocks, one per round in flight.
        ahead = all(s.greedy for s in samplings)
        clock, next_clock = RoundClock(dev), RoundClock(dev)
        last, running = state.last_positions(), state.live()  # [B]: n, each row's last token
        if any(state.running):
            clock.start()
            drafts, draft_probs = self._draft(drafter_kv, token_at, aux_at, drafted_upto, last,
                                              running, samplings, first=True)  # [B, k]
            clock.end("draft")
        while any(state.running):
            verify_ids = torch.cat([token_at.gather(1, last[:, None]), drafts],
                                   dim=1)  # [B, k+1]
            verify_positions = last[:, None] + torch.arange(k + 1, device=dev)  # [B, k+1]
            start = target.slots.used
            logits, new_aux = target.forward(verify_ids, verify_positions,
                                             running[:, None].expand(-1, k + 1))  # [B, k+1, V]
            clock.end("verify")
            accepted, bonus, verdicts = self._verify(drafts, draft_probs, logits, samplings,
                                                     state.running)  # [B], [B], to be listed
            # Every row's round at once: the verify slots past its accepted drafts die; its
            # tokens (accepted drafts, then the bonus) and aux states go to their positions.
            # What lands past them is overwritten by the next round before anything reads it.
            columns = torch.arange(k + 1, device=dev)  # [k+1]
            target.slots.keep(start, columns[None] <= accepted[:, None])  # [B, k+1]
            made = torch.cat([drafts, drafts[:, :1]], dim=1).scatter(
                1, accepted[:, None], bonus[:, None])  # [B, k+1]
            token_at.scatter_(1, last[:, None] + 1 + columns, made)
            aux_at.scatter_(1, verify_positions[..., None].expand(-1, -1, aux_at.shape[-1]),
                            new_aux)
            drafted_upto = torch.where(running, last, drafted_upto)
            if ahead:  # a row that ends in this round drafts once more, for nothing
                next_clock.start()
                next_last = torch.where(running, last + accepted + 1, last).clamp(
                    max=token_at.shape[1] - 1)  # [B]
                next_drafts, next_probs = self._draft(drafter_kv, token_at, aux_at,
                                                      drafted_upto, next_last, running,
                                                      samplings, first=False)
                next_clock.end("draft")
            host = verdicts.wait()
            clock.add_to(result)  # the read waited for the forward
            for row, (a, next_token, *row_drafts) in enumerate(host):
                if state.running[row]:
                    kept = state.add(row, [*row_drafts[:a], next_token])
                    round_tokens[row].append(len(kept))
            result.forwards += 1
            last, running = state.last_positions(), state.live()
            if ahead:
                drafts, draft_probs = next_drafts, next_probs
                clock, next_clock = next_clock, clock
            elif any(state.running):
                clock.start()
                drafts, draft_probs = self._draft(drafter_kv, token_at, aux_at, drafted_upto,
                                                  last, running, samplings, first=False)
                clock.end("draft")
        result.seconds = time.perf_counter() - started
        result.rows = state.generations()
        for generation, counts in zip(result.rows, round_tokens, strict=True):
            generation.round_tokens = counts
        return result

    def _anchors(self, token_at: torch.Tensor, aux_at: torch.Tensor, drafted_upto: torch.Tensor,
                 last: torch.Tensor, running: torch.Tensor, first: bool):
        """The round's new anchors drafted_upto..n-1 of every row, padded to one width (the
        widest prompt first, num_steps + 1 after): ids (each anchor's next token) [B, W],
        aux [B, W, K*H], positions [B, W] and live [B, W]."""
        new = last - drafted_upto  # [B]
        width = int(new.max()) if first else self.num_steps + 1
        # A running row has at most num_steps + 1; a row that ended with its first token
        # never drafted, and has its whole prompt (its drafts are dropped).
        new = new.clamp(max=width)  # [B]
        offsets = torch.arange(width, device=self.device)  # [W]
        positions = drafted_upto[:, None] + offsets  # [B, W]
        # A row that finished with its first token keeps its prompt's anchors live, so that
        # its queries (whose outputs are dropped) see a key.
        live = (offsets[None] < new[:, None]) & (running[:, None] | first)  # [B, W]
        at = positions.clamp(max=token_at.shape[1] - 2)  # [B, W]: padding reads anything
        ids = token_at.gather(1, at + 1)  # [B, W]
        aux = aux_at.gather(1, at[..., None].expand(-1, -1, aux_at.shape[-1]))  # [B, W, K*H]
        return ids, aux, positions, live, new

    def _draft(self, kv: DraftKV, token_at, aux_at, drafted_upto, last, running, samplings,
               first: bool) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """Every row's drafts [B, num_steps] and, sampled, their distributions per row."""
        ids, aux, positions, live, new = self._anchors(token_at, aux_at, drafted_upto, last,
                                                       running, first)
        if self.block:
            return self._draft_block(kv, token_at, aux, positions, live, last, samplings, first)
        return self._draft_chain(kv, ids, aux, positions, live, new, last, running, samplings,
                                 first)

    def _choose(self, logits: torch.Tensor, samplings: list[Sampling],
                probs: list[list[torch.Tensor]]) -> torch.Tensor:
        """Each row's next draft from logits [B, D]: the argmax, or drawn by its Sampling
        (its distribution kept in probs[row]). -> [B] target ids."""
        if all(s.greedy for s in samplings):
            return self.engine.draft_to_target[logits.argmax(-1)]  # [B]
        picked = []
        for row, (sampling, row_logits) in enumerate(zip(samplings, logits, strict=True)):
            drafts: list[int] = []
            self.engine.choose_draft(row_logits, sampling, drafts, probs[row])
            picked.append(drafts[0])
        return torch.tensor(picked, device=self.device)  # [B]

    def _draft_chain(self, kv: DraftKV, ids, aux, positions, live, new, last, running,
                     samplings, first: bool):
        """EAGLE-3: step 0 over the anchors (their keys kept), then the chain, whose keys
        last the round."""
        probs: list[list[torch.Tensor]] = [[] for _ in samplings]
        anchor_forward, chain_forward = self.engine.step_functions
        if first:  # the prompts' width: a compiled step would compile again for each
            anchor_forward = self.engine.anchor_forward
        out, logits, step_kv = anchor_forward(
            ids, aux, positions, kv.past(), kv.step_mask(positions, live))  # [B, W, H], [B, W, D]
        kv.write(kv.slots.append(positions, live), [step_kv])
        anchors_end = kv.slots.used
        pick = (new - 1).clamp(min=0)  # [B]: the last anchor
        hidden = out.gather(1, pick[:, None, None].expand(-1, 1, out.shape[-1]))  # [B, 1, H]
        draft = self._choose(logits.gather(1, pick[:, None, None].expand(
            -1, 1, logits.shape[-1]))[:, 0], samplings, probs)  # [B]
        drafts = [draft]
        for j in range(1, self.num_steps):
            position = (last - 1 + j)[:, None]  # [B, 1]
            out, logits, step_kv = chain_forward(
                drafts[-1][:, None], hidden, position, kv.past(),
                kv.step_mask(position, running[:, None]))  # [B, 1, H], [B, 1, D]
            kv.write(kv.slots.append(position, running[:, None]), [step_kv])
            drafts.append(self._choose(logits[:, 0], samplings, probs))
            hidden = out
        kv.slots.rewind(anchors_end)
        return torch.stack(drafts, dim=1), probs  # [B, k]

    def _draft_block(self, kv: DraftKV, token_at, aux, positions, live, last, samplings,
                     first: bool):
        """DFlash: the anchors' context keys join the cache, then one forward of every row's
        block [x_n, mask x num_steps] at positions n..n+num_steps."""
        drafter, length = self.drafter, self.num_steps + 1
        context_forward, block_forward = self.engine.step_functions
        if first:  # the prompts' width: a compiled step would compile again for each
            context_forward = self.engine.context_kv
        kv.write(kv.slots.append(positions, live), context_forward(aux, positions))
        block = drafter.block_ids(token_at.gather(1, last[:, None])[:, 0], length)  # [B, Q]
        block_positions = last[:, None] + torch.arange(length, device=self.device)  # [B, Q]
        seen = kv.slots.mask(block_positions, kv.keys)  # [B, 1, Q, keys]
        within = drafter.within_block(length, self.device)[None, None].expand(
            len(samplings), -1, -1, -1)  # [B, 1, Q, Q]
        logits = block_forward(block, block_positions, [kv.past(i) for i in range(len(kv.k))],
                               torch.cat([seen, within], dim=-1))  # [B, k, D]
        probs: list[list[torch.Tensor]] = [[] for _ in samplings]
        drafts = [self._choose(logits[:, j], samplings, probs) for j in range(self.num_steps)]
        return torch.stack(drafts, dim=1), probs  # [B, k]

    def _verify(self, drafts: torch.Tensor, draft_probs: list[list[torch.Tensor]],
                logits: torch.Tensor, samplings: list[Sampling], running: list[bool]):
        """Per row, the drafts accepted [B] and the target's own next token [B], on the
        device, and the same with the drafts for the host, a row each [accepted, next,
        *drafts], as a `HostRead`: greedy, the GPU is read when the caller waits, so that it
        can enqueue more work first. drafts [B, k], logits [B, k+1, V]. A finished row's
        figures mean nothing."""
        if all(s.greedy for s in samplings):
            verified = logits.argmax(-1)  # [B, k+1]
            accepted = accepted_counts(drafts, verified)  # [B]
            bonus = verified.gather(1, accepted[:, None])[:, 0]  # [B]
            return accepted, bonus, HostRead(torch.cat(
                [accepted[:, None], bonus[:, None], drafts], dim=1))  # [B, k+2]: one read
        accepted, bonus = [], []
        for row, on in enumerate(running):
            if not on:
                accepted.append(0)
                bonus.append(0)
                continue
            a, token = self.engine.verify_chain(drafts[row].tolist(), draft_probs[row],
                                                logits[row], samplings[row])
            accepted.append(a)
            bonus.append(token)
        host = torch.cat([torch.tensor([accepted, bonus]).T, drafts.cpu()], dim=1)  # [B, k+2]
        return (torch.tensor(accepted, device=self.device),
                torch.tensor(bonus, device=self.device), HostRead(host))
