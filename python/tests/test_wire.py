"""The wire encoding, without a daemon: what goes into a{sv}, how replies and stream lines are
read, and that a generation cleans up in the right order."""

import asyncio
import os

import pytest
from jeepney import DBusAddress, Parser, new_method_call

import leanstream
from leanstream import _wire
from leanstream.errors import error_from_name


def roundtrip(signature, body):
    """Serialises a body with jeepney and parses it back, as the daemon would receive it."""
    addr = DBusAddress("/x", bus_name="a.b", interface="a.b")
    msg = new_method_call(addr, "M", signature, body)
    parser = Parser()
    parser.add_data(msg.serialise(serial=1))
    out = parser.get_next_message()
    assert out.header.fields  # parsed
    return out.body


def test_every_option_has_the_contract_signature():
    opts = _wire.encode_options(
        max_tokens=64, temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.1, seed=2**63,
        stop=["\n\n", "END"], schema={"type": "object"}, priority="background",
        deadline=2.5, first_token_deadline=0.25, sentences=True)
    assert {k: sig for k, (sig, _) in opts.items()} == {
        "max_tokens": "u", "temperature": "d", "top_k": "u", "top_p": "d",
        "repetition_penalty": "d", "seed": "t", "stop": "as", "json_schema": "s",
        "priority": "s", "deadline_ms": "u", "first_token_deadline_ms": "u", "sentences": "b"}
    assert opts["deadline_ms"] == ("u", 2500)
    assert opts["first_token_deadline_ms"] == ("u", 250)
    assert opts["json_schema"] == ("s", '{"type":"object"}')
    # And jeepney can put it on the wire as the daemon's a{sv}.
    (prompt, back) = roundtrip(_wire.GENERATE_SIG, ("hi", opts))
    assert prompt == "hi" and back == opts


def test_lark_and_regex_keys():
    assert _wire.encode_options(lark="start: /a+/") == {"lark": ("s", "start: /a+/")}
    assert _wire.encode_options(regex="[0-9]+") == {"regex": ("s", "[0-9]+")}


def test_absent_options_are_not_sent():
    assert _wire.encode_options() == {}
    assert _wire.encode_options(sentences=False, stop=None) == {}


def test_integers_are_accepted_for_floats_and_strings_as_schemas():
    assert _wire.encode_options(temperature=0) == {"temperature": ("d", 0.0)}
    text = '{"type": "string"}'
    assert _wire.encode_options(schema=text) == {"json_schema": ("s", text)}
    assert _wire.encode_options(stop="x") == {"stop": ("as", ["x"])}


def test_a_positive_deadline_never_rounds_to_none():
    assert _wire.encode_options(deadline=0.0001) == {"deadline_ms": ("u", 1)}
    assert _wire.encode_options(deadline=0) == {"deadline_ms": ("u", 0)}


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": "10"}, {"max_tokens": True}, {"max_tokens": -1}, {"max_tokens": 2**32},
    {"temperature": "hot"}, {"temperature": float("nan")}, {"seed": 2**64}, {"stop": [1]},
    {"priority": 1}, {"deadline": -1}, {"deadline": "soon"}, {"lark": b"x"},
    {"extra_options": {"k": 5}},
])
def test_wrong_python_types_are_refused_before_sending(kwargs):
    with pytest.raises(leanstream.InvalidArgument) as e:
        _wire.encode_options(**kwargs)
    assert isinstance(e.value, ValueError)


def test_extra_options_go_verbatim():
    opts = _wire.encode_options(max_tokens=3, extra_options={"new_key": ("i", -4)})
    assert opts == {"max_tokens": ("u", 3), "new_key": ("i", -4)}


def test_messages_as_dicts_or_pairs():
    msgs = _wire.encode_messages([{"role": "system", "content": "Be brief."},
                                  ("user", "Hi")])
    assert msgs == [("system", "Be brief."), ("user", "Hi")]
    (back, _opts) = roundtrip(_wire.CHAT_SIG, (msgs, {}))
    assert back == msgs
    with pytest.raises(leanstream.InvalidArgument):
        _wire.encode_messages([{"role": "user"}])
    with pytest.raises(leanstream.InvalidArgument):
        _wire.encode_messages(["hello"])


