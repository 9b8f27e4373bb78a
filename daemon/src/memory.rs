//! What the state owner needs from memory accounting, and its implementation by the
//! [`Arbiter`]: models reserve their resident bytes and the floor of their neuron cache (the
//! cache then grows toward its wanted size as memory allows, and yields it back), sessions their
//! scratch and the KV blocks they have grown; a reservation that does not fit is refused and
//! changes nothing. Invariant: `used <= budget` after every call (checked by the arbiter's
//! property tests). The bytes themselves come from the engine (each model, cache and session
//! reports what it holds); this layer only adds them up.
//!
//! The session limit is enforced by the state owner (it answers `Busy`), so the arbiter is
//! created without one.

pub use crate::arbiter::Priority;
use crate::arbiter::{Arbiter, ArbiterConfig, ArbiterError, SessionId as ArbiterSessionId};

/// Identifies a session (its number in the object path).
pub type SessionId = u64;

/// Why a reservation was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what} needs {needed} bytes but only {free} of the {budget}-byte budget are free")]
pub struct OverBudget {
    pub what: String,
    pub needed: u64,
    pub free: u64,
    pub budget: u64,
}

/// The figures of [`Memory::report`], before they become the wire type.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Figures {
    pub budget: u64,
    pub used: u64,
    pub models: Vec<ModelFigures>,
    /// (session, model, client, bytes).
    pub sessions: Vec<(SessionId, String, String, u64)>,
}

/// One model's figures.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelFigures {
    pub name: String,
    pub resident: u64,
    /// The neuron cache granted now, its floor and its wanted size (all 0 without a cache).
    pub cache: u64,
    pub cache_floor: u64,
    pub cache_wanted: u64,
}

/// What the state owner needs from the memory arbiter.
pub trait Memory {
    /// Reserves a model's resident bytes and the floor of its neuron cache; the cache is then
    /// granted up to `cache_wanted` as memory allows (all 0 without a cache). Loading an
    /// accounted model again is a no-op.
    fn load_model(
        &mut self,
        name: &str,
        resident_bytes: u64,
        cache_floor: u64,
        cache_wanted: u64,
    ) -> Result<(), OverBudget>;
    /// Adds `bytes` to a loaded model's resident reservation, for something built after the
    /// load that lives as long as the model.
    fn grow_model(&mut self, name: &str, bytes: u64) -> Result<(), OverBudget>;
    /// Takes back what [`Memory::grow_model`] added, once the model has dropped it.
    fn shrink_model(&mut self, name: &str, bytes: u64);
    /// Releases a model; its sessions must be closed first.
    fn unload_model(&mut self, name: &str);
    /// Reserves what a new session holds at open on an accounted model; `priority` orders the
    /// neuron caches (its model's cache yields after lower-priority ones).
    fn open_session(
        &mut self,
        id: SessionId,
        model: &str,
        client: &str,
        bytes: u64,
        priority: Priority,
    ) -> Result<(), OverBudget>;
    /// Sets an open session's reservation to `bytes` (its KV cache grew or was released).
    fn resize_session(&mut self, id: SessionId, bytes: u64) -> Result<(), OverBudget>;
    fn close_session(&mut self, id: SessionId);
    /// The neuron cache granted to a model now.
    fn cache_bytes(&self, model: &str) -> Option<u64>;
    /// Closes every session of `client`; returns their ids.
    fn client_gone(&mut self, client: &str) -> Vec<SessionId>;
    fn report(&self) -> Figures;
}

impl Memory for Arbiter {
    fn load_model(
        &mut self,
        name: &str,
        resident_bytes: u64,
        cache_floor: u64,
        cache_wanted: u64,
    ) -> Result<(), OverBudget> {
        if self.is_loaded(name) {
            return Ok(());
        }
        Arbiter::load_model(self, name, resident_bytes, cache_floor, cache_wanted)
            .map_err(over_budget)
    }

    fn grow_model(&mut self, name: &str, bytes: u64) -> Result<(), OverBudget> {
        Arbiter::grow_resident(self, name, bytes).map_err(over_budget)
    }

    fn shrink_model(&mut self, name: &str, bytes: u64) {
        // A model unloaded meanwhile has nothing left to shrink.
        let _ = Arbiter::shrink_resident(self, name, bytes);
    }

    fn unload_model(&mut self, name: &str) {
        if let Err(e) = Arbiter::unload_model(self, name) {
            panic!("unload_model({name}): {e}: the state owner must close sessions first");
        }
    }

