"""Inside an SGLang capture server: write each prefilled request's aux and final hidden states
to its own binary file, named by its request id.

No SGLang file is edited. SGLang loads model classes from the package named by
SGLANG_EXTERNAL_MODEL_PACKAGE (draftsmith.extract.sglang_models), which overrides the target's
architecture with a subclass of SGLang's own class whose only addition is `install_capture`:

- it turns on SGLang's EAGLE-3 aux capture itself, with `layers_to_capture` = the canonical
  ids + 1 (SGLang appends the INPUT of each listed layer, i.e. the output of the layer before;
  docs/concepts.md, "Aux layer ids"). The family-specific id rules of
  `set_eagle3_layers_to_capture` are bypassed on purpose: the draft config is not involved
  here, so canonical id i always means the output of decoder layer i.
- it wraps the model's `logits_processor`, which SGLang calls with the full-length final hidden
  states (after the final norm) and the aux states of every token of the batch, before it
  prunes to the last token of each request. The aux states come in either of SGLang's two
  forms (sglang/srt/layers/aux_hidden_states.py): a list of K [N, H] tensors (Llama, Qwen,
  GPT-OSS) or one packed [N, K*H] tensor (DeepseekV2/V3 and so Kimi-K2.5, DeepSeek-V4, Kimi-K3:
  AuxHiddenStatePacker). The tokens are `input_ids`, or `forward_batch.input_ids` when a
  multimodal wrapper (Kimi-K2.5 through mm_utils) calls the language model with
  input_ids=None.

Per extend batch the wrapper splits the tokens by `extend_seq_lens_cpu` and names each dump by
`forward_batch.rids` (SGLang >= 0.5 passes request ids down); without rids it names them by a
hash of the request's tokens. Never by a counter: concurrent requests are batched in any order.
The dump holds the request's token ids too, and the client checks them against what it sent.
Device-to-host copies are asynchronous and a writer thread does the disk work, so the
scheduler's forward never waits on the file system.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import re
import threading
from pathlib import Path
from typing import Any

import torch

from draftsmith.extract.store import write_safetensors

log = logging.getLogger(__name__)

ENV_LAYERS = "DRAFTSMITH_CAPTURE_LAYERS"
ENV_DIR = "DRAFTSMITH_CAPTURE_DIR"
ENV_ARCH = "DRAFTSMITH_CAPTURE_ARCH"
_SAFE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def content_key(input_ids: list[int] | torch.Tensor) -> str:
    ids = torch.as_tensor(input_ids, dtype=torch.int64).cpu().contiguous()  # [T]
    return "tok-" + hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:32]


def dump_name(rid: str | None, input_ids) -> str:
    if rid is not None and _SAFE.match(rid):
        return f"rid-{rid}.safetensors"
    return f"{content_key(input_ids)}.safetensors"


def packed_aux(aux: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
    """[N, K*H] from either of SGLang's forms: already packed, or K tensors of [N, H]."""
    if isinstance(aux, torch.Tensor):
        return aux  # AuxHiddenStatePacker's buffer; list() would split it into rows
    return torch.cat(list(aux), dim=-1)  # [N, K*H]


class DumpWriter:
    """Splits an extend batch into per-request dumps; disk work on a background thread.
    `info` (what the server captures: layers, model class) goes into every dump's metadata,
    so the client can check a dump came from the capture it configured."""

    def __init__(self, directory: str | Path, max_pending: int = 64,
                 info: dict[str, str] | None = None):
        self.directory = Path(directory)
        self.info = dict(info or {})
        self.directory.mkdir(parents=True, exist_ok=True)
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread = threading.Thread(target=self._run, daemon=True, name="draftsmith-dumps")
        self._thread.start()

    def write_batch(self, input_ids: torch.Tensor, final: torch.Tensor,
                    aux: torch.Tensor | list[torch.Tensor], seq_lens: list[int],
                    prefix_lens: list[int] | None, rids: list[str] | None) -> None:
        """input_ids [N], final [N, H], aux [N, K*H] or K x [N, H]: the tokens of all requests
        in order."""
        aux_cat = packed_aux(aux)  # [N, K*H]
        on_gpu = final.is_cuda
        host = [t.to("cpu", non_blocking=on_gpu) for t in (input_ids, aux_cat, final)]
        event = None
        if on_gpu:
            event = torch.cuda.Event()
            event.record()
        self._queue.put((event, host, list(seq_lens), list(prefix_lens or [0] * len(seq_lens)),
                         list(rids) if rids is not None else None))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._write(*item)
            except Exception:  # a failed dump must not kill the server; the client times out
                log.exception("draftsmith capture: writing dumps failed")

    def _write(self, event, host, seq_lens, prefix_lens, rids) -> None:
        if event is not None:
            event.synchronize()
        input_ids, aux, final = host
        start = 0
        for i, n in enumerate(seq_lens):
            ids = input_ids[start:start + n]  # [n]
            rid = rids[i] if rids is not None else None
            write_safetensors(
                self.directory / dump_name(rid, ids),
                {"input_ids": ids.to(torch.int64).clone(),
                 "aux": aux[start:start + n].clone(), "final": final[start:start + n].clone()},
                metadata={**self.info, "rid": rid or "", "prefix_len": str(prefix_lens[i])})
            start += n

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


