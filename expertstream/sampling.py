"""Next-token choice: greedy, or temperature + top-k + top-p + min-p sampling with a seeded generator, after
the repetition, frequency and presence penalties and the request's logits processors (constrained decoding
masks the logits there)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# (token ids this sequence generated so far, logits [V]) -> logits [V]; may modify the logits in place. A
# processor belongs to one sequence (it may keep state, such as a grammar matcher, between calls).
LogitsProcessor = Callable[[Sequence[int], torch.Tensor], torch.Tensor]

# Below this temperature a draw is the argmax (its limit); dividing float32 logits by a smaller number
# overflows or, under float32's smallest subnormal, divides by zero and poisons the softmax with NaN.
GREEDY_BELOW = 1e-5


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """One generator per request, so a seeded request repeats exactly whatever else runs."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def filter_logits(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    """Logits [V] / temperature (> 0) in float32, tokens outside top-k / top-p / min-p set to -inf."""
    # shift so the best logit is 0: any temperature then gives finite-or--inf values and a valid softmax
    logits = (logits.float() - logits.max().float()) / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0.0:
        # keep tokens whose probability is at least min_p times the most likely one's
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens before it already cover top_p; the most likely token always stays
        # (explicitly: a top_p under float32's smallest subnormal, such as 5e-324, rounds to 0 here)
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def apply_logits_processors(
    processors: Sequence[LogitsProcessor], generated: Sequence[int], logits: torch.Tensor
) -> torch.Tensor:
    """Logits [V] after each processor in turn; call once per sampled position, before `sample`."""
    for processor in processors:
        logits = processor(generated, logits)
    return logits


def apply_penalties(
    logits: torch.Tensor,
    seen: torch.Tensor,
    counts: torch.Tensor,
    repetition: float = 1.0,
    frequency: float = 0.0,
    presence: float = 0.0,
) -> torch.Tensor:
    """Logits [V] in float32 with the penalties of `SamplingParams`: `seen` [V] bool marks the prompt's and
    the reply's tokens (repetition), `counts` [V] float32 how often each token is in the reply (OpenAI's
    frequency and presence)."""
    logits = logits.float()
    if repetition != 1.0:
        # dividing a positive logit and multiplying a negative one both make the token less likely
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalized, logits)
    if frequency or presence:
        logits = logits - frequency * counts - presence * (counts > 0).float()
    return logits


def sample(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    generator: torch.Generator | None = None,
) -> int:
    """Pick the next token from logits [V]: argmax when temperature is (about) 0, else a filtered draw."""
    if temperature < GREEDY_BELOW:
        return int(torch.argmax(logits))
    probs = torch.softmax(filter_logits(logits, temperature, top_k, top_p, min_p), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token: int, top_n: int) -> tuple[float, list[tuple[int, float]]]:
    """Log-probability of `token` under the model's raw distribution, and the top_n (id, logprob) pairs."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if top_n > 0:
        vals, ids = torch.topk(logp, min(top_n, logp.shape[-1]))
        top = list(zip(ids.tolist(), vals.tolist()))
    return float(logp[token]), top
