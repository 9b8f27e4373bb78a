"""The asyncio client: the same methods as :class:`leanstream.Client`, as coroutines, and
generations as async iterators.

jeepney's own asyncio connection cannot receive file descriptors, and the token stream *is* a
file descriptor, so this module runs its own small D-Bus connection on the event loop: jeepney
builds and parses the messages, the loop's reader callback receives them with ``recvmsg`` (which
carries the fds), and replies are matched to calls by serial. The token stream is read with
``loop.connect_read_pipe``, so no thread is involved anywhere.

::

    async with leanstream.aio.Client() as client:
        async with client.chat("smollm2", [{"role": "user", "content": "Hi"}]) as gen:
            async for piece in gen:
                print(piece, end="")
"""

from __future__ import annotations

import asyncio
import socket
from itertools import count
from typing import Any, Awaitable, Callable, Dict, Iterable, List, Optional, Set, Tuple

from jeepney import DBusAddress, HeaderFields, Parser, Properties, new_method_call
from jeepney.auth import BEGIN, Authenticator
from jeepney.bus import get_bus
from jeepney.bus_messages import message_bus
from jeepney.fds import FileDescriptor

from . import _wire
from .errors import InvalidArgument, LeanStreamError, Unreachable
from .types import Done, MemoryReport, ModelInfo, SessionStats

__all__ = ["Client", "Session", "Generation"]

# Room for the fds of one message: the reference bus allows 16 per message; be generous.
_FDS_BUF = socket.CMSG_SPACE(256 * 4)
_STREAM_LINE_LIMIT = 1 << 20

# Tasks started from finalizers; held so the loop does not drop them half-way.
_background: Set["asyncio.Task[Any]"] = set()


class _Connection:
    """A D-Bus connection on the running event loop, with fd passing."""

    def __init__(self, sock: socket.socket):
        self._loop = asyncio.get_running_loop()
        self._sock = sock
        self._parser = Parser()
        self._serials = count(start=1)
        self._pending: Dict[int, "asyncio.Future[Any]"] = {}
        self._send_lock = asyncio.Lock()
        self._error: Optional[BaseException] = None
        self.unique_name = ""
        self._loop.add_reader(sock.fileno(), self._readable)

    @classmethod
    async def open(cls, address: str, auth_timeout: float = 10.0) -> "_Connection":
        loop = asyncio.get_running_loop()
        try:
            path = get_bus(address)
        except (OSError, ValueError, KeyError) as e:
            raise Unreachable(f"cannot connect to the bus {address}: {e}") from e
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(cls._authenticate(loop, sock, path), auth_timeout)
        except (OSError, asyncio.TimeoutError, EOFError) as e:
            sock.close()
            raise Unreachable(f"cannot connect to the bus {address}: {e!r}") from e
        except BaseException:
            sock.close()
            raise
        conn = cls(sock)
        try:
            (conn.unique_name,) = await conn.call(message_bus.Hello(), auth_timeout)
        except BaseException:
            conn.close()
            raise
        return conn

    @staticmethod
    async def _authenticate(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                            path: str) -> None:
        await loop.sock_connect(sock, path)
        # Fd passing must be negotiated, or the bus drops the replies that carry the stream.
        auth = Authenticator(enable_fds=True)
        for line in auth:
            await loop.sock_sendall(sock, line)
            data = await loop.sock_recv(sock, 1024)
            if not data:
                raise EOFError("the bus closed the connection during authentication")
            auth.feed(data)
        await loop.sock_sendall(sock, BEGIN)

    def _readable(self) -> None:
        while True:
            try:
                data, anc, flags, _ = self._sock.recvmsg(self._parser.bytes_desired(), _FDS_BUF)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._fail(e)
                return
            if not data:
                self._fail(ConnectionResetError("the bus closed the connection"))
                return
            if flags & getattr(socket, "MSG_CTRUNC", 0):
                self._fail(OSError("file descriptors were truncated"))
                return
            self._parser.add_data(data, FileDescriptor.from_ancdata(anc))
            for msg in iter(self._parser.get_next_message, None):
                serial = msg.header.fields.get(HeaderFields.reply_serial)
                fut = self._pending.pop(serial, None) if serial is not None else None
                if fut is not None and not fut.done():
                    fut.set_result(msg)
                # Anything else (NameAcquired, a reply to a call given up on) is dropped; an fd
                # it carried closes when the message is collected.

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._loop.remove_reader(self._sock.fileno())
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(Unreachable(f"the bus connection broke: {error}"))
        self._pending.clear()

    async def call(self, msg: Any, timeout: Optional[float]) -> Tuple[Any, ...]:
        if self._error is not None:
            raise Unreachable(f"the bus connection is closed: {self._error}")
        serial = next(self._serials)
        fut = self._loop.create_future()
        self._pending[serial] = fut
        try:
            async with self._send_lock:
                try:
                    await self._loop.sock_sendall(self._sock, msg.serialise(serial=serial))
                except OSError as e:
                    self._fail(e)
                    raise Unreachable(f"the bus connection broke: {e}") from e
            reply = await asyncio.wait_for(fut, timeout)
        finally:
            self._pending.pop(serial, None)
        return _wire.unwrap_reply(reply)

    def close(self) -> None:
        if self._error is None:
            self._fail(ConnectionAbortedError("closed by this client"))
        self._sock.close()


