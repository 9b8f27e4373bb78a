"""The blocking client: one D-Bus connection, calls answered in order, token streams read with
plain blocking reads. For asyncio apps see :mod:`leanstream.aio`.
"""

from __future__ import annotations

import math
import threading
from typing import IO, Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

from jeepney import DBusAddress, Properties, new_method_call
from jeepney.io.blocking import open_dbus_connection

from . import _wire
from .errors import InvalidArgument, LeanStreamError, Unreachable
from .types import Done, MemoryReport, ModelInfo, SessionStats

__all__ = ["Client", "Session", "Generation"]


class Client:
    """A connection to leanstreamd.

    ``address`` is a D-Bus address (``unix:path=/run/x/bus``), ``"SYSTEM"`` or ``"SESSION"``;
    None means ``$LEANSTREAM_BUS`` if set, else the system bus. Sessions belong to the
    connection that opened them, so keep one ``Client`` for as long as you use its sessions;
    closing it closes them all on the daemon's side. ``timeout`` (seconds) bounds each call's
    wait for its reply (None: wait as long as the daemon takes, e.g. to load a model).

    A ``Client`` may be shared between threads (calls are serialised), but one generation's
    iterator should be read by one thread.
    """

    def __init__(self, address: Optional[str] = None, *, timeout: Optional[float] = None):
        self.address = _wire.default_address(address)
        self.timeout = timeout
        try:
            # Fd passing must be negotiated, or the bus drops the replies that carry the stream.
            self._conn = open_dbus_connection(bus=self.address, enable_fds=True)
        except (OSError, ValueError, KeyError) as e:
            raise Unreachable(f"cannot connect to the bus {self.address}: {e}") from e
        self._lock = threading.Lock()
        self._orphans: List[str] = []  # sessions a garbage-collected Generation could not close
        self._closed = False
        self._manager = DBusAddress(_wire.MANAGER_PATH, bus_name=_wire.BUS_NAME,
                                    interface=_wire.MANAGER_IFACE)

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def unique_name(self) -> str:
        """This connection's unique bus name, as ``Memory()`` lists it for its sessions."""
        return self._conn.unique_name

    def _call(self, address: DBusAddress, method: str, signature: Optional[str] = None,
              body: tuple = ()) -> tuple:
        return self._send(new_method_call(address, method, signature, body))

    def _send(self, msg: Any) -> tuple:
        with self._lock:
            if self._closed:
                raise LeanStreamError("the client is closed")
            self._close_orphans()
            reply = self._conn.send_and_get_reply(msg, timeout=self.timeout)
        return _wire.unwrap_reply(reply)

    def _close_orphans(self) -> None:
        # Called with the lock held.
        while self._orphans:
            path = self._orphans.pop()
            addr = _session_address(path)
            try:
                self._conn.send_and_get_reply(new_method_call(addr, "Close"), timeout=self.timeout)
            except Exception:  # noqa: BLE001 - best effort for a session nobody holds
                pass

    def close(self) -> None:
        """Closes the connection; the daemon closes this connection's sessions."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._conn.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- manager calls ----------------------------------------------------------------------

    def models(self) -> List[ModelInfo]:
        """The models in the daemon's model directory, loaded or not."""
        return _wire.parse_models(self._call(self._manager, "ListModels"))

    def load(self, model: str, keep_alive: Optional[float] = None) -> None:
        """Loads ``model`` ahead of use. Without ``keep_alive`` it stays loaded until
        :meth:`unload` (a pin); with it, ``keep_alive`` seconds after its last session closes
        (-1 pins it too). Loading first takes the load time out of the first generation."""
        if keep_alive is None:
            self._call(self._manager, "LoadModel", "s", (model,))
        else:
            self._call(self._manager, "LoadModelFor", "sx", (model, _keep_alive(keep_alive)))

    def unload(self, model: str) -> None:
        """Gives up this user's pin or lifetime on ``model``; it unloads when no one else
        holds it (``Busy`` while it has sessions)."""
        self._call(self._manager, "UnloadModel", "s", (model,))

    def memory(self) -> MemoryReport:
        """The daemon's memory report: budget, use, loaded models, this client's sessions."""
        return _wire.parse_memory(self._call(self._manager, "Memory"))

    def counters(self) -> Dict[str, int]:
        """Counters for operators since the daemon started, by name: ``requests.Generate``,
        ``refusals.Busy``, ``tokens.generated``, ``ttft_us.interactive.sum``,
        ``model_load_ms.<model>``, … (docs/clients.md lists them)."""
        (counters,) = self._call(self._manager, "Counters")
        return dict(counters)

    def version(self) -> str:
        """The daemon's version (property ``Version``)."""
        return self._property("Version")

    def backend(self) -> str:
        """``cpu`` or ``cuda`` (property ``Backend``)."""
        return self._property("Backend")

    def _property(self, name: str) -> Any:
        ((_sig, value),) = self._send(Properties(self._manager).get(name))
        return value

    def session(self, model: str, context: int = 0) -> "Session":
        """Opens a session on ``model`` for a multi-turn conversation: the daemon keeps its KV
        cache between generations and reuses it when the next prompt extends the previous
        one. ``context`` is its context in tokens (0 = the daemon's default)."""
        if not _wire._is_int(context) or context < 0:
            raise InvalidArgument(f"context must be a non-negative int, not {context!r}")
        (path,) = self._call(self._manager, "OpenSession", "su", (model, context))
        return Session(self, path)

    # -- one-shot generation ----------------------------------------------------------------

    def generate(self, model: str, prompt: str, **options: Any) -> "Generation":
        """Generates from a raw ``prompt`` (sent as is: for a base model, or a prompt already in
        the model's chat format) in a session of its own that closes when the generation ends
        or is closed. Iterate the result for text pieces; options as :meth:`Session.generate`."""
        return self._one_shot(model, _request("Generate", prompt, options))

    def chat(self, model: str, messages: Iterable[_wire.Message], **options: Any) -> "Generation":
        """Like :meth:`generate` for a conversation: ``messages`` are ``{"role": ...,
        "content": ...}`` dicts (role ``system``, ``user``, ``assistant`` or ``tool``), rendered
        by the model's chat template, so an instruct model answers the last one."""
        return self._one_shot(model, _request("GenerateChat", messages, options))

    def _one_shot(self, model: str, request: "_Request") -> "Generation":
        # The options were checked before the session is opened: a bad one costs no round trip.
        session = self.session(model)
        try:
            return session._start(request, owns_session=True)
        except BaseException:
            session.close()
            raise


