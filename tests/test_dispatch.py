"""Which stages go to the gpu pool, how new data enters a run, the new-data event."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deployments.setup import DATASET_EVENT, dataset_event
from draftsmith.config import ConfigError, PipelineConfig, parse_config, with_source
from flows import dispatch
from tests.conftest import REPO


def config(**sections) -> PipelineConfig:
    return PipelineConfig.model_validate({
        "data": {"sources": [{"name": "a", "path": "/data/a.jsonl"}]}, **sections})


def test_local_mode_runs_everything_in_process():
    cfg = config()
    assert not any(dispatch.is_remote(cfg, s) for s in ("generate", "extract", "train"))


def test_distributed_mode_sends_the_gpu_stages_to_the_gpu_pool():
    cfg = config(orchestration={"mode": "distributed"})
    remote = [s for s in ("generate", "merge", "extract", "train", "export", "deploy",
                          "benchmark") if dispatch.is_remote(cfg, s)]
    assert remote == ["generate", "extract", "train", "deploy", "benchmark"]
    assert dispatch.deployment_name(cfg, "extract") == "draftsmith-extract/gpu"
    # Answering prompts over HTTP needs no GPU.
    http = config(orchestration={"mode": "distributed", "endpoint_block": "kimi"},
                  generate={"backend": "openai"})
    assert not dispatch.is_remote(http, "generate")


def test_generate_goes_where_its_engine_is():
    """The gpu pool when generate starts an engine (transformers, vllm) or talks to one on
    the GPU host (a loopback URL resolves where the stage runs); generate.pool overrides."""
    def remote(**generate) -> bool:
        return dispatch.is_remote(config(orchestration={"mode": "distributed"},
                                         generate=generate), "generate")

    def endpoint(url: str) -> dict:
        return {"backend": "openai", "endpoint": {"base_url": url, "model": "m"}}

    assert remote(backend="transformers") and remote(backend="vllm")
    for url in ("http://127.0.0.1:30000/v1", "http://localhost:8000/v1", "http://[::1]:30000/v1",
                "http://0.0.0.0:30000/v1", "https://127.0.0.2/v1"):
        assert remote(**endpoint(url)), url
    for url in ("http://gpu-host:30000/v1", "https://openrouter.ai/api/v1",
                "http://10.0.0.7:30000/v1"):
        assert not remote(**endpoint(url)), url
    assert remote(**endpoint("http://gpu-host:30000/v1"), pool="gpu")
    assert not remote(**endpoint("http://127.0.0.1:30000/v1"), pool="cpu")
    assert not remote(backend="vllm", pool="cpu")
    from draftsmith.stages import generate_pool

    pool, why = generate_pool(config(generate=endpoint("http://127.0.0.1:30000/v1")))
    assert pool == "gpu" and "loopback" in why and "generate.pool=cpu" in why


def test_a_served_deploy_and_its_benchmark_run_in_one_child_run():
    from draftsmith.artifacts import external_descriptor
    from draftsmith.plan import RunPlan
    from draftsmith.stages import get

    def group(cfg, selected):
        target = external_descriptor("target", "/t", "f")
        return RunPlan(cfg, target, selected).group_of(get("deploy"))

    every = ["deploy", "benchmark"]
    served = config(orchestration={"mode": "distributed"}, deploy={"engine": "sglang"})
    assert group(served, every) == ["deploy", "benchmark"]
    assert group(served, ["deploy"]) == ["deploy"]
    embedded = config(orchestration={"mode": "distributed"})
    assert group(embedded, every) == ["deploy"]


def test_new_data_replaces_a_named_source_or_adds_one():
    cfg = config()
    assert with_source(cfg, "a", "/new/a.jsonl").data.sources[0].path == "/new/a.jsonl"
    added = with_source(cfg, "b", "/new/b.jsonl").data.sources
    assert [(s.name, s.path) for s in added] == [("a", "/data/a.jsonl"), ("b", "/new/b.jsonl")]
    assert cfg.data.sources[0].path == "/data/a.jsonl"  # the deployment's config is untouched


def test_orchestration_and_retention_keys_are_checked():
    with pytest.raises(ConfigError, match="orchestration.mode"):
        parse_config({"data": {"sources": [{"name": "a", "path": "x"}]},
                      "orchestration": {"mode": "cluster"}})


def test_setup_warns_of_servers_that_can_hang_creating_automations():
    from deployments.setup import automation_deadlock_warning

    warning = automation_deadlock_warning("3.7.7", 2)
    assert "3.7.7" in warning and "PrefectHQ/prefect#23055" in warning
    assert "--no-rerun-on-new-data" in warning
    assert automation_deadlock_warning("3.8.6", 2) is None
    assert automation_deadlock_warning("3.7.7", 0) is None  # it creates none
    assert automation_deadlock_warning("3.9.0.dev2", 1) is None
    assert automation_deadlock_warning("unknown", 1) is None


def test_the_new_data_event_names_the_file_its_source_and_content(tmp_path):
    data = tmp_path / "traces.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    event = dataset_event(data)
    assert event["event"] == DATASET_EVENT
    assert event["resource"]["prefect.resource.id"] == "draftsmith.dataset.traces"
    assert event["payload"]["path"] == str(data) and event["payload"]["source"] == "traces"
    assert len(event["payload"]["sha256"]) == 64


def test_notify_new_data_refuses_a_missing_file(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "draftsmith.cli", "prefect", "notify-new-data",
                           str(tmp_path / "nope.jsonl")], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 2 and "no such dataset file" in " ".join(proc.stderr.split())


def test_the_endpoint_block_produces_generate_endpoint_and_names_its_secret():
    from blocks.endpoint import InferenceEndpoint
    from draftsmith.config import GenerateConfig

    partitions = [{"max_prompt_tokens": 2048, "concurrency": 64, "max_tokens": 4096}]
    block = InferenceEndpoint(base_url="http://gpu-host:30000/v1", model="kimi-k2.5",
                              api_key_secret="kimi-api-key", partitions=partitions)
    assert block.endpoint_config() == {
        "base_url": "http://gpu-host:30000/v1", "model": "kimi-k2.5", "api_key_env": None,
        "api_key_secret": "kimi-api-key", "timeout_s": 600.0, "max_retries": 6,
        "partitions": partitions}
    # What the block produces is a valid generate.endpoint section.
    generate = GenerateConfig(backend="openai", endpoint=block.endpoint_config())
    assert generate.endpoint.api_key_secret == "kimi-api-key"
    assert generate.endpoint.partitions[0].concurrency == 64


def test_the_gpu_host_block_pins_devices_and_nccl_for_gpu_runs():
    from blocks.gpu_host import GpuHost

    host = GpuHost(gpu_count=8, nccl_env={"NCCL_IB_HCA": "mlx5"}, scratch_path="/nvme",
                   shared_path="/mnt/shared")
    assert host.job_env() == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "TMPDIR": "/nvme",
                              "NCCL_IB_HCA": "mlx5"}


def test_several_gpu_hosts_each_have_their_deployments_and_train_needs_enough(tmp_path):
    from draftsmith.artifacts import plan_stage
    from draftsmith.plan import Step
    from draftsmith.stages import get

    hosts = {"mode": "distributed", "gpu_hosts": ["gpu-a", "gpu-b"]}
    cfg = config(orchestration=hosts)
    assert dispatch.deployment_name(cfg, "train") == "draftsmith-train/gpu-a"
    assert dispatch.deployment_name(cfg, "extract", "gpu-b") == "draftsmith-extract/gpu-b"
    assert dispatch.is_spread(cfg, get("extract")) and dispatch.is_spread(cfg, get("generate"))
    assert not dispatch.is_spread(cfg, get("train"))  # train.nnodes=1: one host
    assert not dispatch.is_spread(config(), get("extract"))  # local mode: all here
    three = config(orchestration=hosts, train={"nnodes": 3, "rdzv_endpoint": "gpu-a:29400"})
    plan = plan_stage(tmp_path, "train", {}, [])
    with pytest.raises(ConfigError, match=r"train: train.nnodes=3 but orchestration.gpu_hosts "
                                          r"names 2 GPU host block\(s\) \(gpu-a, gpu-b\)"):
        dispatch.run_parts(three, Step(get("train"), plan, {}, "test"))
    assert not plan.dir.exists()  # refused before anything was prepared


def test_the_pipeline_form_selects_the_hosts_setup_registered(tmp_path):
    from deployments.setup import SetupOptions, pipeline_parameters
    from draftsmith.config import apply_overrides

    options = SetupOptions(hosts=["gpu-a", "gpu-b"])
    parameters = pipeline_parameters(tmp_path / "kimi.yaml", ["train.nnodes=2"], options)
    assert parameters["overrides"] == [
        "orchestration.mode=distributed", "orchestration.gpu_host=gpu-a",
        "orchestration.gpu_hosts=[gpu-a,gpu-b]", "train.nnodes=2"]
    raw = apply_overrides({"data": {"sources": [{"name": "a", "path": "x"}]},
                           "train": {"rdzv_endpoint": "gpu-a:29400"}}, parameters["overrides"])
    assert parse_config(raw).orchestration.hosts() == ["gpu-a", "gpu-b"]
