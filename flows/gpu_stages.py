"""One flow per GPU stage, deployed to the gpu work pool (deployments/setup.py). The pipeline
flow dispatches them with run_deployment in distributed mode and passes the descriptors of what
they read. Each takes the GPU host's concurrency slots for the GPUs it uses (strict: a missing
limit is an error, never a silent free-for-all), so two runs never share a GPU."""

from __future__ import annotations

import os
from contextlib import nullcontext
from pathlib import Path

# Engine logs ("draftsmith.*") go to the Prefect run log too; must be set before Prefect loads.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "draftsmith")

from prefect import flow, get_run_logger  # noqa: E402
from prefect.concurrency.sync import concurrency  # noqa: E402

from blocks.gpu_host import GpuHost, concurrency_limit_name  # noqa: E402
from draftsmith.artifacts import Descriptor  # noqa: E402
from draftsmith.config import PipelineConfig  # noqa: E402
from draftsmith.logs import configure_logging  # noqa: E402
from draftsmith.plan import stage_plan  # noqa: E402
from draftsmith.serve import process as child_processes  # noqa: E402
from draftsmith.serve import servers  # noqa: E402
from flows.pipeline import run_stage_task  # noqa: E402


def gpus_in_use(host: GpuHost) -> int:
    """GPUs this flow run may touch: its CUDA_VISIBLE_DEVICES (the pool's job variables), else
    all of the host's."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return host.gpu_count
    return max(1, len([g for g in visible.split(",") if g.strip() and g.strip() != "-1"]))


def run_gpu_stages(stages: list[str], config: PipelineConfig,
                   inputs: dict[str, Descriptor]) -> dict[str, dict]:
    configure_logging(log_file=Path(config.run_root) / "draftsmith.log", console=False)
    logger = get_run_logger()
    host = GpuHost.load(config.orchestration.gpu_host)
    for key, value in host.nccl_env.items():  # the job variables set them; a manual run too
        os.environ.setdefault(key, value)
    slots = gpus_in_use(host)
    limit = concurrency_limit_name(config.orchestration.gpu_host)
    out = dict(inputs)
    results: dict[str, dict] = {}
    logger.info("%s: waiting for %d GPU slot(s) of %s", "+".join(stages), slots, limit)
    try:
        with concurrency(limit, occupy=slots, strict=True) if slots else nullcontext():
            for stage in stages:
                plan = stage_plan(config, stage, out)
                state = run_stage_task(config, stage, plan, out)
                out[stage] = state.result()
                results[stage] = {"state": state.name, "descriptor": out[stage].model_dump()}
                logger.info("stage %s: %s (%s)", stage, state.name, out[stage].path)
    except BaseException:
        if stopped := child_processes.stop_started():
            logger.warning("stopped %d child process(es) this run started", stopped)
        raise
    finally:
        # A kept server outlives this run (the next deploy reuses it while it is ready).
        if not config.deploy.keep_serving:
            servers.stop_all()
    return results


@flow(name="draftsmith-generate")
def generate_flow(config: PipelineConfig, inputs: dict[str, Descriptor]) -> dict[str, dict]:
    """generate on the GPU host: the target answers prompts in process."""
    return run_gpu_stages(["generate"], config, inputs)


@flow(name="draftsmith-extract")
def extract_flow(config: PipelineConfig, inputs: dict[str, Descriptor]) -> dict[str, dict]:
    """extract on the GPU host: the target's aux and final hidden states into shards."""
    return run_gpu_stages(["extract"], config, inputs)


@flow(name="draftsmith-train")
def train_flow(config: PipelineConfig, inputs: dict[str, Descriptor]) -> dict[str, dict]:
    """train on the GPU host: the EAGLE-3 drafter on the hidden-state store."""
    return run_gpu_stages(["train"], config, inputs)


@flow(name="draftsmith-deploy")
def deploy_flow(config: PipelineConfig, inputs: dict[str, Descriptor],
                then_benchmark: bool = False) -> dict[str, dict]:
    """deploy on the GPU host; with then_benchmark, the benchmark too, against the server this
    run started (a served deploy lives in the process that launched it)."""
    return run_gpu_stages(["deploy", "benchmark"] if then_benchmark else ["deploy"], config,
                          inputs)


@flow(name="draftsmith-benchmark")
def benchmark_flow(config: PipelineConfig, inputs: dict[str, Descriptor]) -> dict[str, dict]:
    """benchmark on the GPU host."""
    return run_gpu_stages(["benchmark"], config, inputs)


STAGE_FLOWS = {"generate": generate_flow, "extract": extract_flow, "train": train_flow,
               "deploy": deploy_flow, "benchmark": benchmark_flow}
