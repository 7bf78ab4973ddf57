"""From an OpenAI request to what the worker runs: prompt token ids and `SamplingParams`.

Chat requests become template messages and kwargs, a rendered prompt, and (for tool_choice "required" or a
named function) a forced opening of the Qwen XML call; request sampling fields win over the server defaults.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import jinja2
from starlette.concurrency import run_in_threadpool

from expertstream.generate import SamplingParams
from expertstream.server.errors import APIError
from expertstream.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingRequest,
)
from expertstream.server.reasoning import prompt_ends_in_reasoning, split_reasoning
from expertstream.server.settings import ServerSettings

# OpenAI's reasoning_effort values -> the template's (it accepts xhigh, medium, low and raises on others)
REASONING_EFFORT = {"minimal": "low", "low": "low", "medium": "medium", "high": "xhigh", "xhigh": "xhigh"}
# template arguments a request may not override through chat_template_kwargs
RESERVED_TEMPLATE_KWARGS = {"messages", "tools", "add_generation_prompt"}


@dataclass(slots=True)
class ChatPrompt:
    ids: list[int]
    in_reasoning: bool  # the rendered prompt ends inside an open <think> block
    tools: list[dict] | None  # None: tool calls are not parsed out of the reply
    forced: str  # text appended to the prompt that the reply is taken to start with


def _message_dict(m: ChatMessage) -> dict:
    """A request message as the chat template wants it."""
    if isinstance(m.content, list):
        if any(p.type != "text" or p.text is None for p in m.content):
            raise APIError(400, "only text content parts are supported", param="messages")
        content = "".join(p.text for p in m.content)
    else:
        content = m.content
    out = {"role": "system" if m.role == "developer" else m.role, "content": content}
    if m.role == "assistant":
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is None and content:
            # Open WebUI sends earlier reasoning back inside <think> tags in the content
            reasoning, out["content"] = split_reasoning(content)
        if reasoning:
            out["reasoning_content"] = reasoning
        if m.tool_calls:
            out["tool_calls"] = [_tool_call_dict(c) for c in m.tool_calls]
    for key in ("name", "tool_call_id"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    return out


def _tool_call_dict(call) -> dict:
    args = call.function.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise APIError(
                400, f"tool call arguments are not JSON: {args[:200]!r}", param="messages"
            ) from None
    if not isinstance(args, dict):
        raise APIError(400, "tool call arguments must be a JSON object", param="messages")
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": args}}


def _template_kwargs(req: ChatCompletionRequest, thinking: bool) -> dict:
    kwargs = {"enable_thinking": thinking}
    extra = req.chat_template_kwargs or {}
    if RESERVED_TEMPLATE_KWARGS & extra.keys():
        bad = sorted(RESERVED_TEMPLATE_KWARGS & extra.keys())
        raise APIError(400, f"chat_template_kwargs may not set {bad}", param="chat_template_kwargs")
    kwargs.update(extra)
    if req.reasoning_effort is not None:
        if req.reasoning_effort not in REASONING_EFFORT:
            raise APIError(
                400,
                f"reasoning_effort must be one of {sorted(REASONING_EFFORT)}, got {req.reasoning_effort!r}",
                param="reasoning_effort",
            )
        kwargs["reasoning_effort"] = REASONING_EFFORT[req.reasoning_effort]
    return kwargs


def _forced_tool_prefix(choice, tools: list[dict], in_reasoning: bool) -> str:
    """Text the reply is made to start with so that tool_choice "required" or a named function holds.

    The model then writes only the rest of the Qwen XML call (the function name, or its parameters).
    """
    if choice in (None, "auto", "none"):
        return ""
    close = "</think>\n\n" if in_reasoning else ""  # a forced call ends the (empty) reasoning first
    if choice == "required":
        return close + "<tool_call>\n<function="
    named = isinstance(choice, dict) and choice.get("type") == "function"
    function = choice.get("function") if named else None
    name = function.get("name") if isinstance(function, dict) else None
    if isinstance(name, str):
        known = {t["function"]["name"] for t in tools}
        if name not in known:
            msg = f"tool_choice names {name!r}, not one of {sorted(known)}"
            raise APIError(400, msg, param="tool_choice")
        return close + f"<tool_call>\n<function={name}>\n"
    raise APIError(
        400, f"tool_choice must be none, auto, required or a function, got {choice!r}", param="tool_choice"
    )


def _render(tokenizer, render: Callable[[], str]) -> tuple[str, list[int]]:
    """Render and tokenize; a template or text error is the request's fault (400)."""
    try:
        prompt = render()
        return prompt, tokenizer.encode(prompt)
    except (jinja2.TemplateError, TypeError, ValueError, LookupError) as e:
        raise APIError(400, f"cannot build the prompt: {e}", param="messages") from None


async def chat_prompt(tokenizer, req: ChatCompletionRequest, thinking: bool) -> ChatPrompt:
    """Render the chat template (in a thread: long histories take a while) and tokenize."""
    parse_tools = bool(req.tools) and req.tool_choice != "none"
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if parse_tools else None
    messages = [_message_dict(m) for m in req.messages]
    kwargs = _template_kwargs(req, thinking)
    prompt, ids = await run_in_threadpool(
        _render, tokenizer, lambda: tokenizer.apply_chat_template(messages, tools=tools, **kwargs)
    )
    in_reasoning = prompt_ends_in_reasoning(prompt)
    forced = _forced_tool_prefix(req.tool_choice, tools, in_reasoning) if parse_tools else ""
    ids = ids + tokenizer.encode(forced) if forced else ids
    return ChatPrompt(ids, in_reasoning, tools, forced)


async def completion_prompt(tokenizer, req: CompletionRequest) -> list[int]:
    """Token ids of a legacy prompt: text, a one-element list of text, or token ids."""
    if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str):
        if len(req.prompt) != 1:
            raise APIError(400, "prompt lists must hold exactly one prompt (no batching)", param="prompt")
        prompt = req.prompt[0]
    else:
        prompt = req.prompt
    if isinstance(prompt, str):
        ids = (await run_in_threadpool(_render, tokenizer, lambda: prompt))[1]
    else:
        ids = list(prompt)
        if any(not 0 <= t < tokenizer.vocab_size for t in ids):
            raise APIError(400, f"token ids must be in [0, {tokenizer.vocab_size})", param="prompt")
    if not ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    return ids


def sampling_params(
    settings: ServerSettings,
    req: SamplingRequest,
    n_prompt: int,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int,
) -> SamplingParams:
    """The request's sampling fields over `settings.defaults`, with max_tokens clamped to the context left."""
    if n_prompt >= settings.max_model_len:
        raise APIError(
            400,
            f"the prompt has {n_prompt} tokens; the context holds {settings.max_model_len}",
            param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    d = settings.defaults
    room = settings.max_model_len - n_prompt
    max_tokens = max_tokens or settings.default_max_tokens or room
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(
        max_tokens=min(max_tokens, room),
        temperature=d.temperature if req.temperature is None else req.temperature,
        top_k=d.top_k if req.top_k is None else max(req.top_k, 0),
        top_p=d.top_p if req.top_p is None else req.top_p,
        min_p=d.min_p if req.min_p is None else req.min_p,
        seed=d.seed if req.seed is None else req.seed,
        stop=stop,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
