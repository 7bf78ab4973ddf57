"""Streaming split of generated text into reasoning and content at `<think>` / `</think>`.

Tags may arrive cut across pieces (`</th` + `ink>`), so a possible partial tag is held back until the next
piece decides it. Newlines next to a tag are dropped: the chat template renders `<think>\\n{reasoning}\\n
</think>\\n\\n{content}`, and stripping them here lets a re-rendered history tokenise like the original.
"""

from __future__ import annotations

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def prompt_ends_in_reasoning(prompt: str) -> bool:
    """True when the prompt leaves a think block open (the generation prompt ends `<think>\\n`)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


class ReasoningSplitter:
    """State machine: text goes to "reasoning" between the tags and to "content" outside them.

    Args:
        in_reasoning: start inside a think block (the prompt opened one).
    """

    def __init__(self, in_reasoning: bool):
        self.in_reasoning = in_reasoning
        self._buf = ""
        self._after_tag = True  # drop newlines that follow a tag (or the start of the output)

    def feed(self, text: str) -> list[tuple[str, str]]:
        """Add generated text; return the decided pieces as ("reasoning" | "content", text), in order."""
        self._buf += text
        out: list[tuple[str, str]] = []
        while self._buf:
            if self._after_tag:
                self._buf = self._buf.lstrip("\n")
                if not self._buf:
                    break
                self._after_tag = False
            tag = THINK_CLOSE if self.in_reasoning else THINK_OPEN
            idx = self._buf.find(tag)
            if idx >= 0:
                self._emit(out, self._buf[:idx].rstrip("\n") if self.in_reasoning else self._buf[:idx])
                self._buf = self._buf[idx + len(tag) :]
                self.in_reasoning = not self.in_reasoning
                self._after_tag = True
                continue
            keep = partial_tag_len(self._buf, tag)
            if self.in_reasoning:
                # newlines just before `</think>` are dropped, so hold them until the next piece decides
                head = self._buf[: len(self._buf) - keep]
                keep += len(head) - len(head.rstrip("\n"))
            self._emit(out, self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            break
        return out

    def flush(self) -> list[tuple[str, str]]:
        """End of output: release held-back text (a partial tag was plain text after all)."""
        out: list[tuple[str, str]] = []
        self._emit(out, self._buf.rstrip("\n") if self.in_reasoning else self._buf)
        self._buf = ""
        return out

    def _emit(self, out: list[tuple[str, str]], text: str) -> None:
        if not text:
            return
        kind = "reasoning" if self.in_reasoning else "content"
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))


def split_reasoning(text: str) -> tuple[str | None, str]:
    """Split a finished assistant message that may carry `<think>...</think>` (Open WebUI re-sends them).

    Returns:
        (reasoning or None, content).
    """
    if THINK_CLOSE not in text:
        return None, text
    # like the template: text before a lone `</think>` is reasoning even without the opening tag
    splitter = ReasoningSplitter(in_reasoning=not 0 <= text.find(THINK_OPEN) < text.find(THINK_CLOSE))
    pieces = splitter.feed(text) + splitter.flush()
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    content = "".join(t for kind, t in pieces if kind == "content")
    return reasoning, content