MEMORY_SIG = "(ttta(sttttsttx(tttttt))a(osst)a(sut))"


def test_memory_reply_becomes_dataclasses():
    report = (
        512 << 20, 100 << 20, 150 << 20,
        [("smollm2", 90 << 20, 0, 0, 0, "dense", 0, 3, -1, (80 << 20, 2 << 20, 1, 0, 0, 0))],
        [("/io/github/leanstream/LeanStream1/session/7", "smollm2", ":1.5", 4 << 20)],
        [(":1.5", 1, 4 << 20), ("(other clients)", 2, 8 << 20)],
    )
    (wire,) = roundtrip(MEMORY_SIG, (report,))
    mem = _wire.parse_memory((wire,))
    assert mem.budget_bytes == 512 << 20 and mem.used_bytes == 100 << 20
    assert mem.rss_bytes == 150 << 20
    (m,) = mem.models
    assert (m.name, m.mode, m.idle_seconds, m.unload_in_seconds) == ("smollm2", "dense", 3, -1)
    assert m.parts.weights == 80 << 20 and m.parts.tokenizer == 2 << 20
    assert mem.sessions[0].path.endswith("/7") and mem.sessions[0].client == ":1.5"
    assert [c.client for c in mem.clients] == [":1.5", "(other clients)"]
    assert mem.clients[1].sessions == 2


def test_stats_and_models_replies():
    (wire,) = roundtrip("(suuutttt)", (("smollm2", 256, 40, 2, 30, 30, 0, 0),))
    stats = _wire.parse_stats((wire,))
    assert stats.model == "smollm2" and stats.position == 40 and stats.generations == 2
    assert stats.accepted_draft_tokens == 0
    body = roundtrip("a(sssstb)", ([("smollm2", "gguf", "llama", "Q4_1", 90_000_000, True)],))
    (info,) = _wire.parse_models(body)
    assert info.loaded is True and info.file_bytes == 90_000_000 and info.architecture == "llama"


def test_stream_lines():
    ev = _wire.parse_event(b'{"token":{"id":28120,"text":"Hello"}}\n')
    assert (ev.kind, ev.token_id, ev.text) == ("token", 28120, "Hello")
    assert _wire.parse_event(b'{"sentence":{"text":"Hi there."}}').text == "Hi there."
    done = _wire.parse_event(b'{"done":{"reason":"eos","stats":{"generated_tokens":2}}}').done
    assert done.reason == "eos" and done.stats["generated_tokens"] == 2
    err = _wire.parse_event('{"error":{"name":"OverBudget","message":"no room"}}')
    assert (err.error_name, err.error_message) == ("OverBudget", "no room")
    assert _wire.parse_event(b"\n") is None
    assert _wire.parse_event(b'{"progress":{}}').kind == "unknown"
    with pytest.raises(leanstream.LeanStreamError):
        _wire.parse_event(b"not json")


def test_stream_state_tokens_and_sentences():
    lines = [b'{"token":{"id":1,"text":"Hi"}}', b'{"token":{"id":2,"text":""}}',
             b'{"token":{"id":3,"text":"."}}', b'{"sentence":{"text":"Hi."}}',
             b'{"done":{"reason":"eos","stats":{}}}']
    for sentences, want in ((False, ["Hi", "."]), (True, ["Hi."])):
        state = _wire.StreamState(sentences)
        pieces = [p for p in (state.feed(_wire.parse_event(l)) for l in lines) if p is not None]
        assert pieces == want
        assert state.text == "Hi." and state.token_ids == [1, 2, 3]
        assert state.finished and state.done.reason == "eos"
        state.eof()  # EOF after done is the normal end


def test_stream_state_error_and_truncation():
    state = _wire.StreamState(False)
    with pytest.raises(leanstream.Cancelled) as e:
        state.feed(_wire.parse_event(b'{"error":{"name":"Cancelled","message":"by Cancel()"}}'))
    assert e.value.message == "by Cancel()"
    assert e.value.name == "io.github.leanstream.LeanStream1.Error.Cancelled"
    state = _wire.StreamState(False)
    state.feed(_wire.parse_event(b'{"token":{"id":1,"text":"a"}}'))
    with pytest.raises(leanstream.Truncated):
        state.eof()


