"""A GPU host's concurrency slots, held by a GPU stage's flow run for as long as it works.

Slots are leased from the Prefect server (a global concurrency limit per GPU host, one slot per
GPU: deployments/setup.py), as Prefect's own `concurrency()` leases them, with two differences
that matter when the world around a run fails (docs/faults.md):

- The lease is renewed for as long as the stage works, whatever the API does meanwhile: a
  renewal that finds the Prefect API away is tried again and logged, never a reason to stop
  a GPU stage (Prefect's own gives up after three tries, and then stops the stage).
- A flow run killed -9 (the OOM killer, a reboot) cannot release its slots; Prefect frees them
  only when their lease expires, minutes later, and until then the rerun waits. Each lease is
  recorded under `<run_root>/.locks/gpu-leases/`, and the next GPU stage first releases the
  leases of flow runs that have ended (Crashed, Failed, Cancelled) without releasing them.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from uuid import UUID

from draftsmith.artifacts import atomic_write_json
from draftsmith.runlock import LOCKS_DIR
from tasks.api_outage import api_call, is_outage

log = logging.getLogger("draftsmith.gpu_slots")

LEASES_DIR = "gpu-leases"
LEASE_S = 300.0  # Prefect's default lease; renewed every third of it
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


class GpuSlotsError(RuntimeError):
    pass


def ledger(run_root: str | Path) -> Path:
    return Path(run_root) / LOCKS_DIR / LEASES_DIR


def release_left_behind(run_root: str | Path, outage_s: float) -> int:
    """Release the slots of flow runs that ended without releasing them; returns how many
    leases were released."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    released = 0
    for record_path in sorted(ledger(run_root).glob("*.json")):
        try:
            record = json.loads(record_path.read_text())
        except (OSError, ValueError):
            continue

        def ended(record=record) -> str | None:
            """The holder's final state name, or None while it runs."""
            with get_client(sync_client=True) as client:
                try:
                    state = client.read_flow_run(UUID(record["flow_run"])).state
                except ObjectNotFound:
                    return "deleted"
            return state.name if state is not None and state.type.value in FINAL else None

        how = api_call(ended, "GPU slots: reading the flow run that held them", outage_s)
        if how is None:
            continue

        def release(record=record) -> None:
            with get_client(sync_client=True) as client:
                client.release_concurrency_slots_with_lease(UUID(record["lease_id"]))

        api_call(release, "GPU slots: releasing a lease left behind", outage_s)
        record_path.unlink(missing_ok=True)
        released += 1
        log.warning("released %d GPU slot(s) of %s held by flow run %s, which ended %s "
                    "without releasing them (killed?)", record["slots"], record["limit"],
                    record["flow_run"], how)
    return released


def _acquire(limit: str, slots: int, holder: UUID | None, outage_s: float) -> UUID:
    """Wait for `slots` slots of `limit`; returns the lease's id."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder
    from prefect.client.schemas.responses import ConcurrencyLimitWithLeaseResponse

    owner = ConcurrencyLeaseHolder(type="flow_run", id=holder) if holder else None

    def once():
        with get_client(sync_client=True) as client:
            return client.increment_concurrency_slots_with_lease(
                names=[limit], slots=slots, mode="concurrency", lease_duration=LEASE_S,
                holder=owner)

    while True:
        try:
            response = api_call(once, f"GPU slots of {limit}", outage_s)
        except Exception as err:
            status = getattr(getattr(err, "response", None), "status_code", None)
            if status != 423:  # 423 Locked: every slot is taken; its Retry-After says when
                raise
            wait = float(err.response.headers.get("Retry-After", 1.0))
            time.sleep(min(max(wait, 0.5), 30.0))
            continue
        lease = ConcurrencyLimitWithLeaseResponse.model_validate(response.json())
        if not lease.limits:
            raise GpuSlotsError(
                f"the concurrency limit {limit!r} does not exist on this Prefect server; "
                "create it with `draftsmith prefect setup` (it sizes it to the host's GPUs)")
        return lease.lease_id


class _Renewal:
    """Renews the lease every third of its length until stopped; an unreachable API is
    logged (once, and when it is back) and tried again, never raised."""

    def __init__(self, lease_id: UUID, limit: str):
        self.lease_id, self.limit = lease_id, limit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease {limit}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from prefect.client.orchestration import get_client

        failing = False
        while not self._stop.wait(LEASE_S / 3 if not failing else 10.0):
            try:
                with get_client(sync_client=True) as client:
                    client.renew_concurrency_lease(self.lease_id, LEASE_S)
                if failing:
                    log.warning("GPU slots of %s: lease renewed again", self.limit)
                failing = False
            except Exception as err:  # noqa: BLE001 - the stage goes on; logged
                if not failing:
                    log.warning("GPU slots of %s: the lease could not be renewed (%s: %s)%s; "
                                "the stage goes on and renewal is tried again", self.limit,
                                type(err).__name__, err,
                                "" if is_outage(err) else " (it may have expired)")
                failing = True

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


@contextmanager
def gpu_slots(limit: str, slots: int, run_root: str | Path, outage_s: float) -> Iterator[None]:
    """Hold `slots` slots of the GPU host's limit for the block (none: nothing to hold)."""
    if not slots:
        yield
        return
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    release_left_behind(run_root, outage_s)
    run_id = flow_run.get_id()
    lease_id = _acquire(limit, slots, UUID(run_id) if run_id else None, outage_s)
    record = ledger(run_root) / f"{lease_id}.json"
    if run_id:
        atomic_write_json(record, {"lease_id": str(lease_id), "flow_run": run_id,
                                   "limit": limit, "slots": slots})
    renewal = _Renewal(lease_id, limit)
    try:
        yield
    finally:
        renewal.stop()

        def release() -> None:
            with get_client(sync_client=True) as client:
                client.release_concurrency_slots_with_lease(lease_id)

        api_call(release, f"GPU slots of {limit}: releasing them", outage_s)
        with suppress(OSError):
            record.unlink(missing_ok=True)
