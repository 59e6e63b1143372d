"""Preflight: are the GPUs a stage will use free? (The seeds found a system service holding all
eight GPUs only after a failed start.)"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from draftsmith.errors import TransientError


@dataclass
class GpuProcess:
    gpu: str
    pid: int
    name: str
    used_mib: int


class GpusBusyError(TransientError, RuntimeError):
    pass


def gpu_processes() -> list[GpuProcess] | None:
    """Compute processes on this host's GPUs, or None when there is no nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
         "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True, timeout=60,
    ).stdout
    uuids = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                           capture_output=True, text=True, check=True, timeout=60).stdout
    index_of = {u.strip(): i.strip() for i, u in (line.split(",") for line in uuids.splitlines()
                                                  if line.strip())}
    processes = []
    for line in out.splitlines():
        if not line.strip():
            continue
        uuid, pid, name, used = (part.strip() for part in line.split(","))
        processes.append(GpuProcess(index_of.get(uuid, uuid), int(pid), name,
                                    int(used) if used.isdigit() else 0))
    return processes


def require_free_gpus(gpus: list[str] | None) -> None:
    """Raise naming the processes that hold any of `gpus` (all GPUs when None)."""
    processes = gpu_processes()
    if processes is None:
        return
    busy = [p for p in processes if gpus is None or p.gpu in gpus]
    if busy:
        listing = "\n".join(f"  GPU {p.gpu}: pid {p.pid} {p.name} ({p.used_mib} MiB)"
                            for p in busy)
        raise GpusBusyError(f"GPUs in use by other processes:\n{listing}\nstop them, or choose "
                            "other GPUs with CUDA_VISIBLE_DEVICES")
