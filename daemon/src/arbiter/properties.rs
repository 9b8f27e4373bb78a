//! Property tests over random sequences of arbiter operations, checked against a plain model of
//! the admission rules.

use super::*;
use proptest::prelude::*;
use std::collections::BTreeMap;

const BUDGET: u64 = 1000;
const MAX_SESSIONS: usize = 6;
const MODELS: [&str; 3] = ["a", "b", "c"];
const CLIENTS: [&str; 3] = [":1.1", ":1.2", ":1.3"];

#[derive(Clone, Debug)]
enum Op {
    Load {
        model: usize,
        resident: u64,
        min: u64,
        wanted: u64,
    },
    Unload(usize),
    Open {
        id: u64,
        model: usize,
        client: usize,
        bytes: u64,
        priority: Priority,
    },
    Close(u64),
    Resize {
        id: u64,
        bytes: u64,
    },
    ClientGone(usize),
}

fn priority() -> impl Strategy<Value = Priority> {
    prop_oneof![
        Just(Priority::Background),
        Just(Priority::Normal),
        Just(Priority::Interactive)
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0..MODELS.len(), 0..500u64, 0..200u64, 0..700u64).prop_map(
            |(model, resident, min, wanted)| Op::Load { model, resident, min, wanted }
        ),
        1 => (0..MODELS.len()).prop_map(Op::Unload),
        4 => (0..10u64, 0..MODELS.len(), 0..CLIENTS.len(), 0..300u64, priority()).prop_map(
            |(id, model, client, bytes, priority)| Op::Open { id, model, client, bytes, priority }
        ),
        2 => (0..10u64).prop_map(Op::Close),
        2 => (0..10u64, 0..400u64).prop_map(|(id, bytes)| Op::Resize { id, bytes }),
        1 => (0..CLIENTS.len()).prop_map(Op::ClientGone),
    ]
}

fn apply(arb: &mut Arbiter, op: &Op) -> Result<Vec<SessionId>, ArbiterError> {
    match *op {
        Op::Load {
            model,
            resident,
            min,
            wanted,
        } => arb
            .load_model(MODELS[model], resident, min, wanted)
            .map(|()| vec![]),
        Op::Unload(model) => arb.unload_model(MODELS[model]).map(|()| vec![]),
        Op::Open {
            id,
            model,
            client,
            bytes,
            priority,
        } => arb
            .open_session(
                SessionId(id),
                MODELS[model],
                CLIENTS[client],
                bytes,
                priority,
            )
            .map(|()| vec![]),
        Op::Close(id) => arb.close_session(SessionId(id)).map(|()| vec![]),
        Op::Resize { id, bytes } => arb.resize_session(SessionId(id), bytes).map(|()| vec![]),
        Op::ClientGone(client) => Ok(arb.client_gone(CLIENTS[client])),
    }
}

/// The admission rules written the plain way: models `(resident + min)`, sessions
/// `(model, client, bytes)`.
#[derive(Default)]
struct Oracle {
    models: BTreeMap<usize, u64>,
    sessions: BTreeMap<u64, (usize, usize, u64)>,
}

impl Oracle {
    fn reserved(&self) -> u64 {
        self.models.values().sum::<u64>() + self.sessions.values().map(|s| s.2).sum::<u64>()
    }

    /// Whether `op` must succeed, applying it if so.
    fn step(&mut self, op: &Op) -> bool {
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
            Op::Unload(model) => {
                let ok = self.models.contains_key(&model)
                    && !self.sessions.values().any(|s| s.0 == model);
                if ok {
                    self.models.remove(&model);
                }
                ok
            }
            Op::Open {
                id,
                model,
                client,
                bytes,
                ..
            } => {
                let ok = !self.sessions.contains_key(&id)
                    && self.models.contains_key(&model)
                    && self.sessions.len() < MAX_SESSIONS
                    && bytes <= room;
                if ok {
                    self.sessions.insert(id, (model, client, bytes));
                }
                ok
            }
            Op::Close(id) => self.sessions.remove(&id).is_some(),
            Op::Resize { id, bytes } => match self.sessions.get(&id).map(|s| s.2) {
                Some(old) => {
                    let ok = bytes <= old || bytes - old <= room;
                    if ok && let Some(s) = self.sessions.get_mut(&id) {
                        s.2 = bytes;
                    }
                    ok
                }
                None => false,
            },
            Op::ClientGone(client) => {
                self.sessions.retain(|_, s| s.1 != client);
                true
            }
        }
    }
}

