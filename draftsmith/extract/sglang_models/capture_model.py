"""The target's own SGLang class, plus hidden-state dumps (extract/sglang_dump.py).

Imported by SGLang's model registry in the server's processes, while the registry module is
still being built: with SGLANG_EXTERNAL_MODEL_PACKAGE set, SGLang 0.5.23 imports only this
package, into an empty registry, and loads its own models later (0.5.9 loaded them first).
So the base class comes from SGLang's own model scan, `import_model_classes`, not from the
registry. An import error here is only logged by SGLang, as a warning, and the stock class is
served instead: the capture probe (sglang_backend.probe_capture) turns that into an error.
The architecture, canonical aux ids and dump directory come from the environment the capture
launcher sets.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from draftsmith.extract.sglang_dump import capture_settings_from_env, install_capture

log = logging.getLogger(__name__)


def tensor_parallel_rank_getter() -> Callable[[], int]:
    """This process's tensor-parallel rank, read the way the installed SGLang exposes it."""
    try:
        from sglang.srt.runtime_context import get_parallel  # SGLang 0.5.23
    except ImportError:
        from sglang.srt.distributed import get_tensor_model_parallel_rank  # older 0.5.x

        return get_tensor_model_parallel_rank
    return lambda: get_parallel().tp_rank


def sglang_class(arch: str) -> type:
    from sglang.srt.models.registry import import_model_classes

    found = import_model_classes("sglang.srt.models").get(arch)
    if not isinstance(found, type):
        raise RuntimeError(f"draftsmith capture: SGLang has no model class {arch!r} "
                           "(DRAFTSMITH_CAPTURE_ARCH); its models import with errors on this "
                           "host, or the architecture is not one SGLang serves")
    return found


def capture_class(arch: str, base: type, layers: list[int], directory: str,
                  tp_rank: Callable[[], int]) -> type:
    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        # Tensor-parallel ranks all hold the full hidden states; rank 0 alone writes them.
        install_capture(self, layers, directory, tp_rank() == 0)

    # Named as the architecture: the class name is the key SGLang's registry overrides.
    return type(arch, (base,), {"__init__": __init__, "__module__": __name__,
                                "__doc__": f"{base.__name__} with draftsmith capture"})


def _entry_classes() -> list[type]:
    try:
        arch, layers, directory = capture_settings_from_env()
        cls = capture_class(arch, sglang_class(arch), layers, directory,
                            tensor_parallel_rank_getter())
    except Exception:
        # SGLang reports this as a warning only; say it loudly in the server's log.
        log.exception("draftsmith capture: the capture package could not be loaded")
        raise
    log.info("draftsmith capture: %s registered (captures outputs of layers %s)", arch, layers)
    return [cls]


EntryClass = _entry_classes()
