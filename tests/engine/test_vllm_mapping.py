"""The translation between servelm and vLLM, as pure functions over plain values: runs everywhere, no vLLM.

vLLM's RequestOutput / CompletionOutput / Logprob are stood in for by SimpleNamespace objects with the same
attribute names (vllm/outputs.py, vllm/logprobs.py); the engine itself over a fake AsyncLLM is in
test_vllm_fake.py, and over real vLLM on a GPU in tests/gpu/test_vllm_engine.py.
"""

from __future__ import annotations

import math
from types import SimpleNamespace as NS

import pytest

from servelm.constrain.constraint import Constraint
from servelm.engine.hf_vocab import _unicode_to_byte, byte_level_vocab, drop_double_bos, template_source, token_bytes_table
from servelm.engine.types import BeamParams, FinishReason, GenerationRequest, SamplingParams, TokenLogprob
from servelm.engine.vllm import (
    OutputTranslator,
    VllmOptions,
    check_supported,
    engine_args,
    finish,
    is_client_error,
    prompt_logprobs,
    sampling_kwargs,
    token_logprob,
)
from servelm.errors import InvalidParameter, ServerError


def lp(logprob: float, rank: int | None) -> NS:
    return NS(logprob=logprob, rank=rank, decoded_token=None)


# -- servelm → vLLM ---------------------------------------------------------------------------------------
def test_every_sampling_knob_reaches_vllm():
    p = SamplingParams(
        max_tokens=40, temperature=0.7, top_p=0.9, top_k=12, min_p=0.05, seed=7, frequency_penalty=0.3,
        presence_penalty=-0.2, repetition_penalty=1.1, logit_bias=((5, -100.0), (9, 2.5)), stop=("\n\n", "END"),
        stop_token_ids=(3, 4), ignore_eos=True, min_tokens=2, n=2, skip_special_tokens=False,
        include_stop_str_in_output=True, logprobs=3, prompt_logprobs=1,
    )
    assert sampling_kwargs(p) == {
        "n": 2, "temperature": 0.7, "top_p": 0.9, "top_k": 12, "min_p": 0.05, "seed": 7,
        "presence_penalty": -0.2, "frequency_penalty": 0.3, "repetition_penalty": 1.1,
        "logit_bias": {5: -100.0, 9: 2.5}, "stop": ["\n\n", "END"], "stop_token_ids": [3, 4], "ignore_eos": True,
        "max_tokens": 40, "min_tokens": 2, "logprobs": 3, "prompt_logprobs": 1, "skip_special_tokens": False,
        "include_stop_str_in_output": True,
    }


def test_defaults_map_to_vllms_neutral_values():
    kw = sampling_kwargs(SamplingParams(max_tokens=5))
    assert kw["top_k"] == -1  # our 0 (no limit) is vLLM's -1 in every version
    assert kw["logit_bias"] is None and kw["stop"] is None and kw["stop_token_ids"] is None
    assert kw["logprobs"] is None and kw["prompt_logprobs"] is None and kw["seed"] is None
    assert kw["n"] == 1 and kw["skip_special_tokens"] is True


def test_best_of_runs_every_sample_and_asks_for_their_cumulative_logprobs():
    kw = sampling_kwargs(SamplingParams(max_tokens=5, n=2, best_of=5, temperature=0.8))
    assert kw["n"] == 5  # vLLM samples best_of; the service keeps the n most likely
    assert kw["logprobs"] == 0  # the cumulative logprob is reported only when logprobs are computed
    assert sampling_kwargs(SamplingParams(max_tokens=5, n=2, best_of=5, logprobs=4))["logprobs"] == 4


def test_grammars_and_beam_search_are_400s_never_dropped():
    with pytest.raises(InvalidParameter) as exc:
        check_supported(SamplingParams(max_tokens=5), constrained=True)
    assert exc.value.status == 400 and exc.value.code == "unsupported_parameter"
    assert exc.value.param == "response_format" and "vLLM" in exc.value.message
    with pytest.raises(InvalidParameter) as exc:
        check_supported(SamplingParams(max_tokens=5, best_of=2, temperature=0.0, beam=BeamParams()), False)
    assert exc.value.status == 400 and exc.value.param == "use_beam_search" and "Beam search" in exc.value.message
    check_supported(SamplingParams(max_tokens=5, n=2, best_of=3), constrained=False)  # sampling best_of is fine


def test_engine_args_carry_the_settings_and_the_extra_arguments():
    args = engine_args(VllmOptions("Qwen/Qwen2.5-0.5B-Instruct", tensor_parallel_size=2, gpu_memory_utilization=0.5,
                                   dtype="bfloat16", extra={"enable_prefix_caching": True, "max_num_seqs": 64}))
    assert args == {"model": "Qwen/Qwen2.5-0.5B-Instruct", "tensor_parallel_size": 2, "gpu_memory_utilization": 0.5,
                    "dtype": "bfloat16", "enable_prefix_caching": True, "max_num_seqs": 64}
    assert engine_args(VllmOptions("m", max_model_len=4096))["max_model_len"] == 4096
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        engine_args(VllmOptions("m", extra={"tensor_parallel_size": 4}))
    with pytest.raises(ValueError, match="max_model_len"):
        engine_args(VllmOptions("m", extra={"max_model_len": 4}))


