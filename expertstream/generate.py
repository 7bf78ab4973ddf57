"""The one generation API: `stream_generate` yields a `GenerationResponse` per generated token.

CLI, chat, server, bench and tests all consume it. Stop tokens are matched by id and never emitted; stop
strings are matched on text, held back while they could still match, and never emitted.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from expertstream.config import SamplingParams  # noqa: F401 (re-exported: its home is torch-free)
from expertstream.log import get_logger
from expertstream.sampling import (
    apply_logits_processors,
    apply_penalties,
    make_generator,
    sample,
    token_logprobs,
)

log = get_logger(__name__)

# prompt pieces between two on_progress calls (and should_stop checks) during prefill, in tokens, for an
# engine without spans; an engine's prefill span is its unit (a shorter call would fetch every expert again)
PREFILL_CHUNK = 512


@dataclass(slots=True)
class GenerationResponse:
    """One generated token and the running counters.

    `text` is the new text this token completes (may be '' while a character or a possible stop string is
    held back). `finish_reason` is None until the last record: "stop" (stop token or string), "length"
    (max_tokens or context full) or "cancelled" (should_stop). Rates are tokens/s; `disk_bytes` (expert
    blocks and PLE rows), `cache_hit_rate` and `stall_s` (waiting on expert I/O) count from the request's
    start.
    """

    text: str
    token: int
    logprobs: float | None
    top_logprobs: list[tuple[int, float]] | None
    finish_reason: str | None
    prompt_tokens: int
    generation_tokens: int
    cached_tokens: int
    prompt_tps: float
    generation_tps: float
    peak_memory_gb: float
    disk_bytes: int
    cache_hit_rate: float
    stall_s: float


class StopStringMatcher:
    """Hold back text that could still become a stop string; cut the output where one completes."""

    def __init__(self, stop: list[str]):
        self.stop = stop
        self.pending = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string completed)."""
        self.pending += piece
        if not self.stop:
            out, self.pending = self.pending, ""
            return out, False
        hits = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        # longest suffix of pending that is a proper prefix of some stop string stays held
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:k]):
                    hold = k
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def peak_memory_gb(device: torch.device) -> float:
    """Peak CUDA memory allocated on the device, or the process's peak RSS on CPU, in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is KiB on Linux and bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def _reusable_prefix(state, prompt: list[int]) -> int:
    """Tokens of the prompt the state already consumed; 0 (after a reset) when its history diverges."""
    seen = state.tokens
    # the last prompt token must run again to give the logits of the first generated token
    if len(seen) < len(prompt) and prompt[: len(seen)] == seen:
        return len(seen)
    if seen:
        state.reset()
    return 0


class Generation:
    """One request's generation as a state machine, so a scheduler can run several in one engine step.

    `next_input()` gives the ids to feed next (a prefill span, then the last sampled token), the caller runs
    them through the engine on `state` and hands the last position's logits to `feed`, which samples and
    returns the token's record. `stream_generate` is this loop for one request; the server's scheduler runs
    the same objects batched, so a request's tokens do not depend on what runs beside it.

    Args: as `stream_generate`; `split_at` (a prompt index > the cached prefix) ends a prefill span there and
    calls `on_split()` once the state holds the prompt up to it (the server snapshots the turn boundary).
    """

    def __init__(
        self,
        engine,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        state=None,
        on_progress: Callable[[int, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        split_at: int = 0,
        on_split: Callable[[], None] | None = None,
    ):
        self.engine, self.params = engine, params or SamplingParams()
        self.on_progress, self.should_stop, self.on_split = on_progress, should_stop, on_split
        tokenizer = engine.tokenizer
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        max_len = engine.config.max_model_len
        if len(ids) >= max_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; max_model_len {max_len} leaves no room to generate"
            )
        self.ids = ids
        self.state = engine.new_state() if state is None else state
        self.cached = _reusable_prefix(self.state, ids)
        self.max_tokens = min(self.params.max_tokens, max_len - len(ids))
        self.stop_ids = set(tokenizer.stop_token_ids)
        self.stats0 = engine.stats()
        step = getattr(engine, "prefill_span", PREFILL_CHUNK) if on_progress or should_stop else len(ids)
        cuts = [split_at] if self.cached < split_at < len(ids) else []
        self._split = split_at if cuts else None
        # prompt spans [a, b): a prefill call never crosses the split, so the state can be snapshotted there
        self._spans = []
        for lo, hi in zip([self.cached, *cuts], [*cuts, len(ids)]):
            self._spans += [(a, min(a + step, hi)) for a in range(lo, hi, step)]
        self._span = 0
        self._token: int | None = None
        self.n = 0
        self.done = False
        self.finish_reason: str | None = None
        self.t0 = time.perf_counter()
        self.t_prefill = self.prompt_tps = None
        self.generator = self.detok = self.matcher = self.seen = self.counts = None
        self.generated: list[int] = []

    @property
    def prefilling(self) -> bool:
        return self._span < len(self._spans)

    def next_input(self) -> list[int] | None:
        """The ids the engine runs next on `state`; None once the generation is over."""
        if self.done:
            return None
        if self.prefilling:
            a, b = self._spans[self._span]
            return self.ids[a:b]
        return [self._token]

    def feed(self, logits: torch.Tensor) -> GenerationResponse | None:
        """Take the logits [V] of the last position fed; the next token's record, or None (prefill went on,
        or the request ended without a token: cancelled in prefill, or max_tokens 0)."""
        if self.prefilling:
            _, b = self._spans[self._span]
            self._span += 1
            if self.on_progress:
                self.on_progress(b, len(self.ids))
            if b == self._split and self.on_split:
                self.on_split()
            if self.should_stop and self.should_stop():
                self.done = True
                return None
            if self.prefilling:
                return None
            self._start_decode(logits)
            if self.max_tokens == 0:
                self.done = True
                return None
        return self._sample(logits)

    def _start_decode(self, logits: torch.Tensor) -> None:
        self.t_prefill = time.perf_counter()
        self.prompt_tps = (len(self.ids) - self.cached) / max(self.t_prefill - self.t0, 1e-9)
        p = self.params
        self.generator = make_generator(p.seed, logits.device) if p.temperature > 0 else None
        self.detok = self.engine.tokenizer.detokenizer()
        self.matcher = StopStringMatcher(p.stop)
        if p.penalized:  # seen, counts [V]: the penalties' token sets (sampling.py)
            self.seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            self.seen[torch.tensor(self.ids, device=logits.device)] = True
            self.counts = torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device)

    def _sample(self, logits: torch.Tensor) -> GenerationResponse:
        p, engine, matcher, detok = self.params, self.engine, self.matcher, self.detok
        self.n += 1
        n = self.n
        scores = logits
        if self.seen is not None:
            scores = apply_penalties(
                logits, self.seen, self.counts, p.repetition_penalty, p.frequency_penalty, p.presence_penalty
            )
        scores = apply_logits_processors(p.logits_processors, self.generated, scores)
        token = sample(scores, p.temperature, p.top_k, p.top_p, p.min_p, self.generator)
        self.generated.append(token)
        if self.seen is not None:
            self.seen[token] = True
            self.counts[token] += 1
        lp, top = token_logprobs(logits, token, p.top_logprobs) if p.logprobs else (None, None)
        finish = None
        if token in self.stop_ids:
            text, finish = matcher.flush() + detok.flush(), "stop"
        else:
            text, hit = matcher.feed(detok.add(token))
            if hit:
                finish = "stop"
            elif n == self.max_tokens:
                finish = "length"
            elif self.should_stop and self.should_stop():
                finish = "cancelled"
            if finish in ("length", "cancelled"):
                text += matcher.feed(detok.flush())[0] + matcher.flush()
        stats, stats0 = engine.stats(), self.stats0
        lookups = (stats.hits - stats0.hits) + (stats.misses - stats0.misses)
        self._token, self.done, self.finish_reason = token, finish is not None, finish
        return GenerationResponse(
            text=text,
            token=token,
            logprobs=lp,
            top_logprobs=top,
            finish_reason=finish,
            prompt_tokens=len(self.ids),
            generation_tokens=n,
            cached_tokens=self.cached,
            prompt_tps=self.prompt_tps,
            generation_tps=n / max(time.perf_counter() - self.t_prefill, 1e-9),
            peak_memory_gb=peak_memory_gb(engine.device),
            disk_bytes=stats.bytes_read + stats.ple_bytes_read - stats0.bytes_read - stats0.ple_bytes_read,
            cache_hit_rate=(stats.hits - stats0.hits) / lookups if lookups else 0.0,
            stall_s=stats.stall_seconds - stats0.stall_seconds,
        )


def stream_generate(
    engine,
    prompt: str | list[int],
    params: SamplingParams | None = None,
    state=None,
    on_progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Iterator[GenerationResponse]:
    """Generate from a prompt, one record per token.

    Args:
        engine: an `expertstream.runtime.engine.Engine`.
        prompt: text (tokenized as is, no special tokens added) or token ids.
        params: sampling and stopping; defaults to greedy with 256 tokens.
        state: a state from `engine.new_state()` to continue; when it already consumed a prefix of the prompt,
            only the rest runs (`cached_tokens`); when its history differs it is reset. None: a fresh state.
        on_progress: called as on_progress(done, total) between prefill spans (`engine.prefill_span` tokens,
            else PREFILL_CHUNK).
        should_stop: polled between prefill pieces and after every token; True cancels the request.

    Yields:
        GenerationResponse per generated token; the last one has `finish_reason` set. A request cancelled
        during prefill, or with max_tokens 0 (prefill only), yields nothing.
    """
    g = Generation(engine, prompt, params, state, on_progress, should_stop)
    while (ids := g.next_input()) is not None:
        r = g.feed(engine.forward(g.state, ids))
        if r is not None:
            yield r
