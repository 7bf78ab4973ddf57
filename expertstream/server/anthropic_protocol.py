"""Anthropic Messages request and response models for `POST /v1/messages`.

As on the OpenAI routes, unknown fields are accepted and ignored (clients send `metadata`, cache control,
betas). Content blocks are one permissive model; `server.anthropic` decides which types it supports.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from expertstream.server.protocol import OpenAIRequest, StopString, omit_if_none


class Block(OpenAIRequest):
    """A content block: text, thinking, tool_use, tool_result (others are refused by the translation)."""

    type: str
    text: str | None = None
    thinking: str | None = None
    signature: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[Block] | None = None
    is_error: bool | None = None


class Message(OpenAIRequest):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDef(OpenAIRequest):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class ToolChoice(OpenAIRequest):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class Thinking(OpenAIRequest):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class MessagesRequest(OpenAIRequest):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    stop_sequences: list[StopString] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class CountTokensRequest(OpenAIRequest):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


# ---- responses


class BlockOut(BaseModel):
    type: Literal["text", "thinking", "tool_use"]
    text: str | None = omit_if_none()
    thinking: str | None = omit_if_none()
    signature: str | None = omit_if_none()
    id: str | None = omit_if_none()
    name: str | None = omit_if_none()
    input: dict[str, Any] | None = omit_if_none()


class UsageOut(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int | None = omit_if_none()


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageOut(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[BlockOut]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: UsageOut


class TokenCount(BaseModel):
    input_tokens: int


class Event(BaseModel):
    """One stream event; `type` is also the SSE event name."""

    type: str
    message: MessageOut | None = omit_if_none()
    index: int | None = omit_if_none()
    content_block: BlockOut | None = omit_if_none()
    delta: dict[str, Any] | None = omit_if_none()
    usage: dict[str, int] | None = omit_if_none()
