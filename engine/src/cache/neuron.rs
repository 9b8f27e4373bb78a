//! [`NeuronCache`]: slots, their states, and the eviction index.

use std::ptr::NonNull;

mod resize;

use super::arena::Arena;
use super::heap::{EvictionHeap, retention_key};
use super::{CacheStats, Evict, Lookup, SlotId};
use crate::io::{PAGE, ReadTarget};
use crate::model::lsm::ChunkId;
use crate::{Error, Result};
use resize::slots_for;

/// Marks "no slot" in `slot_of` and "no chunk" in a free slot.
const NONE: u32 = u32::MAX;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Free,
    Loading,
    Ready,
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    state: State,
    /// The chunk held (meaningless when Free).
    chunk: ChunkId,
    retention: f32,
    pins: u32,
    /// Token epoch in which the read completed.
    loaded_epoch: u64,
    /// Accessed since it was reserved.
    used: bool,
}

const FREE_SLOT: Slot = Slot {
    state: State::Free,
    chunk: NONE,
    retention: 0.0,
    pins: 0,
    loaded_epoch: 0,
    used: false,
};

/// The neuron cache. Invariants (checked by `check_invariants` in tests):
/// - `slot_of[c] == s` ⇔ `slots[s]` is Loading or Ready with `chunk == c` (a chunk is in at most
///   one slot, a slot holds at most one chunk);
/// - the free list holds exactly the Free slots; the eviction heap exactly the Ready, unpinned
///   slots, keyed by retention;
/// - `base` points at the arena; slot `s` is bytes `s*slot_bytes..(s+1)*slot_bytes`, and the
///   arena's usable prefix is exactly the `slots.len()` slots (the rest is released);
/// - `floor_slots <= slots.len() <= total_chunks` (unless the cache holds every chunk).
#[derive(Debug)]
pub struct NeuronCache {
    /// Owns the memory `base` points into; only ever used to commit or release whole slot
    /// ranges, so that slices of Ready slots and I/O writes into Loading slots never alias a
    /// whole-arena borrow.
    arena: Arena,
    base: NonNull<u8>,
    slot_bytes: usize,
    /// The fewest slots the cache may have (`min_slots` of `new`, capped at `total_chunks`).
    floor_slots: usize,
    slot_of: Vec<u32>,
    slots: Vec<Slot>,
    free: Vec<SlotId>,
    evictable: EvictionHeap,
    epoch: u64,
    stats: CacheStats,
}

// SAFETY: `base` points into `_arena`, which the cache owns; the only other users of the memory are
// I/O threads writing Loading slots through ReadTargets, which the submitter's safety contract
// covers, so moving the cache to another thread is as sound as moving a Vec.
unsafe impl Send for NeuronCache {}
// SAFETY: &self methods only read Ready slots (`data`), which no one writes.
unsafe impl Sync for NeuronCache {}

impl NeuronCache {
    /// A cache for chunks `0..total_chunks` of `slot_bytes` each (a positive multiple of [`PAGE`]),
    /// with as many slots as `budget_bytes` holds (never more than `total_chunks`). `min_slots`
    /// is its floor: the fewest slots it may ever have, here and in [`NeuronCache::resize`].
    ///
    /// Address space for `total_chunks` slots is reserved; memory only for the slots the budget
    /// gives, and only as reads fill them (see the `arena` module).
    ///
    /// Fails with [`Error::OverBudget`], naming the bytes needed, when the budget holds fewer than
    /// `min_slots` slots (or all chunks, if fewer); with [`Error::InvalidArgument`] on a bad slot
    /// size or more than `u32::MAX - 1` chunks.
    pub fn new(
        total_chunks: usize,
        slot_bytes: usize,
        budget_bytes: u64,
        min_slots: usize,
    ) -> Result<Self> {
        if slot_bytes == 0 || !slot_bytes.is_multiple_of(PAGE) {
            return Err(Error::InvalidArgument {
                arg: "slot_bytes",
                reason: format!("{slot_bytes} is not a positive multiple of {PAGE}"),
            });
        }
        if total_chunks >= NONE as usize {
            return Err(Error::InvalidArgument {
                arg: "total_chunks",
                reason: format!("{total_chunks} does not fit chunk ids (u32)"),
            });
        }
        let floor_slots = min_slots.min(total_chunks);
        let n = slots_for(budget_bytes, slot_bytes, total_chunks, floor_slots)?;
        let os = |source| Error::Os {
            what: format!(
                "reserving a neuron cache arena of {total_chunks} slots of {slot_bytes} bytes"
            ),
            source,
        };
        let reserve = total_chunks
            .checked_mul(slot_bytes)
            .ok_or_else(|| os(std::io::Error::from(std::io::ErrorKind::OutOfMemory)))?;
        let arena = Arena::new(reserve).map_err(os)?;
        arena
            .commit(0..n * slot_bytes)
            .map_err(|source| Error::Os {
                what: format!("committing a neuron cache of {n} slots of {slot_bytes} bytes"),
                source,
            })?;
        let base = arena.base();
        Ok(NeuronCache {
            arena,
            base,
            slot_bytes,
            floor_slots,
            slot_of: vec![NONE; total_chunks],
            slots: vec![FREE_SLOT; n],
            free: (0..n as u32).rev().collect(),
            evictable: EvictionHeap::new(n),
            epoch: 0,
            stats: CacheStats {
                capacity_slots: n as u64,
                slot_bytes: slot_bytes as u64,
                ..CacheStats::default()
            },
        })
    }

