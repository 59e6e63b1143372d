"""The quality benchmark scripts' bookkeeping: what they write is what the docs' tables read."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

QUALITY = Path(__file__).resolve().parents[1] / "benchmarks" / "quality"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"quality_{name}", QUALITY / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    sys.path.insert(0, str(QUALITY))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(QUALITY))
    return module


def test_vllm_speedups_survive_the_json_round_trip_into_the_summary_row(tmp_path: Path) -> None:
    vllm_cpu = load("vllm_cpu")
    # A kept report, as read back from disk: concurrency keys are strings now.
    report = json.loads(json.dumps({"prompts": 48, "summary": {
        "acceptance_length": 2.84, "accepted_per_position": [0.77, 0.59, 0.47],
        "speedups": {1: 1.389, 4: 1.045}, "identical_outputs": "48/48",
        "single_stream_tokens_per_s": 12.9, "baseline_single_stream_tokens_per_s": 9.3,
        "guard": {"ok": True}}}))
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps([{"drafter": "a", "speedup_vllm_c1": None},
                                   {"drafter": "b", "speedup_vllm_c1": None}]))
    vllm_cpu.update_row(summary, "b", report)
    rows = json.loads(summary.read_text())
    assert rows[0] == {"drafter": "a", "speedup_vllm_c1": None}
    assert rows[1]["speedup_vllm_c1"] == 1.389 and rows[1]["speedup_vllm_c4"] == 1.045
    assert rows[1]["measured_vllm"] == 2.84 and rows[1]["vllm_prompts"] == 48
    with pytest.raises(SystemExit, match="no row named 'c'"):
        vllm_cpu.update_row(summary, "c", report)


def test_a_finished_trainings_evaluation_runs_past_the_budget(tmp_path: Path) -> None:
    sweep_module = load("sweep")
    sweep = sweep_module.Sweep(tmp_path, tmp_path / "report", dict(sweep_module.SMOKE),
                               budget_s=0, smoke=True)
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "train").write_text("{}")
    evaluation = [sys.executable, "-c", f"open({str(tmp_path / 'done' / 'eval')!r}, 'w')"]
    sweep.add(sweep_module.Job("train:x", tmp_path / "done" / "train", 60, argv=["false"]))
    sweep.add(sweep_module.Job("eval:x", tmp_path / "done" / "eval", 120, after=["train:x"],
                               heavy=False, argv=evaluation))
    sweep.add(sweep_module.Job("train:y", tmp_path / "done" / "y", 60, argv=["false"]))
    sweep.run_all()
    assert sweep.jobs["eval:x"].state == "done"
    assert sweep.jobs["train:y"].state == "skipped"  # a new training does not fit


def test_the_kinds_side_by_side_at_a_larger_size_makes_generate_answer_it(tmp_path: Path) -> None:
    sweep_module = load("sweep")
    size = {**sweep_module.GPU, "sizes": [24000], "kinds_size": 48000}
    sweep = sweep_module.Sweep(tmp_path, tmp_path / "report", size, budget_s=1e9, smoke=False)
    args = type("Args", (), {"no_genbench": True, "kinds": ["eagle3.1", "dflash"],
                             "speculators": False})
    sweep_module.plan(sweep, args)
    generate = sweep.jobs["generate"].argv
    assert generate[generate.index("--prompts") + 1] == "48000"
    assert {"train:eagle3-24000-e6", "train:eagle3.1-48000-e6",
            "train:dflash-48000-e6"} <= set(sweep.jobs)
    assert "train:eagle3-48000-e6" not in sweep.jobs
    # Two trainings that finish together: EAGLE-3.1, the quality candidate, is evaluated first.
    evaluations = sweep.jobs["eval:eagle3.1-48000-e6"], sweep.jobs["eval:dflash-48000-e6"]
    assert evaluations[0].priority < evaluations[1].priority


def test_speculators_side_by_side_keeps_its_own_epochs_and_runs_its_own_recipe_first(
        tmp_path: Path) -> None:
    sweep_module = load("sweep")
    size = {**sweep_module.GPU, "sizes": [], "kinds_size": 77401, "epochs": 4,
            "speculators_epochs": 6}
    sweep = sweep_module.Sweep(tmp_path, tmp_path / "report", size, budget_s=1e9, smoke=False)
    args = type("Args", (), {"no_genbench": True, "kinds": ["eagle3.1"], "speculators": True})
    sweep_module.plan(sweep, args)
    assert "train:eagle3.1-77401-e4" in sweep.jobs
    own = sweep.jobs["spec:speculators-speculators-6000-e6"]
    ours = sweep.jobs["spec:speculators-draftsmith-6000-e6"]
    assert own.argv[own.argv.index("--epochs") + 1] == "6"
    assert own.priority < ours.priority


def test_a_previous_leases_answers_replace_generation(tmp_path: Path) -> None:
    """--answers: the generate job copies the answers (xz or plain) in their order and records
    their sha256; too few for the sweep's largest size is an error naming the flag."""
    import hashlib
    import lzma

    sweep_module = load("sweep")
    lines = "".join(json.dumps({"id": f"r{i}", "messages": [
        {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}) + "\n"
        for i in range(5))
    answers = tmp_path / "answers.jsonl.xz"
    answers.write_bytes(lzma.compress(lines.encode()))
    out = tmp_path / "q"
    (out / "done").mkdir(parents=True)
    a = {"out": str(out), "size": dict(sweep_module.SMOKE), "answers": str(answers)}
    sweep_module.job_generate(a, 5)
    assert (out / "answers.jsonl").read_text() == lines
    done = json.loads((out / "done" / "generate").read_text())
    assert done["records"] == 5
    assert done["answers_sha256"] == hashlib.sha256(lines.encode()).hexdigest()
    with pytest.raises(SystemExit, match=r"--answers .*answers.jsonl.xz: 5 answers, but the "
                                         r"sweep needs 6"):
        sweep_module.job_generate(a, 6)


def test_extra_answers_are_shuffled_in_among_the_kept_ones(tmp_path: Path, capsys) -> None:
    """--extra-answers: every line of both files, in a seeded order that mixes them (a size
    takes its share of each), with both files' sha256 recorded."""
    import hashlib

    sweep_module = load("sweep")

    def lines(prefix: str, n: int) -> str:
        return "".join(json.dumps({"id": f"{prefix}{i}", "messages": [
            {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}) + "\n"
            for i in range(n))

    kept, extra = tmp_path / "answers.jsonl", tmp_path / "exercise_answers.jsonl"
    kept.write_text(lines("k", 40))
    extra.write_text(lines("e", 20))
    out = tmp_path / "q"
    (out / "done").mkdir(parents=True)
    a = {"out": str(out), "size": dict(sweep_module.SMOKE), "answers": str(kept),
         "extra_answers": [str(extra)]}
    sweep_module.job_generate(a, 60)
    joined = (out / "answers.jsonl").read_text().splitlines(keepends=True)
    assert sorted(joined) == sorted(kept.read_text().splitlines(keepends=True)
                                    + extra.read_text().splitlines(keepends=True))
    assert 2 <= sum('"e' in line for line in joined[:20]) <= 18  # mixed, not appended
    done = json.loads((out / "done" / "generate").read_text())
    assert done["records"] == 60 and done["extra_records"] == 20
    assert done["extra_answers_sha256"] == hashlib.sha256(extra.read_bytes()).hexdigest()
    with pytest.raises(SystemExit):
        sweep_module.main(["run", "--out", str(tmp_path / "x"), "--extra-answers", str(extra)])
    assert "--extra-answers joins --answers" in capsys.readouterr().err


def test_several_extra_answer_files_give_what_their_join_gives(tmp_path: Path) -> None:
    """The best drafter's command names both exercise files; they must give the same answers,
    order and sha256 as the one joined file the 77K run was made from."""
    import lzma

    sweep_module = load("sweep")

    def lines(prefix: str, n: int) -> bytes:
        return "".join(json.dumps({"id": f"{prefix}{i}"}) + "\n" for i in range(n)).encode()

    kept = tmp_path / "answers.jsonl"
    kept.write_bytes(lines("k", 30))
    first, second = tmp_path / "ex80.jsonl.xz", tmp_path / "ex320.jsonl"
    first.write_bytes(lzma.compress(lines("a", 7)))
    second.write_bytes(lines("b", 11))
    joined = tmp_path / "ex_all.jsonl"
    joined.write_bytes(lines("a", 7) + lines("b", 11))
    results = []
    for extra in ([first, second], [joined]):
        out = tmp_path / f"q{len(results)}"
        (out / "done").mkdir(parents=True)
        sweep_module.answers_from_file(out, kept, 48, extra)
        done = json.loads((out / "done" / "generate").read_text())
        results.append(((out / "answers.jsonl").read_bytes(), done["extra_answers_sha256"],
                        done["extra_records"]))
    assert results[0] == results[1]
    assert results[0][2] == 18


def test_exercises_keep_one_prompt_per_new_documented_function() -> None:
    """Unusable, repeated, too many of one name, and HumanEval-like exercises are dropped and
    counted; the rest become prompts in the python-functions form."""
    exercises = load("exercises")
    from draftsmith.data.packaged import completion_prompt, humaneval_problems

    def written(name: str, doc: str) -> str:
        return f"Sure:\n```python\ndef {name}(xs: list) -> int:\n    \"\"\"{doc}\"\"\"\n```"

    first = humaneval_problems()[0]  # has_close_elements, as HumanEval asks it
    renamed = first["prompt"].replace(first["entry_point"], "close_pair")
    texts = [("sums", written("total", "Add up xs.")),
             ("sums", written("total", "Add up xs.")),  # the same head again
             ("sums", written("total", "Sum of xs.")),
             ("sums", written("total", "The sum.")),
             ("sums", written("total", "All of xs added.")),  # a fourth `total`
             ("words", "I cannot write code today."),
             ("lists", f"```python\n{first['prompt']}\n```"),
             ("lists", f"```python\n{renamed}\n```")]
    kept, counts = exercises.select_exercises(texts, max_per_name=3)
    assert [k["head"].split("\n")[1].strip() for k in kept] == [
        '"""Add up xs."""', '"""Sum of xs."""', '"""The sum."""']
    assert counts == {"written": 8, "kept": 3, "duplicate": 1, "same_name": 1,
                      "no_documented_function": 1, "humaneval_name": 1, "humaneval_like": 1,
                      "topics": 1, "max_per_name": 3, "max_humaneval_similarity": 0.3}
    assert kept[0]["messages"] == [{"role": "user", "content": completion_prompt(
        'def total(xs: list) -> int:\n    """Add up xs."""')}]
    assert len({k["id"] for k in kept}) == 3


def test_each_batch_of_exercises_is_sampled_with_its_own_seed() -> None:
    """The same seed for every batch would repeat one batch's samples in the next."""
    exercises = load("exercises")
    requests = exercises.exercise_requests(per_topic=3, topics=2)
    assert len(requests) == 6 and {t for t, _ in requests} == set(exercises.TOPICS[:2])

    class Recorder:
        generator_seed, seeds = None, []

        def complete(self, conversations):
            self.seeds.append(self.generator_seed)
            return [type("C", (), {"text": c[0]["content"][-9:]}) for c in conversations]

    recorder = Recorder()
    written = exercises.written_exercises(recorder, requests, batch_size=4, seed=7)
    assert recorder.seeds == [7, 8]
    assert [t for t, _ in written] == [t for t, _ in requests]


def test_the_target_continues_doctest_examples_from_a_started_answer(
        random_target_tokenizer) -> None:
    """with_examples: the answer is started up to `>>> name(` and the target's continuation
    kept when it gives a call and a result line; otherwise the head stays as it was."""
    exercises = load("exercises")
    heads = ['def total(xs: list) -> int:\n    """Add up xs."""',
             'def twice(x):\n    """Double x."""',
             'def odd(x):\n    """Is x odd?"""',
             "def bare(x):\n    return x"]  # no docstring to extend
    assert exercises.example_prefix(heads[0]) == (
        '```python\ndef total(xs: list) -> int:\n    """Add up xs.\n\n    >>> total(')
    assert exercises.example_prefix(heads[3]) is None
    continuations = iter(['[1, 2])\n    3\n    >>> total([])\n    0\n    """\n```',
                          '2)\n    """\n```',  # a call without a result
                          '3)\n    True\n    """\n```'])

    class Continuer:
        tokenizer, prompts = random_target_tokenizer, []

        def prompt_tokens(self, conversations):  # as TransformersGenerator's
            return [self.tokenizer.apply_chat_template(
                c, add_generation_prompt=True, tokenize=True, return_dict=False)
                for c in conversations]

        def complete_tokens(self, prompts):
            self.prompts += prompts
            return [type("C", (), {"text": next(continuations)}) for _ in prompts]

    continuer = Continuer()
    out = exercises.with_examples(continuer, heads, batch_size=2)
    assert out[0] == ('def total(xs: list) -> int:\n    """Add up xs.\n\n    >>> total([1, 2])'
                      '\n    3\n    >>> total([])\n    0\n    """')
    assert out[1] == heads[1] and out[3] == heads[3]
    assert out[2].endswith('>>> odd(3)\n    True\n    """')
    assert len(continuer.prompts) == 3  # the head without a docstring is not asked
    text = random_target_tokenizer.decode(continuer.prompts[0])
    assert exercises.EXAMPLES_ASK in text and text.endswith(">>> total(")
    kept, counts = exercises.select_exercises(
        [("sums", f"```python\n{h}\n```") for h in heads[:3]],
        add_examples=lambda hs: [h + "!" if h.startswith("def total") else h for h in hs],
        benchmark=[])
    assert kept[0]["head"].endswith("!") and "with_doctest" in counts


def test_a_failed_generation_benchmark_does_not_stop_the_sweep(tmp_path: Path) -> None:
    sweep_module = load("sweep")
    sweep = sweep_module.Sweep(tmp_path, tmp_path / "report", dict(sweep_module.SMOKE),
                               budget_s=1e9, smoke=True)
    done = tmp_path / "done"
    done.mkdir()
    sweep.add(sweep_module.Job("genbench", done / "genbench", 60, argv=["false"]))
    answer = [sys.executable, "-c", f"open({str(done / 'generate')!r}, 'w')"]
    sweep.add(sweep_module.Job("generate", done / "generate", 60, after_ended=["genbench"],
                               argv=answer))
    sweep.add(sweep_module.Job("train", done / "train", 60, after=["generate", "genbench"],
                               argv=["true"]))
    sweep.run_all()
    assert sweep.jobs["genbench"].state == "failed"
    assert sweep.jobs["generate"].state == "done"  # it only waited for the benchmark
    assert sweep.jobs["train"].state == "skipped"  # it needed the benchmark's success


def test_eagle31_with_five_ttt_steps_trains_five_and_exports_the_measured_three(
        tmp_path: Path) -> None:
    sweep_module = load("sweep")
    size = {**sweep_module.GPU, "sizes": [], "kinds_size": 48000}
    sweep = sweep_module.Sweep(tmp_path, tmp_path / "report", size, budget_s=1e9, smoke=False)
    args = type("Args", (), {"no_genbench": True, "kinds": ["eagle3.1-ttt5"],
                             "speculators": False})
    sweep_module.plan(sweep, args)
    argv = sweep.jobs["train:eagle3.1-ttt5-48000-e6"].argv
    train = json.loads(argv[argv.index("--train") + 1])
    drafter = json.loads(argv[argv.index("--drafter") + 1])
    assert train == {"ttt_steps": 5} and drafter["norm_before_fc"] is True
    cfg = sweep_module.pipeline_config(tmp_path, size, [{"name": "a", "path": "a.jsonl"}],
                                       train=train, drafter=drafter)
    assert cfg.train.ttt_steps == 5 and cfg.export.speculative_tokens == sweep_module.DRAFTS
    assert sweep.jobs["eval:eagle3.1-ttt5-48000-e6"].priority == 0


def test_eagle31_on_float32_states_captures_with_the_float32_target(tmp_path: Path) -> None:
    """HumanEval is decoded with the float32 target; this kind trains on its hidden states."""
    sweep_module = load("sweep")
    size = {**sweep_module.GPU, "sizes": [], "kinds_size": 48000}
    sweep = sweep_module.Sweep(tmp_path, tmp_path / "report", size, budget_s=1e9, smoke=False)
    args = type("Args", (), {"no_genbench": True, "kinds": ["eagle3.1-fp32states"],
                             "speculators": False})
    sweep_module.plan(sweep, args)
    argv = sweep.jobs["train:eagle3.1-fp32states-48000-e6"].argv
    extract = json.loads(argv[argv.index("--extract") + 1])
    assert extract == {"target_dtype": "float32"}
    sources = [{"name": "a", "path": "a.jsonl"}]
    cfg = sweep_module.pipeline_config(tmp_path, size, sources, extract=extract)
    plain = sweep_module.pipeline_config(tmp_path, size, sources)
    assert (cfg.extract.target_dtype, plain.extract.target_dtype) == ("float32", "bfloat16")
    assert cfg.extract.dtype == plain.extract.dtype  # only the target's precision changes


def test_each_prompt_is_decoded_plainly_then_speculatively_before_the_next(
        monkeypatch) -> None:
    """Both decodings of a prompt meet the same GPU load; the warm-up runs once."""
    from draftsmith.bench import benchmark
    from draftsmith.config import BenchmarkConfig
    from draftsmith.serve.embedded import Generation

    sweep_module = load("sweep")
    calls: list[tuple[str, int, int]] = []  # (which, prompt, warm-up prompts)

    def plain(runner, prompts, cfg, eos):
        calls.append(("plain", prompts[0][0], cfg.warmup_prompts))
        return [Generation(tokens=[prompts[0][0] + 100], seconds=1.0)]

    def speculative(engine, prompts, cfg, eos, label, greedy):
        calls.append(("speculative", prompts[0][0], cfg.warmup_prompts))
        assert greedy[0].tokens == [prompts[0][0] + 100]
        return {}, [{"prompt": prompts[0][0]}]

    monkeypatch.setattr(benchmark, "plain_decoding", plain)
    monkeypatch.setattr(benchmark, "measure_embedded", speculative)
    engine = type("Engine", (), {"runner": None})()
    rows = sweep_module.paired_decoding(engine, [[7], [8], [9]],
                                        BenchmarkConfig(warmup_prompts=1), eos=0)
    # The greedy output goes with its row, for the replay over the bf16 target's states.
    assert rows == [{"prompt": p, "greedy_tokens": [p + 100]} for p in (7, 8, 9)]
    assert calls == [("plain", 7, 1), ("speculative", 7, 1), ("plain", 8, 0),
                     ("speculative", 8, 0), ("plain", 9, 0), ("speculative", 9, 0)]


def _validation(steps: int) -> dict:
    return {"epoch": 5, "tau": 3.0, "acceptance_replayed": 3.2,
            **{f"full_acc_{j}": 0.5 for j in range(steps)}}


@pytest.mark.parametrize(("steps", "gap"), [(3, 0.6), (15, None)])
def test_the_replay_gap_compares_only_replays_of_the_measured_drafts(steps: int, gap) -> None:
    sweep_module = load("sweep")
    per_prompt = [{"verify_rounds": 10, "round_tokens": 20, "accepted_by_position": [5, 3, 2],
                   "speculative_s": 1.0, "greedy_s": 1.0, "completion_tokens": 20,
                   "plain_tokens": 20, "identical": True}]
    row = sweep_module.summarize("d-48000-e6", {"validation": [_validation(steps)]}, per_prompt)
    assert row["measured_embedded"] == 2.0 and row["replayed"] == 3.2
    assert row["replayed_bf16_states"] is None  # an evaluation without the bf16 replay
    assert sweep_module.summarize("d-48000-e6", {"validation": [_validation(steps)]},
                                  per_prompt, {"rounds": 8, "tokens": 20}
                                  )["replayed_bf16_states"] == 2.5
    assert row["replay_gap"] == gap  # a DFlash block of 16 replays 15 drafts, measured with 3


def test_answer_shape_counts_code_and_the_prose_around_it(random_target_tokenizer) -> None:
    shape_module = load("answer_shape")
    prompt = ("Complete this.\n\n```python\nfrom typing import List\n\n"
              "def f(x: List[int]) -> int:\n    \"\"\"Doc.\"\"\"\n```")
    answer = "Here it is:\n```python\ndef f(x):\n    return sum(x)\n```\nThis sums the list."
    counts = shape_module.shape(random_target_tokenizer, prompt, answer, max_tokens=10_000)
    ids = random_target_tokenizer(answer, add_special_tokens=False)["input_ids"]
    assert counts["tokens"] == len(ids)
    assert counts["prose_before"] > 0 and counts["prose_after"] > 0
    assert counts["prose_between"] == 0
    assert counts["code"] + counts["prose_before"] + counts["prose_after"] == len(ids)
    assert not counts["starts_with_fence"]
    assert not counts["echoes_prompt_code"]  # the prompt's def line has annotations
    assert shape_module.signature_line(prompt) == "def f(x: List[int]) -> int:"
    code_only = shape_module.shape(random_target_tokenizer, prompt, "```python\n"
                                   "def f(x: List[int]) -> int:\n    return 1\n```", 10_000)
    assert code_only["starts_with_fence"] and code_only["echoes_prompt_code"]
    assert code_only["code"] == code_only["tokens"]
    row = shape_module.summarize("s", [counts, code_only])
    assert row["answers_with_prose"] == 0.5 and row["starts_with_fence"] == 0.5


def test_acceptance_by_segment_counts_each_round_under_its_first_drafted_token(
        random_target_tokenizer) -> None:
    segment_module = load("acceptance_by_segment")
    answer = "```python\ndef f(x):\n    return x\n```\nThis returns x unchanged."
    output = random_target_tokenizer(answer, add_special_tokens=False)["input_ids"]
    segments = segment_module.token_segments(random_target_tokenizer, output)
    assert len(segments) == len(output)
    code = segments.count("code")
    assert segments == ["code"] * code + ["prose"] * (len(output) - code) and 0 < code < len(output)
    # The prefill makes output[0]; rounds then cover output[1:] exactly: each round is counted
    # under the segment of the first token it drafts.
    rest = len(output) - 1
    rounds = [2] * ((rest - 1) // 2) + [rest - 2 * ((rest - 1) // 2)]
    counts = segment_module.count_rounds(rounds, segments)
    starts = [1 + sum(rounds[:i]) for i in range(len(rounds))]
    expected_code = sum(segments[s] == "code" for s in starts)
    assert counts["code"]["rounds"] == expected_code
    assert counts["code"]["rounds"] + counts["prose"]["rounds"] == len(rounds)
    assert counts["code"]["tokens"] + counts["prose"]["tokens"] == rest
    row = segment_module.summarize("s", [counts, counts])
    assert row["rounds"] == 2 * len(rounds)
    assert row["acceptance"] == round(rest / len(rounds), 4)
    assert row["code_rounds_share"] == round(expected_code / len(rounds), 4)


def test_exercise_probe_keeps_the_signature_and_docstring_of_a_written_exercise() -> None:
    probe = load("exercises")
    answer = ("Here is one:\n```python\ndef count_vowels(s: str) -> int:\n"
              "    \"\"\"Count the vowels in s.\n\n    >>> count_vowels('abe')\n    2\n"
              "    \"\"\"\n    return sum(c in 'aeiou' for c in s)\n```\nIt counts.")
    assert probe.exercise_head(answer) == (
        "def count_vowels(s: str) -> int:\n    \"\"\"Count the vowels in s.\n\n"
        "    >>> count_vowels('abe')\n    2\n    \"\"\"")
    # A sampled block cut mid-statement still gives the function above the cut.
    cut = "```python\ndef f(x):\n    \"\"\"Twice x.\"\"\"\n    return (x +\n"
    assert probe.exercise_head(cut) == "def f(x):\n    \"\"\"Twice x.\"\"\""
    assert probe.exercise_head("```python\ndef f(x):\n    return x\n```") is None
    assert probe.exercise_head("No code here, only words.") is None


def test_the_starts_instruction_reaches_the_python_function_starts_source(monkeypatch) -> None:
    import draftsmith.data.packaged as packaged
    from draftsmith.config import DataSource

    sweep_module = load("sweep")
    monkeypatch.setattr(packaged, "packaged_code_prompts",
                        lambda kind, limit, instruction=None: (("a", "p"),) * 3)
    plain = sweep_module.sources_for(5)
    explained = sweep_module.sources_for(5, "Then explain it.")
    assert [s["limit"] for s in explained] == [3, 2]
    assert "instruction" not in explained[0] and "instruction" not in plain[1]
    assert DataSource(**explained[1]).instruction == "Then explain it."
    with pytest.raises(SystemExit):  # the kept answers answer the default instruction
        sweep_module.main(["run", "--out", "/nonexistent", "--answers", "a.jsonl",
                           "--starts-instruction", "Then explain it."])
