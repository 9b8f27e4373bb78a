//! Memory accounting behind a small boundary, shaped like the arbiter's API (`load_model`,
//! `open_session`, `close_session`, `client_gone`, `unload_model`, `report`) so that
//! `arbiter::Arbiter` can replace [`Ledger`] without touching the state owner.
//!
//! [`Ledger`] is the simple form: models reserve their resident bytes, sessions their KV cache and
//! scratch; a reservation that does not fit is refused and changes nothing. Invariant:
//! `used <= budget` after every call.

use std::collections::BTreeMap;

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
    /// Reserves a model's resident bytes; loading an accounted model again is a no-op.
    fn load_model(&mut self, name: &str, resident_bytes: u64) -> Result<(), OverBudget>;
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

#[derive(Debug)]
struct SessionEntry {
    model: String,
    client: String,
    bytes: u64,
}

/// Plain reservation accounting (no neuron caches yet: the dense engine has none).
#[derive(Debug)]
pub struct Ledger {
    budget: u64,
    models: BTreeMap<String, u64>,
    sessions: BTreeMap<SessionId, SessionEntry>,
}

impl Ledger {
    pub fn new(budget: u64) -> Ledger {
        Ledger {
            budget,
            models: BTreeMap::new(),
            sessions: BTreeMap::new(),
        }
    }

    fn used(&self) -> u64 {
        self.models.values().sum::<u64>() + self.sessions.values().map(|s| s.bytes).sum::<u64>()
    }

    fn reserve(&self, what: String, needed: u64) -> Result<(), OverBudget> {
        let free = self.budget.saturating_sub(self.used());
        if needed <= free {
            Ok(())
        } else {
            Err(OverBudget {
                what,
                needed,
                free,
                budget: self.budget,
            })
        }
    }
}

impl Memory for Ledger {
    fn load_model(&mut self, name: &str, resident_bytes: u64) -> Result<(), OverBudget> {
        if self.models.contains_key(name) {
            return Ok(());
        }
        self.reserve(format!("model {name:?}"), resident_bytes)?;
        self.models.insert(name.to_string(), resident_bytes);
        Ok(())
    }

    fn unload_model(&mut self, name: &str) {
        assert!(
            !self.sessions.values().any(|s| s.model == name),
            "unload_model({name}) with open sessions: the state owner must close them first"
        );
        self.models.remove(name);
    }

    fn open_session(
        &mut self,
        id: SessionId,
        model: &str,
        client: &str,
        bytes: u64,
    ) -> Result<(), OverBudget> {
        assert!(
            self.models.contains_key(model),
            "open_session on model {model} that is not accounted"
        );
        self.reserve(format!("a session on {model:?}"), bytes)?;
        self.sessions.insert(
            id,
            SessionEntry {
                model: model.to_string(),
                client: client.to_string(),
                bytes,
            },
        );
        Ok(())
    }

    fn close_session(&mut self, id: SessionId) {
        self.sessions.remove(&id);
    }

    fn client_gone(&mut self, client: &str) -> Vec<SessionId> {
        let ids: Vec<SessionId> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.client == client)
            .map(|(id, _)| *id)
            .collect();
        for id in &ids {
            self.sessions.remove(id);
        }
        ids
    }

    fn report(&self) -> Figures {
        Figures {
            budget: self.budget,
            used: self.used(),
            models: self
                .models
                .iter()
                .map(|(n, b)| (n.clone(), *b, 0))
                .collect(),
            sessions: self
                .sessions
                .iter()
                .map(|(id, s)| (*id, s.model.clone(), s.client.clone(), s.bytes))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn reservations_that_do_not_fit_change_nothing() {
        let mut m = Ledger::new(100);
        m.load_model("a", 60).unwrap();
        assert!(m.load_model("b", 50).is_err());
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
