"""The wire contract, kept apart from any I/O so it is unit-tested without a daemon.

Everything here turns Python values into D-Bus bodies and D-Bus bodies and stream lines back
into the dataclasses of :mod:`leanstream.types`. The sync and asyncio clients share it, so they
cannot drift apart in how they encode an option or read an event.
"""

from __future__ import annotations

import json
import math
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from .errors import InvalidArgument, LeanStreamError, Truncated, error_from_name
from .types import (ClientMemory, Done, Event, MemoryReport, ModelInfo, ModelMemory, ModelParts,
                    SessionMemory, SessionStats)

BUS_NAME = "io.github.leanstream.LeanStream1"
MANAGER_PATH = "/io/github/leanstream/LeanStream1"
MANAGER_IFACE = BUS_NAME + ".Manager"
SESSION_IFACE = BUS_NAME + ".Session"

OPTIONS_SIG = "a{sv}"
GENERATE_SIG = "s" + OPTIONS_SIG
CHAT_SIG = "a(ss)" + OPTIONS_SIG

_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1

# A variant as jeepney sends it: (signature, value).
Variant = Tuple[str, Any]
Message = Union[Mapping[str, str], Sequence[str]]


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but True as a token count is a bug worth reporting.
    return isinstance(value, int) and not isinstance(value, bool)


def _uint(key: str, value: Any, limit: int, sig: str) -> Variant:
    if not _is_int(value):
        raise InvalidArgument(f"{key} must be an int, not {type(value).__name__}")
    if not 0 <= value <= limit:
        raise InvalidArgument(f"{key} must be in 0..={limit}, not {value}")
    return (sig, value)


def _float(key: str, value: Any) -> Variant:
    if not (_is_int(value) or isinstance(value, float)):
        raise InvalidArgument(f"{key} must be a number, not {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise InvalidArgument(f"{key} must be finite, not {value}")
    return ("d", value)


def _str(key: str, value: Any) -> Variant:
    if not isinstance(value, str):
        raise InvalidArgument(f"{key} must be a str, not {type(value).__name__}")
    return ("s", value)


def _seconds_to_ms(key: str, value: Any) -> Variant:
    """Deadlines are seconds in Python (as everywhere in the standard library) and whole
    milliseconds on the wire; a positive deadline never rounds down to 0 (= none)."""
    if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
        raise InvalidArgument(f"{key} must be a number of seconds, not {value!r}")
    if value < 0:
        raise InvalidArgument(f"{key} must not be negative, not {value}")
    ms = math.ceil(value * 1000)
    return _uint(key, ms, _U32_MAX, "u")


def encode_options(
    *,
    max_tokens: Optional[int] = None,
    temperature: Optional[float] = None,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    repetition_penalty: Optional[float] = None,
    seed: Optional[int] = None,
    stop: Union[None, str, Iterable[str]] = None,
    schema: Union[None, str, Mapping[str, Any], bool] = None,
    lark: Optional[str] = None,
    regex: Optional[str] = None,
    priority: Optional[str] = None,
    deadline: Optional[float] = None,
    first_token_deadline: Optional[float] = None,
    sentences: bool = False,
    extra_options: Optional[Mapping[str, Variant]] = None,
) -> Dict[str, Variant]:
    """The ``a{sv}`` options dict for Generate/GenerateChat.

    Only the options given are sent (None = absent = the daemon's default), so the daemon's
    defaults stay the daemon's. Python types are checked here because a wrong one would
    otherwise be sent as some other D-Bus type and come back as a less clear refusal.
    ``extra_options`` is sent verbatim as ``{key: (signature, value)}``: the way to use an option
    a newer daemon has and this package does not know yet.
    """
    out: Dict[str, Variant] = {}
    if max_tokens is not None:
        out["max_tokens"] = _uint("max_tokens", max_tokens, _U32_MAX, "u")
    if temperature is not None:
        out["temperature"] = _float("temperature", temperature)
    if top_k is not None:
        out["top_k"] = _uint("top_k", top_k, _U32_MAX, "u")
    if top_p is not None:
        out["top_p"] = _float("top_p", top_p)
    if repetition_penalty is not None:
        out["repetition_penalty"] = _float("repetition_penalty", repetition_penalty)
    if seed is not None:
        out["seed"] = _uint("seed", seed, _U64_MAX, "t")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else list(stop)
        for s in stops:
            _str("stop", s)
        out["stop"] = ("as", stops)
    if schema is not None:
        # A schema is JSON; a dict is the natural way to write one in Python.
        text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))
        out["json_schema"] = ("s", text)
    if lark is not None:
        out["lark"] = _str("lark", lark)
    if regex is not None:
        out["regex"] = _str("regex", regex)
    if priority is not None:
        out["priority"] = _str("priority", priority)
    if first_token_deadline is not None:
        out["first_token_deadline_ms"] = _seconds_to_ms("first_token_deadline",
                                                        first_token_deadline)
    if deadline is not None:
        out["deadline_ms"] = _seconds_to_ms("deadline", deadline)
    if sentences:
        out["sentences"] = ("b", True)
    for key, variant in (extra_options or {}).items():
        if not (isinstance(variant, tuple) and len(variant) == 2 and isinstance(variant[0], str)):
            raise InvalidArgument(
                f"extra_options[{key!r}] must be a (signature, value) tuple like ('u', 5)")
        out[key] = variant
    return out


