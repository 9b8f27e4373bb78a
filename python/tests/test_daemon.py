"""The client against the real leanstreamd serving SmolLM2-135M-Instruct (see conftest.py)."""

import asyncio
import json
import os
import time

import pytest

import leanstream
from leanstream import aio

pytestmark = pytest.mark.daemon

HELLO = [{"role": "user", "content": "Write one short sentence about robots."}]
STORY = [{"role": "user", "content": "Tell me a long story about a robot arm in a factory. "
                                     "Use many short sentences."}]


def settled_stats(session, generations):
    """Stats() once it counts ``generations``: the daemon writes a stream's last event before it
    updates the session's counters, so Stats() right after ``done`` may lag by one turn."""
    for _ in range(100):
        stats = session.stats()
        if stats.generations >= generations:
            return stats
        time.sleep(0.02)
    return stats


PLANNER = {
    "type": "object",
    "properties": {"action": {"enum": ["pick", "place"]}, "object": {"type": "string"}},
    "required": ["action", "object"],
}


def test_models_lists_the_test_model(client, model):
    models = {m.name: m for m in client.models()}
    assert model in models
    m = models[model]
    assert m.format == "gguf" and m.architecture == "llama" and m.file_bytes > 1_000_000
    assert isinstance(m.loaded, bool)


def test_version_and_backend(client):
    assert client.version()
    assert client.backend() in ("cpu", "cuda")


def test_greedy_generation_is_deterministic(client, model):
    a = client.chat(model, HELLO, max_tokens=16)
    text_a = "".join(a)
    b = client.chat(model, HELLO, max_tokens=16, temperature=0)
    text_b = "".join(b)
    assert text_a.strip(), "the model produced no text"
    assert text_a == text_b == a.text
    assert a.token_ids == b.token_ids
    assert a.reason in ("eos", "max_tokens")


def test_raw_generate_streams_pieces(client, model):
    gen = client.generate(model, "The robot arm", max_tokens=8)
    pieces = list(gen)
    assert len(pieces) >= 2 and all(isinstance(p, str) and p for p in pieces)
    # Every token's text is in a sentence; the daemon leaves out the whitespace between them.
    squash = lambda s: "".join(s.split())  # noqa: E731
    assert squash("".join(pieces)) == squash(gen.text)
    assert gen.stats["prompt_tokens"] > 0


def test_max_tokens_bounds_the_token_count(client, model):
    gen = client.chat(model, STORY, max_tokens=5)
    list(gen)
    assert gen.reason == "max_tokens"
    assert len(gen.token_ids) == 5 == gen.stats["generated_tokens"]


def test_sampling_with_a_seed_repeats(client, model):
    opts = dict(max_tokens=12, temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1,
                seed=1234)
    assert "".join(client.chat(model, HELLO, **opts)) == "".join(client.chat(model, HELLO, **opts))


def test_stop_string_ends_the_generation(client, model):
    greedy = "".join(client.chat(model, STORY, max_tokens=40))
    assert " " in greedy.strip()
    word = greedy.strip().split()[1]
    gen = client.chat(model, STORY, max_tokens=40, stop=[word])
    text = "".join(gen)
    assert gen.reason == "stop_string"
    assert len(text) < len(greedy)


def test_json_schema_chat_returns_valid_json(client, model):
    msgs = [{"role": "system", "content": "You control a robot arm. Answer in JSON."},
            {"role": "user", "content": "Pick up the red cup."}]
    gen = client.chat(model, msgs, schema=PLANNER, max_tokens=64)
    text = "".join(gen)
    assert gen.reason == "eos", text
    plan = json.loads(text)
    assert set(plan) >= {"action", "object"}
    assert plan["action"] in ("pick", "place") and isinstance(plan["object"], str)
    # The schema as a JSON string works the same.
    assert "".join(client.chat(model, msgs, schema=json.dumps(PLANNER), max_tokens=64)) == text


def test_regex_constrains_the_output(client, model):
    gen = client.chat(model, HELLO, regex="[0-9]{3}", max_tokens=10)
    text = "".join(gen)
    assert len(text) == 3 and text.isdigit(), text


def test_background_priority(client, model):
    gen = client.chat(model, HELLO, max_tokens=6, priority="background")
    assert "".join(gen)
    assert gen.stats["priority"] == "background"


def test_realtime_priority_as_root(client, model):
    gen = client.chat(model, HELLO, max_tokens=6, priority="realtime")
    if os.geteuid() != 0:
        with pytest.raises(leanstream.AccessDenied):
            list(gen)
        return
    assert "".join(gen)
    assert gen.stats["priority"] == "realtime"


