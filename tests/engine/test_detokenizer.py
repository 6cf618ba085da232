from __future__ import annotations

from servelm.engine.detokenizer import Detokenizer

PIECES = {1: b"Hel", 2: b"lo", 3: b" wor", 4: b"ld", 5: "é".encode()[:1], 6: "é".encode()[1:], 7: b"!", 8: b"\n\n"}


def run(tokens, stop=()):
    d = Detokenizer(PIECES.__getitem__, tuple(stop))
    out = []
    for t in tokens:
        text, hit = d.push(t)
        out.append(text)
        if hit is not None:
            return out, hit
    out.append(d.flush())
    return out, None


def test_plain_text_flows_through():
    out, hit = run([1, 2, 3, 4])
    assert "".join(out) == "Hello world" and hit is None and out[0] == "Hel"


def test_a_character_split_over_tokens_waits_until_complete():
    out, _ = run([1, 5, 6, 7])
    assert out[1] == "" and out[2] == "é" and "".join(out) == "Helé!"


def test_stop_string_across_tokens_is_cut_and_never_leaks():
    out, hit = run([1, 2, 3, 4, 7], stop=["lo wo"])
    assert hit == "lo wo" and "".join(out) == "Hel"
    assert out[0] == "He", "a tail that may begin the stop string is held back"


def test_a_false_start_of_a_stop_string_is_released():
    out, hit = run([1, 2, 3, 4], stop=["lox"])
    assert hit is None and "".join(out) == "Hello world"


def test_earliest_of_several_stop_strings_wins():
    out, hit = run([1, 2, 3, 4], stop=["world", "o w"])
    assert hit == "o w" and "".join(out) == "Hell"
