"""The engine's scheduler thread: several generations run together, each on its own state.

Each engine step feeds every running request its next input in one `engine.forward_batch` call: the next
prefill span of the requests still reading their prompts and the last token of the ones generating, so one
layer-major pass serves them all and each expert block is fetched once per layer for the whole step. At most
`engine.max_num_seqs` requests run; the rest wait, streaming ones ahead of the others, and a full wait list
is refused at once (the server answers 429) instead of piling up requests. The running requests' KV shares
the engine's pool (models/kv_pool.py): each step makes room for each request in priority order, swapping
idle states and requests of lower priority to host RAM; a request it cannot make room for sits the step out.
HTTP handlers only translate.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from expertstream.generate import Generation, SamplingParams
from expertstream.log import get_logger
from expertstream.runtime.prompt_cache import PromptCache

log = get_logger(__name__)


class QueueFull(RuntimeError):
    pass


def _reusable(seen: list[int], ids: list[int]) -> int:
    """Prompt tokens a state that consumed `seen` already holds (the last prompt token must still run)."""
    return len(seen) if len(seen) < len(ids) and ids[: len(seen)] == seen else 0


def turn_boundary(ids: list[int], im_start_id: int | None) -> int:
    """Index of the last `<|im_start|>` (the generation prompt's), or 0 when there is none."""
    if im_start_id is None:
        return 0
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == im_start_id:
            return i
    return 0


@dataclass
class _Request:
    """One submitted generation: its prompt, sampling, event sink, cancel poll and result future."""

    ids: list[int]
    params: SamplingParams
    emit: Callable[..., None]
    should_stop: Callable[[], bool]
    streaming: bool
    order: int
    future: Future = field(default_factory=Future)
    state: object = None
    gen: Generation | None = None

    @property
    def priority(self) -> tuple[bool, int]:
        return (not self.streaming, self.order)


class Scheduler:
    """Runs the generations of an `EngineBackend` on one daemon thread, batched.

    Args:
        backend: the engine side (`_load`, `_start`, `_finish`, `engine`).
        max_queue: requests that may wait beyond those the batch has room for.
    """

    def __init__(self, backend: EngineBackend, max_queue: int):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.backend, self.max_queue = backend, max_queue
        self._cond = threading.Condition()
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._order = itertools.count()
        self._stepping = False
        self._thread = threading.Thread(target=self._loop, name="generation-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def queue_length(self) -> int:
        """Requests waiting for room in the batch."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def busy(self) -> bool:
        return bool(self._running) or self._stepping

    def submit(self, ids, params, emit, should_stop, streaming: bool) -> Future:
        with self._cond:
            room = self.backend.max_num_seqs - len(self._running)
            if len(self._waiting) >= self.max_queue + max(0, room):
                raise QueueFull(f"{len(self._waiting)} requests are already waiting") from None
            req = _Request(ids, params, emit, should_stop, streaming, next(self._order))
            self._waiting.append(req)
            self._cond.notify()
        return req.future

    def _loop(self) -> None:
        self.backend._load_or_fail()
        while True:
            with self._cond:
                while not self._waiting and not self._running:
                    self._cond.wait()
                admit = []
                self._waiting.sort(key=lambda r: r.priority)
                while self._waiting and len(self._running) + len(admit) < self.backend.max_num_seqs:
                    admit.append(self._waiting.pop(0))
                self._stepping = True
            try:
                for req in admit:
                    if req.future.set_running_or_notify_cancel():  # else cancelled while waiting
                        self._admit(req)
                if self._running:
                    self._step()
            finally:
                self._stepping = False

    def _admit(self, req: _Request) -> None:
        try:
            self.backend._start(req)
        except Exception as e:
            self._fail(req, e)
            return
        self._running.append(req)

    def _fail(self, req: _Request, e: Exception) -> None:
        self.backend._release(req, failed=True)
        if not isinstance(e, ValueError):
            log.error("generation failed", exc_info=e)
        req.future.set_exception(e)

    def _kv_room(self, req: _Request, n: int) -> bool:
        """Room in the shared KV pool for req's next n tokens: idle states and running requests of lower
        priority go to host RAM to make it, never one that goes before req."""
        pool = getattr(req.state, "pool", None)
        if pool is None:
            return True
        ahead = {id(r.state) for r in self._running if r.priority < req.priority}
        return pool.fit(req.state, req.state.pos + n, lambda o: id(o) not in ahead)

    def _step(self) -> None:
        """One engine call for every running request that has room in it."""
        engine = self.backend.engine
        budget = getattr(engine, "prefill_span", None)  # prompt tokens one pass may hold (the VRAM plan's)
        batch, prompt_tokens = [], 0
        for req in sorted(self._running, key=lambda r: r.priority):
            ids = req.gen.next_input()
            if len(ids) > 1 and budget is not None and prompt_tokens and prompt_tokens + len(ids) > budget:
                continue  # its span goes in the next pass (spans are never cut: same sums as alone)
            if not self._kv_room(req, len(ids)):
                continue  # its KV waits in host RAM until the pool has room
            prompt_tokens += len(ids) if len(ids) > 1 else 0
            batch.append((req, ids))
        items = [(req.state, ids) for req, ids in batch]
        try:
            if hasattr(engine, "forward_batch"):
                logits = engine.forward_batch(items)
            else:
                logits = [engine.forward(state, ids) for state, ids in items]
        except Exception as e:
            for req, _ in batch:
                self._running.remove(req)
                self._fail(req, e)
            return
        for (req, _), row in zip(batch, logits):
            try:
                r = req.gen.feed(row)
                if r is not None:
                    req.emit("token", r)
            except Exception as e:
                self._running.remove(req)
                self._fail(req, e)
                continue
            if req.gen.done:
                self._running.remove(req)
                self.backend._finish(req)
                req.future.set_result(None)


class EngineBackend:
    """The engine, its pool of states and the conversation state cache, used only on the scheduler thread.

    Loading comes first, so requests that arrive meanwhile simply wait for it.

    Args:
        load_engine: builds the engine (on the scheduler thread).
        max_queue: requests that may wait beyond those the batch has room for.
        state_cache_bytes: budget of the conversation state cache (0: off).
    """

    def __init__(self, load_engine: Callable[[], object], max_queue: int, state_cache_bytes: int):
        self.engine = None
        self.cache = PromptCache(state_cache_bytes)
        self.loaded: Future = Future()
        self._load_engine = load_engine
        self._free: list = []  # states of no running request, each holding what it last consumed
        self._states = 0
        self.worker = Scheduler(self, max_queue)
        self.worker.start()

    @property
    def max_num_seqs(self) -> int:
        return getattr(self.engine, "max_num_seqs", 1) if self.engine is not None else 1

    def _load_or_fail(self) -> None:
        self.loaded.set_running_or_notify_cancel()
        t0 = time.perf_counter()
        try:
            self.engine = self._load_engine()
        except Exception as e:
            log.exception("the model failed to load")
            self.loaded.set_exception(e)
            return
        log.info("model loaded in %.1f s", time.perf_counter() - t0)
        self.loaded.set_result(None)

    def submit(
        self,
        ids: list[int],
        params: SamplingParams,
        emit: Callable[..., None],
        should_stop: Callable[[], bool],
        streaming: bool = False,
    ) -> Future:
        """Queue one generation; `emit` receives ("start", reused_tokens), ("progress", done, total) and
        ("token", GenerationResponse) events on the scheduler thread. Streaming requests start first when
        several wait.

        Raises:
            QueueFull: the wait list is full.
        """
        return self.worker.submit(ids, params, emit, should_stop, streaming)

    def _state_for(self, ids: list[int]):
        """The free state that already holds the longest prefix of `ids`, or a new one while the pool has
        room."""
        if self._free:
            best = max(self._free, key=lambda s: _reusable(s.tokens, ids))
            if _reusable(best.tokens, ids) or self._states >= self.max_num_seqs:
                self._free.remove(best)
                return best
        if self._states < self.max_num_seqs:
            self._states += 1
            return self.engine.new_state()
        return self._free.pop()

    def _start(self, req: _Request) -> None:
        engine = self.engine
        if engine is None:
            raise RuntimeError(f"the model failed to load: {self.loaded.exception()}")
        ids = req.ids
        req.state = state = self._state_for(ids)
        # a state still holding the previous turn is reused when the prompt extends it; else the longest
        # snapshot
        hit = self.cache.lookup(ids)
        if hit is not None and hit[0] > _reusable(state.tokens, ids):
            state.restore(hit[1])
        reused = _reusable(state.tokens, ids)
        split = 0
        if self.cache.max_bytes:
            # stop a span at this turn's `<|im_start|>assistant` and snapshot there: a client that re-renders
            # the reply differently (say, without its reasoning) still reuses everything before it next turn
            split = turn_boundary(ids, engine.tokenizer.token_to_id("<|im_start|>"))

        def progress(done: int, total: int) -> None:
            req.emit("progress", done, total)

        def boundary() -> None:
            self.cache.insert(ids[:split], state.snapshot())

        req.gen = Generation(engine, ids, req.params, state, progress, req.should_stop, split, boundary)
        req.emit("start", reused)

    def _finish(self, req: _Request) -> None:
        if self.cache.max_bytes and req.gen.finish_reason in ("stop", "length"):
            snap = req.state.snapshot()
            self.cache.insert(snap.tokens, snap)
        self._release(req)

    def _release(self, req: _Request, failed: bool = False) -> None:
        if req.state is None:
            return
        if failed:  # a forward that failed half way leaves the state inconsistent; never reuse it
            req.state.reset()
        self._free.append(req.state)
        req.state = None
