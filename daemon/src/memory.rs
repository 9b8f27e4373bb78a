//! What the state owner needs from memory accounting, and its implementation by the
//! [`Arbiter`] (DESIGN §7): models reserve their resident bytes and their neuron cache, sessions
//! their KV cache and scratch; a reservation that does not fit is refused and changes nothing. Invariant:
//! `used <= budget` after every call (checked by the arbiter's property tests).
//!
//! The session limit is enforced by the state owner (it answers `Busy`), so the arbiter is
//! created without one.

use crate::arbiter::{
    Arbiter, ArbiterConfig, ArbiterError, Priority, SessionId as ArbiterSessionId,
};

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
    /// (model, resident bytes, cache bytes).
    pub models: Vec<(String, u64, u64)>,
    /// (session, model, client, bytes).
    pub sessions: Vec<(SessionId, String, String, u64)>,
}

/// What the state owner needs from the memory arbiter.
pub trait Memory {
    /// Reserves a model's resident bytes and its neuron cache (0 without one); loading an
    /// accounted model again is a no-op.
    fn load_model(
        &mut self,
        name: &str,
        resident_bytes: u64,
        cache_bytes: u64,
    ) -> Result<(), OverBudget>;
    /// Releases a model; its sessions must be closed first.
    fn unload_model(&mut self, name: &str);
    /// Reserves a session's KV cache and buffers (its minimum) on an accounted model.
    fn open_session(
        &mut self,
        id: SessionId,
        model: &str,
        client: &str,
        bytes: u64,
    ) -> Result<(), OverBudget>;
    fn close_session(&mut self, id: SessionId);
    /// Closes every session of `client`; returns their ids.
    fn client_gone(&mut self, client: &str) -> Vec<SessionId>;
    fn report(&self) -> Figures;
}

impl Memory for Arbiter {
    fn load_model(
        &mut self,
        name: &str,
        resident_bytes: u64,
        cache_bytes: u64,
    ) -> Result<(), OverBudget> {
        if self.is_loaded(name) {
            return Ok(());
        }
        // The engine's neuron cache has a fixed size, allocated at load: it is the cache's
        // minimum and its wish at once, so it is a hard reservation that never shrinks.
        Arbiter::load_model(self, name, resident_bytes, cache_bytes, cache_bytes)
            .map_err(over_budget)
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
    ) -> Result<(), OverBudget> {
        Arbiter::open_session(
            self,
            ArbiterSessionId(id),
            model,
            client,
            bytes,
            Priority::Normal,
        )
        .map_err(over_budget)
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
                .map(|m| (m.name, m.resident_bytes, m.cache_bytes))
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
        m.load_model("a", 50, 10).unwrap();
        assert_eq!(m.report().models, [("a".to_string(), 50, 10)]);
        let err = m.load_model("b", 40, 10).unwrap_err();
        assert_eq!((err.needed, err.free), (50, 40));
        m.open_session(1, "a", ":1.1", 30).unwrap();
        let before = m.report();
        let err = m.open_session(2, "a", ":1.2", 11).unwrap_err();
        assert_eq!((err.needed, err.free), (11, 10));
        assert_eq!(m.report(), before);
        m.open_session(3, "a", ":1.2", 10).unwrap();
        assert_eq!(m.report().used, 100);
        assert_eq!(m.client_gone(":1.2"), [3]);
        assert_eq!(m.client_gone(":1.2"), Vec::<SessionId>::new());
        m.close_session(1);
        m.unload_model("a");
        assert_eq!(m.report().used, 0);
    }
}
