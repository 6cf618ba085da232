import pickle
import threading

import numpy as np
import pytest

from servelm.constrain.grammars import GrammarError, GrammarLimits, Grammars, MiB, plain_error
from servelm.constrain.masks import MaskComputer

from .bytevocab import EOS, TABLE, accepts, grammars, tokens


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


def test_compiled_grammars_are_cached_by_text_and_evicted_lru_within_a_byte_budget(monkeypatch):
    # sizes by text length, not by the process's heap: other threads of the test run allocate while one compiles
    monkeypatch.setattr("servelm.constrain.grammars._HEAP", None)
    probe = grammars()
    probe.regex("a+")
    one = probe.cached_bytes()
    g = Grammars(TABLE, [EOS], lambda data: [b + 1 for b in data], limits=GrammarLimits(cache_bytes=int(2.5 * one)))
    a1 = g.regex("a+")
    assert g.regex("a+").key == a1.key and g.cached() == 1
    g.regex("b+")
    g.regex("c+")  # evicts a+
    assert g.cached() == 2 and a1.key not in g._cache and g.cached_bytes() <= 2.5 * one
    m = g.matcher(pickle.loads(pickle.dumps(a1)))  # crossed a process: compiled again from its text
    assert m.consume_token(tokens("a")[0]) and m.is_accepting()


def test_a_constraint_carries_its_compiled_grammar_but_pickles_without_it():
    g = grammars()
    c = g.regex("x+")
    assert c.proto is not None
    back = pickle.loads(pickle.dumps(c))
    assert back.proto is None and (back.grammar, back.key, back.kind) == (c.grammar, c.key, c.kind) and back == c


def test_the_cache_holds_no_more_bytes_than_its_budget():
    g = Grammars(TABLE, [EOS], lambda data: [b + 1 for b in data], limits=GrammarLimits(cache_bytes=4 * MiB))
    for i in range(60):
        g.choice([f"option-{i}-{j}" for j in range(300)])
        assert g.cached_bytes() <= 4 * MiB
    assert 1 < g.cached() < 60


def test_one_grammar_over_the_memory_limit_is_refused_saying_so():
    g = Grammars(TABLE, [EOS], lambda data: [b + 1 for b in data], limits=GrammarLimits(max_bytes=MiB // 4))
    with pytest.raises(GrammarError) as info:
        g.choice([f"choice number {j}" for j in range(4000)])
    assert info.value.code == "grammar_too_large" and "MiB" in str(info.value)
    assert g.cached() == 0


def test_one_grammar_over_the_time_limit_is_refused_saying_so():
    g = Grammars(TABLE, [EOS], lambda data: [b + 1 for b in data], limits=GrammarLimits(max_compile_seconds=0.0))
    with pytest.raises(GrammarError) as info:
        g.choice([f"choice number {j}" for j in range(2000)])
    assert info.value.code == "grammar_too_slow" and "compile" in str(info.value)


def test_a_grammar_too_complex_to_follow_is_refused_before_any_answer():
    """20,000 alternatives in one rule compile, but llguidance cannot take a step in them (2,000 items a row):
    the engine would end such an answer empty. The probe finds it first."""
    g = grammars()
    with pytest.raises(GrammarError) as info:
        g.lark("start: " + " | ".join(f'"w{i}"' for i in range(20000)))
    assert info.value.code == "grammar_too_complex"
    assert "\n" not in str(info.value) and "<state>" not in str(info.value)


def test_many_choices_work_as_one_terminal():
    g = grammars()
    options = [f"w{i}" for i in range(5000)]
    c = g.choice(options)
    assert accepts(g, c, "w4321") and not accepts(g, c, "w5000")


def test_llguidance_failures_read_as_plain_sentences():
    assert plain_error("panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n<backtrace>\n 0: x") \
        == "the grammar is larger than the grammar engine can hold (assertion failed: grammar.symbols.len() < u16::MAX as usize - 10)"
    assert plain_error("Parser Error: row too big\n<state>\nTokens: ...") == "Parser Error: row too big"
    g = grammars()
    try:  # a list past what llguidance can hold: refused or served, but never a panic and backtrace
        g.lark("start: " + " | ".join(f"r{i}" for i in range(70000)) + "\n" + "\n".join(f'r{i}: "a{i}"' for i in range(70000)))
    except GrammarError as exc:
        assert "panic" not in str(exc) and "backtrace" not in str(exc) and "\n" not in str(exc)


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


def test_grammars_compiled_at_once_on_many_threads_are_each_probed_on_their_own():
    """Requests compile their grammars on worker threads at the same time: each compile's first-step probe must
    see its own grammar's mask. A probe buffer shared between threads let a JSON schema's mask reach a choice's
    probe, which then refused a valid request as grammar_too_complex."""
    g = grammars()
    errors: list[str] = []
    ready = threading.Barrier(4)

    def compile_many(k: int) -> None:
        ready.wait()
        for i in range(150):
            try:
                if k % 2:
                    g.choice([f"red{k}x{i}", f"blue{k}x{i}"])
                else:
                    g.json_schema({"type": "object", "properties": {f"p{k}_{i}": {"type": "integer"}}})
            except GrammarError as exc:
                errors.append(str(exc))

    threads = [threading.Thread(target=compile_many, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
