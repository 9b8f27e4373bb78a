//! Neuron cache tests: targeted cases, and a model-based proptest of the invariants under random
//! operation sequences.

use std::collections::HashMap;

use proptest::prelude::*;

use super::heap::retention_key;
use super::*;
use crate::Error;
use crate::io::{PAGE, ReadTarget};
use crate::model::lsm::ChunkId;

const SB: usize = PAGE;

fn cache(chunks: usize, slots: usize) -> NeuronCache {
    NeuronCache::new(chunks, SB, (slots * SB) as u64, 1).expect("cache")
}

/// Simulates the read: stamps the chunk id at both ends of the target.
fn fill(target: &ReadTarget, c: ChunkId) {
    let tag = c.to_le_bytes();
    // SAFETY: the target is a whole Loading slot (SB ≥ 8 bytes) of a live cache; nothing else
    // touches it until complete().
    unsafe {
        std::ptr::copy_nonoverlapping(tag.as_ptr(), target.as_ptr(), 4);
        std::ptr::copy_nonoverlapping(tag.as_ptr(), target.as_ptr().add(target.len() - 4), 4);
    }
}

fn load(cache: &mut NeuronCache, c: ChunkId, retention: f32) -> SlotId {
    let (s, t) = cache.reserve(c, retention, Evict::Any).expect("a slot");
    fill(&t, c);
    cache.complete(s, true);
    s
}

