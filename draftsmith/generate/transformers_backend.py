"""In-process generation with transformers: batched, left-padded, greedy or sampled.

Two ways to run `generate` (`generate.cache`):
- `dynamic`: transformers' default DynamicCache, in eager mode. The CPU path.
- `static` (the default on CUDA): a StaticCache and `generate`'s compiled decode step
  (torch.compile with CUDA graphs). The decode step compiles once per shape (25-50 s for
  SmolLM2 on an H200, each time), so there is one shape: every batch is filled up to
  `generate.batch_size` rows (with a repeated prompt, dropped afterwards), and the cache
  length is the longest prompt of the whole stage plus max_new_tokens, rounded up to a
  multiple of CACHE_LENGTH_STEP. (A length per batch recompiled at almost every batch.)
  With `cache_lengths="batch"` each batch gets its own length instead, from a few lengths
  about 1.5x apart (`cache_bucket`: 256, 384, 512, 768, ...). Prompts sorted by length then
  compile each length once, and a batch of short prompts does not attend over the cache that
  the longest prompt needs (on python-functions prompts, 5 batches of 6 need at most 384
  positions where the stage needs 896). One cache is kept: a length met again after another
  gets a new cache, which the compiled step's CUDA graphs record again.
  A batch whose cache and prefill would not fit CACHE_MEMORY_SHARE of the GPU's free memory is
  split into batches of fewer rows (`batch_rows`). A row of SmolLM2 in bf16 at 2,048 positions
  takes 47 MB of cache and, for a 1,888-token prompt, 38 MB of prefill (the 4D mask, the
  MLP): 2,048 such rows do not fit an H200, 1,216 do (70% of its free memory).

Decode attention over a padded cache is most of a decode step's work on a small target.
transformers' SDPA path repeats every KV head for its query heads whenever a mask is given
(grouped-query attention: SmolLM2 has 9 query heads on 3 KV heads), so a step reads and writes
each cached key and value `groups` times over. The static cache's decode steps read each KV
head once instead, in one of three ways (`decode_attention`):
- `matmul` (the default): two batched matmuls and a float32 softmax, which the compiled
  decode step fuses. On SmolLM2 on an H200: 55.7K tokens/s against SDPA's 45.3K in the same
  call, float32 answers identical to the dynamic cache's (512/512; benchmarks/results/
  generation_speed/h200_2026-12-03_lease6_matmul.jsonl).
- `sdpa`: SDPA with each KV head's query heads on the query axis.
- `flex`: flex attention with the mask as a block mask, skipping cache blocks no row sees.
  Alone it beats the matmuls only when most of the cache is unwritten (264 against 370 us at
  320 of 768 positions); not measured in the model.

The prefill is generate's first forward, in eager mode: on SmolLM2 at 2,048 rows it is about a
third of a batch's GPU time, most of it unfused element-wise work (benchmarks/results/
generation_speed/h200_2026-12-03_profile.log). With `compile_prefill`, every prompt token but
the last goes into the static cache through one forward compiled with dynamic shapes (one
compile for all prompt lengths); generate then runs the last prompt token and decodes.
On SmolLM2 on an H200, with a cache length per batch as well: 85.0K tokens/s in bf16, 12.5x the
dynamic cache in the same call, and float32 answers identical to it (512/512; benchmarks/
results/generation_speed/h200_2026-12-04_lease13b_buckets_prefill.jsonl). The compile takes
about 110 s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from draftsmith.compiling import allocate_static_cache
from draftsmith.errors import InputError
from draftsmith.model.grouped_attention import DECODE_ATTENTION, use_decode_attention

log = logging.getLogger(__name__)

CACHE_LENGTH_STEP = 128
# The static caches' share of the GPU memory free once the target is loaded; the rest is for
# the prefill's and the decode step's activations and the CUDA graphs' pools.
CACHE_MEMORY_SHARE = 0.7
ROWS_STEP = 64  # rows below batch_size come in steps of this: few compiled shapes


class GenerateMemoryError(InputError, RuntimeError):
    """The GPU ran out of memory on a batch: the same batch fails the same way on a retry, so
    it is not retried; the message names the batch's shape and generate.batch_size."""


