"""How a stage talks to vLLM: requests in flight, timeouts, retries and when to give up.
Declared once for the stages that send requests (hidden states, target responses), whose
settings extend it, and for the client (`clients/vllm_client.py`), whose defaults these
are — so it sits on the floor both stand on."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class RequestSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    concurrency: int = Field(default=8, ge=1, description="Requests in flight across all servers.")
    max_retries: int = Field(default=4, ge=0, description="Retries of a transient failure.")
    breaker_failures: int = Field(
        default=8,
        ge=1,
        description="Failed tries in a row that take a server out of rotation while another "
        "remains (its requests go to the others); requests in a row that failed all their "
        "tries that stop the step.",
    )
    probe_after_s: float = Field(
        default=30.0, gt=0, description="When a server out of rotation gets a request again."
    )
    request_timeout_s: float = Field(default=600.0, gt=0, description="Per request.")
