"""The target's own SGLang class, plus hidden-state dumps (extract/sglang_dump.py).

Imported by SGLang's model registry in the server's processes, after SGLang has registered its
own models; the architecture, canonical aux ids and dump directory come from the environment
the capture launcher sets.
"""

from __future__ import annotations

from draftsmith.extract.sglang_dump import capture_settings_from_env, install_capture


def _is_writer_rank() -> bool:
    """Tensor-parallel ranks all hold the full hidden states; rank 0 alone writes them."""
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_rank
    except ImportError:
        return True
    return get_tensor_model_parallel_rank() == 0


def sglang_class(arch: str) -> type:
    from sglang.srt.models.registry import ModelRegistry

    found = ModelRegistry.models.get(arch)
    if not isinstance(found, type):
        raise RuntimeError(f"draftsmith capture: SGLang has no model class {arch!r} "
                           f"(known: {sorted(ModelRegistry.models)[:20]}...)")
    return found


def capture_class(arch: str, base: type, layers: list[int], directory: str) -> type:
    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        install_capture(self, layers, directory, _is_writer_rank())

    # Named as the architecture: the class name is the key SGLang's registry overrides.
    return type(arch, (base,), {"__init__": __init__, "__module__": __name__,
                                "__doc__": f"{base.__name__} with draftsmith capture"})


_arch, _layers, _directory = capture_settings_from_env()
EntryClass = [capture_class(_arch, sglang_class(_arch), _layers, _directory)]
