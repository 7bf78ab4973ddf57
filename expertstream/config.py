"""`EngineConfig` and `SamplingParams`: the validated parameters of the engine and of a request.

EngineConfig's field names are the CLI flags (`ram_cache_gb` -> `--ram-cache-gb`). Neither imports torch, so
the command line refuses a bad flag before torch loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

# other tools' names for a flag, accepted too (llama.cpp's --ctx-size)
ALIASES = {"max_model_len": ("--ctx-size",)}


@dataclass(slots=True)
class EngineConfig:
    model: str = field(
        default="",
        metadata={"help": "working directory made by `expertstream setup` (default: the bundled demo model)"},
    )
    device: str = field(default="auto", metadata={"help": "cuda, cpu or auto (cuda when available)"})
    dtype: str = field(
        default="auto",
        metadata={"help": "activation dtype: auto (bf16 on cuda, fp32 on cpu), bfloat16, float32"},
    )
    max_model_len: int = field(
        default=32768,
        metadata={"help": "context length in tokens (KV and indexer keys are preallocated for it)"},
    )
    max_num_seqs: int = field(
        default=4,
        metadata={
            "help": "sequences that run together (vLLM's name), each with its own state, their KV from one "
            "shared pool; on a GPU the VRAM plan lowers it to what fits"
        },
    )
    kv_pool_tokens: int | None = field(
        default=None,
        metadata={
            "help": "tokens of attention KV the sequences share, taken in blocks as contexts grow (at least "
            "--max-model-len; default: the VRAM plan's, or on the CPU --max-num-seqs whole contexts)"
        },
    )
    gpu_memory_gb: float | None = field(
        default=None,
        metadata={
            "help": "VRAM budget the engine enforces on itself, GiB "
            "(default: --gpu-memory-utilization of the total)"
        },
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata={
            "help": "fraction of the GPU's total memory the engine may use, as in vLLM; refused when other "
            "processes hold more than the rest (with --gpu-memory-gb: the fraction of that budget)"
        },
    )
    ram_cache_gb: float = field(
        default=4.0,
        metadata={"help": "pinned-RAM expert cache in GiB (llama.cpp's closest word: --moe-cache-mib)"},
    )
    io_threads: int = field(
        default=16, metadata={"help": "O_DIRECT reader threads (about the drive's queue depth)"}
    )
    kernels: str = field(
        default="auto", metadata={"help": "auto (Triton on CUDA, torch elsewhere), triton or torch"}
    )
    seed: int | None = field(
        default=None, metadata={"help": "sampling seed of every reply (default: random)"}
    )
    no_speculation: bool = field(
        default=False,
        metadata={"help": "do not guess layer L+1's experts from layer L's input (no early disk reads)"},
    )
    speculation_width: float = field(
        default=1.0,
        metadata={
            "help": "next-layer guesses as a multiple of the experts per token: wider finds more of the "
            "next layer's experts early and wastes more copies and reads (bench routing measures both)"
        },
    )
    stage_guesses: int = field(
        default=-1,
        metadata={
            "help": "decode with every expert in the RAM cache: copy this many of the next layer's guessed "
            "experts to VRAM while the bus is idle (attention), on a side stream; 0: off; -1 (default): as "
            "many as the expert slots leave room for, at most half the experts per token"
        },
    )
    enforce_eager: bool = field(
        default=False,
        metadata={
            "help": "decode without CUDA graphs: launch every kernel from Python each token (vLLM's name)"
        },
    )
    preload_experts: bool = field(
        default=False,
        metadata={
            "help": "when --ram-cache-gb holds every expert, read them all into it in the background at "
            "start (below demand reads and guesses); decode then reads no routing back once they are in"
        },
    )
    prefill_piece: int | None = field(
        default=None,
        metadata={
            "help": "prompt tokens a layer's attention and expert kernels take at a time (default: the VRAM "
            "plan's; on the CPU 8192; llama.cpp's closest word: --ubatch-size)"
        },
    )
    prefill_span: int | None = field(
        default=None,
        metadata={
            "help": "prompt tokens that go through a layer together; each expert is fetched once per layer "
            "and span (default: the VRAM plan's; on the CPU the whole context; llama.cpp: --batch-size). "
            "Larger than the plan's may not fit the VRAM budget"
        },
    )
    fp8_dense: bool = field(
        default=False,
        metadata={
            "help": "store the big DeltaNet matrices FP8 row-scaled at load, as `setup --fp8-dense` does: a "
            "BF16 working directory then runs in the formats of the 8 GiB plan"
        },
    )
    threads: int = field(
        default=0,
        metadata={
            "help": "CPU compute threads (torch's and the CPU expert kernel's); 0: the cores other processes "
            "leave free, re-measured while running, less 2 for a CPU share of GPU decode (the decode "
            "thread's and the driver's) (llama.cpp's name)"
        },
    )
    cpu_moe_share: float = field(
        default=0.0,
        metadata={
            "help": "GPU decode with every expert in the pinned RAM cache: the fraction of each layer's "
            "routed experts the CPU computes in place while the bus carries the rest; -1: first chosen from "
            "the bus and CPU kernel rates measured at start, then tuned by the first decode tokens' time (it "
            "may move or turn off); 0: off (llama.cpp: --moe-cache-cpu-share)"
        },
    )
    cpu_affinity: str | None = field(
        default=None,
        metadata={
            "help": "pin the thread that loads the engine (and runs it) to these CPUs, e.g. 0 or 0-3 or 0,2; "
            "on a hybrid CPU pick a performance core"
        },
    )

    def __post_init__(self) -> None:
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.kv_pool_tokens is not None and self.kv_pool_tokens < self.max_model_len:
            raise ValueError(
                f"kv_pool_tokens {self.kv_pool_tokens} cannot hold one {self.max_model_len}-token context"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.gpu_memory_gb is not None and self.gpu_memory_gb <= 0:
            raise ValueError(f"gpu_memory_gb must be positive, got {self.gpu_memory_gb}")
        if self.ram_cache_gb < 0:
            raise ValueError(f"ram_cache_gb must be >= 0, got {self.ram_cache_gb}")
        if self.io_threads <= 0:
            raise ValueError(f"io_threads must be positive, got {self.io_threads}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0: the free cores), got {self.threads}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.dtype not in ("auto", "bfloat16", "float32", "float16"):
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.kernels not in ("auto", "triton", "torch"):
            raise ValueError(f"kernels must be auto, triton or torch, got {self.kernels!r}")
        if self.speculation_width < 1:
            raise ValueError(
                f"speculation_width must be >= 1 (K guesses or more), got {self.speculation_width}"
            )
        if self.stage_guesses < -1:
            raise ValueError(f"stage_guesses must be >= 0, or -1 (auto), got {self.stage_guesses}")
        if self.cpu_affinity is not None:
            parse_cpu_list(self.cpu_affinity)
        for name in ("prefill_piece", "prefill_span"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.prefill_piece and self.prefill_span and self.prefill_span < self.prefill_piece:
            raise ValueError(
                f"prefill_span {self.prefill_span} is shorter than prefill_piece {self.prefill_piece}"
            )

    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser, positional_model: bool = True, model_help: str | None = None
    ) -> None:
        """Add one flag per field (the model path is positional; `model_help` replaces its help)."""
        for f in dataclasses.fields(cls):
            help_text = f.metadata.get("help", "")
            if f.name == "model":
                help_text = model_help or help_text
                if positional_model:
                    parser.add_argument("model", nargs="?", default="", help=help_text)
                continue
            flags = ["--" + f.name.replace("_", "-"), *ALIASES.get(f.name, ())]
            if isinstance(f.default, bool):
                parser.add_argument(*flags, action="store_true", default=f.default, help=help_text)
                continue
            # field types are strings under `from __future__ import annotations`
            typ = float if "float" in f.type else int if "int" in f.type else str
            if "default" not in help_text and f.default is not None:  # each default said once
                help_text += f" (default: {f.default})"
            parser.add_argument(*flags, type=typ, default=f.default, help=help_text)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})


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
        repetition_penalty: a token of the prompt or the reply has its logit divided by this when positive,
            multiplied when negative (transformers' and vLLM's rule; 1: off; llama.cpp's --repeat-penalty).
        frequency_penalty: subtracted from a token's logit once per time the reply already holds it (OpenAI).
        presence_penalty: subtracted once from the logit of every token the reply already holds (OpenAI).
        logits_processors: `(generated_ids, logits [V]) -> logits` callables applied before each draw, after
            the penalties (for example a grammar's mask); logprobs stay those of the model's own distribution.
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
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logits_processors: list[Callable] = field(default_factory=list)

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
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0


def parse_cpu_list(spec: str) -> set[int]:
    """CPU ids of a list like "0", "0-3" or "0,2,4-5" (the `taskset -c` syntax)."""
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            first, last = int(lo), int(hi or lo)
            if first < 0 or last < first:
                raise ValueError
            cpus.update(range(first, last + 1))
    except ValueError:
        raise ValueError(f"cpu_affinity must look like 0, 0-3 or 0,2,4-5, got {spec!r}") from None
    return cpus