#[test]
fn budget_too_small_names_the_bytes_needed() {
    let err = NeuronCache::new(100, 2 * PAGE, 10 * PAGE as u64, 20).expect_err("too small");
    assert!(
        matches!(
            err,
            Error::OverBudget {
                needed: 163_840,
                budget: 40_960,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("163840"), "{err}");
    // A budget that holds every chunk is enough even below min_slots.
    let c = NeuronCache::new(3, PAGE, 3 * PAGE as u64, 20).expect("all chunks fit");
    assert_eq!(c.capacity_slots(), 3);
}

#[test]
fn sizes_from_the_budget_and_rejects_bad_slot_sizes() {
    let c = NeuronCache::new(100, 2 * PAGE, 21 * PAGE as u64 + 5, 1).expect("cache");
    assert_eq!(c.capacity_slots(), 10);
    assert_eq!(c.resident_bytes(), 20 * PAGE as u64);
    assert_eq!(c.stats().capacity_slots, 10);
    assert_eq!(
        NeuronCache::new(5, PAGE, u64::MAX, 1)
            .expect("capped")
            .capacity_slots(),
        5
    );
    for bad in [0, 100, PAGE + 1] {
        let err = NeuronCache::new(10, bad, 1 << 20, 1).expect_err("bad slot size");
        assert!(
            matches!(
                err,
                Error::InvalidArgument {
                    arg: "slot_bytes",
                    ..
                }
            ),
            "{err}"
        );
    }
}

#[test]
fn hits_need_a_load_before_the_current_token() {
    let mut c = cache(10, 4);
    c.begin_token();
    assert_eq!(c.access(1), Lookup::Absent);
    let (s, t) = c.reserve(1, 0.0, Evict::Any).expect("free slot");
    assert_eq!(c.access(1), Lookup::Loading(s));
    fill(&t, 1);
    c.complete(s, true);
    assert_eq!(c.lookup(1), Lookup::Ready(s));
    assert_eq!(
        c.access(1),
        Lookup::Ready(s),
        "loaded this token: still a miss"
    );
    c.begin_token();
    assert_eq!(c.access(1), Lookup::Ready(s));
    let st = c.stats();
    assert_eq!((st.hits, st.misses, st.bytes_loaded), (1, 3, SB as u64));
    assert_eq!(&c.data(s)[..4], &1u32.to_le_bytes());
    c.reset_stats();
    assert_eq!(c.stats().hits, 0);
    assert_eq!(c.stats().capacity_slots, 4);
}

#[test]
fn evicts_the_lowest_retention_never_pinned_or_loading() {
    let mut c = cache(10, 3);
    load(&mut c, 0, 5.0);
    load(&mut c, 1, 1.0);
    let (loading, _t) = c.reserve(2, -10.0, Evict::Any).expect("third slot");
    assert!(c.pin(1));
    // Candidates: only chunk 0 (1 is pinned, 2 is Loading despite its low retention).
    assert_eq!(
        c.reserve(3, 4.0, Evict::NotHigher).map(|r| r.0),
        None,
        "0 is worth more"
    );
    let (s, t) = c.reserve(3, 4.0, Evict::Any).expect("evicts 0");
    assert_eq!(c.lookup(0), Lookup::Absent);
    fill(&t, 3);
    c.complete(s, true);
    assert!(c.unpin(1));
    assert!(!c.unpin(1), "not pinned any more");
    assert!(c.set_retention(3, 0.5));
    let (s, _t) = c
        .reserve(4, 0.5, Evict::NotHigher)
        .expect("evicts 3: equal is not higher");
    assert_eq!(c.lookup(3), Lookup::Absent);
    assert_eq!(c.retention(4), Some(0.5));
    c.abandon(s);
    c.complete(loading, false);
    assert_eq!((c.lookup(2), c.lookup(4)), (Lookup::Absent, Lookup::Absent));
    assert_eq!(c.stats().evictions, 2);
    assert_eq!(
        c.reserve(1, 0.0, Evict::Any).map(|r| r.0),
        None,
        "already cached"
    );
    c.check_invariants();
}

#[test]
fn unused_bytes_count_loads_never_accessed() {
    let mut c = cache(10, 2);
    load(&mut c, 0, 0.0);
    load(&mut c, 1, 1.0);
    c.access(1);
    load(&mut c, 2, 2.0); // evicts 0, never accessed
    let (_loading, _t) = c.reserve(3, 0.0, Evict::Any).expect("evicts 1, accessed");
    assert_eq!(c.stats().bytes_unused, SB as u64);
    c.clear(); // drops 2 (never accessed), keeps the Loading 3
    assert_eq!(c.stats().bytes_unused, 2 * SB as u64);
    assert!(matches!(c.lookup(3), Lookup::Loading(_)));
    assert_eq!(c.len(), 1);
    c.check_invariants();
}

#[test]
#[should_panic(expected = "not Ready")]
fn data_of_a_loading_slot_is_a_broken_invariant() {
    let mut c = cache(4, 2);
    let (s, _t) = c.reserve(0, 0.0, Evict::Any).expect("slot");
    let _ = c.data(s);
}

#[test]
fn shrinking_keeps_the_highest_retention_chunks_with_their_bytes() {
    let mut c = NeuronCache::new(20, SB, (10 * SB) as u64, 2).expect("cache");
    // Chunk i has retention i, except chunk 0: lowest retention, but pinned.
    for ch in 0..10u32 {
        load(&mut c, ch, ch as f32);
    }
    assert!(c.pin(0));
    c.begin_token();
    assert_eq!(c.resize((4 * SB) as u64).expect("shrink"), (4 * SB) as u64);
    c.check_invariants();
    let kept: Vec<u32> = (0..20)
        .filter(|&ch| c.lookup(ch) != Lookup::Absent)
        .collect();
    assert_eq!(
        kept,
        [0, 7, 8, 9],
        "the pinned chunk and the three most valued"
    );
    for &ch in &kept {
        let d = c.data_of(ch).expect("Ready");
        assert_eq!(
            (&d[..4], &d[SB - 4..]),
            (&ch.to_le_bytes()[..], &ch.to_le_bytes()[..])
        );
        assert_eq!(c.access(ch), c.lookup(ch));
    }
    let st = c.stats();
    assert_eq!((st.evictions, st.capacity_slots), (6, 4));
    assert_eq!(
        (st.hits, st.misses),
        (4, 0),
        "moved chunks stay loaded before this token"
    );
    assert_eq!(c.resident_bytes(), (4 * SB) as u64);
}

#[test]
fn growing_adds_free_slots_and_caps_at_every_chunk() {
    let mut c = NeuronCache::new(12, SB, (3 * SB) as u64, 2).expect("cache");
    load(&mut c, 5, 1.0);
    assert_eq!(c.resize(u64::MAX).expect("grow"), (12 * SB) as u64);
    assert_eq!(c.capacity_slots(), 12);
    for ch in 0..12u32 {
        if ch != 5 {
            load(&mut c, ch, 0.0);
        }
    }
    assert_eq!(c.len(), 12);
    assert_eq!(c.stats().evictions, 0, "every chunk fits");
    assert_eq!(&c.data_of(5).expect("kept")[..4], &5u32.to_le_bytes());
    c.check_invariants();
}

#[test]
fn a_resize_below_the_floor_is_refused_and_changes_nothing() {
    let mut c = NeuronCache::new(12, SB, (6 * SB) as u64, 3).expect("cache");
    for ch in 0..6u32 {
        load(&mut c, ch, ch as f32);
    }
    let before = c.stats();
    let err = c.resize((3 * SB - 1) as u64).expect_err("below the floor");
    assert!(
        matches!(err, Error::OverBudget { needed, budget, .. }
            if needed == (3 * SB) as u64 && budget == (3 * SB - 1) as u64),
        "{err}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains(&(3 * SB).to_string()) && msg.contains(&(3 * SB - 1).to_string()),
        "{msg}"
    );
    assert_eq!(c.stats(), before);
    assert_eq!(c.len(), 6);
    assert_eq!(c.floor_bytes(), (3 * SB) as u64);
    assert_eq!(
        c.resize((3 * SB) as u64).expect("the floor itself"),
        (3 * SB) as u64
    );
}

#[test]
fn shrinking_never_removes_a_slot_a_read_is_filling() {
    let mut c = NeuronCache::new(12, SB, (4 * SB) as u64, 1).expect("cache");
    load(&mut c, 0, 0.0);
    load(&mut c, 1, 0.0);
    let (s, t) = c.reserve(2, 0.0, Evict::Any).expect("slot 2");
    assert_eq!(s, 2);
    let err = c.resize(SB as u64).expect_err("slot 2 is Loading");
    assert!(err.to_string().contains("slot 2"), "{err}");
    assert_eq!((c.len(), c.capacity_slots()), (3, 4), "nothing changed");
    // A size that keeps slot 2 is fine.
    assert_eq!(
        c.resize((3 * SB) as u64).expect("keeps slot 2"),
        (3 * SB) as u64
    );
    fill(&t, 2);
    c.complete(s, true);
    assert_eq!(&c.data_of(2).expect("Ready")[..4], &2u32.to_le_bytes());
    assert!(c.pin(0) && c.pin(1) && c.pin(2));
    let err = c.resize((2 * SB) as u64).expect_err("three pinned chunks");
    assert!(err.to_string().contains("pinned"), "{err}");
    c.check_invariants();
}

#[test]
fn a_large_shrink_gives_the_memory_back_to_the_os() {
    const BIG: usize = 16 * PAGE; // 64 KiB slots, 256 of them: a 16 MiB arena
    let mut c = NeuronCache::new(256, BIG, (256 * BIG) as u64, 4).expect("cache");
    assert_eq!(
        c.measured_resident_bytes().expect("mincore"),
        0,
        "untouched"
    );
    for ch in 0..256u32 {
        let (s, t) = c.reserve(ch, ch as f32, Evict::Any).expect("free slot");
        // SAFETY: `t` is a whole Loading slot nothing else touches until complete().
        unsafe { std::ptr::write_bytes(t.as_ptr(), ch as u8, t.len()) };
        c.complete(s, true);
    }
    let full = c.measured_resident_bytes().expect("mincore");
    assert!(full <= c.resident_bytes(), "{full}");
    assert!(
        full > (128 * BIG) as u64,
        "filled slots are resident: {full}"
    );
    assert_eq!(
        c.resize((8 * BIG) as u64).expect("shrink"),
        (8 * BIG) as u64
    );
    let small = c.measured_resident_bytes().expect("mincore");
    assert!(
        small <= (8 * BIG) as u64,
        "{small} resident after shrinking to 8 slots"
    );
    for ch in 248..256u32 {
        assert!(
            c.data_of(ch)
                .expect("most valued kept")
                .iter()
                .all(|&b| b == ch as u8),
            "chunk {ch}"
        );
    }
    assert_eq!(
        c.resize((256 * BIG) as u64).expect("grow"),
        (256 * BIG) as u64
    );
    assert!(
        c.measured_resident_bytes().expect("mincore") <= (8 * BIG) as u64,
        "grown slots cost nothing until filled"
    );
    c.check_invariants();
}

#[derive(Clone, Debug)]
enum Op {
    Begin,
    Access(u32),
    Reserve(u32, i8, bool),
    Complete(usize, bool),
    Abandon(usize),
    Pin(u32),
    Unpin(u32),
    SetRetention(u32, i8),
    Evict(u32),
    Clear,
    /// Resize to this many slots.
    Resize(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let c = 0u32..12;
    prop_oneof![
        1 => Just(Op::Begin),
        4 => c.clone().prop_map(Op::Access),
        5 => (c.clone(), -3i8..4, any::<bool>()).prop_map(|(c, r, a)| Op::Reserve(c, r, a)),
        4 => (0usize..8, prop::bool::weighted(0.85)).prop_map(|(i, ok)| Op::Complete(i, ok)),
        1 => (0usize..8).prop_map(Op::Abandon),
        1 => c.clone().prop_map(Op::Pin),
        1 => c.clone().prop_map(Op::Unpin),
        2 => (c.clone(), -3i8..4).prop_map(|(c, r)| Op::SetRetention(c, r)),
        1 => c.prop_map(Op::Evict),
        1 => Just(Op::Clear),
        2 => (0usize..15).prop_map(Op::Resize),
    ]
}

#[derive(Clone, Debug)]
struct M {
    slot: SlotId,
    ready: bool,
    retention: f32,
    pins: u32,
    epoch: u64,
    used: bool,
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Runs random operations, resizes included, against the cache and a plain model: same
    /// contents, same victims (lowest retention, ties by slot, never pinned or Loading), same
    /// counters, same refusals; the structural invariants hold after every step (no slot holds
    /// two chunks, capacity respected); Ready slots hold their own chunk's bytes, moved or not.
    #[test]
    fn cache_matches_a_model(ops in prop::collection::vec(op(), 1..120)) {
        const FLOOR: usize = 2;
        let mut cap = 5;
        let mut c = NeuronCache::new(12, SB, (cap * SB) as u64, FLOOR).expect("cache");
        let mut m: HashMap<u32, M> = HashMap::new();
        let mut loading: Vec<(SlotId, ChunkId, ReadTarget)> = Vec::new();
        let (mut epoch, mut hits, mut misses, mut evictions, mut loaded, mut unused) =
            (0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
        for op in ops {
            match op {
                Op::Begin => { c.begin_token(); epoch += 1; }
                Op::Access(ch) => {
                    let got = c.access(ch);
                    match m.get_mut(&ch) {
                        None => { misses += 1; prop_assert_eq!(got, Lookup::Absent); }
                        Some(e) => {
                            e.used = true;
                            if e.ready && e.epoch < epoch { hits += 1 } else { misses += 1 }
                        }
                    }
                }
                Op::Reserve(ch, r, any) => {
                    let (r, rule) = (r as f32, if any { Evict::Any } else { Evict::NotHigher });
                    let victim = if m.contains_key(&ch) {
                        Err(())
                    } else if m.len() < cap {
                        Ok(None)
                    } else {
                        let best = m.iter()
                            .filter(|(_, e)| e.ready && e.pins == 0)
                            .min_by_key(|(_, e)| (retention_key(e.retention), e.slot));
                        match best {
                            Some((&v, e)) if any || retention_key(e.retention) <= retention_key(r) =>
                                Ok(Some((v, e.slot))),
                            _ => Err(()),
                        }
                    };
                    let got = c.reserve(ch, r, rule);
                    match (victim, got) {
                        (Err(()), None) => {}
                        (Ok(v), Some((s, t))) => {
                            if let Some((vc, vs)) = v {
                                prop_assert_eq!(s, vs, "evicted the wrong slot");
                                let e = m.remove(&vc).expect("victim in model");
                                if !e.used { unused += SB as u64 }
                                evictions += 1;
                            }
                            m.insert(ch, M { slot: s, ready: false, retention: r, pins: 0, epoch: 0, used: false });
                            loading.push((s, ch, t));
                        }
                        (v, g) => prop_assert!(false, "expected {:?}, got {:?}", v, g.map(|x| x.0)),
                    }
                }
                Op::Complete(i, _) | Op::Abandon(i) if !loading.is_empty() => {
                    let (s, ch, t) = loading.swap_remove(i % loading.len());
                    match op {
                        Op::Complete(_, true) => {
                            fill(&t, ch);
                            c.complete(s, true);
                            let e = m.get_mut(&ch).expect("loading in model");
                            e.ready = true;
                            e.epoch = epoch;
                            loaded += SB as u64;
                        }
                        Op::Complete(_, false) => {
                            c.complete(s, false);
                            m.remove(&ch);
                        }
                        _ => {
                            c.abandon(s);
                            m.remove(&ch);
                        }
                    }
                }
                Op::Complete(..) | Op::Abandon(_) => {}
                Op::Pin(ch) => {
                    let e = m.get_mut(&ch);
                    prop_assert_eq!(c.pin(ch), e.is_some());
                    if let Some(e) = e { e.pins += 1 }
                }
                Op::Unpin(ch) => {
                    let e = m.get_mut(&ch).filter(|e| e.pins > 0);
                    prop_assert_eq!(c.unpin(ch), e.is_some());
                    if let Some(e) = e { e.pins -= 1 }
                }
                Op::SetRetention(ch, r) => {
                    let e = m.get_mut(&ch);
                    prop_assert_eq!(c.set_retention(ch, r as f32), e.is_some());
                    if let Some(e) = e { e.retention = r as f32 }
                }
                Op::Evict(ch) => {
                    let ok = m.get(&ch).is_some_and(|e| e.ready && e.pins == 0);
                    prop_assert_eq!(c.evict(ch), ok);
                    if ok {
                        let e = m.remove(&ch).expect("in model");
                        if !e.used { unused += SB as u64 }
                        evictions += 1;
                    }
                }
                Op::Clear => {
                    c.clear();
                    m.retain(|_, e| {
                        if e.ready && !e.used { unused += SB as u64 }
                        !e.ready
                    });
                }
                Op::Resize(k) => {
                    let want = k.min(12);
                    let busy = m.values().filter(|e| !e.ready || e.pins > 0).count();
                    let loading_removed = loading.iter().any(|&(s, _, _)| s as usize >= want);
                    let got = c.resize((k * SB) as u64);
                    if k < FLOOR {
                        prop_assert!(matches!(got, Err(Error::OverBudget { .. })), "{:?}", got);
                    } else if want < cap && (loading_removed || busy > want) {
                        prop_assert!(matches!(got, Err(Error::InvalidArgument { .. })), "{:?}", got);
                    } else {
                        prop_assert_eq!(got.expect("resize"), (want * SB) as u64);
                        let mut victims: Vec<(u32, u32, u32)> = m.iter()
                            .filter(|(_, e)| e.ready && e.pins == 0)
                            .map(|(&ch, e)| (retention_key(e.retention), e.slot, ch))
                            .collect();
                        victims.sort_unstable();
                        for &(_, _, ch) in victims.iter().take(m.len().saturating_sub(want)) {
                            let e = m.remove(&ch).expect("victim in model");
                            if !e.used { unused += SB as u64 }
                            evictions += 1;
                        }
                        cap = want;
                        for (&ch, e) in m.iter_mut() {
                            match c.lookup(ch) {
                                Lookup::Ready(s) if e.ready => e.slot = s,
                                Lookup::Loading(s) if !e.ready => {
                                    prop_assert_eq!(s, e.slot, "a Loading slot never moves");
                                }
                                got => prop_assert!(false, "chunk {} is {:?}", ch, got),
                            }
                        }
                    }
                }
            }
            c.check_invariants();
            prop_assert_eq!(c.capacity_slots(), cap);
            prop_assert_eq!(c.resident_bytes(), (cap * SB) as u64);
            prop_assert!(c.len() <= cap);
            prop_assert_eq!(c.len(), m.len());
            for ch in 0..12u32 {
                let want = match m.get(&ch) {
                    None => Lookup::Absent,
                    Some(e) if e.ready => Lookup::Ready(e.slot),
                    Some(e) => Lookup::Loading(e.slot),
                };
                prop_assert_eq!(c.lookup(ch), want);
                prop_assert_eq!(c.retention(ch), m.get(&ch).map(|e| e.retention));
                if let Some(d) = c.data_of(ch) {
                    prop_assert_eq!(&d[..4], &ch.to_le_bytes());
                    prop_assert_eq!(&d[SB - 4..], &ch.to_le_bytes());
                }
            }
            let s = c.stats();
            prop_assert_eq!((s.hits, s.misses, s.evictions), (hits, misses, evictions));
            prop_assert_eq!((s.bytes_loaded, s.bytes_unused), (loaded, unused));
        }
    }
}
