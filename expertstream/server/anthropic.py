"""Anthropic Messages (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the same pipeline.

A Messages request is translated into a chat request (system, text, thinking, tool_use and tool_result
blocks become template messages; tools and tool_choice map one to one), rendered and run like any other;
`AnthropicOutput` turns the chat deltas (reasoning split, parsed tool calls) into content blocks, as one
message or as Anthropic's stream events.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

from fastapi import FastAPI, Request

from expertstream.generate import GenerationResponse
from expertstream.server.anthropic_protocol import (
    Block,
    BlockOut,
    CountTokensRequest,
    Event,
    MessageOut,
    MessagesRequest,
    TokenCount,
    UsageOut,
)
from expertstream.server.errors import ERROR_RESPONSES, APIError, anthropic_body
from expertstream.server.jobs import Jobs
from expertstream.server.output import ChatOutput
from expertstream.server.protocol import ChatCompletionRequest, DeltaMessage, Usage, new_id
from expertstream.server.request import ChatPrompt, Prompts, sampling_params
from expertstream.server.settings import ServerSettings

TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}  # Anthropic's -> OpenAI's


def _text(blocks: str | list[Block] | None, where: str) -> str:
    """The text of a string or of text blocks; other block types are refused."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    bad = sorted({b.type for b in blocks if b.type != "text"})
    if bad:
        raise APIError(400, f"{where}: only text blocks are supported here, got {bad}", param=where)
    return "".join(b.text or "" for b in blocks)


