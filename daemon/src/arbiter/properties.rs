//! Property tests over random sequences of arbiter operations, checked against a plain model of
//! the admission rules.

use super::*;
use proptest::prelude::*;
use std::collections::BTreeMap;

const BUDGET: u64 = 1000;
const MODELS: [&str; 3] = ["a", "b", "c"];

#[derive(Clone, Debug)]
enum Op {
    Load {
        model: usize,
        resident: u64,
        min: u64,
        wanted: u64,
    },
    /// `drop_model`.
    Drop(usize),
    /// `dropped` for the oldest model still being dropped.
    Dropped,
    Open {
        id: u64,
        model: usize,
        bytes: u64,
        class: CacheClass,
    },
    Close(u64),
    Resize {
        id: u64,
        bytes: u64,
    },
}

fn class() -> impl Strategy<Value = CacheClass> {
    prop_oneof![
        Just(CacheClass::Background),
        Just(CacheClass::Normal),
        Just(CacheClass::Interactive)
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0..MODELS.len(), 0..500u64, 0..200u64, 0..700u64).prop_map(
            |(model, resident, min, wanted)| Op::Load { model, resident, min, wanted }
        ),
        1 => (0..MODELS.len()).prop_map(Op::Drop),
        1 => Just(Op::Dropped),
        4 => (0..10u64, 0..MODELS.len(), 0..300u64, class()).prop_map(
            |(id, model, bytes, class)| Op::Open { id, model, bytes, class }
        ),
        2 => (0..10u64).prop_map(Op::Close),
        2 => (0..10u64, 0..400u64).prop_map(|(id, bytes)| Op::Resize { id, bytes }),
    ]
}

fn apply(arb: &mut Arbiter, op: &Op) -> Result<(), ArbiterError> {
    match *op {
        Op::Load {
            model,
            resident,
            min,
            wanted,
        } => arb.load_model(MODELS[model], resident, min, wanted),
        Op::Drop(model) => arb.drop_model(MODELS[model]).map(drop),
        Op::Dropped => {
            if let Some(d) = arb.report().dropping.first() {
                arb.dropped(d.ticket);
            }
            Ok(())
        }
        Op::Open {
            id,
            model,
            bytes,
            class,
        } => arb.open_session(id, MODELS[model], bytes, class),
        Op::Close(id) => arb.close_session(id),
        Op::Resize { id, bytes } => arb.resize_session(id, bytes),
    }
}

/// The admission rules written the plain way: models `(resident + min)`, sessions
/// `(model, bytes)`, and what each model being dropped holds, oldest first.
#[derive(Default)]
struct Oracle {
    models: BTreeMap<usize, u64>,
    sessions: BTreeMap<u64, (usize, u64)>,
    dropping: Vec<u64>,
}

impl Oracle {
    fn reserved(&self) -> u64 {
        self.models.values().sum::<u64>()
            + self.sessions.values().map(|s| s.1).sum::<u64>()
            + self.dropping.iter().sum::<u64>()
    }

    /// Whether `op` must succeed on `arb` (the state before it), applying it if so.
    fn step(&mut self, op: &Op, arb: &Arbiter) -> bool {
        let room = BUDGET - self.reserved();
        match *op {
            Op::Load {
                model,
                resident,
                min,
                wanted,
            } => {
                let ok =
                    !self.models.contains_key(&model) && min <= wanted && resident + min <= room;
                if ok {
                    self.models.insert(model, resident + min);
                }
                ok
            }
            Op::Drop(model) => {
                let ok = self.models.contains_key(&model)
                    && !self.sessions.values().any(|s| s.0 == model);
                if ok {
                    self.models.remove(&model);
                    // It holds its weights and the cache granted when it was dropped.
                    let usage = arb
                        .report()
                        .models
                        .into_iter()
                        .find(|m| m.name == MODELS[model]);
                    let held = usage.map_or(0, |m| m.resident_bytes + m.cache_bytes);
                    self.dropping.push(held);
                }
                ok
            }
            Op::Dropped => {
                if !self.dropping.is_empty() {
                    self.dropping.remove(0);
                }
                true
            }
            Op::Open {
                id, model, bytes, ..
            } => {
                let ok = !self.sessions.contains_key(&id)
                    && self.models.contains_key(&model)
                    && bytes <= room;
                if ok {
                    self.sessions.insert(id, (model, bytes));
                }
                ok
            }
            Op::Close(id) => self.sessions.remove(&id).is_some(),
            Op::Resize { id, bytes } => match self.sessions.get(&id).map(|s| s.1) {
                Some(old) => {
                    let ok = bytes <= old || bytes - old <= room;
                    if ok && let Some(s) = self.sessions.get_mut(&id) {
                        s.1 = bytes;
                    }
                    ok
                }
                None => false,
            },
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_operations_keep_every_rule(ops in prop::collection::vec(op(), 1..60)) {
        let mut arb = Arbiter::new(BUDGET);
        let mut oracle = Oracle::default();
        for op in &ops {
            let before = arb.clone();
            let result = apply(&mut arb, op);
            prop_assert_eq!(arb.check_invariants(), Ok(()));
            prop_assert!(arb.used_bytes() <= BUDGET);
            let must_succeed = oracle.step(op, &before);
            prop_assert_eq!(result.is_ok(), must_succeed, "{:?} gave {:?}", op, result);
            prop_assert_eq!(arb.reserved_bytes(), oracle.reserved());
            if let Err(err) = &result {
                prop_assert_eq!(&arb, &before, "refused {:?} changed the state", op);
                if let ArbiterError::OverBudget { needed, available, budget, .. } = err {
                    prop_assert!(needed > available);
                    prop_assert_eq!(*available, before.available_bytes());
                    prop_assert_eq!(*budget, BUDGET);
                }
            }
        }

        // With every session closed and every drop finished the caches grow back as far as the
        // budget allows, the same as if the loaded models had been all there ever was.
        let report = arb.report();
        for id in report.sessions.iter().map(|s| s.id) {
            arb.close_session(id).unwrap();
            prop_assert_eq!(arb.check_invariants(), Ok(()));
        }
        for ticket in report.dropping.iter().map(|d| d.ticket) {
            arb.dropped(ticket);
            prop_assert_eq!(arb.check_invariants(), Ok(()));
        }
        let report = arb.report();
        prop_assert!(report.sessions.is_empty() && report.dropping.is_empty());
        let resident: u64 = report.models.iter().map(|m| m.resident_bytes).sum();
        let caches: u64 = report.models.iter().map(|m| m.cache_bytes).sum();
        let wanted: u64 = report.models.iter().map(|m| m.wanted_cache_bytes).sum();
        prop_assert_eq!(report.used_bytes, resident + caches);
        prop_assert_eq!(report.used_bytes, BUDGET.min(resident + wanted));
        let mut only_models = Arbiter::new(BUDGET);
        for m in &report.models {
            only_models
                .load_model(&m.name, m.resident_bytes, m.min_cache_bytes, m.wanted_cache_bytes)
                .unwrap();
        }
        // Tickets are numbered on; everything else is equal.
        only_models.next_ticket = arb.next_ticket;
        prop_assert_eq!(&arb, &only_models);
    }
}