def encode_messages(messages: Iterable[Message]) -> List[Tuple[str, str]]:
    """Chat messages as ``a(ss)``: dicts with ``role`` and ``content`` (the shape every LLM API
    uses) or ``(role, content)`` pairs."""
    out = []
    for m in messages:
        if isinstance(m, Mapping):
            try:
                role, content = m["role"], m["content"]
            except KeyError as e:
                raise InvalidArgument(f"a chat message needs 'role' and 'content': {m!r}") from e
        else:
            try:
                role, content = m
            except (TypeError, ValueError) as e:
                raise InvalidArgument(
                    f"a chat message is a dict or a (role, content) pair: {m!r}") from e
        if not isinstance(role, str) or not isinstance(content, str):
            raise InvalidArgument(f"a chat message's role and content are str: {m!r}")
        out.append((role, content))
    return out


def parse_models(body: Tuple[Any, ...]) -> List[ModelInfo]:
    """``ListModels`` reply body ``(a(sssstb),)``."""
    (rows,) = body
    return [ModelInfo(*row) for row in rows]


def parse_memory(body: Tuple[Any, ...]) -> MemoryReport:
    """``Memory`` reply body: one struct ``(ttta(sttttsttx(tttttt))a(osst)a(sut))``."""
    (report,) = body
    budget, used, rss, models, sessions, clients = report
    return MemoryReport(
        budget_bytes=budget,
        used_bytes=used,
        rss_bytes=rss,
        models=[ModelMemory(*m[:9], parts=ModelParts(*m[9])) for m in models],
        sessions=[SessionMemory(*s) for s in sessions],
        clients=[ClientMemory(*c) for c in clients],
    )


def parse_stats(body: Tuple[Any, ...]) -> SessionStats:
    """``Stats`` reply body: one struct ``(suuutttt)``."""
    (stats,) = body
    return SessionStats(*stats)


def parse_event(line: Union[bytes, str]) -> Optional[Event]:
    """One line of the token stream as an :class:`Event`; None for a blank line."""
    if isinstance(line, bytes):
        line = line.decode("utf-8")
    line = line.strip()
    if not line:
        return None
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise LeanStreamError(f"the token stream sent a line that is not JSON: {line[:200]!r}") \
            from e
    if "token" in obj:
        tok = obj["token"]
        return Event("token", text=tok.get("text", ""), token_id=tok.get("id"))
    if "sentence" in obj:
        return Event("sentence", text=obj["sentence"].get("text", ""))
    if "done" in obj:
        d = obj["done"]
        return Event("done", done=Done(reason=d.get("reason", ""), stats=d.get("stats", {})))
    if "error" in obj:
        e = obj["error"]
        return Event("error", error_name=e.get("name", "Internal"),
                     error_message=e.get("message", ""))
    return Event("unknown")


class StreamState:
    """What a generation has seen so far, and which events become yielded pieces.

    Fed one event at a time by the sync or the async reader; :meth:`feed` returns the text to
    yield (or None), records ``done``, and raises the daemon's exception for an ``error``
    event. ``text`` and ``token_ids`` accumulate every token, also in sentence mode, so the
    whole answer is there after the loop whichever pieces were yielded.
    """

    def __init__(self, sentences: bool) -> None:
        self.sentences = sentences
        self.pieces: List[str] = []
        self.token_ids: List[int] = []
        self.done: Optional[Done] = None
        self.finished = False

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def feed(self, event: Optional[Event]) -> Optional[str]:
        if event is None or event.kind == "unknown":
            return None
        if event.kind == "token":
            if event.token_id is not None:
                self.token_ids.append(event.token_id)
            self.pieces.append(event.text)
            # An empty text is half a UTF-8 character: nothing to show yet.
            return event.text if (not self.sentences and event.text) else None
        if event.kind == "sentence":
            return event.text if (self.sentences and event.text) else None
        self.finished = True
        if event.kind == "done":
            self.done = event.done
            return None
        raise error_from_name(event.error_name, event.error_message)

    def eof(self) -> None:
        """The stream reached EOF: fine after done or error, a broken generation otherwise."""
        if not self.finished:
            self.finished = True
            raise Truncated("the token stream ended without a done event (the daemon stopped?)")


def unwrap_reply(msg: Any) -> Tuple[Any, ...]:
    """A method reply's body, or the matching :mod:`leanstream.errors` exception for an error
    reply (jeepney's own ``DBusErrorResponse`` would make every app map names itself)."""
    from jeepney import HeaderFields, MessageType

    if msg.header.message_type == MessageType.error:
        name = msg.header.fields.get(HeaderFields.error_name, "")
        body = msg.body
        message = body[0] if body and isinstance(body[0], str) else ""
        raise error_from_name(name, message)
    return msg.body


def default_address(address: Optional[str]) -> str:
    """The bus to connect to: the one given, else ``$LEANSTREAM_BUS`` (so a test harness or a
    developer's shell can point every client at a private daemon), else the system bus, where
    leanstreamd runs as a service."""
    import os

    return address or os.environ.get("LEANSTREAM_BUS") or "SYSTEM"
