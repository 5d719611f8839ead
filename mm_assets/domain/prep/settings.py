"""Settings of a tokenization run (the `tokenized_samples` asset's config), declared once:
the tokenizer and the rejection watch take their values from here."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, FiniteFloat


class TokenizationSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_length: int = Field(
        default=4096,
        ge=2,
        description="Rows are cut to this many tokens, never inside an image-token block.",
    )
    repeated_rejection_rows: int = Field(
        default=100,
        ge=1,
        description="How many first rows `max_repeated_rejection_share` looks at.",
    )
    max_repeated_rejection_share: FiniteFloat = Field(
        default=0.5,
        gt=0,
        le=1,
        description="The step stops (instead of quarantining) when one kind of rejection "
        "takes more than this share of the first rows: a setup problem, not bad rows.",
    )
