"""A GPU stage spread over several GPU hosts: which part each host takes, and the proof that
every host sees the run root.

A stage that can be spread (its `spread` entry in the stage table, draftsmith/stages.py) runs
as one part per host, each in its own flow run on that host's worker:
- train: the parts are the nodes of one torchrun job (c10d rendezvous on the first host);
- extract and generate: the parts are ranges of the work (shards, batches of prompts), each
  written by its own host, then joined into the one output a single host would have written.

Before any part starts, the pipeline writes a proof file under the stage's directory on the
run root, named after this dispatch; each part reads it back before it touches anything. A host
that does not see it is not on the shared storage: its part refuses with an error that says so,
instead of training on, or writing into, a directory nobody else reads.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from draftsmith.artifacts import StagePlan, atomic_write_json
from draftsmith.errors import InputError

PARTS_DIR = ".parts"  # beside the stage directories: a retry that clears one leaves it alone


class SharedStorageError(InputError, RuntimeError):
    """A host does not see what another wrote under run_root: the run root is not shared."""


class HostPart(BaseModel):
    """One host's part of a spread stage, as the pipeline hands it to that host's flow run."""

    index: int = Field(..., ge=0, description="This host's place: 0 is the first host.")
    count: int = Field(..., ge=1, description="Hosts the stage is spread over.")
    host: str = Field(..., description="The GPU host block of the host that runs this part.")
    run_id: str = Field(..., min_length=1, description=(
        "Names this dispatch of the stage: the proof file, the rendezvous id, the journals."))
    kind: Literal["node", "range"] = Field(
        "range", description="node (of one torchrun job) or range (of the work).")
    address: str | None = Field(None, description=(
        "How the other hosts reach this one (torchrun --local-addr); None: its host name."))

    @property
    def label(self) -> str:
        """`node 1 of 2`, `range 0 of 3`."""
        return f"{self.kind} {self.index} of {self.count}"

    def where(self) -> str:
        """The part and the host, for messages: `range 1 of 2 (GPU host gpu-b)`."""
        return f"{self.label} (GPU host {self.host})"


def parts_dir(plan: StagePlan) -> Path:
    """Bookkeeping of the stage's parts: the proof files, which ranges finished."""
    return plan.dir.parent / PARTS_DIR / plan.key


def proof_path(plan: StagePlan, run_id: str) -> Path:
    return parts_dir(plan) / f"proof-{run_id}.json"


def new_run_id(plan: StagePlan) -> str:
    return f"{plan.stage}-{plan.key}-{uuid.uuid4().hex[:8]}"


def write_proof(plan: StagePlan) -> str:
    """Write this dispatch's proof file under run_root; returns the run id that names it."""
    run_id = new_run_id(plan)
    atomic_write_json(proof_path(plan, run_id), {"run_id": run_id,
                                                 "written_by": socket.gethostname(),
                                                 "pid": os.getpid(), "time": time.time()})
    return run_id


def check_shared(plan: StagePlan, part: HostPart, run_root: str, wait_s: float,
                 poll_s: float = 0.5) -> None:
    """Read back the pipeline's proof file, waiting up to wait_s for it (a network file
    system may show a new file late); refuse when this host never sees it."""
    path = proof_path(plan, part.run_id)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if json.loads(path.read_text()).get("run_id") == part.run_id:
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        if time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    raise SharedStorageError(
        f"{plan.stage} {part.where()}, hostname {socket.gethostname()}: this host does not "
        f"see {path}, which the pipeline wrote before starting the {part.count} hosts' runs "
        f"(waited {wait_s:g} s). run_root ({run_root}) must be one storage that the cpu worker "
        "and every GPU host mount at the same path (NFS, Lustre, a cloud file system); mount "
        "it on this host, or take the host out of orchestration.gpu_hosts")


def range_bounds(items: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when `items` are cut into `parts` contiguous ranges whose
    sizes differ by at most one (the first ones take the extra items)."""
    size, extra = divmod(items, parts)
    start = index * size + min(index, extra)
    return start, start + size + (1 if index < extra else 0)


def done_path(plan: StagePlan, part: HostPart) -> Path:
    return parts_dir(plan) / f"done-{part.kind}-{part.index}-of-{part.count}.json"


def mark_done(plan: StagePlan, part: HostPart, report: dict) -> None:
    """A range finished: the pipeline does not start it again (see is_done)."""
    atomic_write_json(done_path(plan, part), {"run_id": part.run_id, "host": part.host,
                                              **report})


def is_done(plan: StagePlan, part: HostPart) -> bool:
    return done_path(plan, part).is_file()


def parts_to_run(plan: StagePlan, parts: list[HostPart], coupled: bool) -> list[HostPart]:
    """The parts a dispatch starts: every node of a job (they only run together); the
    ranges that have not finished (a finished range is never run again)."""
    return list(parts) if coupled else [p for p in parts if not is_done(plan, p)]


def forget_parts(plan: StagePlan) -> None:
    """The stage is complete: its parts' bookkeeping is no longer needed."""
    import shutil

    shutil.rmtree(parts_dir(plan), ignore_errors=True)