def test_deadlines_are_goals(client, model):
    gen = client.chat(model, STORY, max_tokens=8, deadline=0.001, first_token_deadline=60)
    list(gen)
    assert gen.reason == "max_tokens"  # it still ran to its end
    assert "end" in gen.stats["missed_deadlines"]
    assert "first_token" not in gen.stats["missed_deadlines"]


def test_unknown_model_raises_model_not_found(client):
    with pytest.raises(leanstream.ModelNotFound):
        client.chat("no-such-model", HELLO)
    with pytest.raises(leanstream.ModelNotFound):
        client.load("no-such-model")
    assert client.memory().sessions == []


def test_bad_options_raise_invalid_argument(client, model):
    # Refused by the daemon: a wrong D-Bus type, an unknown key, two grammars, a bad priority.
    for bad in ({"extra_options": {"max_tokens": ("s", "ten")}},
                {"extra_options": {"temperature": ("s", "hot")}},
                {"extra_options": {"no_such_option": ("u", 1)}},
                {"regex": "[0-9]+", "lark": "start: /a/"},
                {"priority": "urgent"},
                {"schema": "{not json"}):
        with pytest.raises(leanstream.InvalidArgument):
            list(client.chat(model, HELLO, max_tokens=4, **bad))
    # Refused here, before sending: a Python value of the wrong type.
    with pytest.raises(leanstream.InvalidArgument):
        client.chat(model, HELLO, max_tokens="ten")
    with pytest.raises(leanstream.InvalidArgument):
        client.chat(model, [{"role": "robot", "content": "hi"}], max_tokens=4)
    assert client.memory().sessions == []


def test_integer_types_are_accepted_for_integer_options(client, model):
    # The daemon takes any D-Bus integer type in range (Python has no u32).
    base = "".join(client.chat(model, HELLO, max_tokens=4))
    for sig in ("y", "n", "q", "i", "x", "t"):
        gen = client.chat(model, HELLO, extra_options={"max_tokens": (sig, 4)})
        assert "".join(gen) == base, sig


def test_closing_the_iterator_early_leaves_no_session(client, model):
    gen = client.chat(model, STORY, max_tokens=200)
    assert next(gen)
    assert len(client.memory().sessions) == 1
    gen.close()
    assert client.memory().sessions == []

    with client.chat(model, STORY, max_tokens=200) as gen:
        next(gen)
    assert client.memory().sessions == []

    # A plain `break` from a for loop over a temporary: CPython collects it at once.
    for _ in client.chat(model, STORY, max_tokens=200):
        break
    assert client.memory().sessions == []


def test_cancel_ends_the_stream_with_cancelled(client, model):
    with client.session(model) as session:
        gen = session.chat(STORY, max_tokens=200)
        assert next(gen)
        session.cancel()
        with pytest.raises(leanstream.Cancelled):
            list(gen)
        assert len(gen.token_ids) < 200
        # The session is still usable afterwards.
        assert "".join(session.chat(HELLO, max_tokens=4))
    assert client.memory().sessions == []


def test_session_reuses_the_cache_across_turns(client, model):
    with client.session(model, context=256) as session:
        first = session.chat(HELLO, max_tokens=12)
        answer = "".join(first)
        turn2 = HELLO + [{"role": "assistant", "content": answer},
                         {"role": "user", "content": "And one more."}]
        second = session.chat(turn2, max_tokens=12)
        assert "".join(second)
        assert second.stats["cached_prompt_tokens"] > 0
        stats = settled_stats(session, 2)
        assert stats.model == model and stats.generations == 2
        assert stats.context_tokens == 256 and 0 < stats.position <= 256
        assert stats.generated_tokens == len(first.token_ids) + len(second.token_ids)
        assert [s.path for s in client.memory().sessions] == [session.path]
    assert client.memory().sessions == []


def test_sentences_yield_whole_sentences(client, model):
    gen = client.chat(model, STORY, max_tokens=60, sentences=True)
    pieces = list(gen)
    assert len(pieces) >= 2, pieces
    for piece in pieces[:-1]:
        assert piece.endswith("\n") or piece.rstrip()[-1:] in ".!?;:", repr(piece)
    # Every token's text is in a sentence; the daemon leaves out the whitespace between them.
    squash = lambda s: "".join(s.split())  # noqa: E731
    assert squash("".join(pieces)) == squash(gen.text)


def test_memory_figures_are_plausible(client, model):
    mem = client.memory()
    assert 0 < mem.budget_bytes and mem.used_bytes <= mem.budget_bytes and mem.rss_bytes > 0
    with client.session(model) as session:
        "".join(session.chat(HELLO, max_tokens=2))
        mem = client.memory()
        assert mem.used_bytes <= mem.budget_bytes
        (s,) = mem.sessions
        assert (s.path, s.model, s.client) == (session.path, model, client.unique_name)
        loaded = {m.name: m for m in mem.models}
        assert loaded[model].resident_bytes > 0
        mine = [c for c in mem.clients if c.client == client.unique_name]
        assert mine and mine[0].sessions == 1


