"""The one generation API: `stream_generate` yields a `GenerationResponse` per generated token.

CLI, chat, server, bench and tests all consume it. Stop tokens are matched by id and never emitted; stop
strings are matched on text, held back while they could still match, and never emitted.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from expertstream.log import get_logger
from expertstream.sampling import make_generator, sample, token_logprobs

log = get_logger(__name__)

# prompt pieces between two on_progress calls (and should_stop checks) during prefill, in tokens, for an
# engine without spans; an engine's prefill span is its unit (a shorter call would fetch every expert again)
PREFILL_CHUNK = 512


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    Args:
        max_tokens: most tokens to generate (also clamped to the context left).
        temperature: 0 picks the argmax (greedy); above 0 samples.
        top_k: keep the k most likely tokens (0: all).
        top_p: keep the smallest set of tokens whose probability reaches top_p (1: all).
        min_p: keep tokens at least min_p times as likely as the most likely one (0: all).
        seed: seed of this request's generator (None: random).
        stop: strings that end generation; they are not part of the output.
        logprobs: report the chosen token's log-probability.
        top_logprobs: also report this many most likely (token, logprob) pairs.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        if any(not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r}")


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
    params = params or SamplingParams()
    tokenizer = engine.tokenizer
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise ValueError("the prompt is empty")
    max_len = engine.config.max_model_len
    if len(ids) >= max_len:
        raise ValueError(
            f"the prompt has {len(ids)} tokens; max_model_len {max_len} leaves no room to generate"
        )
    state = engine.new_state() if state is None else state
    cached = _reusable_prefix(state, ids)
    max_tokens = min(params.max_tokens, max_len - len(ids))
    stop_ids = set(tokenizer.stop_token_ids)
    stats0 = engine.stats()

    t0 = time.perf_counter()
    tail = ids[cached:]
    step = getattr(engine, "prefill_span", PREFILL_CHUNK) if on_progress or should_stop else len(tail)
    for start in range(0, len(tail), step):
        logits = engine.forward(state, tail[start : start + step])
        if on_progress:
            on_progress(cached + min(start + step, len(tail)), len(ids))
        if should_stop and should_stop():
            return
    t_prefill = time.perf_counter()
    prompt_tps = len(tail) / max(t_prefill - t0, 1e-9)
    generator = make_generator(params.seed, logits.device) if params.temperature > 0 else None

    detok = tokenizer.detokenizer()
    matcher = StopStringMatcher(params.stop)
    for n in range(1, max_tokens + 1):
        token = sample(logits, params.temperature, params.top_k, params.top_p, params.min_p, generator)
        lp, top = token_logprobs(logits, token, params.top_logprobs) if params.logprobs else (None, None)
        finish = None
        if token in stop_ids:
            text, finish = matcher.flush() + detok.flush(), "stop"
        else:
            text, hit = matcher.feed(detok.add(token))
            if hit:
                finish = "stop"
            elif n == max_tokens:
                finish = "length"
            elif should_stop and should_stop():
                finish = "cancelled"
            if finish in ("length", "cancelled"):
                text += matcher.feed(detok.flush())[0] + matcher.flush()
        stats = engine.stats()
        lookups = (stats.hits - stats0.hits) + (stats.misses - stats0.misses)
        yield GenerationResponse(
            text=text,
            token=token,
            logprobs=lp,
            top_logprobs=top,
            finish_reason=finish,
            prompt_tokens=len(ids),
            generation_tokens=n,
            cached_tokens=cached,
            prompt_tps=prompt_tps,
            generation_tps=n / max(time.perf_counter() - t_prefill, 1e-9),
            peak_memory_gb=peak_memory_gb(engine.device),
            disk_bytes=stats.bytes_read + stats.ple_bytes_read - stats0.bytes_read - stats0.ple_bytes_read,
            cache_hit_rate=(stats.hits - stats0.hits) / lookups if lookups else 0.0,
            stall_s=stats.stall_seconds - stats0.stall_seconds,
        )
        if finish:
            return
        logits = engine.forward(state, [token])
