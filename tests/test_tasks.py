"""tasks/stages.py: what the Prefect task wrappers add around the engine."""

from __future__ import annotations

import pytest
from prefect.states import Failed

from draftsmith.extract.preflight import DiskSpaceError
from draftsmith.preflight import PreflightError
from tasks.stages import retry_unless_hopeless


@pytest.mark.parametrize("error, retried", [
    (DiskSpaceError("extract will not fit"), False),  # the disk stays full between attempts
    (PreflightError("train: needs about 3 GiB"), False),
    (RuntimeError("CUDA error: an illegal memory access"), True),
    (ConnectionError("endpoint went away"), True),
])
def test_preflight_failures_are_not_retried_other_failures_are(error, retried):
    state = Failed(data=error, message=repr(error))
    assert retry_unless_hopeless(None, None, state) is retried