class Client:
    """The asyncio counterpart of :class:`leanstream.Client`.

    It connects on ``async with`` or on the first call (or ``await client.connect()``); the
    address rules are the same (None: ``$LEANSTREAM_BUS``, else the system bus).
    """

    def __init__(self, address: Optional[str] = None, *, timeout: Optional[float] = None):
        self.address = _wire.default_address(address)
        self.timeout = timeout
        self._conn: Optional[_Connection] = None
        self._connecting: Optional[asyncio.Lock] = None  # made on the loop that connects
        self._closed = False
        self._manager = DBusAddress(_wire.MANAGER_PATH, bus_name=_wire.BUS_NAME,
                                    interface=_wire.MANAGER_IFACE)

    async def connect(self) -> "Client":
        """Connects now (every method connects on first use anyway)."""
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._closed:
                raise LeanStreamError("the client is closed")
            if self._conn is None:
                self._conn = await _Connection.open(self.address)
        return self

    @property
    def unique_name(self) -> str:
        """This connection's unique bus name ("" before it connects)."""
        return self._conn.unique_name if self._conn else ""

    async def _send(self, msg: Any) -> Tuple[Any, ...]:
        if self._conn is None:
            await self.connect()
        assert self._conn is not None
        return await self._conn.call(msg, self.timeout)

    async def _call(self, address: DBusAddress, method: str, signature: Optional[str] = None,
                    body: tuple = ()) -> Tuple[Any, ...]:
        return await self._send(new_method_call(address, method, signature, body))

    async def close(self) -> None:
        """Closes the connection; the daemon closes this connection's sessions."""
        self._closed = True
        if self._conn is not None:
            self._conn.close()

    aclose = close

    async def __aenter__(self) -> "Client":
        return await self.connect()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def models(self) -> List[ModelInfo]:
        """See :meth:`leanstream.Client.models`."""
        return _wire.parse_models(await self._call(self._manager, "ListModels"))

    async def load(self, model: str, keep_alive: Optional[float] = None) -> None:
        """See :meth:`leanstream.Client.load`."""
        from .client import _keep_alive

        if keep_alive is None:
            await self._call(self._manager, "LoadModel", "s", (model,))
        else:
            await self._call(self._manager, "LoadModelFor", "sx", (model, _keep_alive(keep_alive)))

    async def unload(self, model: str) -> None:
        """See :meth:`leanstream.Client.unload`."""
        await self._call(self._manager, "UnloadModel", "s", (model,))

    async def memory(self) -> MemoryReport:
        """See :meth:`leanstream.Client.memory`."""
        return _wire.parse_memory(await self._call(self._manager, "Memory"))

    async def counters(self) -> Dict[str, int]:
        """See :meth:`leanstream.Client.counters`."""
        (counters,) = await self._call(self._manager, "Counters")
        return dict(counters)

    async def version(self) -> str:
        """The daemon's version."""
        ((_sig, value),) = await self._send(Properties(self._manager).get("Version"))
        return value

    async def backend(self) -> str:
        """``cpu`` or ``cuda``."""
        ((_sig, value),) = await self._send(Properties(self._manager).get("Backend"))
        return value

    async def session(self, model: str, context: int = 0) -> "Session":
        """See :meth:`leanstream.Client.session`; use it as ``async with await
        client.session(...)`` or close it yourself."""
        if not _wire._is_int(context) or context < 0:
            raise InvalidArgument(f"context must be a non-negative int, not {context!r}")
        (path,) = await self._call(self._manager, "OpenSession", "su", (model, context))
        return Session(self, path)

    def generate(self, model: str, prompt: str, **options: Any) -> "Generation":
        """An async iterator of text pieces, in a session of its own. Nothing is sent until the
        first ``async for`` step (or ``async with``), so a refusal raises there."""
        opts = _wire.encode_options(**options)
        if not isinstance(prompt, str):
            raise InvalidArgument(f"the prompt must be a str, not {type(prompt).__name__}")

        async def start() -> Tuple["Session", FileDescriptor]:
            return await self._start_owned(model, "Generate", _wire.GENERATE_SIG, (prompt, opts))

        return Generation(start, bool(options.get("sentences")), owns_session=True)

    def chat(self, model: str, messages: Iterable[_wire.Message], **options: Any) -> "Generation":
        """Like :meth:`generate` for a conversation (``GenerateChat``)."""
        opts = _wire.encode_options(**options)
        msgs = _wire.encode_messages(messages)

        async def start() -> Tuple["Session", FileDescriptor]:
            return await self._start_owned(model, "GenerateChat", _wire.CHAT_SIG, (msgs, opts))

        return Generation(start, bool(options.get("sentences")), owns_session=True)

    async def _start_owned(self, model: str, method: str, sig: str,
                           body: tuple) -> Tuple["Session", FileDescriptor]:
        session = await self.session(model)
        try:
            (fd,) = await self._call(session._address, method, sig, body)
        except BaseException:
            await session.close()
            raise
        return session, fd


