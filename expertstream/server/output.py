"""Generated records -> OpenAI replies, as stream chunks or one response, for chat and legacy completions.

Chat output goes through the reasoning splitter and, when the request has tools, the tool-call streamer;
both outputs add logprobs when asked. `server_jobs.Jobs.respond` drives either one.
"""

from __future__ import annotations

from collections.abc import Iterator

from expertstream.generate import GenerationResponse
from expertstream.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatMessageOut,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from expertstream.server.reasoning import ReasoningSplitter
from expertstream.server.request import ChatPrompt
from expertstream.server.settings import REASONING_FIELDS
from expertstream.server.tool_parser import ToolCallStreamer


def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def _finish_reason(last: GenerationResponse | None) -> str:
    return "length" if last is not None and last.finish_reason == "length" else "stop"


class ChatOutput:
    """Turns generated records into chat deltas: reasoning split, tool calls, logprobs."""

    def __init__(
        self, tokenizer, chat_id: str, model: str, prompt: ChatPrompt, reasoning_field: str, logprobs: bool
    ):
        self.tokenizer, self.id, self.model = tokenizer, chat_id, model
        self.splitter = ReasoningSplitter(prompt.in_reasoning)
        self.tool_stream = ToolCallStreamer(prompt.tools) if prompt.tools is not None else None
        self.fields = REASONING_FIELDS[reasoning_field]
        self.logprobs = logprobs
        self.content = ""
        self.reasoning = ""
        self._token_logprobs: list[TokenLogprob] = []
        self._started = False
        self._forced_deltas = self.feed(prompt.forced) if prompt.forced else []  # e.g. the forced call's name

    def feed(self, text: str) -> list[DeltaMessage]:
        return self._deltas(self.splitter.feed(text), final=False)

    def finish(self) -> list[DeltaMessage]:
        return self._deltas(self.splitter.flush(), final=True)

    def _deltas(self, pieces: list[tuple[str, str]], final: bool) -> list[DeltaMessage]:
        out: list[DeltaMessage] = []
        for kind, text in pieces:
            if kind == "reasoning":
                self.reasoning += text
                out.append(DeltaMessage(**dict.fromkeys(self.fields, text)))
            else:
                out.extend(self._content(text, final=False))
        if final:
            out.extend(self._content("", final=True))
        return out

    def _content(self, text: str, final: bool) -> list[DeltaMessage]:
        if self.tool_stream is None:
            self.content += text
            return [DeltaMessage(content=text)] if text else []
        content, calls = self.tool_stream.flush() if final else self.tool_stream.feed(text)
        self.content += content
        out = [DeltaMessage(content=content)] if content else []
        first = len(self.tool_stream.calls) - len(calls)
        out.extend(DeltaMessage(tool_calls=[c.to_openai(first + i)]) for i, c in enumerate(calls))
        return out

    @property
    def tool_calls(self) -> list:
        return self.tool_stream.calls if self.tool_stream is not None else []

    def finish_reason(self, last: GenerationResponse | None) -> str:
        return "tool_calls" if self.tool_calls else _finish_reason(last)

    def token_logprobs(self, r: GenerationResponse) -> TokenLogprob | None:
        if not self.logprobs or r.logprobs is None:
            return None

        def entry(token: int, logprob: float) -> TopLogprob:
            text = _token_text(self.tokenizer, token)
            return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8", "surrogatepass")))

        top = [entry(t, lp) for t, lp in r.top_logprobs or []]
        return TokenLogprob(**entry(r.token, r.logprobs).model_dump(), top_logprobs=top)

    # ---- streamed: the role first (then any forced deltas), then a chunk per delta, then the finish reason

    def _chunk(self, delta: DeltaMessage, logprobs=None, finish=None) -> ChatCompletionChunk:
        choice = ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish)
        return ChatCompletionChunk(id=self.id, model=self.model, choices=[choice])

    def _opening(self) -> Iterator[ChatCompletionChunk]:
        if not self._started:
            self._started = True
            yield self._chunk(DeltaMessage(role="assistant", content=""))
            for delta in self._forced_deltas:
                yield self._chunk(delta)

    def token_chunks(self, r: GenerationResponse) -> Iterator[ChatCompletionChunk]:
        yield from self._opening()
        lp = self.token_logprobs(r)
        deltas = self.feed(r.text)
        if lp is not None and not deltas:
            deltas = [DeltaMessage()]
        for i, delta in enumerate(deltas):
            yield self._chunk(delta, ChoiceLogprobs(content=[lp]) if lp is not None and i == 0 else None)

    def final_chunks(self, last: GenerationResponse | None) -> Iterator[ChatCompletionChunk]:
        yield from self._opening()
        for delta in self.finish():
            yield self._chunk(delta)
        yield self._chunk(DeltaMessage(), finish=self.finish_reason(last))

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, model=self.model, choices=[], usage=usage)

    # ---- not streamed: one message

    def add(self, r: GenerationResponse) -> None:
        self.feed(r.text)
        if (lp := self.token_logprobs(r)) is not None:
            self._token_logprobs.append(lp)

    def response(self, last: GenerationResponse | None, usage: Usage) -> ChatCompletionResponse:
        self.finish()
        reasoning = dict.fromkeys(self.fields, self.reasoning or None)
        message = ChatMessageOut(
            content=(self.content.strip() if self.tool_calls else self.content) or None,
            tool_calls=[c.to_openai() for c in self.tool_calls] or None,
            **reasoning,
        )
        choice = ChatChoice(
            message=message,
            logprobs=ChoiceLogprobs(content=self._token_logprobs) if self.logprobs else None,
            finish_reason=self.finish_reason(last),
        )
        return ChatCompletionResponse(id=self.id, model=self.model, choices=[choice], usage=usage)


