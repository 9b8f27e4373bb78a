//! The neuron cache: an arena of equal, page-aligned slots holding FFN neuron chunks read from
//! the model file, with retention priorities deciding what to evict, and a slot count that can
//! change between reads (elastic caches).
//!
//! Owned by the single engine thread, so it has no locks: the I/O workers only ever see a slot as a
//! [`ReadTarget`](crate::io::ReadTarget) between [`NeuronCache::reserve`] and [`NeuronCache::complete`]. Everything is
//! sized at construction or by [`NeuronCache::resize`]; the per-token path allocates nothing.
//!
//! Slot life cycle: Free → (`reserve`) Loading → (`complete(ok)`) Ready → (eviction, `evict`,
//! `clear`) Free; a failed or cancelled read goes Loading → Free (`complete(false)`, `abandon`).
//!
//! Resizing (`resize`, never while a removed slot is Loading): growing appends Free slots;
//! shrinking evicts Ready chunks, lowest retention first, until the chunks fit, moves the Ready
//! chunks of removed slots into Free slots below the new end (a chunk keeps its state, pins and
//! counters; only its slot id changes), and gives the removed slots' memory back to the OS. The
//! arena is one reserved address range whose usable prefix is the slots (see `arena`), so the
//! slots stay contiguous at a fixed address for a device registration.

mod arena;
mod heap;
mod neuron;
#[cfg(test)]
mod tests;

pub use neuron::NeuronCache;

/// A slot of the arena, numbered `0..capacity_slots`.
pub type SlotId = u32;

/// Where a chunk is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// Not cached.
    Absent,
    /// A read into this slot is in flight.
    Loading(SlotId),
    /// Its bytes are in this slot.
    Ready(SlotId),
}

/// Which Ready slot [`NeuronCache::reserve`] may evict when no slot is free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Evict {
    /// The lowest-retention evictable slot, whatever its retention (LRU-style baselines).
    Any,
    /// The lowest-retention evictable slot only if its retention is not higher than the new
    /// chunk's: a chunk never displaces one the policy values more.
    NotHigher,
}

/// Cache counters since construction or the last `reset_stats`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Accesses that found the chunk Ready and loaded before the current token.
    pub hits: u64,
    /// Accesses that did not: absent, still loading, or loaded during the current token.
    pub misses: u64,
    /// Ready chunks evicted to make room (or by `evict`).
    pub evictions: u64,
    /// Bytes of successful reads completed into slots.
    pub bytes_loaded: u64,
    /// Bytes loaded and then evicted or cleared without ever being accessed.
    pub bytes_unused: u64,
    /// Number of slots now (changed by `resize`).
    pub capacity_slots: u64,
    /// Bytes per slot (fixed, a multiple of [`PAGE`](crate::io::PAGE)).
    pub slot_bytes: u64,
}
