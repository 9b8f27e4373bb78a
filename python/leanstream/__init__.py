"""Python client for leanstreamd, the on-device LLM inference daemon, over D-Bus.

::

    import leanstream

    with leanstream.Client() as client:              # $LEANSTREAM_BUS, else the system bus
        for piece in client.chat("smollm2", [{"role": "user", "content": "Hi!"}]):
            print(piece, end="", flush=True)

Blocking API here; the same with ``async``/``await`` in :mod:`leanstream.aio`. The wire contract
is ``docs/clients.md`` in the LeanStream repository.
"""

from .client import Client, Generation, Session
from .errors import (AccessDenied, Busy, Cancelled, Internal, InvalidArgument, InvalidModel,
                     LeanStreamError, ModelNotFound, OverBudget, Truncated, Unreachable)
from .types import (ClientMemory, Done, MemoryReport, ModelInfo, ModelMemory, ModelParts,
                    SessionMemory, SessionStats)

__version__ = "0.1.0"

__all__ = [
    "Client", "Session", "Generation",
    "LeanStreamError", "ModelNotFound", "InvalidArgument", "OverBudget", "Busy", "InvalidModel",
    "AccessDenied", "Cancelled", "Internal", "Unreachable", "Truncated",
    "ModelInfo", "MemoryReport", "ModelMemory", "ModelParts", "SessionMemory", "ClientMemory",
    "SessionStats", "Done",
]
