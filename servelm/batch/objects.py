"""OpenAI's Batch and File objects, typed (its spec's `Batch`, `BatchError`, `BatchRequestCounts` and `OpenAIFile`):
what the store keeps and the API answers. A batch is serialised to the same JSON either way (`wire`, `stored`): its
fields in the spec's order, every one present (null when unset); a file leaves out an `expires_at` it does not have."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field

Status = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"]


class BatchError(BaseModel):
    """Why a batch failed, or which line of its file is not a request."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0

    def add(self, input_tokens: int, cached_tokens: int, output_tokens: int) -> None:
        """One answered line's tokens."""
        self.input_tokens += input_tokens
        self.input_tokens_details.cached_tokens += cached_tokens
        self.output_tokens += output_tokens
        self.total_tokens = self.input_tokens + self.output_tokens


FieldValue = str | int | BatchErrors | RequestCounts | None  # what Batch.with_fields sets


class Batch(BaseModel):
    """A batch (the `*_at` times are Unix seconds; `errors`: why it failed)."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None = None
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: Status
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    usage: BatchUsage = Field(default_factory=BatchUsage)
    metadata: dict[str, str] | None = None

    def wire(self) -> dict[str, Any]:
        """The object as the API answers it."""
        return self.model_dump()

    def stored(self) -> str:
        """The object as the store's row holds it (json.dumps of the wire object, as rows always were)."""
        return json.dumps(self.wire())

    @classmethod
    def from_stored(cls, row: str | bytes) -> Batch:
        return cls.model_validate_json(row)

    def with_fields(self, **fields: FieldValue) -> Batch:
        """A copy with these fields set, checked as the fields' types (a KeyError for a field it has not)."""
        unknown = fields.keys() - Batch.model_fields.keys()
        if unknown:
            raise KeyError(f"a batch has no field {', '.join(sorted(unknown))}")
        return Batch.model_validate({**self.wire(), **fields})


class OpenAIFile(BaseModel):
    """A stored file as the API describes it."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None

    def wire(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)