def _messages(req) -> list[dict]:
    """Anthropic messages -> chat-template messages (OpenAI roles, tool results as `tool` messages)."""
    out = [{"role": "system", "content": _text(req.system, "system")}] if req.system else []
    for i, m in enumerate(req.messages):
        where = f"messages.{i}.content"
        blocks = [Block(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        supported = {"text", "tool_result"} if m.role == "user" else {"text", "thinking", "tool_use"}
        bad = sorted({b.type for b in blocks if b.type not in supported | {"redacted_thinking"}})
        if bad:
            raise APIError(400, f"{where}: {m.role} blocks of type {bad} are not supported", param=where)
        text = "".join(b.text or "" for b in blocks if b.type == "text")
        if m.role == "user":
            # results answer the previous assistant turn's calls, so they come before the user's text
            for b in blocks:
                if b.type == "tool_result":
                    result = _text(b.content, where)
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": result})
            if text or not any(b.type == "tool_result" for b in blocks):
                out.append({"role": "user", "content": text})
            continue
        message = {"role": "assistant", "content": text}
        reasoning = "".join(b.thinking or "" for b in blocks if b.type == "thinking")
        if reasoning:
            message["reasoning_content"] = reasoning
        calls = [
            {"id": b.id, "type": "function", "function": {"name": b.name or "", "arguments": b.input or {}}}
            for b in blocks
            if b.type == "tool_use"
        ]
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out


def to_chat_request(
    req: MessagesRequest | CountTokensRequest, thinking: bool
) -> tuple[ChatCompletionRequest, bool]:
    """The chat request that runs `req`, and whether thinking is on (the model id, or `thinking`)."""
    if req.thinking is not None:
        thinking = req.thinking.type != "disabled"
    body: dict = {"model": req.model, "messages": _messages(req), "stream": getattr(req, "stream", False)}
    if req.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in req.tools
        ]
    if req.tool_choice is not None:
        choice = req.tool_choice
        if choice.type == "tool":
            if not choice.name:
                raise APIError(400, "tool_choice of type tool needs a name", param="tool_choice")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = TOOL_CHOICE[choice.type]
    for key in ("max_tokens", "temperature", "top_p", "top_k"):
        if getattr(req, key, None) is not None:
            body[key] = getattr(req, key)
    if getattr(req, "stop_sequences", None):
        body["stop"] = req.stop_sequences
    body["chat_template_kwargs"] = {"enable_thinking": thinking}
    return ChatCompletionRequest.model_validate(body), thinking


class AnthropicOutput:
    """Chat deltas -> Anthropic content blocks: as stream events, or collected into one message.

    Args:
        tokenizer: names the stop sequence that ended the reply.
        msg_id, model: echoed in the message.
        prompt: the rendered prompt (reasoning state, tools, forced opening).
        stop: the request's stop sequences.
    """

    def __init__(self, tokenizer, msg_id: str, model: str, prompt: ChatPrompt, stop: list[str]):
        self.tokenizer, self.id, self.model, self.stop = tokenizer, msg_id, model, stop
        self.input_tokens = len(prompt.ids)
        self.chat = ChatOutput(tokenizer, msg_id, model, prompt, "reasoning_content", logprobs=False)
        self.blocks: list[BlockOut] = []
        self._open: str | None = None  # type of the block receiving deltas
        self._tokens: list[int] = []
        self._started = False

    # ---- deltas -> events (the blocks are kept either way)

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        self._open = None
        return [Event(type="content_block_stop", index=len(self.blocks) - 1)]

    def _start(self, block: BlockOut) -> list[Event]:
        events = self._close()
        self.blocks.append(block)
        # a copy: the kept block grows with the deltas, the start event must stay empty
        start = Event(
            type="content_block_start", index=len(self.blocks) - 1, content_block=block.model_copy()
        )
        events.append(start)
        return events

    def _extend(self, kind: str, text: str) -> list[Event]:
        events = []
        if self._open != kind:
            start = {"thinking": BlockOut(type="thinking", thinking="", signature="")}
            events += self._start(start.get(kind, BlockOut(type="text", text="")))
            self._open = kind
        block = self.blocks[-1]
        if kind == "thinking":
            block.thinking += text
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            block.text += text
            delta = {"type": "text_delta", "text": text}
        return events + [Event(type="content_block_delta", index=len(self.blocks) - 1, delta=delta)]

    def _events(self, deltas: list[DeltaMessage]) -> list[Event]:
        events: list[Event] = []
        for d in deltas:
            if d.reasoning_content:
                events += self._extend("thinking", d.reasoning_content)
            if d.content:
                events += self._extend("text", d.content)
            for call in d.tool_calls or []:
                args = json.loads(call.function.arguments)
                events += self._start(
                    BlockOut(type="tool_use", id=call.id, name=call.function.name, input={})
                )
                delta = {"type": "input_json_delta", "partial_json": call.function.arguments}
                events.append(Event(type="content_block_delta", index=len(self.blocks) - 1, delta=delta))
                self.blocks[-1].input = args
                self._open = "tool_use"
        return events

    def _stop(self, last: GenerationResponse | None) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of the reply."""
        if self.chat.tool_calls:
            return "tool_use", None
        if last is not None and last.finish_reason == "length":
            return "max_tokens", None
        if last is not None and last.token not in self.tokenizer.stop_token_ids and self.stop:
            # a stop string ended the reply: the first one in the generated text
            text = self.tokenizer.decode(self._tokens)
            hits = [(text.find(s), s) for s in self.stop if s in text]
            if hits:
                return "stop_sequence", min(hits)[1]
        return "end_turn", None

    # ---- the Output protocol of `server.jobs`

    def _opening(self) -> Iterator[Event]:
        if not self._started:
            self._started = True
            usage = UsageOut(input_tokens=self.input_tokens, output_tokens=0)
            start = MessageOut(id=self.id, model=self.model, content=[], usage=usage)
            yield Event(type="message_start", message=start)
            yield from self._events(self.chat.forced_deltas)  # the forced opening of a tool call

    def token_chunks(self, r: GenerationResponse) -> Iterator[Event]:
        yield from self._opening()
        self._tokens.append(r.token)
        yield from self._events(self.chat.feed(r.text))

    def final_chunks(self, last: GenerationResponse | None) -> Iterator[Event]:
        yield from self._opening()
        yield from self._events(self.chat.finish())
        yield from self._close()
        reason, sequence = self._stop(last)
        output = last.generation_tokens if last is not None else 0
        yield Event(
            type="message_delta",
            delta={"stop_reason": reason, "stop_sequence": sequence},
            usage={"output_tokens": output},
        )
        yield Event(type="message_stop")

    def usage_chunk(self, usage: Usage) -> Event:
        return Event(type="ping")  # usage travels in message_delta

    def add(self, r: GenerationResponse) -> None:
        for _ in self._opening():
            pass
        self._tokens.append(r.token)
        self._events(self.chat.feed(r.text))

    def response(self, last: GenerationResponse | None, usage: Usage) -> MessageOut:
        for _ in self._opening():
            pass
        self._events(self.chat.finish())
        cached = usage.prompt_tokens_details.cached_tokens
        out = UsageOut(
            input_tokens=usage.prompt_tokens,
            output_tokens=usage.completion_tokens,
            cache_read_input_tokens=cached or None,
        )
        reason, sequence = self._stop(last)
        if self.chat.tool_calls:  # as on the chat route: the text around calls loses its padding
            for b in self.blocks:
                b.text = b.text.strip() if b.type == "text" else b.text
            self.blocks = [b for b in self.blocks if b.type != "text" or b.text]
        return MessageOut(
            id=self.id,
            model=self.model,
            content=self.blocks,
            stop_reason=reason,
            stop_sequence=sequence,
            usage=out,
        )

    def encode(self, event: Event) -> str:
        return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"

    def error_event(self, err: APIError) -> str:
        return f"event: error\ndata: {json.dumps(anthropic_body(err), ensure_ascii=False)}\n\n"

    def end(self) -> str:
        return ""


def add_anthropic_routes(
    app: FastAPI,
    tokenizer,
    settings: ServerSettings,
    prompts: Prompts,
    jobs: Jobs,
    resolve_model: Callable[[str | None], bool],
) -> None:
    """`POST /v1/messages` and `POST /v1/messages/count_tokens` (errors in Anthropic's shape)."""

    @app.post("/v1/messages", response_model=MessageOut, responses=ERROR_RESPONSES)
    async def messages(req: MessagesRequest, request: Request):
        chat, thinking = to_chat_request(req, resolve_model(req.model))
        prompt = await prompts.chat(chat, thinking)
        params = sampling_params(settings, chat, len(prompt.ids), req.max_tokens, False, 0, prompt.processors)
        out = AnthropicOutput(tokenizer, new_id("msg"), req.model, prompt, list(req.stop_sequences or []))
        return await jobs.respond(jobs.submit(prompt.ids, params, "messages"), out, chat, request)

    @app.post("/v1/messages/count_tokens", responses=ERROR_RESPONSES)
    async def count_tokens(req: CountTokensRequest) -> TokenCount:
        chat, thinking = to_chat_request(req, resolve_model(req.model))
        return TokenCount(input_tokens=len((await prompts.chat(chat, thinking)).ids))
