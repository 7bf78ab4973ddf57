"""`ServerSettings`: what the HTTP side of `expertstream serve` needs besides the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from expertstream.config import SamplingParams

# --reasoning-field -> the message and delta fields that carry reasoning text
REASONING_FIELDS = {"reasoning_content": ("reasoning_content",), "reasoning": ("reasoning",)}
REASONING_FIELDS["both"] = REASONING_FIELDS["reasoning_content"] + REASONING_FIELDS["reasoning"]
THINKING_SUFFIX = "-thinking"  # the served model id with this suffix renders the template with thinking on


@dataclass(slots=True)
class ServerSettings:
    """What the HTTP side needs besides the engine (see `server.configure_parser` for each flag)."""

    served_model_name: str
    max_model_len: int
    defaults: SamplingParams = field(default_factory=SamplingParams)
    default_max_tokens: int | None = None  # None: up to the end of the context
    api_key: str | None = None
    reasoning_field: str = "reasoning_content"
    allowed_origins: list[str] = field(default_factory=list)
    allowed_hosts: list[str] | None = None  # None: loopback names only (`guard.host_allowed`)
    state_cache_bytes: int = 4 << 30
    max_queue: int = 16
    keepalive_s: float = 15.0
    max_body_bytes: int | None = None  # None: what the context can hold (`server.limits.body_limit`)

    def __post_init__(self) -> None:
        if self.reasoning_field not in REASONING_FIELDS:
            raise ValueError(
                f"reasoning_field must be one of {sorted(REASONING_FIELDS)}, got {self.reasoning_field!r}"
            )
        if self.keepalive_s <= 0:
            raise ValueError(f"keepalive interval must be positive seconds, got {self.keepalive_s}")
        if self.default_max_tokens is not None and self.default_max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.default_max_tokens}")
