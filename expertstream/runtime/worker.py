"""One generation worker thread fed by a bounded FIFO queue, and the engine work it runs.

The engine owns one device and one state, so generations run strictly one at a time; a full queue is
refused at once (the server answers 429) instead of piling up requests. HTTP handlers only translate.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from expertstream.generate import SamplingParams, stream_generate
from expertstream.log import get_logger
from expertstream.runtime.prompt_cache import PromptCache

log = get_logger(__name__)


class QueueFull(RuntimeError):
    pass


class GenerationWorker:
    """Runs submitted jobs in order on one daemon thread.

    Args:
        max_queue: jobs that may wait behind the running one.
    """

    def __init__(self, max_queue: int):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self._queue: queue.Queue[tuple[Callable[[], object], Future]] = queue.Queue(maxsize=max_queue)
        self._busy = False
        self._thread = threading.Thread(target=self._loop, name="generation-worker", daemon=True)
        self._thread.start()

    @property
    def queue_length(self) -> int:
        """Jobs waiting (not counting the running one)."""
        return self._queue.qsize()

    @property
    def busy(self) -> bool:
        return self._busy

    def submit(self, fn: Callable[[], object]) -> Future:
        """Queue `fn`; the future holds its result. Cancelling the future while it waits skips the job.

        Raises:
            QueueFull: `max_queue` jobs are already waiting.
        """
        fut: Future = Future()
        try:
            self._queue.put_nowait((fn, fut))
        except queue.Full:
            raise QueueFull(f"{self._queue.maxsize} requests are already waiting") from None
        return fut

    def _loop(self) -> None:
        while True:
            fn, fut = self._queue.get()
            if not fut.set_running_or_notify_cancel():
                continue  # cancelled while waiting
            self._busy = True
            try:
                fut.set_result(fn())
            except Exception as e:  # the job's owner reports it; the worker must survive
                log.exception("generation job failed")
                fut.set_exception(e)
            finally:
                self._busy = False


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


class EngineBackend:
    """The engine, its one live state and the conversation state cache, used only on the worker thread.

    Loading is the first job, so requests that arrive meanwhile simply queue behind it.

    Args:
        load_engine: builds the engine (on the worker thread).
        max_queue: requests that may wait behind the running one.
        state_cache_bytes: budget of the conversation state cache (0: off).
    """

    def __init__(self, load_engine: Callable[[], object], max_queue: int, state_cache_bytes: int):
        self.engine = None
        self.cache = PromptCache(state_cache_bytes)
        self.worker = GenerationWorker(max_queue)
        self._state = None
        self.loaded: Future = self.worker.submit(lambda: self._load(load_engine))

    def _load(self, load_engine: Callable[[], object]) -> None:
        t0 = time.perf_counter()
        engine = load_engine()
        self._state = engine.new_state()
        self.engine = engine
        log.info("model loaded in %.1f s", time.perf_counter() - t0)

    def submit(
        self,
        ids: list[int],
        params: SamplingParams,
        emit: Callable[..., None],
        should_stop: Callable[[], bool],
    ) -> Future:
        """Queue one generation; `emit` receives ("start", reused_tokens), ("progress", done, total) and
        ("token", GenerationResponse) events on the worker thread.

        Raises:
            QueueFull: the queue is full.
        """
        return self.worker.submit(lambda: self._generate(ids, params, emit, should_stop))

    def _generate(self, ids, params, emit, should_stop) -> None:
        if self.engine is None:
            raise RuntimeError(f"the model failed to load: {self.loaded.exception()}")
        try:
            self._generate_on(self.engine, self._state, ids, params, emit, should_stop)
        except Exception:
            # a forward that failed half way leaves the state inconsistent; never reuse it
            self._state.reset()
            raise

    def _generate_on(self, engine, state, ids, params, emit, should_stop) -> None:
        # the live state (the previous turn) is reused when the prompt extends it; else the longest snapshot
        hit = self.cache.lookup(ids)
        if hit is not None and hit[0] > _reusable(state.tokens, ids):
            state.restore(hit[1])
        reused = _reusable(state.tokens, ids)
        emit("start", reused)

        def progress(done: int, _total: int) -> None:
            emit("progress", done, len(ids))

        boundary = turn_boundary(ids, engine.tokenizer.token_to_id("<|im_start|>"))
        if self.cache.max_bytes and boundary > reused:
            # run up to this turn's `<|im_start|>assistant` first: a client that re-renders the reply
            # differently (say, without its reasoning) still reuses everything before it next turn
            for _ in stream_generate(
                engine, ids[:boundary], SamplingParams(max_tokens=0), state, progress, should_stop
            ):
                pass
            if should_stop():
                return
            self.cache.insert(ids[:boundary], state.snapshot())
        last = None
        for r in stream_generate(engine, ids, params, state, progress, should_stop):
            emit("token", r)
            last = r
        if self.cache.max_bytes and last is not None and last.finish_reason in ("stop", "length"):
            snap = state.snapshot()
            self.cache.insert(snap.tokens, snap)
