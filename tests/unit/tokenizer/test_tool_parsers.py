"""Tool-call parsers (services/detokenizer/tool_parsers): every parser and mode, fed whole, one
character at a time and in random splits; the joined pieces must give exactly the calls and the
content the text holds."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.services.detokenizer.tool_parsers import (
    PARSERS,
    GuardedParser,
    ToolParser,
    ToolParserErrors,
    make_parser,
)
from kvflow.services.detokenizer.tool_parsers.guard import parser_errors
from kvflow.services.detokenizer.tool_parsers.hermes import START
from kvflow.services.detokenizer.tool_parsers.json_scan import JsonScanner
from kvflow.shared.messages import ToolCallDelta, ToolParsing

HERMES = ToolParsing("auto", parser="hermes")
LLAMA = ToolParsing("auto", parser="llama3_json")
REQUIRED = ToolParsing("required")
ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}\Z")


def run(tp: ToolParsing | ToolParser, pieces: list[str]):
    """Feed the pieces and finish; returns (content, [(name, arguments text)], tools_called)
    after checking the shape of the call pieces."""
    p = make_parser(tp) if isinstance(tp, ToolParsing) else tp
    content, calls = "", []
    for piece in pieces:
        c, k = p.feed(piece)
        content, calls = content + c, calls + k
    c, k = p.finish()
    return content + c, join(calls), p.tools_called


def join(pieces: list[ToolCallDelta]) -> list[tuple[str, str]]:
    """Calls from their pieces, as the gateway joins them, checking each call's first piece
    (and only it) carries an id and a name, and that indexes count up from 0."""
    ids: list[str] = []
    out: list[list[str]] = []
    for d in pieces:
        if d.index == len(out):
            assert d.id is not None and ID.match(d.id) and d.name, d
            ids.append(d.id)
            out.append([d.name, d.arguments])
        else:
            assert d.index == len(out) - 1 and d.id is None and d.name is None, d
            out[d.index][1] += d.arguments
    assert len(set(ids)) == len(ids)
    return [(name, args) for name, args in out]


def splits(text: str) -> list[list[str]]:
    return [[text], list(text), [text[i : i + 3] for i in range(0, len(text), 3)]]


def check(tp: ToolParsing, text: str, content: str, calls: list[tuple[str, str]]) -> None:
    for pieces in splits(text):
        got_content, got_calls, called = run(tp, pieces)
        assert got_content == content, pieces
        assert got_calls == calls, pieces
        assert called == bool(calls)


ARGS = '{"city": "Par\\"is \\u00e9 é 🙂", "n": [1, -2.5e3, null, true, {}], "s": "a}\\\\"}'
TWO = f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>\n'
TWO += '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'

HERMES_CASES = [
    # content before, two calls, the whitespace between and after them is not content
    (TWO, "Let me check.\n", [("get_weather", ARGS), ("f", "{}")]),
    ("plain text, no calls", "plain text, no calls", []),
    ("a <tool_ b <tool_call", "a <tool_ b <tool_call", []),  # held back, then content
    ("<tool_call>oops</tool_call> after", "<tool_call>oops</tool_call> after", []),
    ('x<tool_call>{"name": 5}</tool_call>', 'x<tool_call>{"name": 5}</tool_call>', []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f', '<tool_call>{"name": "f', []),  # cut before it was a call
    ('<tool_call>{"name": "f", "argu', "", [("f", "")]),  # cut after: the call as sent
    # content after the calls (leading whitespace dropped)
    (
        '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n\nDone.',
        "Done.",
        [("f", '{"a": 1}')],
    ),
    # lenient: the object's closing brace or the closing tag is missing
    ('<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>ok', "ok", [("f", '{"a": 1}')]),
    ('<tool_call>{"name":"f","arguments":{"a":1}}', "", [("f", '{"a":1}')]),
    # arguments written before the name; a call without arguments
    ('<tool_call>{"arguments": {"a": [1]}, "name": "g"}</tool_call>', "", [("g", '{"a": [1]}')]),
    ('<tool_call>{"name": "now"}</tool_call>', "", [("now", "{}")]),
    # a malformed call after a good one is content; the good one stays
    (
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>[1]</tool_call>',
        "<tool_call>[1]</tool_call>",
        [("f", "{}")],
    ),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    check(HERMES, text, content, calls)
    for _, args in calls:
        assert args == "" or isinstance(json.loads(args), dict)


def test_hermes_streams_name_first_then_arguments_as_they_arrive() -> None:
    p = make_parser(HERMES)
    assert p.feed("Sure. <tool_") == ("Sure. ", [])  # the tag's start is held back
    assert p.feed('call>{"name": "get_wea') == ("", [])
    _, k = p.feed('ther", "arguments": {"ci')
    assert [(d.index, d.name, d.arguments) for d in k] == [(0, "get_weather", '{"ci')]
    _, k = p.feed('ty": "Paris"}}</tool_call>')
    assert [(d.id, d.arguments) for d in k] == [(None, 'ty": "Paris"}')]
    assert p.tools_called and p.finish() == ("", [])


def test_hermes_call_broken_after_its_first_piece_ends_where_it_broke() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"a": 1,,}}</tool_call>ok'
    for pieces in splits(text):
        content, calls, called = run(HERMES, pieces)
        assert (content, calls, called) == ("ok", [("f", '{"a": 1,')], True)


LLAMA_CASES = [
    (
        '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {"b": "x"}}',
        "",
        [("f", '{"a": 1}'), ("g", '{"b": "x"}')],
    ),
    ('\n{"name": "f", "parameters": ' + ARGS + "}", "", [("f", ARGS)]),
    ("Hello {\"name\": 'f'}", "Hello {\"name\": 'f'}", []),
    (' {"nam": 1} x', ' {"nam": 1} x', []),  # not a call: all of the text, as written
    ('{"name": "f", "parameters": {}} thanks', "thanks", [("f", "{}")]),
    ("  ", "  ", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA_CASES)
def test_llama3_json(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    check(LLAMA, text, content, calls)


REQUIRED_CASES = [
    (
        '[{"name": "f", "parameters": {"a": "é\\"}"}}, {"name": "g", "parameters": {}}]',
        "",
        [("f", '{"a": "é\\"}"}'), ("g", "{}")],
    ),
    ('  [ {"name":"f","parameters":{"x":[1,2]}} ]  ', "", [("f", '{"x":[1,2]}')]),
    ("[]", "", []),
    # cut by max_tokens in the arguments: what was generated is sent
    ('[{"name": "f", "parameters": {"a": "hel', "", [("f", '{"a": "hel')]),
    ("no array", "no array", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), REQUIRED_CASES)
def test_required(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    check(REQUIRED, text, content, calls)


def test_named_sends_id_and_name_before_any_text_then_every_piece_as_arguments() -> None:
    p = make_parser(ToolParsing("named", name="get_weather"))
    _, first = p.feed("")
    assert len(first) == 1 and first[0].name == "get_weather" and ID.match(first[0].id or "")
    assert p.tools_called
    text = '{"city": "Paris \\"é\\""}'
    for pieces in splits(text):
        assert run(ToolParsing("named", name="f"), pieces) == ("", [("f", text)], True)


def test_make_parser_knows_the_settings_choices_and_refuses_others() -> None:
    assert set(PARSERS) == {"hermes", "llama3_json"}
    with pytest.raises(ValueError):
        make_parser(ToolParsing("auto", parser="mistral"))
    with pytest.raises(ValueError):
        make_parser(ToolParsing("sometimes"))
    with pytest.raises(ValueError):
        make_parser(ToolParsing("named"))


class _Boom(ToolParser):
    def __init__(self, after: int) -> None:
        self.left = after

    def feed(self, text: str):
        self.left -= 1
        if self.left < 0:
            raise RuntimeError("parser bug")
        return "", []  # holds everything back

    def finish(self):
        return "", []


def test_guard_turns_a_failing_parser_into_content_and_counts_it() -> None:
    before = parser_errors()
    g = GuardedParser(_Boom(after=2), "r1")
    assert g.feed("ab") == ("", []) and g.feed("cd") == ("", [])
    assert g.feed("ef") == ("abcdef", [])  # what it held back comes out too
    assert g.feed("gh") == ("gh", []) and g.finish() == ("", [])
    assert g.failed and not g.tools_called and parser_errors() == before + 1
    metric = next(iter(ToolParserErrors().collect()))
    assert metric.samples[0].value == before + 1


# ---- random splits and random arguments (hypothesis)

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
ARG_OBJECTS = st.dictionaries(st.text(), JSON_VALUES, max_size=5)


def cut(text: str, points: list[int]) -> list[str]:
    at = sorted({p % (len(text) + 1) for p in points})
    return [text[a:b] for a, b in zip([0, *at], [*at, len(text)], strict=True)]


@settings(max_examples=100, deadline=None)
@given(
    args=st.lists(ARG_OBJECTS, min_size=1, max_size=3),
    before=st.text(alphabet="<tool_ca>/ \n{}é", max_size=14).filter(lambda s: START not in s),
    ascii_only=st.booleans(),
    indent=st.sampled_from([None, 2]),
    points=st.lists(st.integers(min_value=0), max_size=30),
)
def test_hermes_random_calls_and_splits(args, before, ascii_only, indent, points) -> None:
    raw = [json.dumps(a, ensure_ascii=ascii_only, indent=indent) for a in args]
    text = before + "".join(
        f'<tool_call>\n{{"name": "f{i}", "arguments": {r}}}\n</tool_call>\n'
        for i, r in enumerate(raw)
    )
    content, calls, called = run(HERMES, cut(text, points))
    assert content == before and called
    assert calls == [(f"f{i}", r) for i, r in enumerate(raw)]
    assert [json.loads(r) for _, r in calls] == args


@settings(max_examples=75, deadline=None)
@given(args=st.lists(ARG_OBJECTS, min_size=1, max_size=3), points=st.lists(st.integers(0)))
def test_required_and_llama_random_calls_and_splits(args, points) -> None:
    objs = [{"name": f"f{i}", "parameters": a} for i, a in enumerate(args)]
    expected = [(f"f{i}", json.dumps(a)) for i, a in enumerate(args)]
    text = json.dumps(objs)
    assert run(REQUIRED, cut(text, points))[:2] == ("", expected)
    text = "<|python_tag|>" + "; ".join(json.dumps(o) for o in objs)
    assert run(LLAMA, cut(text, points))[:2] == ("", expected)


@settings(max_examples=150, deadline=None)
@given(value=JSON_VALUES, drop=st.integers(min_value=0), points=st.lists(st.integers(0)))
def test_json_scanner_agrees_with_json_loads(value, drop, points) -> None:
    text = "[" + json.dumps(value, ensure_ascii=False) + "] "
    broken = text[: drop % len(text)] + text[drop % len(text) + 1 :]  # one character less
    for t in (text, broken):
        s = JsonScanner()
        pos = 0
        for piece in cut(t, points):
            pos += len(piece)
            s.scan(t[:pos])
        try:
            json.loads(t)
            valid = True
        except ValueError:
            valid = False
        assert (s.end is not None and s.error is None and not t[s.end :].strip()) == valid, t


@pytest.mark.parametrize(
    "text",
    [
        '{"a": 1,}',
        "[1, 2,]",
        "[,]",
        '{"a" 1}',
        "[1 2]",
        '{"a": 01}',
        '{"a": 1.}',
        '{"a": -}',
        '{"a": tru}',
        '{"a": nul }',
        '"a\nb"',
        '"\\x"',
        '"\\u12G4"',
        "{1: 2}",
        '{"a": 1}}',
        "{'a': 1}",
        "[}",
    ],
)
def test_json_scanner_refuses_what_json_loads_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        json.loads(text)
    for pieces in splits(text):
        s = JsonScanner()
        pos = 0
        for piece in pieces:
            pos += len(piece)
            s.scan(text[:pos])
        assert s.error is not None or (s.end is not None and text[s.end :].strip()), pieces
