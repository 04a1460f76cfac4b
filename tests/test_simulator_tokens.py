"""The deterministic tokenizer/model: what tests use to compute expected answers."""

from __future__ import annotations

from simulator.tokens import (BOS_ID, EOS_ID, Generator, decode, encode, expected_generation, output_ids,
                              token_text)


def test_encode_is_stable_and_starts_with_bos():
    ids = encode("Hello world, this is")
    assert ids[0] == BOS_ID and len(ids) == 5
    assert ids == encode("Hello world, this is")
    assert encode("Hello world") != encode("Hello there")


def test_output_depends_only_on_input_ids():
    a = expected_generation("same prompt", max_new_tokens=20)
    b = expected_generation(input_ids=encode("same prompt"), max_new_tokens=20)
    assert a == b
    assert a.output_ids == output_ids(encode("same prompt"), 20)
    assert a.text == decode(a.output_ids) and a.finish_reason == {"type": "length", "length": 20}
    assert EOS_ID not in a.output_ids and all(i >= 4 for i in a.output_ids)
    assert expected_generation("other prompt", max_new_tokens=20).output_ids != a.output_ids


def test_longer_generation_extends_the_shorter_one():
    short = expected_generation("x", max_new_tokens=3).output_ids
    assert expected_generation("x", max_new_tokens=10).output_ids[:3] == short
    assert output_ids(encode("x"), 2, start=1) == short[1:3]


def test_generator_steps_match_the_whole():
    gen = Generator(encode("abc"), 7)
    while not gen.finished:
        gen.step(2)
    assert gen.output_ids == expected_generation("abc", max_new_tokens=7).output_ids


def test_zero_tokens_and_stop_token_ids():
    assert expected_generation("x", max_new_tokens=0).output_ids == []
    first = expected_generation("x", max_new_tokens=1).output_ids[0]
    g = expected_generation("x", max_new_tokens=5, stop_token_ids=[first])
    assert g.output_ids == [first] and g.finish_reason == {"type": "stop", "matched": first}
    assert token_text(first).startswith(" ")