    /// The arena's first byte and its length in bytes. Slots are carved from it as the type's
    /// docs say; a caller may register the range with a device but must not write through it.
    pub fn arena(&self) -> (NonNull<u8>, usize) {
        (self.base, self.slots.len() * self.slot_bytes)
    }

    /// Number of slots.
    pub fn capacity_slots(&self) -> usize {
        self.slots.len()
    }

    /// Bytes per slot.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Bytes of the arena (slots × slot bytes), resident or not: what the cache costs the budget,
    /// and an upper bound of its resident memory (the arena beyond the slots is released).
    pub fn resident_bytes(&self) -> u64 {
        self.slots.len() as u64 * self.slot_bytes as u64
    }

    /// The fewest slots the cache may have ([`NeuronCache::new`]'s `min_slots`, capped at the
    /// chunk count).
    pub fn floor_slots(&self) -> usize {
        self.floor_slots
    }

    /// [`NeuronCache::floor_slots`] in bytes.
    pub fn floor_bytes(&self) -> u64 {
        self.floor_slots as u64 * self.slot_bytes as u64
    }

    /// Bytes of the whole arena reservation whose pages are resident now, as the kernel reports
    /// (`mincore`). For tests and benchmarks that check memory really leaves on a shrink; the
    /// budget uses [`NeuronCache::resident_bytes`].
    pub fn measured_resident_bytes(&self) -> Result<u64> {
        let reserved = self.total_chunks() * self.slot_bytes;
        let bytes = self
            .arena
            .resident_bytes(0..reserved)
            .map_err(|source| Error::Os {
                what: "counting the neuron cache's resident pages (mincore)".into(),
                source,
            })?;
        Ok(bytes as u64)
    }

    /// Number of chunks the cache was made for.
    pub fn total_chunks(&self) -> usize {
        self.slot_of.len()
    }

