"""SMG's worker selector: the terms it documents, and a byte offset for every way a selector can be wrong."""

from __future__ import annotations

import pytest

from router.api.rl.selector import SelectorError, parse

SGLANG_PREFILL = {"id": "w1", "engine": "sglang", "worker_type": "prefill", "role": "prefill", "health": "ready",
                  "url": "http://p1:30000", "tp_size": "1"}
SGLANG_DECODE = {**SGLANG_PREFILL, "id": "w2", "worker_type": "decode", "role": "decode", "health": "not_ready"}


@pytest.mark.parametrize("text,prefill,decode", [
    ("engine=sglang", True, True),
    ("engine=vllm", False, False),
    ("engine in (sglang,vllm)", True, True),
    ("worker_type=decode", False, True),
    ("role!=prefill", False, True),
    ("role!=reward", True, True),  # a value the key does not have
    ("missing!=x", True, True),  # a key the worker does not have
    ("missing=x", False, False),
    ("missing in (x)", False, False),
    ("missing notin (x)", True, True),
    ("worker_type notin (prefill, encode)", False, True),
    ("id in (w1,w3)", True, False),
    ("engine=sglang, health=ready", True, False),
    ("  engine = sglang ,worker_type= prefill  ", True, False),
    ("url=http://p1:30000", True, True),
    ('url="http://p1:30000", tp_size in ("1", "2")', True, True),
    ("Engine=sglang", False, False),  # case-sensitive keys
    ("engine=SGLang", False, False),  # and values
])
def test_terms_match_as_smg_documents(text, prefill, decode):
    selector = parse(text)
    assert (selector.matches(SGLANG_PREFILL), selector.matches(SGLANG_DECODE)) == (prefill, decode)


def test_quoted_values_hold_commas_spaces_parentheses_and_escapes():
    selector = parse(r'note="a, b (c)", path="say \"hi\" \\ bye"')
    assert [t.values for t in selector.terms] == [("a, b (c)",), ('say "hi" \\ bye',)]
    assert selector.matches({"note": "a, b (c)", "path": 'say "hi" \\ bye'})
    assert parse('k=""').matches({"k": ""})


@pytest.mark.parametrize("text,offset,words", [
    ("id in (w1,", 10, "expected a value"),
    ("=sglang", 0, "expected a key"),
    ("engine", 6, "expected =, !=, in or notin"),
    ("engine sglang", 7, "expected =, !=, in or notin"),
    ("engine=sglang health=ready", 14, "expected ','"),
    ("engine=sglang,", 14, "expected a key, found the end"),
    ("engine=", 7, "expected a value"),
    ("engine in sglang", 10, "expected '('"),
    ("engine in (a b)", 13, "expected ',' or ')'"),
    ("engine inside (a)", 7, "expected =, !=, in or notin"),
    ('engine="sglang', 14, "unterminated"),
    (r'engine="a\nb"', 9, "escapes"),
    ("eng$ine=x", 3, "expected =, !=, in or notin"),
    ("é=x", 0, "expected a key"),
    ("k=é,=x", 5, "expected a key"),  # byte offsets: é is two bytes
])
def test_a_selector_that_does_not_parse_names_the_byte_offset(text, offset, words):
    with pytest.raises(SelectorError) as caught:
        parse(text)
    assert caught.value.offset == offset, str(caught.value)
    assert words in str(caught.value)
