"""In-process generation: the static cache with the grouped decode attention decodes exactly
what transformers' default path decodes (float32), and the attention itself equals SDPA."""

from __future__ import annotations

import pytest
import torch

from draftsmith.generate.transformers_backend import (
    CACHE_LENGTH_STEP,
    TransformersGenerator,
    cache_bucket,
    cache_length,
    resolve_cache,
)
from draftsmith.model.grouped_attention import (
    DECODE_ATTENTION,
    grouped_decode_attention,
    grouped_decode_flex,
    grouped_decode_matmul,
)


class _Attention(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


BATCH, KV_HEADS, GROUPS, LENGTH, DIM = 4, 2, 3, 11, 8


def decode_step_inputs() -> tuple[torch.Tensor, ...]:
    """One decode step's query, keys, values and a bool mask with left padding and holes."""
    torch.manual_seed(0)
    query = torch.randn(BATCH, KV_HEADS * GROUPS, 1, DIM)  # [B, nh, 1, d]
    key = torch.randn(BATCH, KV_HEADS, LENGTH, DIM)  # [B, nkv, S, d]
    value = torch.randn(BATCH, KV_HEADS, LENGTH, DIM)  # [B, nkv, S, d]
    mask = torch.rand(BATCH, 1, 1, LENGTH) > 0.3  # [B, 1, 1, S]
    mask[..., -1] = True
    return query, key, value, mask


def test_grouped_decode_attention_equals_sdpa_with_repeated_heads():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, kv_heads, groups, length, dim = BATCH, KV_HEADS, GROUPS, LENGTH, DIM
    query, key, value, mask = decode_step_inputs()
    module = _Attention()
    ours, _ = grouped_decode_attention(module, query, key, value, mask, scaling=0.5)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.5)
    assert ours.shape == theirs.shape == (batch, 1, kv_heads * groups, dim)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # Several query tokens (prefill) take transformers' own path.
    prefill = torch.randn(batch, kv_heads * groups, length, dim)
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    ours, _ = grouped_decode_attention(module, prefill, key, value, causal.expand(batch, 1,
                                                                                 -1, -1))
    theirs, _ = sdpa_attention_forward(module, prefill, key, value,
                                       causal.expand(batch, 1, -1, -1))
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("masks", ["bool", "additive"])
@pytest.mark.parametrize("step", [grouped_decode_matmul, grouped_decode_flex],
                         ids=["matmul", "flex"])
def test_the_other_decode_steps_equal_sdpas(masks: str, step):
    query, key, value, keep = decode_step_inputs()
    mask = keep if masks == "bool" else torch.where(keep, 0.0, float("-inf"))
    module = _Attention()
    ours, _ = step(module, query, key, value, mask, scaling=0.5)
    theirs, _ = grouped_decode_attention(module, query, key, value, mask, scaling=0.5)
    assert ours.shape == theirs.shape == (BATCH, 1, KV_HEADS * GROUPS, DIM)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("decode_attention", ["sdpa", "matmul", "flex"])
def test_static_cache_decodes_what_the_dynamic_cache_decodes(random_target_dir,
                                                             random_target_tokenizer,
                                                             decode_attention: str):
    from draftsmith.target import load_target_model

    conversations = [[{"role": "user", "content": "def f(x):" + " return x" * (1 + i % 4)}]
                     for i in range(5)]

    def answers(cache: str):
        generator = TransformersGenerator(load_target_model(random_target_dir),
                                          random_target_tokenizer, max_new_tokens=12,
                                          temperature=0.0, top_p=1.0, seed=0, cache=cache,
                                          batch_size=8, decode_attention=decode_attention)
        used.append(generator.model.config._attn_implementation)
        return generator.complete(conversations)

    used: list[str] = []
    dynamic, static = answers("dynamic"), answers("static")
    assert used[1] == DECODE_ATTENTION[decode_attention][0]  # the static cache decodes with it
    assert len(static) == len(conversations)  # the rows that filled the batch are dropped
    assert [c.token_ids for c in static] == [c.token_ids for c in dynamic]
    assert all(len(c.token_ids) == c.completion_tokens for c in static)