    /// Chunks Loading or Ready.
    pub fn len(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Whether no chunk is Loading or Ready.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Starts a new token: chunks loaded from now on are misses for this token and hits later.
    pub fn begin_token(&mut self) {
        self.epoch += 1;
    }

    /// Where chunk `c` is, without counting anything. Panics if `c >= total_chunks`.
    pub fn lookup(&self, c: ChunkId) -> Lookup {
        match self.slot_of[c as usize] {
            NONE => Lookup::Absent,
            s if self.slots[s as usize].state == State::Ready => Lookup::Ready(s),
            s => Lookup::Loading(s),
        }
    }

    /// The compute is about to use chunk `c` (call once per chunk per token): marks its slot used
    /// and counts a hit if it is Ready and was loaded before the current token, a miss otherwise.
    pub fn access(&mut self, c: ChunkId) -> Lookup {
        let found = self.lookup(c);
        let hit = match found {
            Lookup::Absent => false,
            Lookup::Loading(s) | Lookup::Ready(s) => {
                let slot = &mut self.slots[s as usize];
                slot.used = true;
                slot.state == State::Ready && slot.loaded_epoch < self.epoch
            }
        };
        if hit {
            self.stats.hits += 1;
        } else {
            self.stats.misses += 1;
        }
        found
    }

    /// Marks chunk `c`'s slot as used without counting an access (for a chunk the compute already
    /// counted with [`NeuronCache::access`] before its read was issued). No-op when not cached.
    pub fn mark_used(&mut self, c: ChunkId) {
        if let Lookup::Loading(s) | Lookup::Ready(s) = self.lookup(c) {
            self.slots[s as usize].used = true;
        }
    }

    /// Gets a slot to read chunk `c` into and marks it Loading for `c` with `retention`: a free
    /// slot, else the unpinned Ready slot with the lowest retention (ties: lowest slot id), subject
    /// to `evict`. Never takes a Loading or pinned slot.
    ///
    /// Returns `None` if `c` is already cached (Loading or Ready), if every slot is Loading or
    /// pinned, or if `evict` forbids the only candidate. The target covers the whole slot; it must
    /// be handed back by [`NeuronCache::complete`] or [`NeuronCache::abandon`].
    pub fn reserve(
        &mut self,
        c: ChunkId,
        retention: f32,
        evict: Evict,
    ) -> Option<(SlotId, ReadTarget)> {
        if self.slot_of[c as usize] != NONE {
            return None;
        }
        let s = match self.free.pop() {
            Some(s) => s,
            None => {
                let (victim, key) = self.evictable.min()?;
                if evict == Evict::NotHigher && key > retention_key(retention) {
                    return None;
                }
                self.drop_ready(victim);
                self.stats.evictions += 1;
                victim
            }
        };
        self.slots[s as usize] = Slot {
            state: State::Loading,
            chunk: c,
            retention,
            ..FREE_SLOT
        };
        self.slot_of[c as usize] = s;
        // SAFETY: s < capacity_slots, so the slot lies inside the arena `base` points at. The slot
        // is Loading: `data` refuses it and no other ReadTarget for it exists until it is freed.
        let target = unsafe {
            let ptr = self.base.as_ptr().add(s as usize * self.slot_bytes);
            ReadTarget::new(ptr, self.slot_bytes)
        };
        Some((s, target))
    }

    /// The read into Loading slot `slot` finished: Ready on success, Free on failure (the chunk is
    /// then absent again and its pins are dropped). Panics if the slot is not Loading, a broken
    /// invariant of the caller's bookkeeping.
    pub fn complete(&mut self, slot: SlotId, ok: bool) {
        let st = &mut self.slots[slot as usize];
        assert_eq!(
            st.state,
            State::Loading,
            "complete() on slot {slot}, which is not Loading"
        );
        if ok {
            st.state = State::Ready;
            st.loaded_epoch = self.epoch;
            self.stats.bytes_loaded += self.slot_bytes as u64;
            if st.pins == 0 {
                self.evictable.set(slot, retention_key(st.retention));
            }
        } else {
            self.release(slot);
        }
    }

    /// The read into Loading slot `slot` was cancelled before it started: the slot is Free again.
    /// Panics if the slot is not Loading.
    pub fn abandon(&mut self, slot: SlotId) {
        let state = self.slots[slot as usize].state;
        assert_eq!(
            state,
            State::Loading,
            "abandon() on slot {slot}, which is not Loading"
        );
        self.release(slot);
    }

    /// The bytes of Ready slot `slot`. Panics if it is not Ready (a broken invariant: only Ready
    /// slots have defined contents).
    pub fn data(&self, slot: SlotId) -> &[u8] {
        let state = self.slots[slot as usize].state;
        assert_eq!(
            state,
            State::Ready,
            "data() on slot {slot}, which is not Ready"
        );
        // SAFETY: the slot is inside the arena (index checked above), Ready, so no read is writing
        // it, and it stays Ready while &self is borrowed (changes need &mut self).
        unsafe {
            std::slice::from_raw_parts(
                self.base.as_ptr().add(slot as usize * self.slot_bytes),
                self.slot_bytes,
            )
        }
    }

    /// The bytes of chunk `c` if it is Ready.
    pub fn data_of(&self, c: ChunkId) -> Option<&[u8]> {
        match self.lookup(c) {
            Lookup::Ready(s) => Some(self.data(s)),
            _ => None,
        }
    }

    /// Pins a cached (Loading or Ready) chunk: it is never evicted until unpinned as many times.
    /// Returns false if `c` is not cached.
    pub fn pin(&mut self, c: ChunkId) -> bool {
        let s = self.slot_of[c as usize];
        if s == NONE {
            return false;
        }
        self.slots[s as usize].pins += 1;
        self.evictable.remove(s);
        true
    }

    /// Undoes one [`NeuronCache::pin`]. Returns false if `c` is not cached or not pinned.
    pub fn unpin(&mut self, c: ChunkId) -> bool {
        let s = self.slot_of[c as usize];
        if s == NONE || self.slots[s as usize].pins == 0 {
            return false;
        }
        let st = &mut self.slots[s as usize];
        st.pins -= 1;
        if st.pins == 0 && st.state == State::Ready {
            self.evictable.set(s, retention_key(st.retention));
        }
        true
    }

    /// Sets the retention priority of a cached chunk (higher is kept longer). Returns false if `c`
    /// is not cached.
    pub fn set_retention(&mut self, c: ChunkId, retention: f32) -> bool {
        let s = self.slot_of[c as usize];
        if s == NONE {
            return false;
        }
        self.slots[s as usize].retention = retention;
        if self.evictable.contains(s) {
            self.evictable.set(s, retention_key(retention));
        }
        true
    }

    /// The retention priority of a cached chunk.
    pub fn retention(&self, c: ChunkId) -> Option<f32> {
        match self.slot_of[c as usize] {
            NONE => None,
            s => Some(self.slots[s as usize].retention),
        }
    }

    /// Evicts chunk `c` if it is Ready and unpinned (counted as an eviction). Returns whether it was.
    pub fn evict(&mut self, c: ChunkId) -> bool {
        let s = self.slot_of[c as usize];
        if s == NONE || !self.evictable.contains(s) {
            return false;
        }
        self.drop_ready(s);
        self.stats.evictions += 1;
        self.free.push(s);
        true
    }

    /// Drops every Ready chunk, pinned or not (never-accessed ones count as unused bytes). Loading
    /// slots are kept: their reads are in flight and still own the memory.
    pub fn clear(&mut self) {
        for s in 0..self.slots.len() as u32 {
            if self.slots[s as usize].state == State::Ready {
                self.drop_ready(s);
                self.free.push(s);
            }
        }
    }

    /// Counters since construction or the last reset.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Zeroes the counters (capacity fields stay).
    pub fn reset_stats(&mut self) {
        self.stats = CacheStats {
            capacity_slots: self.stats.capacity_slots,
            slot_bytes: self.stats.slot_bytes,
            ..CacheStats::default()
        };
    }

    /// Empties a Ready slot (not pushed to the free list: the caller reuses or frees it).
    fn drop_ready(&mut self, s: SlotId) {
        let st = self.slots[s as usize];
        debug_assert_eq!(st.state, State::Ready);
        if !st.used {
            self.stats.bytes_unused += self.slot_bytes as u64;
        }
        self.evictable.remove(s);
        self.slot_of[st.chunk as usize] = NONE;
        self.slots[s as usize] = FREE_SLOT;
    }

    /// Loading → Free.
    fn release(&mut self, s: SlotId) {
        let chunk = self.slots[s as usize].chunk;
        self.slot_of[chunk as usize] = NONE;
        self.slots[s as usize] = FREE_SLOT;
        self.free.push(s);
    }

    /// Checks every structural invariant; panics naming the broken one.
    #[cfg(test)]
    pub(super) fn check_invariants(&self) {
        assert!(
            self.floor_slots <= self.slots.len() && self.slots.len() <= self.total_chunks(),
            "capacity {} outside floor {} ..= chunks {}",
            self.slots.len(),
            self.floor_slots,
            self.total_chunks()
        );
        assert_eq!(
            self.stats.capacity_slots,
            self.slots.len() as u64,
            "reported capacity"
        );
        let mut listed = vec![false; self.slots.len()];
        for &s in &self.free {
            assert!(
                !std::mem::replace(&mut listed[s as usize], true),
                "slot {s} listed free twice"
            );
        }
        let mut free = 0;
        for (s, st) in self.slots.iter().enumerate() {
            let s = s as u32;
            match st.state {
                State::Free => free += 1,
                _ => assert_eq!(self.slot_of[st.chunk as usize], s, "slot {s} ↔ chunk"),
            }
            let evictable = st.state == State::Ready && st.pins == 0;
            assert_eq!(
                self.evictable.contains(s),
                evictable,
                "heap membership of slot {s}"
            );
        }
        assert_eq!(self.free.len(), free, "free list size");
        assert!(
            self.free
                .iter()
                .all(|&s| self.slots[s as usize].state == State::Free)
        );
        for (c, &s) in self.slot_of.iter().enumerate() {
            if s != NONE {
                assert!(
                    (s as usize) < self.slots.len(),
                    "chunk {c} in removed slot {s}"
                );
                assert_eq!(self.slots[s as usize].chunk as usize, c, "chunk {c} ↔ slot");
            }
        }
    }
}