def _keep_alive(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(f"keep_alive must be a number of seconds, not {value!r}")
    return int(value) if value == -1 else math.ceil(value)


# (method, signature, body, sentences): a checked, encoded Generate or GenerateChat call.
_Request = Tuple[str, str, tuple, bool]


def _request(method: str, what: Any, options: Mapping[str, Any]) -> _Request:
    opts = _wire.encode_options(**options)
    sentences = bool(options.get("sentences"))
    if method == "Generate":
        if not isinstance(what, str):
            raise InvalidArgument(f"the prompt must be a str, not {type(what).__name__}")
        return method, _wire.GENERATE_SIG, (what, opts), sentences
    return method, _wire.CHAT_SIG, (_wire.encode_messages(what), opts), sentences


def _session_address(path: str) -> DBusAddress:
    return DBusAddress(path, bus_name=_wire.BUS_NAME, interface=_wire.SESSION_IFACE)


class Session:
    """A session on a model, for multi-turn use. Its KV cache stays between generations; a
    prompt (or conversation) that extends the previous one computes only the new tokens.
    Only the client that opened it may use it. One generation at a time."""

    def __init__(self, client: Client, path: str):
        self.client = client
        self.path = path
        self._address = _session_address(path)
        self._closed = False

    def generate(self, prompt: str, **options: Any) -> "Generation":
        """Starts generating from ``prompt`` and returns the :class:`Generation` to iterate.

        Options (all optional; None = the daemon's default): ``max_tokens``, ``temperature``
        (0 = greedy), ``top_k``, ``top_p``, ``repetition_penalty``, ``seed``, ``stop`` (a str or
        a list), ``schema`` (a JSON Schema as dict or str), ``lark``, ``regex``, ``priority``
        (``background``, ``interactive``, ``realtime``), ``deadline`` and
        ``first_token_deadline`` (seconds; goals, not limits), ``sentences`` (yield whole
        sentences instead of tokens), ``extra_options`` (``{key: (signature, value)}`` sent
        verbatim). The call is made now, so a refusal raises here, not at the first piece.
        """
        return self._start(_request("Generate", prompt, options), owns_session=False)

    def chat(self, messages: Iterable[_wire.Message], **options: Any) -> "Generation":
        """Generates the answer to a conversation (send the whole conversation each turn; the
        daemon reuses the cache for the part it has seen). Options as :meth:`generate`."""
        return self._start(_request("GenerateChat", messages, options), owns_session=False)

    def _start(self, request: "_Request", owns_session: bool) -> "Generation":
        method, signature, body, sentences = request
        (fd,) = self.client._call(self._address, method, signature, body)
        return Generation(self, fd.to_file("rb"), sentences, owns_session)

    def cancel(self) -> None:
        """Cancels the generation in progress; its stream ends with ``Cancelled``."""
        self.client._call(self._address, "Cancel")

    def stats(self) -> SessionStats:
        """The session's counters: position in its context, generations, tokens."""
        return _wire.parse_stats(self.client._call(self._address, "Stats"))

    def close(self) -> None:
        """Closes the session and frees its KV cache. Closing twice, or after the client
        closed (which closed the session on the daemon's side), is harmless."""
        if not self._closed and not self.client._closed:
            self._closed = True
            self.client._call(self._address, "Close")

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Generation:
    """A generation in progress: iterate it for text pieces (tokens, or whole sentences with
    ``sentences=True``). After the loop, ``done`` has the end's reason and stats, and ``text``
    the whole output. An ``error`` event raises its exception from the loop.

    Leaving early is safe: ``close()`` (also called by ``with``, and when the object is
    garbage-collected) cancels the generation, and closes its session if it opened one.
    """

    def __init__(self, session: Session, stream: IO[bytes], sentences: bool,
                 owns_session: bool):
        self.session = session
        self._stream: Optional[IO[bytes]] = stream
        self._state = _wire.StreamState(sentences)
        self._owns_session = owns_session

    @property
    def text(self) -> str:
        """Everything generated so far (all tokens, whatever the pieces yielded)."""
        return self._state.text

    @property
    def token_ids(self) -> List[int]:
        """The ids of the tokens generated so far."""
        return list(self._state.token_ids)

    @property
    def done(self) -> Optional[Done]:
        """The ``done`` event once the stream ended normally, else None."""
        return self._state.done

    @property
    def reason(self) -> Optional[str]:
        """``eos``, ``max_tokens``, ``stop_string`` or ``context_full`` once done."""
        return self._state.done.reason if self._state.done else None

    @property
    def stats(self) -> Optional[dict]:
        """The ``done`` event's stats dict once done."""
        return self._state.done.stats if self._state.done else None

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        while self._stream is not None:
            line = self._stream.readline()
            try:
                if not line:
                    self._state.eof()
                piece = self._state.feed(_wire.parse_event(line))
            except BaseException:
                # An error event ended it; anything else (KeyboardInterrupt) leaves it running.
                self._finish(cancel=not self._state.finished)
                raise
            if self._state.finished:
                self._finish()
            if piece is not None:
                return piece
        raise StopIteration

    def _finish(self, cancel: bool = False) -> None:
        stream, self._stream = self._stream, None
        if stream is None:
            return
        try:
            if cancel:
                try:
                    self.session.cancel()
                except LeanStreamError:
                    pass  # It ended meanwhile; closing the stream cancels it anyway.
        finally:
            stream.close()
            if self._owns_session:
                self.session.close()

    def close(self) -> None:
        """Stops reading: cancels the generation if it is still running and closes the session
        it opened. Safe to call at any time, and more than once."""
        self._finish(cancel=not self._state.finished)

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_stream", None) is None:
            return
        client = self.session.client
        # The garbage collector may run us in the middle of one of this client's calls (in this
        # thread): never block on the lock or use the connection then. Closing the stream alone
        # cancels the generation; the session is closed by the client's next call.
        if client._lock.acquire(blocking=False):
            client._lock.release()
            try:
                self.close()
            except Exception:  # noqa: BLE001 - nothing to report to from a finalizer
                pass
        else:
            stream, self._stream = self._stream, None
            stream.close()
            if self._owns_session:
                self.session._closed = True
                client._orphans.append(self.session.path)
