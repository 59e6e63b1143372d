"""An in-process speculative decoder: a transformers target + an exported EAGLE-3 drafter.

Chain drafting, greedy verification, KV caches for both models. It loads the drafter from the
exported SGLang files (never from training memory), so what it measures is what gets shipped.

One round, with tokens x_0..x_n known and the target's aux states known for positions 0..n-1:
  1. drafter step 0 over the new anchors t (aux state t, embedding of token t+1); its cache
     keeps these keys for good. The last anchor drafts d_1.
  2. steps 1..k-1 draft d_2..d_k, each feeding its own output hidden and the previous draft.
  3. the target verifies [x_n, d_1..d_k] in one forward; the longest prefix of drafts equal to
     the target's argmax is accepted, plus the target's own next token (the bonus).
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache

from draftsmith.export.convert import read_drafter
from draftsmith.extract.capture import decoder_of
from draftsmith.model.eagle3 import Eagle3Drafter


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

    @property
    def verify_rounds(self) -> int:
        return len(self.round_tokens)

    @property
    def acceptance_length(self) -> float:
        """Tokens produced per target verify forward (SGLang's accept length)."""
        return sum(self.round_tokens) / max(self.verify_rounds, 1)


class TargetRunner:
    """The target with a KV cache and forward hooks on the aux layers."""

    def __init__(self, model, aux_layer_ids: list[int]):
        self.model = model
        self.aux_layer_ids = aux_layer_ids
        # transformers renamed `past_key_values` to `cache` in 5.x; accept both.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._captured: dict[int, torch.Tensor] = {}
        layers = decoder_of(model).layers
        self._handles = [layers[i].register_forward_hook(self._hook(i)) for i in aux_layer_ids]

    def close(self) -> None:
        """Take the hooks off the target, so the model can be reused by another runner."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer_id: int):
        def hook(_module, _inputs, output):
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output
        return hook

    @torch.inference_mode()
    def forward(self, input_ids: list[int], cache: DynamicCache):
        """Returns logits [T, V] and aux states [1, T, K*H] for the new tokens."""
        ids = torch.tensor([input_ids], device=self.model.device)  # [1, T]
        logits = self.model(input_ids=ids, use_cache=True, **{self._cache_kw: cache}).logits
        aux = torch.cat([self._captured[i] for i in self.aux_layer_ids], dim=-1)  # [1, T, K*H]
        return logits[0], aux  # [T, V], [1, T, K*H]


class EmbeddedSpeculativeEngine:
    def __init__(self, target_model, drafter: Eagle3Drafter, num_steps: int):
        self.drafter = drafter.eval()
        self.runner = TargetRunner(target_model, drafter.config.aux_layer_ids)
        self.num_steps = num_steps
        self.device = target_model.device
        self.draft_to_target = drafter.draft_to_target_ids()  # [D]
        self.vocab_size = drafter.config.vocab_size

    @classmethod
    def load(cls, target_model, drafter_dir: str | Path, num_steps: int, family: str = "llama"):
        """Load the drafter from exported files (any layout, validated on read); the
        embedding is the target's."""
        checkpoint = read_drafter(drafter_dir, family)
        drafter = Eagle3Drafter(checkpoint.config)
        state = dict(checkpoint.tensors)
        state["embed_tokens.weight"] = decoder_of(target_model).embed_tokens.weight.detach()
        drafter.load_state_dict(state, strict=True)
        dtype = next(target_model.parameters()).dtype
        return cls(target_model, drafter.to(target_model.device, dtype), num_steps)

    @torch.inference_mode()
    def _draft(self, tokens: list[int], aux: torch.Tensor, drafted_upto: int, cache,
               sampling: Sampling):
        """Run step 0 over anchors drafted_upto..n-1, then the chain. Returns the drafts, the
        draft distributions over the target vocab (sampling only) and the drafter's step-0
        cache extended with the new anchors."""
        n = len(tokens) - 1
        dev = self.device
        new = n - drafted_upto
        ids = torch.tensor([tokens[drafted_upto + 1 : n + 1]], device=dev)  # [1, new]
        positions = torch.arange(drafted_upto, n, device=dev)[None]  # [1, new]
        causal = torch.ones(new, new, dtype=torch.bool, device=dev).tril()  # [new, new]
        mask = torch.cat([torch.ones(new, drafted_upto, dtype=torch.bool, device=dev), causal],
                         dim=-1)[None, None]  # [1, 1, new, n]
        hidden = self.drafter.project_aux(aux[:, drafted_upto:n])  # [1, new, H]
        out, logits, (k, v) = self.drafter.step(ids, hidden, positions, cache, mask)
        cache = (k, v) if cache is None else (torch.cat([cache[0], k], 2),
                                              torch.cat([cache[1], v], 2))
        drafts: list[int] = []
        draft_probs: list[torch.Tensor] = []

        def choose(draft_logits: torch.Tensor) -> None:  # [D]
            if sampling.greedy:
                drafts.append(int(self.draft_to_target[draft_logits.argmax()]))
                return
            q = torch.zeros(self.vocab_size).index_copy_(  # [V]
                0, self.draft_to_target.cpu(), sampling.probs(draft_logits))
            draft_probs.append(q)
            drafts.append(sampling.draw(q))

        choose(logits[0, -1])
        hidden, chain_kv = out[:, -1:], cache
        for j in range(1, self.num_steps):
            out, logits, (k, v) = self.drafter.step(
                torch.tensor([[drafts[-1]]], device=dev), hidden,
                torch.tensor([[n - 1 + j]], device=dev), chain_kv, None)
            chain_kv = (torch.cat([chain_kv[0], k], 2), torch.cat([chain_kv[1], v], 2))
            choose(logits[0, -1])
            hidden = out
        return drafts, draft_probs, cache

    def generate(self, prompt: list[int], max_new_tokens: int, eos_id: int | None,
                 sampling: Sampling | None = None) -> Generation:
        """Greedy (lossless: token for token plain greedy decoding) or sampled (each token
        distributed as the target's own sampling at that temperature)."""
        sampling = sampling or Sampling()
        started = time.perf_counter()
        cache = DynamicCache()
        logits, aux = self.runner.forward(prompt, cache)
        tokens = [*prompt, sampling.pick(logits[-1])]
        result = Generation(tokens=[], seconds=0.0)
        drafter_cache, drafted_upto = None, 0
        while len(tokens) - len(prompt) < max_new_tokens and tokens[-1] != eos_id:
            n = len(tokens) - 1
            drafts, draft_probs, drafter_cache = self._draft(tokens, aux, drafted_upto,
                                                             drafter_cache, sampling)
            drafted_upto = n
            logits, new_aux = self.runner.forward([tokens[n], *drafts], cache)  # [k+1, V]
            accepted, next_token = self._verify(drafts, draft_probs, logits, sampling)
            produced = _truncate([*drafts[:accepted], next_token],
                                 max_new_tokens - (len(tokens) - len(prompt)), eos_id)
            tokens += produced
            result.round_tokens.append(len(produced))
            aux = torch.cat([aux, new_aux[:, : accepted + 1]], dim=1)  # [1, n+a+1, K*H]
            rejected = len(drafts) - accepted
            if rejected:
                cache.crop(-rejected)  # negative: drop that many positions from the end
        result.tokens = _truncate(tokens[len(prompt):], max_new_tokens, eos_id)
        result.seconds = time.perf_counter() - started
        return result

    @staticmethod
    def _verify(drafts: list[int], draft_probs: list[torch.Tensor], logits: torch.Tensor,
                sampling: Sampling) -> tuple[int, int]:
        """(drafts accepted, the target's own next token). logits [k+1, V]: row i is the
        target's prediction for the position of draft i (row k: the bonus position)."""
        if sampling.greedy:
            verified = logits.argmax(-1).tolist()
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == verified[accepted]:
                accepted += 1
            return accepted, verified[accepted]
        p = sampling.probs(logits)  # [k+1, V]
        for i, (token, q) in enumerate(zip(drafts, draft_probs, strict=True)):
            if sampling.uniform() >= acceptance_probability(p[i], q, token):
                return i, sampling.draw(residual_distribution(p[i], q))
        return len(drafts), sampling.draw(p[len(drafts)])


def greedy_generate(runner: TargetRunner, prompt: list[int], max_new_tokens: int,
                    eos_id: int | None, sampling: Sampling | None = None) -> Generation:
    """Plain decoding with the same target and KV cache, one token per forward: the baseline
    (greedy by default, or sampled)."""
    sampling = sampling or Sampling()
    started = time.perf_counter()
    cache = DynamicCache()
    logits, _ = runner.forward(prompt, cache)
    tokens = [sampling.pick(logits[-1])]
    while len(tokens) < max_new_tokens and tokens[-1] != eos_id:
        logits, _ = runner.forward([tokens[-1]], cache)
        tokens.append(sampling.pick(logits[-1]))
    return Generation(tokens=_truncate(tokens, max_new_tokens, eos_id),
                      seconds=time.perf_counter() - started, round_tokens=[1] * (len(tokens) - 1))


def _truncate(tokens: list[int], max_new_tokens: int, eos_id: int | None) -> list[int]:
    tokens = tokens[:max_new_tokens]
    if eos_id in tokens:
        tokens = tokens[: tokens.index(eos_id) + 1]
    return tokens
