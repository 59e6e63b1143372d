"""A vLLM KV connector that writes each request's captured hidden states to a file, on CPU too.

vLLM 0.32 extracts hidden states for speculator training with its `extract_hidden_states`
speculative method: the target's forward records the states of the layers named by
`eagle_aux_hidden_state_layer_ids` (id i = the input of decoder layer i; id L = the last
layer's output, before the final norm) into a cache-only KV layer, and a KV connector reads
them out when the request finishes. Its example connector (`ExampleHiddenStatesConnector`)
copies them on a CUDA stream with CUDA events, which a CPU worker does not have. This subclass
keeps vLLM's scheduling side as it is and replaces only the copy-out: a plain synchronous copy,
then an atomic write (temp name, rename), so a reader never sees half a file.

Loaded by vLLM from its kv_transfer_config: {"kv_connector": "DraftsmithHiddenStatesConnector",
"kv_connector_module_path": "draftsmith.extract.vllm_connector", "kv_role": "kv_producer",
"kv_connector_extra_config": {"shared_storage_path": DIR, "use_synchronization_lock": false}}.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Written:
    """Stands where the example connector keeps a CUDA event: the copy is already done."""

    @staticmethod
    def query() -> bool:
        return True


class DraftsmithHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)  # [B]
        offsets = torch.arange(self._block_size, dtype=torch.long)  # [block]
        slots = (blocks[:, None] * self._block_size + offsets[None, :]).flatten()  # [B*block]
        num_tokens = pending.token_ids.shape[0]
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device),
                                       num_tokens)  # [T, K, H]
        tensors = {"hidden_states": states.to("cpu").contiguous(),
                   "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        partial = pending.filename + ".partial"
        save_file(tensors, partial)
        os.replace(partial, pending.filename)
        self._req_copy_events[pending.req_id] = _Written()
