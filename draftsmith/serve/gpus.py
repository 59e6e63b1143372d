"""Preflight: are the GPUs a stage will use free? (The seeds found a system service holding all
eight GPUs only after a failed start.) A busy GPU is named with its process, the server that
process belongs to and how to stop it (draftsmith/serve/holders.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from draftsmith.errors import TransientError
from draftsmith.serve.holders import Holder, how_to_free, server_root


@dataclass
class GpuProcess:
    gpu: str
    pid: int
    name: str
    used_mib: int


class GpusBusyError(TransientError, RuntimeError):
    pass


SERVICES_HINT = ("a leftover job; a system service such as nv-hostengine is stopped with "
                 "`systemctl stop`")


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


def holder_line(process: GpuProcess, holder: Holder) -> str:
    """`GPU 0: pid 5121 python3 (70000 MiB)`, then what the process is: its command line, or
    the server it is a worker of."""
    line = f"  GPU {process.gpu}: pid {process.pid} {process.name} ({process.used_mib} MiB)"
    if holder.pid != process.pid:
        return f"{line}, a worker of {holder.describe()}"
    if holder.command is not None and holder.command != process.name:
        return f"{line}: {holder.describe().split(': ', 1)[1]}"
    return line


def busy_gpus_message(who: str, gpus: list[str] | None, busy: list[GpuProcess]) -> str:
    holders = {p.pid: server_root(p.pid) for p in busy}
    listing = "\n".join(holder_line(p, holders[p.pid]) for p in busy)
    which = "all GPUs" if gpus is None else f"GPUs {','.join(gpus)}"
    advice = how_to_free(list(holders.values()), SERVICES_HINT)
    return (f"{who}: {which} must be free, but other processes hold them:\n{listing}\n"
            f"{advice}; or give this stage other GPUs with CUDA_VISIBLE_DEVICES (the gpu pool's "
            "job variables)")


def require_free_gpus(gpus: list[str] | None, who: str = "deploy") -> None:
    """Raise naming the processes that hold any of `gpus` (all GPUs when None), the servers
    they belong to and how to stop them; this process's own use does not count."""
    processes = gpu_processes()
    if processes is None:  # no nvidia-smi: nothing to ask (CPU hosts)
        return
    busy = [p for p in processes
            if p.pid != os.getpid() and (gpus is None or p.gpu in gpus)]
    if busy:
        raise GpusBusyError(busy_gpus_message(who, gpus, busy))
