"""Inference endpoint block: an OpenAI-compatible server that answers prompts for generate.

The API key is never stored here in clear: the block names a Prefect Secret block, which the
generate task reads and hands to the engine as a value (tasks/stages.py), so it reaches no
config file, log, task parameter or artifact.
"""

from __future__ import annotations

from typing import Any

from prefect.blocks.core import Block
from pydantic import Field


class InferenceEndpoint(Block):
    """An OpenAI-compatible endpoint (SGLang, vLLM, a hosted API) for the generate stage."""

    _block_type_name = "draftsmith inference endpoint"
    _block_type_slug = "draftsmith-inference-endpoint"
    _description = ("OpenAI-compatible endpoint that draftsmith's generate stage sends prompts "
                    "to: URL, model, API key (a Secret block) and request limits.")

    base_url: str = Field(..., description="e.g. http://gpu-host:30000/v1")
    model: str = Field(..., description="Model name the server expects in requests.")
    api_key_secret: str | None = Field(
        None, description="Name of the Prefect Secret block that holds the API key.")
    api_key_env: str | None = Field(
        None, description="Or: the environment variable that holds the key on the worker.")
    timeout_s: float = Field(600.0, gt=0, description="Per-request timeout.")
    max_retries: int = Field(6, ge=0, description="Retries of a failed request.")
    partitions: list[dict[str, int]] = Field(default_factory=list, description=(
        "Request limits by prompt length: [{max_prompt_tokens, concurrency, max_tokens}]; "
        "empty: generate's defaults."))

    def endpoint_config(self) -> dict[str, Any]:
        """The `generate.endpoint` section of a pipeline config."""
        config = {"base_url": self.base_url, "model": self.model,
                  "api_key_env": self.api_key_env, "api_key_secret": self.api_key_secret,
                  "timeout_s": self.timeout_s, "max_retries": self.max_retries}
        if self.partitions:
            config["partitions"] = self.partitions
        return config