class Session:
    """See :class:`leanstream.Session`; ``cancel``, ``stats`` and ``close`` are coroutines."""

    def __init__(self, client: Client, path: str):
        self.client = client
        self.path = path
        self._address = DBusAddress(path, bus_name=_wire.BUS_NAME,
                                    interface=_wire.SESSION_IFACE)
        self._closed = False

    def generate(self, prompt: str, **options: Any) -> "Generation":
        """An async iterator of text pieces from ``prompt`` in this session."""
        opts = _wire.encode_options(**options)
        if not isinstance(prompt, str):
            raise InvalidArgument(f"the prompt must be a str, not {type(prompt).__name__}")
        return self._generation("Generate", _wire.GENERATE_SIG, (prompt, opts), options)

    def chat(self, messages: Iterable[_wire.Message], **options: Any) -> "Generation":
        """An async iterator of the answer to a conversation in this session."""
        opts = _wire.encode_options(**options)
        body = (_wire.encode_messages(messages), opts)
        return self._generation("GenerateChat", _wire.CHAT_SIG, body, options)

    def _generation(self, method: str, sig: str, body: tuple,
                    options: Dict[str, Any]) -> "Generation":
        async def start() -> Tuple[Session, FileDescriptor]:
            (fd,) = await self.client._call(self._address, method, sig, body)
            return self, fd

        return Generation(start, bool(options.get("sentences")), owns_session=False)

    async def cancel(self) -> None:
        """Cancels the generation in progress."""
        await self.client._call(self._address, "Cancel")

    async def stats(self) -> SessionStats:
        """The session's counters."""
        return _wire.parse_stats(await self.client._call(self._address, "Stats"))

    async def close(self) -> None:
        """Closes the session; harmless twice or after the client closed."""
        if not self._closed and not self.client._closed:
            self._closed = True
            await self.client._call(self._address, "Close")

    async def __aenter__(self) -> "Session":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class Generation:
    """See :class:`leanstream.Generation`: ``async for`` it; ``done``, ``text``, ``reason`` and
    ``stats`` after the loop; ``await gen.aclose()`` (or ``async with``) to leave early.

    A generation dropped without ``aclose`` still has its stream closed (which cancels it) and
    its own session closed by a task, but the loop may get to that later: prefer
    ``async with`` when breaking out of the loop.
    """

    def __init__(self, start: Callable[[], Awaitable[Tuple[Session, FileDescriptor]]],
                 sentences: bool, owns_session: bool):
        self._start: Optional[Callable[[], Awaitable[Tuple[Session, FileDescriptor]]]] = start
        self._state = _wire.StreamState(sentences)
        self._owns_session = owns_session
        self.session: Optional[Session] = None
        self._reader: Optional[asyncio.StreamReader] = None
        self._transport: Optional[asyncio.ReadTransport] = None

    text = property(lambda self: self._state.text, doc="Everything generated so far.")
    token_ids = property(lambda self: list(self._state.token_ids),
                         doc="The ids of the tokens generated so far.")
    done: Optional[Done] = property(lambda self: self._state.done,  # type: ignore[assignment]
                                    doc="The done event once the stream ended normally.")
    reason = property(lambda self: self._state.done.reason if self._state.done else None)
    stats = property(lambda self: self._state.done.stats if self._state.done else None)

    async def _ensure_started(self) -> None:
        if self._start is None:
            return
        start, self._start = self._start, None
        self.session, fd = await start()
        try:
            loop = asyncio.get_running_loop()
            reader = asyncio.StreamReader(limit=_STREAM_LINE_LIMIT)
            pipe = fd.to_file("rb", buffering=0)
            self._transport, _ = await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), pipe)
            self._reader = reader
        except BaseException:
            self._state.finished = True
            if self._owns_session:
                await self.session.close()
            raise

    def __aiter__(self) -> "Generation":
        return self

    async def __anext__(self) -> str:
        await self._ensure_started()
        while self._reader is not None:
            try:
                line = await self._reader.readline()
                if not line:
                    self._state.eof()
                piece = self._state.feed(_wire.parse_event(line))
            except BaseException:
                # An error event ended it; anything else (a cancelled task) leaves it running.
                await self._finish(cancel=not self._state.finished)
                raise
            if self._state.finished:
                await self._finish()
            if piece is not None:
                return piece
        raise StopAsyncIteration

    async def _finish(self, cancel: bool = False) -> None:
        transport, self._transport = self._transport, None
        self._reader = None
        if transport is None:
            return
        try:
            if cancel and self.session is not None:
                try:
                    await self.session.cancel()
                except LeanStreamError:
                    pass
        finally:
            transport.close()
            if self._owns_session and self.session is not None:
                await self.session.close()

    async def aclose(self) -> None:
        """Cancels the generation if it is still running and closes the session it opened."""
        if self._start is not None:  # never started: nothing was sent
            self._start = None
            self._state.finished = True
            return
        await self._finish(cancel=not self._state.finished)

    async def __aenter__(self) -> "Generation":
        await self._ensure_started()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def __del__(self) -> None:
        transport = getattr(self, "_transport", None)
        if transport is None:
            return
        self._transport = None
        try:
            transport.close()  # closing the stream cancels the generation
            if self._owns_session and self.session is not None:
                task = asyncio.get_running_loop().create_task(self.session.close())
                _background.add(task)
                task.add_done_callback(_background.discard)
        except Exception:  # noqa: BLE001 - a finalizer has no one to report to
            pass