@pytest.mark.parametrize("name", ["ModelNotFound", "InvalidArgument", "OverBudget", "Busy",
                                  "InvalidModel", "AccessDenied", "Cancelled", "Internal"])
def test_error_names_map_to_classes(name):
    for wire_name in (name, "io.github.leanstream.LeanStream1.Error." + name):
        err = error_from_name(wire_name, "why")
        assert type(err).__name__ == name
        assert isinstance(err, leanstream.LeanStreamError)
        assert str(err) == f"{name}: why"


def test_other_error_names():
    assert isinstance(error_from_name("org.freedesktop.DBus.Error.ServiceUnknown"),
                      leanstream.Unreachable)
    err = error_from_name("io.github.leanstream.LeanStream1.Error.SomethingNew", "m")
    assert type(err) is leanstream.LeanStreamError and err.name.endswith("SomethingNew")


class FakeSession:
    """Records the calls a Generation makes on its session."""

    def __init__(self):
        self.calls = []
        self.client = self

    def cancel(self):
        self.calls.append("cancel")

    def close(self):
        self.calls.append("close")


def write_lines(fd, lines):
    with os.fdopen(fd, "wb") as w:
        w.write(b"".join(l + b"\n" for l in lines))


TOKENS = [b'{"token":{"id":%d,"text":"t%d "}}' % (i, i) for i in range(3)]
DONE = b'{"done":{"reason":"max_tokens","stats":{"generated_tokens":3}}}'


def test_generation_reads_to_done_and_closes_its_session():
    r, w = os.pipe()
    write_lines(w, TOKENS + [DONE])
    session = FakeSession()
    gen = leanstream.Generation(session, os.fdopen(r, "rb"), False, owns_session=True)
    assert list(gen) == ["t0 ", "t1 ", "t2 "]
    assert gen.reason == "max_tokens" and gen.stats["generated_tokens"] == 3
    assert gen.text == "t0 t1 t2 " and gen.token_ids == [0, 1, 2]
    assert session.calls == ["close"]  # no Cancel for a finished generation
    gen.close()
    assert session.calls == ["close"]


def test_leaving_early_cancels_then_closes():
    r, w = os.pipe()
    write_lines(w, TOKENS)  # still "running": no done yet
    session = FakeSession()
    with leanstream.Generation(session, os.fdopen(r, "rb"), False, owns_session=True) as gen:
        assert next(gen) == "t0 "
    assert session.calls == ["cancel", "close"]
    assert list(gen) == []


def test_a_borrowed_session_stays_open():
    r, w = os.pipe()
    write_lines(w, TOKENS)
    session = FakeSession()
    gen = leanstream.Generation(session, os.fdopen(r, "rb"), False, owns_session=False)
    next(gen)
    gen.close()
    assert session.calls == ["cancel"]


def test_truncated_stream_raises_and_cleans_up():
    r, w = os.pipe()
    write_lines(w, TOKENS)
    session = FakeSession()
    gen = leanstream.Generation(session, os.fdopen(r, "rb"), False, owns_session=True)
    with pytest.raises(leanstream.Truncated):
        list(gen)
    assert session.calls == ["close"]


def test_async_generation_reads_a_pipe():
    from jeepney.fds import FileDescriptor

    from leanstream import aio

    class AsyncFakeSession:
        def __init__(self):
            self.calls = []

        async def cancel(self):
            self.calls.append("cancel")

        async def close(self):
            self.calls.append("close")

    async def main():
        session = AsyncFakeSession()
        r, w = os.pipe()
        write_lines(w, TOKENS + [b'{"sentence":{"text":"t0 t1 t2 "}}', DONE])

        async def start():
            return session, FileDescriptor(r)

        gen = aio.Generation(start, True, owns_session=True)
        pieces = [p async for p in gen]
        assert pieces == ["t0 t1 t2 "] and gen.reason == "max_tokens"
        assert session.calls == ["close"]

        r, w = os.pipe()
        write_lines(w, TOKENS)

        async def start2():
            return session, FileDescriptor(r)

        session.calls.clear()
        async with aio.Generation(start2, False, owns_session=True) as gen:
            assert await gen.__anext__() == "t0 "
        assert session.calls == ["cancel", "close"]

    asyncio.run(main())