    fn open_session(
        &mut self,
        id: SessionId,
        model: &str,
        client: &str,
        bytes: u64,
        priority: Priority,
    ) -> Result<(), OverBudget> {
        Arbiter::open_session(self, ArbiterSessionId(id), model, client, bytes, priority)
            .map_err(over_budget)
    }

    fn resize_session(&mut self, id: SessionId, bytes: u64) -> Result<(), OverBudget> {
        Arbiter::resize_session(self, ArbiterSessionId(id), bytes).map_err(over_budget)
    }

    fn cache_bytes(&self, model: &str) -> Option<u64> {
        Arbiter::cache_bytes(self, model)
    }

    fn close_session(&mut self, id: SessionId) {
        // Closing an unknown session is a no-op: a client may vanish while it closes one.
        let _ = Arbiter::close_session(self, ArbiterSessionId(id));
    }

    fn client_gone(&mut self, client: &str) -> Vec<SessionId> {
        Arbiter::client_gone(self, client)
            .into_iter()
            .map(|id| id.0)
            .collect()
    }

    fn report(&self) -> Figures {
        let r = Arbiter::report(self);
        Figures {
            budget: r.budget_bytes,
            used: r.used_bytes,
            models: r
                .models
                .into_iter()
                .map(|m| ModelFigures {
                    name: m.name,
                    resident: m.resident_bytes,
                    cache: m.cache_bytes,
                    cache_floor: m.min_cache_bytes,
                    cache_wanted: m.wanted_cache_bytes,
                })
                .collect(),
            sessions: r
                .sessions
                .into_iter()
                .map(|s| (s.id.0, s.model, s.client, s.bytes))
                .collect(),
        }
    }
}

/// The arbiter refuses only for lack of memory here: names and ids come from the state owner,
/// which checks them first, and it has no session limit (see the module docs).
fn over_budget(e: ArbiterError) -> OverBudget {
    match e {
        ArbiterError::OverBudget {
            what,
            needed,
            available,
            budget,
        } => OverBudget {
            what,
            needed,
            free: available,
            budget,
        },
        other => panic!("memory arbiter refused a request the state owner validated: {other}"),
    }
}

/// The daemon's arbiter for a budget of `budget` bytes.
pub fn arbiter(budget: u64) -> Arbiter {
    Arbiter::new(ArbiterConfig {
        budget_bytes: budget,
        max_sessions: usize::MAX,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn reservations_that_do_not_fit_change_nothing() {
        let mut a = arbiter(100);
        let m: &mut dyn Memory = &mut a;
        m.load_model("a", 50, 10, 10).unwrap();
        let a = ModelFigures {
            name: "a".into(),
            resident: 50,
            cache: 10,
            cache_floor: 10,
            cache_wanted: 10,
        };
        assert_eq!(m.report().models, [a]);
        let err = m.load_model("b", 40, 10, 10).unwrap_err();
        assert_eq!((err.needed, err.free), (50, 40));
        m.open_session(1, "a", ":1.1", 30, Priority::Normal)
            .unwrap();
        let before = m.report();
        let err = m
            .open_session(2, "a", ":1.2", 11, Priority::Normal)
            .unwrap_err();
        assert_eq!((err.needed, err.free), (11, 10));
        assert_eq!(m.report(), before);
        m.open_session(3, "a", ":1.2", 10, Priority::Normal)
            .unwrap();
        assert_eq!(m.report().used, 100);
        let err = m.resize_session(3, 11).unwrap_err();
        assert_eq!((err.needed, err.free), (1, 0));
        assert_eq!(m.report().used, 100);
        m.resize_session(3, 4).unwrap();
        assert_eq!(m.report().used, 94);
        assert_eq!(m.client_gone(":1.2"), [3]);
        assert_eq!(m.client_gone(":1.2"), Vec::<SessionId>::new());
        m.close_session(1);
        m.unload_model("a");
        assert_eq!(m.report().used, 0);
    }

    #[test]
    fn an_elastic_cache_yields_to_a_session_and_grows_back() {
        let mut a = arbiter(100);
        let m: &mut dyn Memory = &mut a;
        m.load_model("a", 20, 10, 70).unwrap();
        assert_eq!(m.cache_bytes("a"), Some(70));
        m.open_session(1, "a", ":1.1", 30, Priority::Normal)
            .unwrap();
        assert_eq!(m.cache_bytes("a"), Some(50));
        m.resize_session(1, 70).unwrap();
        assert_eq!(m.cache_bytes("a"), Some(10), "shrunk to its floor");
        assert!(m.resize_session(1, 71).is_err(), "nothing below the floor");
        m.close_session(1);
        assert_eq!(m.cache_bytes("a"), Some(70));
    }
}
