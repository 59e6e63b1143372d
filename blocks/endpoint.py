"""Inference endpoint block: an OpenAI-compatible server that answers prompts for generate.

The API key is never stored here in clear: the block names a Prefect Secret block, and the flow
that runs generate copies the secret into the environment variable the engine reads
(`api_key_env`), so it reaches no config file, log or artifact.
"""

from __future__ import annotations

import os
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
    api_key_env: str = Field(
        "DRAFTSMITH_API_KEY", description="Environment variable the engine reads the key from.")
    timeout_s: float = Field(600.0, gt=0, description="Per-request timeout.")
    max_retries: int = Field(5, ge=0, description="Retries of a failed request.")
    partitions: int = Field(1, ge=1, description="Parallel request partitions (limits load).")

    def endpoint_config(self) -> dict[str, Any]:
        """The `generate.endpoint` section of a pipeline config."""
        return {"base_url": self.base_url, "model": self.model, "api_key_env": self.api_key_env,
                "api_key_secret": self.api_key_secret, "timeout_s": self.timeout_s,
                "max_retries": self.max_retries, "partitions": self.partitions}


def export_api_key(endpoint: dict[str, Any] | None) -> bool:
    """Put the key of `endpoint` (a generate.endpoint section) into its environment variable,
    read from its Secret block; returns whether a key was exported."""
    if not endpoint or not endpoint.get("api_key_secret"):
        return False
    from prefect.blocks.system import Secret

    env = endpoint.get("api_key_env") or "DRAFTSMITH_API_KEY"
    try:
        value = Secret.load(endpoint["api_key_secret"]).get()
    except ValueError as err:
        raise ValueError(
            f"generate.endpoint.api_key_secret={endpoint['api_key_secret']!r}: no such Secret "
            "block on this Prefect server; create it (draftsmith prefect setup --api-key-env VAR "
            "does) or unset api_key_secret") from err
    os.environ[env] = str(value)
    return True
