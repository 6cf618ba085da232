import numpy as np
import pytest

from servelm.constrain.grammars import GrammarError
from servelm.constrain.masks import MaskComputer

from .bytevocab import EOS, accepts, grammars, tokens


@pytest.fixture(scope="module")
def g():
    return grammars()


def test_json_schema_takes_valid_objects_only(g):
    c = g.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                       "additionalProperties": False})
    assert accepts(g, c, '{"a": 12}')
    assert not accepts(g, c, '{"a": "x"}')
    assert not accepts(g, c, '{"a": 1, "b": 2}')
    assert not accepts(g, c, '{"a": 1')


def test_json_object_and_compact_spacing(g):
    c = g.json_object()
    assert accepts(g, c, '{"x": [1, 2], "y": {"z": null}}')
    assert not accepts(g, c, "[1]")
    assert not accepts(g, c, '{"x":  1}')  # no runs of whitespace for a small model to loop in


def test_regex_is_a_full_match_with_ascii_digits(g):
    c = g.regex(r"\d{3}-\d{2}")
    assert accepts(g, c, "123-45")
    assert not accepts(g, c, "123-456")
    assert not accepts(g, c, "١٢٣-45")  # Arabic-Indic digits are not \d here


def test_choice_and_grammars(g):
    c = g.choice(["yes", "no"])
    assert accepts(g, c, "yes") and accepts(g, c, "no") and not accepts(g, c, "maybe")
    lark = g.grammar('start: "a" NUM "b"\nNUM: /[0-9]+/')
    assert accepts(g, lark, "a42b") and not accepts(g, lark, "ab")
    gbnf = g.grammar('root ::= "x" [0-9]+')
    assert accepts(g, gbnf, "x7") and not accepts(g, gbnf, "y7")


@pytest.mark.parametrize("build", [
    lambda g: g.json_schema({"type": "strang"}),
    lambda g: g.regex("a(b"),
    lambda g: g.grammar("start: undefined_rule"),
    lambda g: g.grammar("root ::= ("),
    lambda g: g.choice([]),
])
def test_uncompilable_constraints_raise(g, build):
    with pytest.raises(GrammarError) as info:
        build(g)
    assert str(info.value)


def test_compiled_grammars_are_cached_by_text_and_evicted_lru():
    g = grammars()
    g._cache_size = 2
    a1 = g.regex("a+")
    assert g.regex("a+").key == a1.key and g.cached() == 1
    g.regex("b+")
    g.regex("c+")  # evicts a+
    assert g.cached() == 2 and a1.key not in g._cache
    m = g.matcher(a1)  # compiled again from the constraint itself
    assert m.consume_token(tokens("a")[0]) and m.is_accepting()


def test_masks_allow_exactly_the_grammars_next_bytes(g):
    masks = MaskComputer(g.vocab_size)
    c = g.choice(["ab", "ac"])
    m1, m2 = g.matcher(c), g.matcher(c)
    assert m2.consume_token(tokens("a")[0])
    allowed = masks.allowed([m1, m2])
    assert allowed.shape == (2, g.vocab_size)
    assert list(np.flatnonzero(allowed[0])) == tokens("a")
    assert list(np.flatnonzero(allowed[1])) == sorted(tokens("b") + tokens("c"))
    assert m2.consume_token(tokens("b")[0]) and m2.is_stopped()
    assert list(np.flatnonzero(masks.allowed([m2])[0])) == [EOS]


def test_control_tokens_are_found_by_text_and_spelled_out(g):
    assert g.special_id("<eos>") == EOS and g.special_id("a") is None
    assert g.spelled[EOS] == b"<eos>" and g.spelled[tokens("a")[0]] == b"a"
