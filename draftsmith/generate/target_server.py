"""The target served by vLLM for the generate stage (generate.backend: vllm): started once, the
first time the stage needs it (the prompts the target writes, then the answers), and stopped
when the stage ends. Also: running the HTTP clients' coroutines from any thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from pathlib import Path

from draftsmith.artifacts import Descriptor
from draftsmith.config import EndpointConfig, GenerateConfig, TargetConfig

log = logging.getLogger(__name__)

QUIET_ACCESS_LOG = "--disable-uvicorn-access-log"


def run_async(coro):
    """asyncio.run, also from a thread that already runs an event loop (some task runners)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


class TargetServer:
    """`vllm serve` of the target alone (generate.vllm), started the first time the stage
    needs it (prompts the target writes, then the answers: one start for both) and stopped
    when the stage ends."""

    def __init__(self, cfg: GenerateConfig, target_cfg: TargetConfig, target: Descriptor,
                 log_dir: Path):
        self.cfg, self.target_cfg, self.target, self.log_dir = cfg, target_cfg, target, log_dir
        self._process = None
        self._endpoint: EndpointConfig | None = None

    def launch(self):
        """The `vllm serve` command: the target alone, without the access log's line per
        request (a run sends tens of thousands; vLLM's periodic stats line says the progress)."""
        from draftsmith.config import DeployConfig
        from draftsmith.serve.vllm_launch import build_launch

        server = self.cfg.vllm
        extra_args = list(server.extra_args)
        if QUIET_ACCESS_LOG not in extra_args:
            extra_args.append(QUIET_ACCESS_LOG)
        deploy = DeployConfig(engine="vllm", host=server.host, port=server.port,
                              env=server.env, extra_args=extra_args,
                              startup_timeout_s=server.startup_timeout_s)
        return build_launch(deploy, self.target_cfg, None, self.target.figures["family"],
                            self.target.path)

    def endpoint(self) -> EndpointConfig:
        if self._endpoint is not None:
            return self._endpoint
        from draftsmith.config import Partition
        from draftsmith.serve.vllm_launch import start_vllm

        server = self.cfg.vllm
        launch = self.launch()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log.info("generate: starting vLLM for the target at %s (log %s)", launch.url,
                 self.log_dir / "vllm-server.log")
        self._process, _ = start_vllm(launch, self.log_dir / "vllm-server.log",
                                      "vllm-generate", server.startup_timeout_s)
        self._endpoint = EndpointConfig(
            base_url=f"{launch.url}/v1", model=launch.model,
            partitions=[Partition(max_prompt_tokens=1 << 30, concurrency=server.concurrency)])
        return self._endpoint

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()
        self._process = self._endpoint = None