class CompletionOutput:
    """Legacy completions: the text as generated, with OpenAI's parallel logprob lists when asked."""

    def __init__(self, tokenizer, cmpl_id: str, model: str, logprobs: bool):
        self.tokenizer, self.id, self.model = tokenizer, cmpl_id, model
        self.logprobs = logprobs
        self.text_offset = 0
        self._pieces: list[str] = []
        self._merged = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])

    def token_logprobs(self, r: GenerationResponse) -> CompletionLogprobs | None:
        if not self.logprobs or r.logprobs is None:
            return None
        top = {_token_text(self.tokenizer, t): lp for t, lp in r.top_logprobs or []}
        lp = CompletionLogprobs(
            tokens=[_token_text(self.tokenizer, r.token)],
            token_logprobs=[r.logprobs],
            top_logprobs=[top],
            text_offset=[self.text_offset],
        )
        self.text_offset += len(r.text)
        return lp

    def _chunk(self, text: str, logprobs=None, finish=None) -> CompletionResponse:
        choice = CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish)
        return CompletionResponse(id=self.id, model=self.model, choices=[choice])

    def token_chunks(self, r: GenerationResponse) -> Iterator[CompletionResponse]:
        lp = self.token_logprobs(r)
        if r.text or lp is not None:
            yield self._chunk(r.text, lp)

    def final_chunks(self, last: GenerationResponse | None) -> Iterator[CompletionResponse]:
        yield self._chunk("", finish=_finish_reason(last))

    def usage_chunk(self, usage: Usage) -> CompletionResponse:
        return CompletionResponse(id=self.id, model=self.model, choices=[], usage=usage)

    def add(self, r: GenerationResponse) -> None:
        if (lp := self.token_logprobs(r)) is not None:
            for key in CompletionLogprobs.model_fields:
                getattr(self._merged, key).extend(getattr(lp, key))
        self._pieces.append(r.text)

    def response(self, last: GenerationResponse | None, usage: Usage) -> CompletionResponse:
        choice = CompletionChoice(
            text="".join(self._pieces),
            logprobs=self._merged if self.logprobs else None,
            finish_reason=_finish_reason(last),
        )
        return CompletionResponse(id=self.id, model=self.model, choices=[choice], usage=usage)
