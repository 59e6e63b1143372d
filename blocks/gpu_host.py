"""GPU host block: what the gpu work pool's machine offers. Its GPU count sizes the global
concurrency limit GPU stages take, its NCCL environment and visible devices go into the gpu
pool's job variables, and its paths tell where big outputs may go."""

from __future__ import annotations

from prefect.blocks.core import Block
from pydantic import Field


class GpuHost(Block):
    """One GPU machine running the `gpu` pool's process worker."""

    _block_type_name = "draftsmith gpu host"
    _block_type_slug = "draftsmith-gpu-host"
    _description = "A GPU machine for draftsmith's GPU stages: GPUs, NCCL environment, paths."

    gpu_count: int = Field(..., ge=1, description="GPUs the stages may use on this host.")
    visible_devices: str | None = Field(
        None, description="CUDA_VISIBLE_DEVICES for GPU stages; default 0..gpu_count-1.")
    nccl_env: dict[str, str] = Field(
        default_factory=dict,
        description="NCCL settings for multi-GPU stages, e.g. NCCL_SOCKET_IFNAME, NCCL_IB_HCA.")
    scratch_path: str = Field("/tmp", description="Fast local disk for temporary files.")
    shared_path: str = Field(
        ..., description="Storage both pools see; run_root must live under it.")
    address: str | None = Field(
        None, description="With several GPU hosts: how the others reach this one (a host name "
        "they resolve, or an IP), given to torchrun as --local-addr when it trains as one of "
        "several nodes. Default: the host's fully qualified name.")

    def devices(self) -> str:
        return self.visible_devices or ",".join(str(i) for i in range(self.gpu_count))

    def job_env(self) -> dict[str, str]:
        """Environment of every GPU stage's flow run (the gpu deployments' job variables)."""
        return {"CUDA_VISIBLE_DEVICES": self.devices(), "TMPDIR": self.scratch_path,
                **self.nccl_env}


def concurrency_limit_name(host_block: str) -> str:
    """The global concurrency limit of a GPU host: one slot per GPU."""
    return f"gpus-{host_block}"