def test_a_separate_prefill_decodes_what_generates_own_prefill_decodes(
        random_target_dir, random_target_tokenizer):
    """compile_prefill fills the static cache with every prompt token but the last before
    generate runs (compiled on CUDA, eager here): the same answers in float32, for prompts
    of several lengths (left padding) over two batches that share the cache."""
    from draftsmith.target import load_target_model

    model = load_target_model(random_target_dir)
    batches = [[[{"role": "user", "content": "def f(x):" + " return x" * (1 + i % 4)}]
                for i in range(5)],
               [[{"role": "user", "content": f"def g{i}(y): return y" * (1 + i)}]
                for i in range(3)]]

    def answers(compile_prefill: bool) -> list[list[int]]:
        generator = TransformersGenerator(model, random_target_tokenizer, max_new_tokens=12,
                                          temperature=0.0, top_p=1.0, seed=0, cache="static",
                                          batch_size=6, longest_prompt=80,
                                          compile_prefill=compile_prefill)
        return [c.token_ids for batch in batches for c in generator.complete(batch)]

    real_generate, prefilled = model.generate, []

    def generate(**kwargs):  # what generate finds in the cache when it starts (a copy: the
        # static cache counts its tokens in a tensor that decoding then advances in place)
        prefilled.append(int(kwargs["past_key_values"].get_seq_length()))
        return real_generate(**kwargs)

    model.generate = generate
    separate = answers(compile_prefill=True)
    widths = [max(len(random_target_tokenizer.apply_chat_template(
        c, add_generation_prompt=True, tokenize=True, return_dict=False)) for c in batch)
        for batch in batches]
    assert prefilled == [widths[0] - 1, widths[1] - 1]  # all but the last prompt token
    assert separate == answers(compile_prefill=False)
    assert prefilled[2:] == [0, 0]  # without it generate prefills
    with pytest.raises(ValueError, match="compile_prefill with cache='dynamic'"):
        TransformersGenerator(model, random_target_tokenizer, max_new_tokens=1, temperature=0,
                              top_p=1, seed=0, cache="dynamic", compile_prefill=True)


def test_the_separate_prefill_fills_the_cache_as_one_forward_over_the_prompts_would(
        random_target_dir, random_target_tokenizer):
    """The next-token logits after the separate prefill and the last prompt token equal a
    forward over the whole left-padded batch, row by row (float32): positions, padding and
    cache slots are those generate would use."""
    from transformers import StaticCache

    from draftsmith.target import load_target_model

    model = load_target_model(random_target_dir)
    generator = TransformersGenerator(model, random_target_tokenizer, max_new_tokens=4,
                                      temperature=0.0, top_p=1.0, seed=0, cache="static",
                                      compile_prefill=True)
    prompts = [random_target_tokenizer(text)["input_ids"]
               for text in ("def f(x): return x", "x = 1", "def long_name(a, b, c): return a")]
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, P]
    attention_mask = torch.zeros_like(input_ids)  # [B, P]
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt):] = 1
    positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)  # [B, P]
    with torch.inference_mode():
        whole = model(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=positions).logits[:, -1]  # [B, V]
        cache = StaticCache(config=model.config, max_cache_len=width + 8)
        # As on CUDA before the compiled prefill: the cache allocated first, in eager mode.
        assert generator.allocate_cache(cache, len(prompts))
        assert cache.layers[0].keys.shape[:3] == (len(prompts), model.config.num_key_value_heads,
                                                  width + 8)
        generator.prefill(cache, input_ids, attention_mask, compiled=False)
        assert int(cache.get_seq_length()) == width - 1
        last = model(input_ids=input_ids[:, -1:], attention_mask=attention_mask,
                     position_ids=positions[:, -1:], past_key_values=cache,
                     cache_position=torch.tensor([width - 1])).logits[:, -1]  # [B, V]
    torch.testing.assert_close(last, whole, rtol=1e-4, atol=1e-4)


