"""What the deploy stage needs from a serving engine (SGLang, vLLM), so that one routine
(draftsmith/serve/deploy.py `deploy_server`) reuses, checks, starts and records either.

An engine differs only in these methods: the launch command, how readiness is read from its
endpoints (which includes what "still serving this drafter" means), and what of the launch and of
the server's answers the deployment records.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

from draftsmith.config import DeployConfig, TargetConfig
from draftsmith.errors import InputError
from draftsmith.serve.process import ManagedProcess, ServerLaunch


class LaunchError(InputError, ValueError):
    """A server's launch is refused before anything starts (a drafter in the wrong layout,
    drafting settings the engine cannot run, a flag the engine's parser rejects)."""


LaunchT = TypeVar("LaunchT", bound=ServerLaunch)


class EngineAdapter(ABC, Generic[LaunchT]):
    """One serving engine as the deploy stage drives it, with its kind of launch."""

    name: ClassVar[str]  # deploy.engine's value; deployment.json's engine; the process's name
    label: ClassVar[str]  # how the logs name the engine

    @abstractmethod
    def build_launch(self, cfg: DeployConfig, target_cfg: TargetConfig,
                     drafter_dir: str | Path | None, family: str = "llama",
                     model_path: str | None = None) -> LaunchT:
        """The checked launch command; raises LaunchError for what the engine would refuse
        (or get wrong) only after loading weights."""

    @abstractmethod
    def wait_until_ready(self, launch: LaunchT, cfg: DeployConfig,
                         process: ManagedProcess | None = None,
                         timeout_s: float | None = None) -> dict[str, Any]:
        """Every readiness check, the drafter the server serves among them; returns what the
        server reported that the deployment keeps. Raises ReadinessError naming the check
        (ServerInstallError, not retried, for a server that exited on a missing module)."""

    def start(self, launch: LaunchT, cfg: DeployConfig, log_file: Path,
              timeout_s: float) -> tuple[ManagedProcess, dict[str, Any]]:
        """Start the server in its own process group and wait for readiness; on any failure
        the whole group is stopped."""
        return start_until_ready(launch, log_file, self.name,
                                 lambda process: self.wait_until_ready(launch, cfg, process,
                                                                       timeout_s))

    @abstractmethod
    def deployment(self, launch: LaunchT, cfg: DeployConfig, target_path: str,
                   family: str) -> dict[str, Any]:
        """deployment.json: how the server was started and with what (fingerprinted)."""

    @abstractmethod
    def figures(self, launch: LaunchT, cfg: DeployConfig,
                reported: dict[str, Any]) -> dict[str, Any]:
        """The deploy stage's figures, which the benchmark stage reads."""


def start_until_ready(launch: ServerLaunch, log_file: str | Path, name: str,
                      wait_until_ready: Callable[[ManagedProcess], dict[str, Any]],
                      ) -> tuple[ManagedProcess, dict[str, Any]]:
    """Start `launch` in its own process group, its output streamed to `log_file` and the run
    log, and return it with what `wait_until_ready(process)` returns; on any failure the whole
    group is stopped. A port that another program holds is named before anything starts:
    the benchmark starts servers one after another on the deploy port, and a program that
    takes it in between would otherwise answer the readiness checks itself."""
    from draftsmith.serve.holders import require_free_port

    require_free_port("deploy", launch.host, launch.port)
    process = ManagedProcess(launch.argv, log_file, launch.env, name=name)
    process.start()
    try:
        return process, wait_until_ready(process)
    except BaseException:
        process.stop()
        raise