def test_vllm_validation_errors_are_client_errors():
    class VLLMValidationError(Exception):  # recent vLLM: not always a ValueError
        pass

    assert is_client_error(ValueError("bad")) and is_client_error(VLLMValidationError("bad"))
    assert not is_client_error(RuntimeError("engine dead"))


# -- vLLM → servelm -----------------------------------------------------------------------------------------
def test_finish_reasons_and_stop_reasons():
    none: frozenset[int] = frozenset()
    assert finish(None, None, none) == (None, None)
    assert finish("length", None, none) == (FinishReason.LENGTH, None)
    assert finish("abort", None, none) == (FinishReason.ABORT, None)
    assert finish("stop", None, none) == (FinishReason.STOP, None)  # EOS
    assert finish("stop", "END", none) == (FinishReason.STOP, "END")  # a stop string
    assert finish("stop", 7, frozenset({7})) == (FinishReason.STOP, 7)  # a stop token the request named
    # an end-of-generation id from the model's generation config: vLLM says stop token, servelm says EOS
    assert finish("stop", 128009, frozenset({7})) == (FinishReason.STOP, None)
    with pytest.raises(ServerError):
        finish("error", None, none)


def test_token_logprob_keeps_the_k_most_likely_and_the_taken_tokens_rank():
    entries = {11: lp(-0.1, 1), 12: lp(-2.0, 2), 13: lp(-3.0, 3), 99: lp(-7.5, 40)}
    e = token_logprob(99, entries, 3)  # the token taken was not among the 3 most likely
    assert e == TokenLogprob(99, -7.5, ((11, -0.1), (12, -2.0), (13, -3.0)), 40)
    e = token_logprob(12, {11: lp(-0.1, 1), 12: lp(-2.0, 2)}, 2)
    assert e.rank == 2 and e.logprob == -2.0 and [t for t, _ in e.top] == [11, 12]
    assert token_logprob(11, {11: lp(-0.1, 1)}, 0).top == ()  # logprobs=0: the token taken only


def test_token_logprob_without_ranks_and_with_minus_infinity():
    e = token_logprob(5, {4: lp(-0.5, None), 6: lp(-1.0, None), 5: lp(-4.0, None), 7: lp(-math.inf, None)}, 4)
    assert e.rank == 3  # two listed tokens are more likely
    assert e.top == ((4, -0.5), (6, -1.0), (5, -4.0))  # -inf is never listed
    missing = token_logprob(8, {4: lp(-0.5, 1)}, 1)
    assert missing.logprob == -math.inf and missing.rank == 2


def test_prompt_logprobs_one_entry_per_prompt_token_the_first_none():
    raw = [None, {20: lp(-1.0, 1), 21: lp(-0.5, 1)}, {22: lp(-3.0, 5), 30: lp(-0.2, 1)}]
    out = prompt_logprobs((10, 21, 22), raw, 1)
    assert out[0] is None
    assert out[1] == TokenLogprob(21, -0.5, ((21, -0.5),), 1)
    assert out[2] == TokenLogprob(22, -3.0, ((30, -0.2),), 5)
    assert prompt_logprobs((10, 21), None, 1) is None
    assert prompt_logprobs((10, 21, 22), [None], 0) == [None, None, None]


def request(**params) -> GenerationRequest:
    return GenerationRequest("chatcmpl-x", (1, 2, 3, 4), SamplingParams(**{"max_tokens": 16, **params}))


def comp(index, text, ids, reason=None, stop=None, logprobs=None, cumulative=None) -> NS:
    return NS(index=index, text=text, token_ids=ids, finish_reason=reason, stop_reason=stop, logprobs=logprobs,
              cumulative_logprob=cumulative)


def raw(*outputs, finished=False, cached=None, prompt=None) -> NS:
    return NS(outputs=list(outputs), finished=finished, num_cached_tokens=cached, prompt_logprobs=prompt)


def test_delta_outputs_become_generation_outputs_per_choice():
    t = OutputTranslator(request(n=2))
    a = t.convert(raw(comp(0, "Hel", [40, 41]), comp(1, "Yo", [50]), cached=2))
    assert [(o.index, o.text, o.token_ids, o.completion_tokens, o.cached_tokens, o.prompt_tokens) for o in a] == [
        (0, "Hel", [40, 41], 2, 2, 4), (1, "Yo", [50], 1, 2, 4)]
    assert not any(o.finished for o in a) and a[0].logprobs is None
    b = t.convert(raw(comp(0, "lo", [42, 0], "stop", None), cached=2))  # ended by EOS (id 0)
    assert b[0].token_ids == [42] and b[0].completion_tokens == 4  # EOS counted, not reported
    assert b[0].finish_reason is FinishReason.STOP and b[0].stop_reason is None
    c = t.convert(raw(comp(1, "!", [51], "length"), finished=True, cached=2))
    assert c[0].finish_reason is FinishReason.LENGTH and c[0].completion_tokens == 2 and c[0].token_ids == [51]