def test_the_static_cache_decodes_with_the_matmul_step_by_default(random_target_dir,
                                                                   random_target_tokenizer):
    """The measured fastest (benchmarks/results/generation_speed/h200_2026-12-03_lease6_*)."""
    from draftsmith.target import load_target_model

    generator = TransformersGenerator(load_target_model(random_target_dir),
                                      random_target_tokenizer, max_new_tokens=1,
                                      temperature=0.0, top_p=1.0, seed=0, cache="static")
    assert generator.model.config._attn_implementation == DECODE_ATTENTION["matmul"][0]


def test_batches_share_one_static_cache_and_nothing_leaks_between_them(
        random_target_dir, random_target_tokenizer):
    from draftsmith.target import load_target_model

    model = load_target_model(random_target_dir)
    first = [[{"role": "user", "content": "def f(x):" + " return x" * 3}]] * 2
    second = [[{"role": "user", "content": f"def g{i}(y): return y"}] for i in range(3)]

    def generator():
        return TransformersGenerator(model, random_target_tokenizer, max_new_tokens=10,
                                     temperature=0.0, top_p=1.0, seed=0, cache="static",
                                     batch_size=4, longest_prompt=40)

    shared = generator()
    shared.complete(first)
    cache = shared._static_cache
    after_first = shared.complete(second)
    assert shared._static_cache is cache  # reused: same shape, emptied
    alone = generator().complete(second)
    assert [c.token_ids for c in after_first] == [c.token_ids for c in alone]