@dataclass
class Completion:
    text: str
    completion_tokens: int
    finish_reason: str  # "stop" (end of turn) or "length"
    token_ids: list[int] | None = None  # the completion's tokens, end of turn included


def resolve_cache(cache: str, device: torch.device) -> str:
    """`auto`: static on CUDA (compiled decode with CUDA graphs), dynamic elsewhere."""
    if cache == "auto":
        return "static" if device.type == "cuda" else "dynamic"
    return cache


def cache_length(longest_prompt: int, max_new_tokens: int) -> int:
    """The StaticCache length for a batch: rounded up, so batches of similar prompt lengths
    share one compiled decode step."""
    needed = longest_prompt + max_new_tokens
    return -(-needed // CACHE_LENGTH_STEP) * CACHE_LENGTH_STEP


def cache_bucket(needed: int) -> int:
    """The shortest of CACHE_LENGTH_STEP x 1, 2, 3, 4, 6, 8, 12, ... that holds `needed`
    positions: each length about 1.5x the last, so a length per batch compiles few shapes."""
    power = CACHE_LENGTH_STEP
    while True:
        for length in (power, power * 3 // 2):
            if length >= needed and length % CACHE_LENGTH_STEP == 0:
                return length
        power *= 2


class TransformersGenerator:
    def __init__(self, model, tokenizer, *, max_new_tokens: int, temperature: float, top_p: float,
                 seed: int, cache: str = "dynamic", batch_size: int | None = None,
                 longest_prompt: int = 0, decode_attention: str = "matmul",
                 compile_prefill: bool = False, cache_lengths: str = "stage",
                 cache_budget_bytes: int | None = None):
        """cache: dynamic or static (resolve `auto` with resolve_cache first). With the
        static cache every batch is filled up to batch_size rows.
        cache_lengths: `stage`, the cache holds longest_prompt (the longest of all the
        prompts to come) + max_new_tokens: one shape; or `batch`, each batch's own
        cache_bucket (see the module's docstring).
        decode_attention: how the static cache's decode steps attend (DECODE_ATTENTION).
        compile_prefill: the static cache is filled by a forward of its own, compiled on
        CUDA (eager elsewhere), before generate (see the module's docstring).
        cache_budget_bytes: the most one static cache may take; a batch that needs more is
        split (`batch_rows`). None: on CUDA, CACHE_MEMORY_SHARE of the memory free now;
        elsewhere no limit."""
        if cache not in ("dynamic", "static"):
            raise ValueError(f"cache={cache!r}: dynamic or static")
        if compile_prefill and cache != "static":
            raise ValueError(f"compile_prefill with cache={cache!r}: it fills a static cache; "
                             "set cache='static' or drop compile_prefill")
        if cache_lengths not in ("stage", "batch"):
            raise ValueError(f"cache_lengths={cache_lengths!r}: stage or batch")
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention={decode_attention!r}: one of "
                             f"{', '.join(DECODE_ATTENTION)}")
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.generator_seed = seed
        self.cache, self.batch_size, self.longest_prompt = cache, batch_size, longest_prompt
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.compiled = cache == "static"  # generate compiles the decode step on CUDA
        self.cache_lengths = cache_lengths
        self._static_cache, self._static_rows = None, 0  # one cache for batches of one shape
        self.cache_lengths_made: list[int] = []  # each a shape that the decode step compiles
        self.compile_prefill, self._compiled_prefill = compile_prefill, None
        if cache == "static" and cache_budget_bytes is None and model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(model.device)
            cache_budget_bytes = int(CACHE_MEMORY_SHARE * free)
        self.cache_budget_bytes = cache_budget_bytes
        self._rows_said: set[int] = set()  # cache lengths whose smaller batches were logged
        if cache == "static":
            use_decode_attention(model, decode_attention)

    def static_cache(self, rows: int, length: int):
        """The StaticCache for a batch: the previous batch's, emptied, when the shape is the
        same. The compiled decode step's CUDA graphs read the cache at fixed addresses, so a
        new cache a batch would make them be recorded again (as generate's own static cache,
        which it also keeps across calls)."""
        from transformers import StaticCache

        cache = self._static_cache
        if cache is not None and self.cache_lengths_made[-1] == length \
                and self._static_rows == rows:
            cache.reset()
            return cache
        self._static_cache = None  # the old cache's memory goes before the new one is made
        self._static_cache = StaticCache(config=self.model.config, max_cache_len=length)
        self._static_rows = rows
        self.cache_lengths_made.append(length)
        return self._static_cache

    def batch_cache_length(self, width: int) -> int:
        """The static cache's length for a batch whose longest prompt has `width` tokens."""
        if self.cache_lengths == "stage":
            return cache_length(max(width, self.longest_prompt), self.max_new_tokens)
        return cache_bucket(width + self.max_new_tokens)

    def cache_bytes_per_row(self, length: int) -> int:
        """One row's static cache at this length: keys and values of every layer."""
        config = self.model.config
        head_dim = getattr(config, "head_dim", None) \
            or config.hidden_size // config.num_attention_heads
        return (length * config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim
                * self.model.dtype.itemsize)

    def prefill_bytes_per_row(self, width: int, length: int) -> int:
        """One row's working memory while its prompt of `width` tokens goes into a cache of
        `length` positions: the 4D attention mask [P, L] (as the model's dtype and as the bool
        it is made from), and the MLP's and the residual stream's activations. On an H200 the
        keys and values alone fit, and the prefill of 2,048 rows of 1,780-token prompts still
        ran out of memory allocating that mask (13.9 GiB)."""
        config = self.model.config
        itemsize = self.model.dtype.itemsize
        intermediate = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
        return width * (length * (itemsize + 1) + 3 * intermediate * itemsize
                        + 4 * config.hidden_size * itemsize)

    def batch_bytes_per_row(self, length: int) -> int:
        """One row of a static-cache batch at this cache length: its cache, and the working
        memory of its prefill at the longest prompt the length holds (the row count then
        depends on the length alone: each new row count records the decode step again)."""
        width = max(1, length - self.max_new_tokens)
        return self.cache_bytes_per_row(length) + self.prefill_bytes_per_row(width, length)

    def batch_rows(self, length: int) -> int:
        """Rows of one static-cache batch at this cache length: batch_size, or fewer (a
        multiple of ROWS_STEP where at least that many fit) where batch_size rows would take
        more than cache_budget_bytes."""
        rows = self.batch_size or 1
        if self.cache_budget_bytes is None:
            return rows
        per_row = self.batch_bytes_per_row(length)
        fits = self.cache_budget_bytes // per_row
        if fits >= rows:
            return rows
        fits = max(1, fits // ROWS_STEP * ROWS_STEP if fits >= ROWS_STEP else fits)
        if length not in self._rows_said:
            self._rows_said.add(length)
            log.info("generate: %d rows of a %d-position cache and its prefill would take "
                     "%.1f GB, more than the %.1f GB a batch may use (%d%% of the GPU memory "
                     "free at the start): %d rows a batch at this length", rows, length,
                     rows * per_row / 1e9, self.cache_budget_bytes / 1e9,
                     round(100 * CACHE_MEMORY_SHARE), fits)
        return fits

    def allocate_cache(self, cache, rows: int) -> bool:
        """Allocate the static cache's tensors now, outside any compiled region: the decode
        step's CUDA graphs need them at fixed addresses, which transformers marks only for a
        cache allocated in eager mode. False when this transformers cannot (the prefill then
        runs eagerly until the first batch has allocated it)."""
        if all(getattr(layer, "is_initialized", True) for layer in cache.layers):
            return True
        if not hasattr(cache, "early_initialization"):
            return False
        allocate_static_cache(cache, self.model, rows)
        return True

    def prefill(self, cache, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                compiled: bool) -> None:
        """Every prompt token but the last into `cache`, numbered as generate numbers
        left-padded rows (padding at position 1, masked). generate then finds the cache
        holding P - 1 tokens and runs only the last one before decoding."""
        if input_ids.shape[1] < 2:
            return
        forward = self.model.forward
        device = self.model.device
        if compiled and device.type == "cuda" and self.allocate_cache(cache, input_ids.shape[0]):
            if self._compiled_prefill is None:  # one graph for every prompt length
                self._compiled_prefill = torch.compile(forward, dynamic=True)
            forward = self._compiled_prefill
        ids = input_ids[:, :-1].to(device)  # [B, P-1]
        mask = attention_mask[:, :-1].to(device)  # [B, P-1]
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # [B, P-1]
        forward(input_ids=ids, attention_mask=mask, position_ids=positions,
                past_key_values=cache, use_cache=True, logits_to_keep=1,
                cache_position=torch.arange(ids.shape[1], device=device))  # [B, 1, V]

    def prompt_tokens(self, conversations: list[list[dict[str, str]]]) -> list[list[int]]:
        return [self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False) for c in conversations]

    def complete(self, conversations: list[list[dict[str, str]]]) -> list[Completion]:
        return self.complete_tokens(self.prompt_tokens(conversations))

    def complete_tokens(self, prompts: list[list[int]]) -> list[Completion]:
        try:
            return self._complete_tokens(prompts)
        except torch.OutOfMemoryError as err:
            width = max(len(p) for p in prompts)
            length = self.batch_cache_length(width) if self.cache == "static" else None
            rows = self.batch_rows(length) if length else len(prompts)
            shape = (f"{rows} rows, a {length}-position static cache "
                     f"({rows * self.cache_bytes_per_row(length) / 1e9:.1f} GB, and about "
                     f"{rows * self.prefill_bytes_per_row(width, length) / 1e9:.1f} GB more "
                     "while the prompts go in)" if length else f"{rows} rows, a dynamic cache")
            raise GenerateMemoryError(
                f"generate: the GPU ran out of memory on a batch of {shape}, prompts of up to "
                f"{width} tokens and {self.max_new_tokens} new tokens: lower "
                f"generate.batch_size (now {self.batch_size}), generate.max_new_tokens or "
                f"the longest prompts. ({str(err).splitlines()[0][:200]})") from err

    @torch.inference_mode()
    def _complete_tokens(self, prompts: list[list[int]]) -> list[Completion]:
        real = len(prompts)
        width = max(len(p) for p in prompts)
        if self.cache == "static" and self.batch_size:
            rows = self.batch_rows(self.batch_cache_length(width))
            if real > rows:  # the cache would not fit: batches of fewer rows, in order
                return [completion for start in range(0, real, rows)
                        for completion in self._complete_tokens(prompts[start:start + rows])]
            prompts = prompts + [prompts[-1]] * (rows - real)  # one shape per bucket
        device = self.model.device
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # [B, P]
        attention_mask = torch.zeros_like(input_ids)  # [B, P]
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt):] = 1
        sampling = self.temperature > 0
        if sampling:
            torch.manual_seed(self.generator_seed)
        extra = {}
        if self.cache == "static":
            extra["past_key_values"] = self.static_cache(len(prompts),
                                                         self.batch_cache_length(width))
        def generate(**compile_args):
            if self.compile_prefill:
                self.prefill(extra["past_key_values"], input_ids, attention_mask,
                             compiled=not compile_args.get("disable_compile"))
            return self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                max_new_tokens=self.max_new_tokens,
                do_sample=sampling,
                temperature=self.temperature if sampling else None,
                top_p=self.top_p if sampling else None,
                top_k=None,
                eos_token_id=self.eos_id,
                pad_token_id=self.pad_id,
                **extra, **compile_args,
            )

        try:
            output = generate() if self.compiled else generate(disable_compile=True)
        except Exception as err:  # noqa: BLE001 - a compiler failure: one rung down, said so
            if not self.compiled or isinstance(err, torch.OutOfMemoryError):
                raise
            log.warning("generate: the compiled decode step failed (%s: %s); decoding with "
                        "the static cache in eager mode from here on", type(err).__name__,
                        str(err).splitlines()[0][:300] if str(err) else "")
            self.compiled = False
            extra["past_key_values"].reset()
            output = generate(disable_compile=True)
        completions = []
        for row in output[:real, width:].tolist():
            stopped = self.eos_id in row
            tokens = row[: row.index(self.eos_id)] if stopped else row
            completions.append(Completion(
                text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                completion_tokens=len(tokens) + int(stopped),
                finish_reason="stop" if stopped else "length",
                token_ids=tokens + [self.eos_id] * stopped,
            ))
        return completions