class CaptureLogitsProcessor(torch.nn.Module):
    """Stands in for the model's logits processor: dumps the extend batch, then delegates."""

    def __init__(self, inner: torch.nn.Module, writer: DumpWriter, is_writer_rank: bool = True):
        super().__init__()
        self.inner, self.writer, self.is_writer_rank = inner, writer, is_writer_rank

    def forward(self, input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states=None,
                *args: Any, **kwargs: Any):
        mode = forward_batch.forward_mode
        if (self.is_writer_rank and aux_hidden_states is not None and mode.is_extend()
                and not getattr(mode, "is_target_verify", lambda: False)()):
            tokens = input_ids if input_ids is not None else forward_batch.input_ids  # [N]
            self.writer.write_batch(tokens, hidden_states, aux_hidden_states,
                                    forward_batch.extend_seq_lens_cpu,
                                    getattr(forward_batch, "extend_prefix_lens_cpu", None),
                                    getattr(forward_batch, "rids", None))
        return self.inner(input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states,
                          *args, **kwargs)


def capture_owner(model: torch.nn.Module) -> torch.nn.Module:
    """The (sub)module that owns `logits_processor` and a decoder with `.layers`: the model
    itself for Llama/Qwen/DeepSeek, the language model inside multimodal wrappers."""
    for module in model.modules():
        if hasattr(module, "logits_processor") and hasattr(getattr(module, "model", None),
                                                           "layers"):
            return module
    raise TypeError(f"{type(model).__name__}: no submodule with a logits_processor and "
                    ".model.layers; draftsmith cannot capture this architecture")


def install_capture(model: torch.nn.Module, canonical_ids: list[int], directory: str | Path,
                    is_writer_rank: bool = True) -> DumpWriter:
    owner = capture_owner(model)
    num_layers = len(owner.model.layers)
    bad = [i for i in canonical_ids if not 0 <= i < num_layers - 1]
    if bad:
        raise ValueError(f"{ENV_LAYERS}: ids {bad} cannot be captured by SGLang, which records "
                         f"the input of layer i+1 (0 <= i < {num_layers - 1})")
    inputs_of = [i + 1 for i in canonical_ids]
    owner.capture_aux_hidden_states = True
    owner.model.capture_aux_hidden_states = True
    if hasattr(owner.model, "set_eagle3_layers_to_capture"):  # Qwen3-MoE keeps its own list
        owner.model.set_eagle3_layers_to_capture(inputs_of)
    else:
        owner.model.layers_to_capture = inputs_of
    writer = DumpWriter(directory, info={
        "layers_to_capture": ",".join(map(str, inputs_of)), "num_layers": str(num_layers),
        "model": type(owner).__name__})
    owner.logits_processor = CaptureLogitsProcessor(owner.logits_processor, writer,
                                                    is_writer_rank)
    log.info("draftsmith capture: %s captures outputs of layers %s (inputs of %s) into %s",
             type(owner).__name__, canonical_ids, inputs_of, directory)
    return writer


def capture_settings_from_env() -> tuple[str, list[int], str]:
    try:
        arch = os.environ[ENV_ARCH]
        layers = [int(x) for x in os.environ[ENV_LAYERS].split(",")]
        directory = os.environ[ENV_DIR]
    except (KeyError, ValueError) as err:
        raise RuntimeError(f"draftsmith capture server: {ENV_ARCH}, {ENV_LAYERS} (comma-separated "
                           f"ints) and {ENV_DIR} must be set ({err})") from None
    return arch, layers, directory
