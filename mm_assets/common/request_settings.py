"""How a stage talks to vLLM: requests in flight, timeouts, retries and when to give up;
the settings of the stages that send requests extend it, and the client's defaults."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat

MAX_CONCURRENCY = 1024


class RequestSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    concurrency: int = Field(
        default=8,
        ge=1,
        le=MAX_CONCURRENCY,
        description="Requests in flight across all servers; at most 1024: more only queue in "
        "the servers (vLLM schedules 256 sequences per server by default) while each holds "
        "its prompt and inline images in memory here.",
    )
    max_retries: int = Field(
        default=4,
        ge=0,
        le=10,
        description="Retries of a transient failure; at most 10: the waits double up to 30 s, "
        "so 10 retries span about 2.5 minutes, and a failure that lasts longer is not transient.",
    )
    breaker_failures: int = Field(
        default=8,
        ge=1,
        le=100,
        description="Failed tries in a row that take a server out of rotation while another "
        "remains (its requests go to the others); requests in a row that failed all their "
        "tries that stop the step. At most 100: past that a dead server is never taken out.",
    )
    probe_after_s: FiniteFloat = Field(
        default=30.0, gt=0, description="When a server out of rotation gets a request again."
    )
    request_timeout_s: FiniteFloat = Field(default=600.0, gt=0, description="Per request.")