def test_counters_count_calls_refusals_and_tokens(client, model):
    before = client.counters()
    gen = client.generate(model, "Hello", max_tokens=3)
    "".join(gen)
    with pytest.raises(leanstream.ModelNotFound):
        client.session("no-such-model")
    # The generation's end reaches the counters just after its stream's last event.
    deadline = time.monotonic() + 10
    while True:
        after = client.counters()
        grew = lambda key: after.get(key, 0) - before.get(key, 0)  # noqa: E731
        if grew("tokens.generated") > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert grew("tokens.generated") == gen.done.stats["generated_tokens"]
    assert grew("requests.Generate") == 1
    assert grew("requests.OpenSession") == 2
    assert grew("refusals.ModelNotFound") == 1
    assert after[f"model_load_ms.{model}"] >= 0 and after[f"model_loads.{model}"] >= 1
    assert after["uptime_seconds"] >= 0


def test_load_and_unload(client, model):
    client.load(model)
    assert {m.name: m.loaded for m in client.models()}[model]
    client.unload(model)
    client.load(model, keep_alive=30)
    assert {m.name: m.loaded for m in client.models()}[model]
    client.unload(model)
    with pytest.raises(leanstream.InvalidArgument):
        client.load(model, keep_alive=0)


def test_closing_the_client_closes_its_sessions(address, model):
    with leanstream.Client(address) as other:
        other.session(model)
        other.session(model)
        assert len(other.memory().sessions) == 2
    with leanstream.Client(address) as c:
        assert c.memory().sessions == []


def test_unreachable_bus():
    with pytest.raises(leanstream.Unreachable):
        leanstream.Client("unix:path=/nonexistent/leanstream-bus")


def test_asyncio_client_streams_the_same_greedy_text(client, address, model):
    sync_text = "".join(client.chat(model, HELLO, max_tokens=16))

    async def main():
        async with aio.Client(address) as ac:
            models = await ac.models()
            assert model in [m.name for m in models]
            pieces = [p async for p in ac.chat(model, HELLO, max_tokens=16)]
            # In a session, with an early exit.
            async with await ac.session(model) as session:
                async with session.chat(STORY, max_tokens=200) as gen:
                    await gen.__anext__()
                    assert len((await ac.memory()).sessions) == 1
                for _ in range(100):  # Stats() may lag the stream's end (see settled_stats)
                    stats = await session.stats()
                    if stats.generations:
                        break
                    await asyncio.sleep(0.02)
                assert stats.generations == 1  # a cancelled turn counts too
            assert (await ac.memory()).sessions == []
            with pytest.raises(leanstream.ModelNotFound):
                async for _ in ac.chat("no-such-model", HELLO):
                    pass
            return pieces

    pieces = asyncio.run(main())
    assert len(pieces) > 1
    assert "".join(pieces) == sync_text


def test_asyncio_generations_run_concurrently(address, model):
    async def main():
        async with aio.Client(address) as ac:
            async def one(prompt):
                gen = ac.chat(model, [{"role": "user", "content": prompt}], max_tokens=8)
                return "".join([p async for p in gen]), gen.stats

            return await asyncio.gather(one("Name a color."), one("Name an animal."))

    (a, sa), (b, sb) = asyncio.run(main())
    assert a and b
    assert sa["generated_tokens"] <= 8 and sb["generated_tokens"] <= 8


def test_asyncio_break_without_aclose_still_closes_the_session(address, model):
    async def main():
        async with aio.Client(address) as ac:
            async for _ in ac.chat(model, STORY, max_tokens=200):
                break  # the dropped generation's finalizer closes its stream and session
            for _ in range(100):
                if not (await ac.memory()).sessions:
                    return True
                await asyncio.sleep(0.05)
            return False

    assert asyncio.run(main())


def test_two_sessions_stream_interleaved_on_one_client(client, model):
    with client.session(model) as one, client.session(model) as two:
        a = one.chat(HELLO, max_tokens=10)
        b = two.chat(HELLO, max_tokens=10)
        pieces_a, pieces_b = [], []
        for pa, pb in zip(a, b):
            pieces_a.append(pa)
            pieces_b.append(pb)
        pieces_a += list(a)
        pieces_b += list(b)
        # Greedy and the same conversation: the same text, whichever ran when.
        assert "".join(pieces_a) == "".join(pieces_b) == a.text
        assert len(client.memory().sessions) == 2