def test_stop_strings_keep_their_last_token_and_stop_tokens_do_not():
    t = OutputTranslator(request(stop=("END",), stop_token_ids=(9,)))
    out = t.convert(raw(comp(0, "ab", [60, 61], "stop", "END"), finished=True))[0]
    assert out.token_ids == [60, 61] and out.stop_reason == "END"
    t = OutputTranslator(request(stop_token_ids=(9,)))
    out = t.convert(raw(comp(0, "ab", [60, 9], "stop", 9), finished=True))[0]
    assert out.token_ids == [60] and out.stop_reason == 9 and out.completion_tokens == 2


def test_logprobs_follow_the_reported_tokens_and_prompt_logprobs_come_once():
    t = OutputTranslator(request(logprobs=1, prompt_logprobs=0))
    prompt = [None, {2: lp(-1.0, 1)}, {3: lp(-2.0, 2), 8: lp(-0.1, 1)}, {4: lp(-0.3, 1)}]
    first = t.convert(raw(comp(0, "x", [70], logprobs=[{70: lp(-0.2, 1)}], cumulative=-0.2), prompt=prompt))[0]
    assert first.logprobs == [TokenLogprob(70, -0.2, ((70, -0.2),), 1)] and first.cumulative_logprob == -0.2
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == 4
    assert first.prompt_logprobs[0] is None and first.prompt_logprobs[2] == TokenLogprob(3, -2.0, (), 2)
    eos = [{71: lp(-0.5, 1)}, {0: lp(-0.01, 1)}]
    last = t.convert(raw(comp(0, "y", [71, 0], "stop", logprobs=eos, cumulative=-0.71), finished=True))[0]
    assert last.logprobs == [TokenLogprob(71, -0.5, ((71, -0.5),), 1)]  # the EOS's entry goes with the EOS
    assert last.prompt_logprobs is None and last.cumulative_logprob == -0.71


def test_an_output_with_nothing_new_is_skipped():
    t = OutputTranslator(request())
    assert t.convert(raw(comp(0, "", []))) == []
    assert t.convert(raw(comp(0, "", [0], "stop"), finished=True))[0].token_ids == []  # a bare EOS still finishes


# -- a Hugging Face vocabulary → bytes -----------------------------------------------------------------------
def test_the_byte_level_alphabet_covers_every_byte_once():
    table = _unicode_to_byte()
    assert sorted(table.values()) == list(range(256)) and len(table) == 256
    assert table["Ġ"] == 0x20 and table["Ċ"] == 0x0A and table["A"] == 0x41


def test_token_bytes_of_a_byte_level_vocabulary():
    pieces = ["<|endoftext|>", "Ġhello", "Ċ", "Ã©", "Ã", "x", None]
    out = token_bytes_table(pieces, {0: "<|endoftext|>"}, byte_level=True)
    assert out == [b"<|endoftext|>", b" hello", b"\n", "é".encode(), b"\xc3", b"x", b""]


def test_token_bytes_of_a_sentencepiece_vocabulary():
    pieces = ["<s>", "▁Hi", "<0x0A>", "there", "▁▁"]
    assert token_bytes_table(pieces, {0: "<s>"}, byte_level=False) == [b"<s>", b" Hi", b"\n", b"there", b"  "]


def test_byte_level_detection_bos_dedup_and_template_forms():
    assert byte_level_vocab(["Ġa", "Ġb", "c", "▁d"]) and not byte_level_vocab(["▁a", "▁b", "Ġc"])
    assert drop_double_bos([1, 1, 5], 1, "<s>hi", "<s>") == [1, 5]
    assert drop_double_bos([1, 5], 1, "<s>hi", "<s>") == [1, 5]
    assert drop_double_bos([1, 1, 5], 1, "hi", "<s>") == [1, 1, 5]  # the text did not write it
    assert template_source("{{x}}") == "{{x}}" and template_source(None) is None
    assert template_source({"tool_use": "T", "default": "D"}) == "D"
    assert template_source([{"name": "rag", "template": "R"}, {"name": "default", "template": "D"}]) == "D"


def test_constraint_reaches_check_supported_through_the_request():
    req = GenerationRequest("r", (1,), SamplingParams(max_tokens=2), Constraint("{}", "k", "json_object"))
    with pytest.raises(InvalidParameter):
        check_supported(req.params, req.constraint is not None)
