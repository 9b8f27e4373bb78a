"""The official `openai` Python SDK, unchanged, against leanstream-openai.

Run by scripts/test-openai, which starts the real daemon and the endpoint and sets
OPENAI_TEST_BASE_URL (http://127.0.0.1:PORT/v1) and LEANSTREAM_MODEL. Exits non-zero on the
first failed check, and prints 'N passed, 0 failed' when all pass.
"""

import json
import os
import sys

import openai
from openai import OpenAI

BASE_URL = os.environ["OPENAI_TEST_BASE_URL"]
MODEL = os.environ.get("LEANSTREAM_MODEL", "smollm2")
client = OpenAI(base_url=BASE_URL, api_key="unused", max_retries=0, timeout=120)

checks = []


def check(fn):
    checks.append(fn)
    return fn


@check
def models_list():
    ids = [m.id for m in client.models.list()]
    assert MODEL in ids, ids
    assert client.models.retrieve(MODEL).id == MODEL


@check
def streamed_chat_matches_the_whole_one():
    messages = [{"role": "user", "content": "Tell me a short story about a robot."}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=32, temperature=0
    )
    text = whole.choices[0].message.content
    assert text, whole
    assert whole.usage.completion_tokens > 0 and whole.usage.total_tokens == (
        whole.usage.prompt_tokens + whole.usage.completion_tokens
    ), whole.usage
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                finish = choice.finish_reason
    assert "".join(pieces) == text, ("".join(pieces), text)
    assert finish == whole.choices[0].finish_reason, (finish, whole.choices[0].finish_reason)
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens, usage


@check
def json_schema_response_format():
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a person as JSON with a name and an age."}],
        max_tokens=128,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema, "strict": True},
        },
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop", choice
    person = json.loads(choice.message.content)
    assert isinstance(person["name"], str) and isinstance(person["age"], int), person


@check
def text_completion_and_length():
    answer = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0
    )
    assert answer.choices[0].finish_reason == "length", answer
    assert answer.usage.completion_tokens == 5, answer.usage


@check
def errors_are_typed():
    try:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "Hi"}]
        )
    except openai.NotFoundError as e:
        assert e.status_code == 404 and e.body["code"] == "model_not_found", e.body
    else:
        raise AssertionError("an unknown model was accepted")
    try:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2
        )
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.body["param"] == "n", e.body
    else:
        raise AssertionError("n=2 was accepted")


failed = 0
for fn in checks:
    try:
        fn()
        print(f"ok   {fn.__name__}")
    except Exception as e:  # noqa: BLE001 - report every check
        failed += 1
        print(f"FAIL {fn.__name__}: {type(e).__name__}: {e}")
print(f"{len(checks) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
