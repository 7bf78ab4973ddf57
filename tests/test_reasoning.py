"""The streaming reasoning splitter: tags cut across pieces, back-to-back tags, start state, flush."""

import pytest

from expertstream.server.reasoning import ReasoningSplitter, prompt_ends_in_reasoning, split_reasoning


def run(pieces, in_reasoning):
    s = ReasoningSplitter(in_reasoning)
    out = [p for piece in pieces for p in s.feed(piece)] + s.flush()
    reasoning = "".join(t for k, t in out if k == "reasoning")
    content = "".join(t for k, t in out if k == "content")
    return reasoning, content, out


TEXT = "Let me think.\nTwo plus two.\n</think>\n\nThe answer is 4."


@pytest.mark.parametrize("cut", range(1, len(TEXT)))
def test_every_cut_point_gives_the_same_split(cut):
    assert run([TEXT[:cut], TEXT[cut:]], in_reasoning=True)[:2] == (
        "Let me think.\nTwo plus two.",
        "The answer is 4.",
    )


def test_one_character_at_a_time():
    assert run(list(TEXT), in_reasoning=True)[:2] == ("Let me think.\nTwo plus two.", "The answer is 4.")


def test_starts_in_content_and_opens_a_think_block():
    reasoning, content, out = run(["Hi <thi", "nk>\nhmm</th", "ink>\n\nDone"], in_reasoning=False)
    assert (reasoning, content) == ("hmm", "Hi Done")
    assert [k for k, _ in out] == ["content", "reasoning", "content"]


def test_back_to_back_tags():
    reasoning, content, _ = run(["<think>a</think><think>b</think>c"], in_reasoning=False)
    assert (reasoning, content) == ("ab", "c")


def test_partial_tag_is_held_then_released_as_text():
    s = ReasoningSplitter(in_reasoning=True)
    assert s.feed("x </thi") == [("reasoning", "x ")]
    assert s.feed("s is not a tag") == [("reasoning", "</this is not a tag")]
    assert s.feed("</") == []
    assert s.flush() == [("reasoning", "</")]


def test_reasoning_cut_by_length_is_flushed_without_trailing_newlines():
    reasoning, content, _ = run(["still thinking\n\n"], in_reasoning=True)
    assert (reasoning, content) == ("still thinking", "")


def test_newlines_inside_reasoning_are_kept():
    reasoning, _, _ = run(["a\n", "\nb", "</think>c"], in_reasoning=True)
    assert reasoning == "a\n\nb"


def test_plain_content_passes_through_unchanged():
    assert run(["Hello, ", "world! 3 < 4 > 2"], in_reasoning=False)[:2] == ("", "Hello, world! 3 < 4 > 2")


def test_prompt_state_detection():
    assert prompt_ends_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_ends_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_ends_in_reasoning("plain prompt")


def test_split_finished_message():
    assert split_reasoning("<think>\nwhy\n</think>\n\nanswer") == ("why", "answer")
    assert split_reasoning("why</think>answer") == ("why", "answer")  # the opening tag is in the prompt
    assert split_reasoning("just an answer") == (None, "just an answer")
