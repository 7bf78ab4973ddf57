"""OpenAI request and response models for `expertstream serve`.

Requests accept and ignore unknown fields: UIs add their own parameters, and rejecting them breaks those UIs.
Response fields that are None are left out, except `message.content` and `finish_reason`, which the
OpenAI schema requires even when null.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


def _absent(value) -> bool:
    return value is None


def omit_if_none():
    """A response field left out of the JSON when None."""
    return Field(None, exclude_if=_absent)


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# ---- requests


class ContentPart(OpenAIRequest):
    type: str
    text: str | None = None


class FunctionCallIn(OpenAIRequest):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(OpenAIRequest):
    id: str | None = None
    type: str = "function"
    function: FunctionCallIn


class ChatMessage(OpenAIRequest):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionDef(OpenAIRequest):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(OpenAIRequest):
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(OpenAIRequest):
    include_usage: bool = False


StopString = Annotated[str, Field(min_length=1)]


class SamplingRequest(OpenAIRequest):
    """Fields shared by chat and legacy completions; None means the server default."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: no top-k filter")
    min_p: float | None = Field(None, ge=0, lt=1)
    # torch generators take seeds in [-2**63, 2**64)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: StopString | list[StopString] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = 1

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n not in (None, 1):
            raise ValueError(f"n must be 1 (one choice per request; no batching), got {n}")
        return n


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] = Field(description="text, a one-element list of text, or token ids")
    logprobs: int | None = Field(None, ge=0, le=20)


# ---- responses


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "expertstream"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    index: int | None = omit_if_none()
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = omit_if_none()
    reasoning: str | None = omit_if_none()
    tool_calls: list[ToolCallOut] | None = omit_if_none()


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = omit_if_none()
    content: str | None = omit_if_none()
    reasoning_content: str | None = omit_if_none()
    reasoning: str | None = omit_if_none()
    tool_calls: list[ToolCallOut] | None = omit_if_none()


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def _now() -> int:
    return int(time.time())


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = omit_if_none()
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = omit_if_none()


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = omit_if_none()


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
