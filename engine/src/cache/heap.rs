//! An indexed binary min-heap of slots keyed by retention: the eviction index of the neuron cache.
//!
//! O(log n) insert, remove, re-key; O(1) minimum; no allocation after construction or a
//! [`EvictionHeap::resize`] (all three vectors are sized to the slot count up front).

/// Marks a slot that is not in the heap.
const ABSENT: u32 = u32::MAX;

/// Maps an f32 retention to a u32 whose unsigned order is the float's total order (NaN as -∞,
/// so a NaN retention is evicted first).
pub(crate) fn retention_key(p: f32) -> u32 {
    let p = if p.is_nan() { f32::NEG_INFINITY } else { p };
    let b = p.to_bits();
    if b >> 31 == 1 { !b } else { b | 0x8000_0000 }
}

/// Slots ordered by `(key, slot)`, smallest first. Invariant: `pos[heap[i]] == i` for every heap
/// index `i`, and `pos[s] == ABSENT` for every slot not in the heap.
#[derive(Debug)]
pub(crate) struct EvictionHeap {
    heap: Vec<u32>,
    key: Vec<u32>,
    pos: Vec<u32>,
}

impl EvictionHeap {
    /// An empty heap for slots `0..n`.
    pub(crate) fn new(n: usize) -> Self {
        EvictionHeap {
            heap: Vec::with_capacity(n),
            key: vec![0; n],
            pos: vec![ABSENT; n],
        }
    }

    /// Makes the heap one for slots `0..n`. Panics if a slot `>= n` is in it (the cache moves or
    /// evicts the slots it removes first).
    pub(crate) fn resize(&mut self, n: usize) {
        assert!(
            self.heap.iter().all(|&s| (s as usize) < n),
            "resizing the eviction heap to {n} slots while a higher slot is in it"
        );
        self.key.resize(n, 0);
        self.pos.resize(n, ABSENT);
        self.heap.reserve(n.saturating_sub(self.heap.len()));
    }

    /// Slots in the heap.
    pub(crate) fn len(&self) -> usize {
        self.heap.len()
    }

    pub(crate) fn contains(&self, slot: u32) -> bool {
        self.pos[slot as usize] != ABSENT
    }

    /// The slot with the smallest `(key, slot)` and its key.
    pub(crate) fn min(&self) -> Option<(u32, u32)> {
        self.heap.first().map(|&s| (s, self.key[s as usize]))
    }

    /// Inserts `slot` with `key`, or re-keys it if present.
    pub(crate) fn set(&mut self, slot: u32, key: u32) {
        if self.contains(slot) {
            self.key[slot as usize] = key;
            let i = self.pos[slot as usize] as usize;
            let i = self.sift_up(i);
            self.sift_down(i);
        } else {
            self.key[slot as usize] = key;
            self.heap.push(slot);
            let i = self.heap.len() - 1;
            self.pos[slot as usize] = i as u32;
            self.sift_up(i);
        }
    }

    /// Removes `slot` if present; returns whether it was.
    pub(crate) fn remove(&mut self, slot: u32) -> bool {
        let i = self.pos[slot as usize];
        if i == ABSENT {
            return false;
        }
        let i = i as usize;
        let last = self.heap.len() - 1;
        self.swap(i, last);
        self.heap.pop();
        self.pos[slot as usize] = ABSENT;
        if i < self.heap.len() {
            let i = self.sift_up(i);
            self.sift_down(i);
        }
        true
    }

    #[cfg(test)]
    pub(crate) fn clear(&mut self) {
        for &s in &self.heap {
            self.pos[s as usize] = ABSENT;
        }
        self.heap.clear();
    }

    fn less(&self, a: usize, b: usize) -> bool {
        let (sa, sb) = (self.heap[a], self.heap[b]);
        (self.key[sa as usize], sa) < (self.key[sb as usize], sb)
    }

    fn swap(&mut self, a: usize, b: usize) {
        self.heap.swap(a, b);
        self.pos[self.heap[a] as usize] = a as u32;
        self.pos[self.heap[b] as usize] = b as u32;
    }

    fn sift_up(&mut self, mut i: usize) -> usize {
        while i > 0 {
            let parent = (i - 1) / 2;
            if !self.less(i, parent) {
                break;
            }
            self.swap(i, parent);
            i = parent;
        }
        i
    }

    fn sift_down(&mut self, mut i: usize) {
        loop {
            let (l, r) = (2 * i + 1, 2 * i + 2);
            let mut m = i;
            if l < self.heap.len() && self.less(l, m) {
                m = l;
            }
            if r < self.heap.len() && self.less(r, m) {
                m = r;
            }
            if m == i {
                return;
            }
            self.swap(i, m);
            i = m;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    #[test]
    fn retention_key_is_monotonic() {
        let ps = [f32::NEG_INFINITY, -2.0, -0.0, 0.0, 0.5, 7.0, f32::INFINITY];
        let keys: Vec<u32> = ps.iter().map(|&p| retention_key(p)).collect();
        assert!(keys.windows(2).all(|w| w[0] < w[1]), "{keys:?}");
        assert_eq!(retention_key(f32::NAN), retention_key(f32::NEG_INFINITY));
    }

    proptest! {
        /// The heap agrees with a BTreeSet of (key, slot) under random set/remove/clear.
        #[test]
        fn heap_matches_an_ordered_set(ops in prop::collection::vec((0u8..8, 0u32..24, 0u32..6), 0..300)) {
            let mut h = EvictionHeap::new(24);
            let mut model: BTreeSet<(u32, u32)> = BTreeSet::new();
            let mut keys = [0u32; 24];
            for (op, slot, key) in ops {
                match op {
                    0..=4 => {
                        if h.contains(slot) {
                            model.remove(&(keys[slot as usize], slot));
                        }
                        h.set(slot, key);
                        keys[slot as usize] = key;
                        model.insert((key, slot));
                    }
                    5 | 6 => {
                        let was = model.remove(&(keys[slot as usize], slot));
                        prop_assert_eq!(h.remove(slot), was);
                    }
                    _ => {
                        h.clear();
                        model.clear();
                    }
                }
                prop_assert_eq!(h.len(), model.len());
                prop_assert_eq!(h.min(), model.first().map(|&(k, s)| (s, k)));
                for s in 0..24 {
                    prop_assert_eq!(h.contains(s), model.contains(&(keys[s as usize], s)));
                }
            }
        }
    }
}