fn fresh() -> Arbiter {
    Arbiter::new(ArbiterConfig {
        budget_bytes: BUDGET,
        max_sessions: MAX_SESSIONS,
    })
}

/// The client that owns session `id` now, if any.
fn owner(arb: &Arbiter, id: u64) -> Option<String> {
    arb.session(SessionId(id)).map(|s| s.client)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn random_operations_keep_every_rule(
        ops in prop::collection::vec(op(), 1..60),
        gone in 0..CLIENTS.len(),
    ) {
        let mut arb = fresh();
        let mut oracle = Oracle::default();
        // Successful operations, with the owner of a closed session.
        let mut log: Vec<(Op, Option<String>)> = Vec::new();
        for op in &ops {
            let before = arb.clone();
            let closed_owner = match op {
                Op::Close(id) | Op::Resize { id, .. } => owner(&arb, *id),
                _ => None,
            };
            let client_before = before.report().clients;
            let result = apply(&mut arb, op);
            prop_assert_eq!(arb.check_invariants(), Ok(()));
            prop_assert!(arb.used_bytes() <= BUDGET);
            let must_succeed = oracle.step(op);
            prop_assert_eq!(result.is_ok(), must_succeed, "{:?} gave {:?}", op, result);
            prop_assert_eq!(arb.reserved_bytes(), oracle.reserved());
            match &result {
                Err(err) => {
                    prop_assert_eq!(&arb, &before, "refused {:?} changed the state", op);
                    if let ArbiterError::OverBudget { needed, available, budget, .. } = err {
                        prop_assert!(needed > available);
                        prop_assert_eq!(*available, before.available_bytes());
                        prop_assert_eq!(*budget, BUDGET);
                    }
                }
                Ok(closed) => {
                    if let Op::ClientGone(c) = op {
                        let name = CLIENTS[*c];
                        let had = client_before.iter().find(|u| u.client == name);
                        prop_assert_eq!(closed.len(), had.map_or(0, |u| u.sessions));
                        prop_assert_eq!(
                            arb.reserved_bytes(),
                            before.reserved_bytes() - had.map_or(0, |u| u.bytes)
                        );
                        prop_assert!(arb.report().sessions.iter().all(|s| s.client != name));
                        prop_assert!(arb.report().clients.iter().all(|u| u.client != name));
                    }
                    log.push((op.clone(), closed_owner));
                }
            }
        }

        // A client that disappears leaves the state as if it had never been there.
        let name = CLIENTS[gone];
        let mut gone_now = arb.clone();
        gone_now.client_gone(name);
        let mut never = fresh();
        for (op, closed_owner) in &log {
            let skip = match op {
                Op::Open { client, .. } | Op::ClientGone(client) => CLIENTS[*client] == name,
                Op::Close(_) | Op::Resize { .. } => closed_owner.as_deref() == Some(name),
                _ => false,
            };
            if !skip {
                prop_assert!(apply(&mut never, op).is_ok(), "replaying {:?}", op);
            }
        }
        prop_assert_eq!(&gone_now, &never);

        // With every session closed the caches grow back as far as the budget allows, the
        // same as if no session had ever been opened.
        for id in arb.report().sessions.iter().map(|s| s.id).collect::<Vec<_>>() {
            arb.close_session(id).unwrap();
            prop_assert_eq!(arb.check_invariants(), Ok(()));
        }
        let report = arb.report();
        prop_assert!(report.sessions.is_empty() && report.clients.is_empty());
        let resident: u64 = report.models.iter().map(|m| m.resident_bytes).sum();
        let caches: u64 = report.models.iter().map(|m| m.cache_bytes).sum();
        let wanted: u64 = report.models.iter().map(|m| m.wanted_cache_bytes).sum();
        prop_assert_eq!(report.used_bytes, resident + caches);
        prop_assert_eq!(report.used_bytes, BUDGET.min(resident + wanted));
        let mut only_models = fresh();
        for m in &report.models {
            only_models
                .load_model(&m.name, m.resident_bytes, m.min_cache_bytes, m.wanted_cache_bytes)
                .unwrap();
        }
        prop_assert_eq!(&arb, &only_models);
    }
}
