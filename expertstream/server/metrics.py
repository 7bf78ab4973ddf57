"""`GET /metrics` of `expertstream serve`: request counters kept by the HTTP side, plus the worker's queue,
the conversation state cache and the expert store, in Prometheus text exposition format 0.0.4."""

from __future__ import annotations

from dataclasses import dataclass, field

from expertstream.generate import GenerationResponse
from expertstream.runtime.worker import EngineBackend


def _family(name: str, kind: str, help_text: str, samples: list[tuple[dict, object]]) -> list[str]:
    lines = [f"# HELP expertstream_{name} {help_text}", f"# TYPE expertstream_{name} {kind}"]
    for labels, value in samples:
        label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
        lines.append(
            f"expertstream_{name}{{{label_text}}} {value}" if labels else f"expertstream_{name} {value}"
        )
    return lines


def _hit_rate(hits: int, misses: int) -> float:
    return hits / (hits + misses) if hits + misses else 0.0


@dataclass(slots=True)
class Metrics:
    requests: dict[tuple[str, str], int] = field(default_factory=dict)  # (endpoint, outcome) -> count
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0

    def count(self, endpoint: str, outcome: str) -> None:
        self.requests[(endpoint, outcome)] = self.requests.get((endpoint, outcome), 0) + 1

    def finished(
        self, endpoint: str, last: GenerationResponse | None, prompt_tokens: int, cached: int
    ) -> None:
        self.count(endpoint, "ok")
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached
        if last is not None:
            self.generation_tokens += last.generation_tokens
            self.prompt_tps, self.generation_tps = last.prompt_tps, last.generation_tps

    def render(self, backend: EngineBackend) -> str:
        """Prometheus text exposition format, version 0.0.4."""
        C, G = "counter", "gauge"  # short, so that each family fits on one line
        cache = backend.cache
        requests = [({"endpoint": e, "outcome": o}, n) for (e, o), n in sorted(self.requests.items())]
        families = [
            ("requests_total", C, "Generation requests by endpoint and outcome.", requests),
            ("prompt_tokens_total", C, "Prompt tokens of finished requests.", self.prompt_tokens),
            ("generation_tokens_total", C, "Generated tokens.", self.generation_tokens),
            ("cached_prompt_tokens_total", C, "Prompt tokens reused from cached state.", self.cached_tokens),
            ("prompt_tokens_per_second", G, "Prefill speed of the last request.", self.prompt_tps),
            ("generation_tokens_per_second", G, "Decode speed of the last request.", self.generation_tps),
            ("queue_length", G, "Requests waiting for the worker.", backend.worker.queue_length),
            ("worker_busy", G, "Whether a generation is running (0 or 1).", int(backend.worker.busy)),
            ("state_cache_hits_total", C, "Prompts that restored a cached state.", cache.hits),
            ("state_cache_misses_total", C, "Prompts with no cached state.", cache.misses),
            ("state_cache_hit_rate", G, "State cache hits / lookups.", _hit_rate(cache.hits, cache.misses)),
            ("state_cache_bytes", G, "Bytes held by state snapshots.", cache.nbytes),
            ("state_cache_entries", G, "State snapshots held.", len(cache)),
        ]
        if backend.engine is not None:
            stats = backend.engine.stats()
            disk = [({"kind": "experts"}, stats.bytes_read), ({"kind": "ple"}, stats.ple_bytes_read)]
            expert_rate = _hit_rate(stats.hits, stats.misses)
            families += [
                ("disk_read_bytes_total", C, "Bytes read from disk: expert blocks and PLE rows.", disk),
                ("expert_cache_hits_total", C, "Expert lookups served from cache.", stats.hits),
                ("expert_cache_misses_total", C, "Expert lookups read from disk.", stats.misses),
                ("expert_cache_hit_rate", G, "Expert cache hits / lookups.", expert_rate),
                ("io_stall_seconds_total", C, "Seconds spent waiting on expert reads.", stats.stall_seconds),
                ("expert_bus_bytes_total", C, "Expert bytes moved from host RAM to the GPU: copies into VRAM "
                 "and kernels' reads in place (0 on the CPU).", stats.copied_bytes + stats.bus_read_bytes),
            ]  # fmt: skip
            vram = [({"kind": k}, v) for k, v in backend.engine.gpu_memory().items()]
            if vram:
                held = "VRAM held: allocated, reserved, and of the reserved the decode graphs' pool."
                families.append(("gpu_memory_bytes", G, held, vram))
        lines: list[str] = []
        for name, kind, help_text, value in families:
            # a bare number is the one unlabelled sample; a list holds labelled samples
            lines += _family(name, kind, help_text, value if isinstance(value, list) else [({}, value)])
        return "\n".join(lines) + "\n"