def test_a_batch_whose_cache_would_not_fit_runs_as_smaller_batches(
        random_target_dir, random_target_tokenizer, caplog):
    """An 80 GB H100 could not hold 2,048 rows of SmolLM2's cache at 1,536 positions
    (2026-12-05): a batch over the cache budget runs as batches of the rows that fit, in
    order, with the answers it gives whole."""
    from draftsmith.target import load_target_model

    model = load_target_model(random_target_dir)
    conversations = [[{"role": "user", "content": f"def f{i}(x):" + " return x" * i}]
                     for i in range(1, 8)]

    def generator(budget):
        return TransformersGenerator(model, random_target_tokenizer, max_new_tokens=10,
                                     temperature=0.0, top_p=1.0, seed=0, cache="static",
                                     batch_size=8, cache_lengths="batch",
                                     cache_budget_bytes=budget)

    whole = generator(None)
    length = whole.batch_cache_length(max(len(p) for p in whole.prompt_tokens(conversations)))
    assert whole.batch_rows(length) == 8
    split = generator(3 * whole.batch_bytes_per_row(length))  # three rows' worth
    with caplog.at_level("INFO", logger="draftsmith"):
        answers = split.complete(conversations)
    assert split.batch_rows(length) == 3
    assert [c.token_ids for c in answers] == [c.token_ids for c in whole.complete(conversations)]
    assert split._static_rows == 3  # the last of three batches: rows 7, padded to 3
    assert f"8 rows of a {length}-position cache" in caplog.text
    assert "3 rows a batch at this length" in caplog.text
    config = model.config
    assert whole.cache_bytes_per_row(length) == (  # keys and values, every layer, float32
        length * config.num_hidden_layers * 2 * config.num_key_value_heads
        * (config.hidden_size // config.num_attention_heads) * 4)


def test_rows_below_the_batch_size_come_in_steps(random_target_dir, random_target_tokenizer):
    from draftsmith.generate.transformers_backend import ROWS_STEP
    from draftsmith.target import load_target_model

    model = load_target_model(random_target_dir)
    generator = TransformersGenerator(model, random_target_tokenizer, max_new_tokens=4,
                                      temperature=0.0, top_p=1.0, seed=0, cache="static",
                                      batch_size=2048, cache_budget_bytes=0)
    per_row = generator.batch_bytes_per_row(1536)
    generator.cache_budget_bytes = 1000 * per_row
    assert generator.batch_rows(1536) == 1000 // ROWS_STEP * ROWS_STEP
    generator.cache_budget_bytes = 5 * per_row
    assert generator.batch_rows(1536) == 5
    generator.cache_budget_bytes = per_row // 2  # not even one row: one, and let it try
    assert generator.batch_rows(1536) == 1
    generator.cache_budget_bytes = 4096 * per_row
    assert generator.batch_rows(1536) == 2048


def test_a_batch_counts_its_prefill_as_well_as_its_cache(random_target_dir,
                                                         random_target_tokenizer):
    """2,048 rows whose keys and values fit ran out of memory on an H200 while the prompts
    went in: the prefill's 4D mask alone took 13.9 GiB. A batch's rows count both."""
    from draftsmith.target import load_target_model

    model = load_target_model(random_target_dir)
    generator = TransformersGenerator(model, random_target_tokenizer, max_new_tokens=160,
                                      temperature=0.0, top_p=1.0, seed=0, cache="static",
                                      batch_size=2048, cache_budget_bytes=0)
    length, config = 2048, model.config
    cache = generator.cache_bytes_per_row(length)
    prefill = generator.prefill_bytes_per_row(length - 160, length)
    itemsize = model.dtype.itemsize
    assert prefill >= (length - 160) * length * itemsize  # the mask, [P, L], at least
    assert prefill >= (length - 160) * config.intermediate_size * itemsize  # an MLP output
    assert generator.batch_bytes_per_row(length) == cache + prefill
    generator.cache_budget_bytes = 2048 * cache  # the keys and values alone would fit
    assert generator.batch_rows(length) < 2048
    assert generator.batch_rows(length) * (cache + prefill) <= generator.cache_budget_bytes


def test_cache_choice_and_length():
    assert resolve_cache("auto", torch.device("cpu")) == "dynamic"
    assert resolve_cache("auto", torch.device("cuda")) == "static"
    assert resolve_cache("static", torch.device("cpu")) == "static"
    assert cache_length(100, 160) == 3 * CACHE_LENGTH_STEP
    assert cache_length(96, 160) == 2 * CACHE_LENGTH_STEP
    tokenizer = type("T", (), {"eos_token_id": 0, "pad_token_id": 0})()
    with pytest.raises(ValueError, match="cache='paged'"):
        TransformersGenerator(None, tokenizer, max_new_tokens=1, temperature=0, top_p=1, seed=0,
                              cache="paged")
    with pytest.raises(ValueError, match="decode_attention='flash': one of sdpa, matmul, flex"):
        TransformersGenerator(None, tokenizer, max_new_tokens=1, temperature=0, top_p=1, seed=0,
                              decode_attention="flash")


def test_a_failing_compiled_decode_step_falls_back_to_eager_and_says_so(
        random_target_dir, random_target_tokenizer, caplog):
    from draftsmith.target import load_target_model

    model = load_target_model(random_target_dir)
    real, calls = model.generate, []

    def generate(**kwargs):
        calls.append(kwargs.get("disable_compile", False))
        if not kwargs.get("disable_compile"):
            raise RuntimeError("inductor: a kernel failed to compile")
        return real(**kwargs)

    model.generate = generate
    generator = TransformersGenerator(model, random_target_tokenizer, max_new_tokens=4,
                                      temperature=0.0, top_p=1.0, seed=0, cache="static",
                                      batch_size=2)
    conversation = [[{"role": "user", "content": "def f(x):"}]]
    first = generator.complete(conversation)
    second = generator.complete(conversation)
    assert calls == [False, True, True]  # once compiled, then eager for good
    assert first[0].token_ids == second[0].token_ids
    assert "the compiled decode step failed (RuntimeError: inductor" in caplog.text


def test_every_static_batch_has_one_shape(random_target_dir, random_target_tokenizer):
    """Each new shape recompiles the decode step (25-50 s on an H200), so every batch is
    filled to batch_size rows and sized for the longest prompt of the whole stage."""
    from draftsmith.target import load_target_model

    model = load_target_model(random_target_dir)
    real, shapes = model.generate, []

    def generate(**kwargs):
        shapes.append((tuple(kwargs["input_ids"].shape[:1]),
                       kwargs["past_key_values"].max_cache_len))
        return real(**kwargs)

    model.generate = generate
    generator = TransformersGenerator(model, random_target_tokenizer, max_new_tokens=4,
                                      temperature=0.0, top_p=1.0, seed=0, cache="static",
                                      batch_size=3, longest_prompt=300)
    short = [[{"role": "user", "content": "f"}]]
    long = [[{"role": "user", "content": "def f(x): return x " * 20}]] * 2
    generator.complete(short)
    generator.complete(long)
    assert shapes == [((3,), cache_length(300, 4))] * 2


def test_cache_buckets_are_few_lengths_about_one_and_a_half_apart():
    assert [cache_bucket(n) for n in (1, 128, 129, 256, 260, 385, 513, 799, 1025)] == [
        128, 128, 256, 256, 384, 512, 768, 1024, 1536]
    lengths = {cache_bucket(n) for n in range(1, 8193)}
    assert len(lengths) == 12  # compiles for every need up to 8,192 positions
    tokenizer = type("T", (), {"eos_token_id": 0, "pad_token_id": 0})()
    with pytest.raises(ValueError, match="cache_lengths='prompt': stage or batch"):
        TransformersGenerator(None, tokenizer, max_new_tokens=1, temperature=0, top_p=1, seed=0,
                              cache_lengths="prompt")


def test_a_cache_length_per_batch_answers_as_one_length_for_the_stage(
        random_target_dir, random_target_tokenizer):
    """cache_lengths="batch": each batch attends over its own bucket, so a batch of short
    prompts does not read the long prompts' cache; the answers are the same (float32)."""
    from draftsmith.target import load_target_model

    model = load_target_model(random_target_dir)
    real, lengths = model.generate, []

    def generate(**kwargs):
        lengths.append(kwargs["past_key_values"].layers[0].max_cache_len)
        return real(**kwargs)

    model.generate = generate
    short = [[{"role": "user", "content": f"def f{i}(x):"}] for i in range(3)]
    long = [[{"role": "user", "content": "def g(x): return x " * (30 + i)}] for i in range(3)]

    def answers(cache_lengths: str) -> list[list[int]]:
        generator = TransformersGenerator(model, random_target_tokenizer, max_new_tokens=100,
                                          temperature=0.0, top_p=1.0, seed=0, cache="static",
                                          batch_size=3, longest_prompt=300,
                                          cache_lengths=cache_lengths)
        return [c.token_ids for c in generator.complete(short) + generator.complete(long)
                + generator.complete(short)]

    widths = [max(len(p) for p in random_target_tokenizer.apply_chat_template(
        batch, add_generation_prompt=True, tokenize=True, return_dict=False))
        for batch in (short, long)]
    by_stage = answers("stage")
    assert lengths == [cache_length(300, 100)] * 3
    lengths.clear()
    assert answers("batch") == by_stage
    assert lengths == [cache_bucket(widths[0] + 100), cache_bucket(widths[1] + 100),
                       cache_bucket(widths[0] + 100)]
    assert lengths[0] < lengths[1] < cache_length(300, 100)


def test_running_out_of_gpu_memory_names_the_batch_and_the_setting(
        random_target_dir, random_target_tokenizer, monkeypatch):
    """An out-of-memory batch fails the same way on every retry: an input error (no retry)
    saying which batch and which setting to lower."""
    from draftsmith.errors import worth_retrying
    from draftsmith.generate.transformers_backend import GenerateMemoryError
    from draftsmith.target import load_target_model

    model = load_target_model(random_target_dir)
    generator = TransformersGenerator(model, random_target_tokenizer, max_new_tokens=10,
                                      temperature=0.0, top_p=1.0, seed=0, cache="static",
                                      batch_size=4, cache_lengths="batch")

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB.")

    monkeypatch.setattr(model, "generate", out_of_memory)
    with pytest.raises(GenerateMemoryError) as caught:
        generator.complete([[{"role": "user", "content": "def f(x): return x"}]])
    message = str(caught.value)
    assert "a batch of 4 rows, a 128-position static cache" in message
    assert "generate.batch_size (now 4)" in message and "Tried to allocate 1.50 GiB" in message
    assert not worth_retrying(caught.value)
