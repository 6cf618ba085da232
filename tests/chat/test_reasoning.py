"""The reasoning parser's edge cases: markers split across pieces, a thought the prompt opened (no opening marker
in the output), no thought at all, and an unfinished one."""

from __future__ import annotations

import pytest

from servelm.chat.reasoning import THINK, ReasoningMarkers, ReasoningParser, split_reasoning

M = ReasoningMarkers(*THINK)


def feed_all(pieces, opened=False, markers=M):
    p = ReasoningParser(markers, opened)
    thought = answer = ""
    for piece in pieces:
        t, a = p.feed(piece)
        thought, answer = thought + t, answer + a
    t, a = p.finish()
    return thought + t, answer + a


@pytest.mark.parametrize("cut", range(1, len("<think>plan</think>answer")))
def test_markers_split_anywhere(cut):
    text = "<think>plan</think>answer"
    assert feed_all([text[:cut], text[cut:]]) == ("plan", "answer")


def test_one_character_at_a_time():
    assert feed_all(list("  <think>\nstep one\n</think>\n\nThe answer.")) == ("step one\n", "The answer.")


def test_the_prompt_opened_it_so_the_output_has_no_opening_marker():
    assert feed_all(["I should add. ", "2+2=4</th", "ink>\n", "4"], opened=True) == ("I should add. 2+2=4", "4")


def test_no_thought_is_all_answer_and_goes_out_at_once():
    p = ReasoningParser(M, opened=False)
    assert p.feed("Hello") == ("", "Hello")  # cannot begin <think>: not held back
    assert p.feed(" <think> is text here") == ("", " <think> is text here")


def test_a_prefix_of_the_opening_marker_waits_then_resolves():
    p = ReasoningParser(M, opened=False)
    assert p.feed("<thi") == ("", "")
    assert p.feed("s is not a thought") == ("", "<this is not a thought")


def test_an_unfinished_thought_stays_a_thought():
    assert feed_all(["<think>still going</thi"]) == ("still going</thi", "")


def test_the_thought_streams_while_a_partial_closing_marker_waits():
    p = ReasoningParser(M, opened=True)
    assert p.feed("abc</") == ("abc", "")
    assert p.feed("think>done") == ("", "done")


def test_markers_of_a_deployment_of_its_own():
    m = ReasoningMarkers.parse("[THINK],[/THINK]")
    assert split_reasoning(m, False, "[THINK]x[/THINK]y") == ("x", "y")
    with pytest.raises(ValueError):
        ReasoningMarkers.parse("<think>")


def test_a_thought_the_prompt_opened_is_taken_whole():
    # the engine counts every token of it against the budget: a leading line break is part of the thought
    assert feed_all(["\n", "x</think>y"], opened=True) == ("\nx", "y")
