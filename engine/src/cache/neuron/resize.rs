//! Resizing a [`NeuronCache`] between reads: growing appends Free slots, shrinking evicts by
//! retention, compacts the survivors below the new end and releases the rest (see the `cache`
//! module docs).

use super::{FREE_SLOT, NeuronCache, State};
use crate::cache::SlotId;
use crate::cache::heap::retention_key;
use crate::{Error, Result};

impl NeuronCache {
    /// Resizes the cache to as many slots as `budget_bytes` holds (rounded down to whole slots,
    /// never more than `total_chunks`), between reads: returns the bytes it now holds
    /// ([`NeuronCache::resident_bytes`]).
    ///
    /// - **Shrinking** evicts the lowest-retention unpinned Ready chunks first (the order
    ///   [`NeuronCache::reserve`] evicts in, counted as evictions) until the chunks fit, moves
    ///   the Ready chunks held in the slots being removed into free slots below the new end
    ///   (copying their bytes; their slot ids change, so `Lookup` results and `data` slices taken
    ///   before do not survive a resize, which `&mut self` enforces for slices), then releases
    ///   the removed slots' memory to the OS: resident memory falls by their resident pages.
    ///   Pinned chunks and Loading slots below the new end are kept in place.
    /// - **Growing** makes new Free slots usable; their memory is faulted in as reads fill them.
    ///
    /// Refused, with nothing changed: below the floor ([`Error::OverBudget`], naming the floor's
    /// bytes and `budget_bytes`); when a slot being removed is Loading (its read owns the memory:
    /// finish or cancel reads first) or when the Loading and pinned chunks alone outnumber the
    /// new slots ([`Error::InvalidArgument`]); when the OS refuses to commit grown slots
    /// ([`Error::Os`]).
    pub fn resize(&mut self, budget_bytes: u64) -> Result<u64> {
        let n = self.slots.len();
        let want = self.slots_for(budget_bytes)?;
        if want > n {
            self.grow(want)?;
        } else if want < n {
            self.shrink(want)?;
        }
        Ok(self.resident_bytes())
    }

    /// The slots [`NeuronCache::resize`] would give the cache for `budget_bytes`, or its refusal
    /// of a size below the floor ([`Error::OverBudget`] naming both); changes nothing.
    pub fn slots_for(&self, budget_bytes: u64) -> Result<usize> {
        slots_for(
            budget_bytes,
            self.slot_bytes,
            self.total_chunks(),
            self.floor_slots,
        )
    }

    fn grow(&mut self, want: usize) -> Result<()> {
        let n = self.slots.len();
        let sb = self.slot_bytes;
        self.arena
            .commit(n * sb..want * sb)
            .map_err(|source| Error::Os {
                what: format!("growing a neuron cache from {n} to {want} slots of {sb} bytes"),
                source,
            })?;
        self.slots.resize(want, FREE_SLOT);
        self.evictable.resize(want);
        self.rebuild_free_list();
        self.stats.capacity_slots = want as u64;
        Ok(())
    }

    fn shrink(&mut self, want: usize) -> Result<()> {
        let n = self.slots.len();
        let refuse = |reason: String| {
            Err(Error::InvalidArgument {
                arg: "budget_bytes",
                reason,
            })
        };
        if let Some(s) = (want..n).find(|&s| self.slots[s].state == State::Loading) {
            return refuse(format!(
                "shrinking the neuron cache to {want} slots would remove slot {s}, which a read is                  still filling; finish or cancel reads first"
            ));
        }
        let kept = self.len() - self.evictable.len();
        if kept > want {
            return refuse(format!(
                "shrinking the neuron cache to {want} slots: {kept} chunks are loading or pinned"
            ));
        }
        while self.len() > want {
            let (victim, _) = self
                .evictable
                .min()
                .expect("more cached chunks than slots, yet none evictable: counted above");
            self.drop_ready(victim);
            self.stats.evictions += 1;
            self.free.push(victim);
        }
        let mut to = 0; // the next free slot below the new end to move a chunk into
        for from in want..n {
            let slot = self.slots[from];
            if slot.state == State::Free {
                continue;
            }
            while self.slots[to].state != State::Free {
                to += 1;
            }
            assert!(
                to < want,
                "chunks fit the new slots after eviction, so one is free below"
            );
            // SAFETY: `from` and `to` are distinct slots inside the usable arena; `from` is Ready
            // (Loading ones were refused above), so no read writes it, and `to` is Free, so no
            // one uses it; `&mut self` rules out live `data` slices.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.base.as_ptr().add(from * self.slot_bytes),
                    self.base.as_ptr().add(to * self.slot_bytes),
                    self.slot_bytes,
                );
            }
            self.slots[to] = slot;
            self.slots[from] = FREE_SLOT;
            self.slot_of[slot.chunk as usize] = to as SlotId;
            if self.evictable.remove(from as SlotId) {
                self.evictable
                    .set(to as SlotId, retention_key(slot.retention));
            }
        }
        let sb = self.slot_bytes;
        self.slots.truncate(want);
        self.evictable.resize(want);
        self.rebuild_free_list();
        self.stats.capacity_slots = want as u64;
        // SAFETY: slots `want..n` are Free and outside the cache now: no reference, read or
        // registration covers them (a device registration is the owner's to drop first, see
        // `arena`).
        unsafe { self.arena.release(want * sb..n * sb) }.map_err(|source| Error::Os {
            what: format!("releasing {} neuron cache slots of {sb} bytes", n - want),
            source,
        })
    }

    /// The free list holds every Free slot, lowest popped first (so the cache fills from the
    /// front and a later shrink has less to move).
    fn rebuild_free_list(&mut self) {
        self.free.clear();
        let slots = &self.slots;
        self.free.extend(
            (0..slots.len() as SlotId)
                .rev()
                .filter(|&s| slots[s as usize].state == State::Free),
        );
    }
}

/// Slots a budget of `budget_bytes` gives: whole slots, at most `total_chunks`; refuses fewer
/// than `floor_slots` with [`Error::OverBudget`] naming the floor's bytes and the budget. The one
/// check both construction and resizing apply.
pub(super) fn slots_for(
    budget_bytes: u64,
    slot_bytes: usize,
    total_chunks: usize,
    floor_slots: usize,
) -> Result<usize> {
    let fits = usize::try_from(budget_bytes / slot_bytes as u64).unwrap_or(usize::MAX);
    if fits < floor_slots {
        return Err(Error::OverBudget {
            what: format!("a neuron cache of {floor_slots} slots of {slot_bytes} bytes"),
            needed: floor_slots as u64 * slot_bytes as u64,
            budget: budget_bytes,
        });
    }
    Ok(fits.min(total_chunks))
}
