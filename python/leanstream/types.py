"""Plain data returned by the client: one dataclass per D-Bus struct, fields in wire order.

The field names follow the Rust client's (``client/src/contract.rs``) so the two read alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass(frozen=True)
class ModelInfo:
    """One entry of ``ListModels() -> a(sssstb)``."""

    name: str
    format: str
    """``lsm`` or ``gguf``."""
    architecture: str
    """``llama``, ``qwen2``, ``qwen3``, ``gemma3`` (or ``unknown`` with the reason)."""
    quantization: str
    file_bytes: int
    loaded: bool


@dataclass(frozen=True)
class ModelParts:
    """What a loaded model holds by part, ``(tttttt)`` (all 0 while it loads)."""

    weights: int
    """Weight bytes read into memory (resident)."""
    tokenizer: int
    tables: int
    """f32 tables."""
    ring: int
    """The memory planner's stream ring."""
    streamed_whole: int
    """Weight bytes the plan streams whole through the ring every token."""
    streamed_sparse: int
    """Weight bytes of FFN layers streamed by neuron through the neuron cache."""


@dataclass(frozen=True)
class ModelMemory:
    """A loaded model in ``Memory()``: ``(sttttsttx(tttttt))``."""

    name: str
    resident_bytes: int
    cache_bytes: int
    """The neuron cache's bytes now."""
    cache_floor_bytes: int
    cache_wanted_bytes: int
    mode: str
    """``dense``, ``mmap``, ``on-demand``, ``prefetch``, ``leanstream`` or ``dense+neuron``."""
    streamed_bytes_per_token: int
    idle_seconds: int
    """Seconds since its last session closed."""
    unload_in_seconds: int
    """Seconds until it unloads on its own, -1 when it will not."""
    parts: ModelParts


@dataclass(frozen=True)
class SessionMemory:
    """An open session in ``Memory()``: ``(osst)``."""

    path: str
    model: str
    client: str
    """The owning connection's unique bus name."""
    bytes: int


@dataclass(frozen=True)
class ClientMemory:
    """A client in ``Memory()``: ``(sut)``. Other users' clients appear summed as one entry
    named ``(other clients)`` unless the caller is an admin."""

    client: str
    sessions: int
    bytes: int


@dataclass(frozen=True)
class MemoryReport:
    """``Memory() -> (ttta(sttttsttx(tttttt))a(osst)a(sut))``."""

    budget_bytes: int
    used_bytes: int
    rss_bytes: int
    """The daemon's resident memory (VmRSS)."""
    models: List[ModelMemory] = field(default_factory=list)
    sessions: List[SessionMemory] = field(default_factory=list)
    """Only the caller's own sessions (all of them for an admin)."""
    clients: List[ClientMemory] = field(default_factory=list)


@dataclass(frozen=True)
class SessionStats:
    """``Session.Stats() -> (suuutttt)``."""

    model: str
    context_tokens: int
    position: int
    """Tokens in the session's KV cache now."""
    generations: int
    generated_tokens: int
    decode_passes: int
    """generated_tokens / decode_passes is the tokens per pass of speculative decoding."""
    draft_tokens: int
    accepted_draft_tokens: int


@dataclass(frozen=True)
class Done:
    """The stream's final ``done`` event.

    ``reason`` is ``eos``, ``max_tokens``, ``stop_string`` or ``context_full``; ``stats`` is the
    event's dict as sent (``prompt_tokens``, ``generated_tokens``, ``time_to_first_token_s``,
    ``decode_tokens_per_s``, ``cached_prompt_tokens``, ``priority``, ``missed_deadlines``, ...),
    kept as a dict so fields a newer daemon adds are not dropped.
    """

    reason: str
    stats: Dict[str, Any]


@dataclass(frozen=True)
class Event:
    """One parsed line of the token stream. ``kind`` is ``token``, ``sentence``, ``done``,
    ``error`` or ``unknown`` (an event a newer daemon added: skipped by the iterators)."""

    kind: str
    text: str = ""
    token_id: Optional[int] = None
    done: Optional[Done] = None
    error_name: str = ""
    error_message: str = ""
