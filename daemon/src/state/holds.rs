//! Who keeps a loaded model beyond its sessions: each user (uid) that pinned it with `LoadModel`
//! or gave it a lifetime with `LoadModelFor`. A hold belongs to its user, not to the connection
//! that made it: it outlives the connection, counts against that user's
//! `limits.max_pins_per_client`, and only that user or an admin can give it up.
//!
//! A model that failed to load holds nothing: its holds lived in its entry, which is gone.

use std::collections::BTreeMap;

use leanstream::contract::LeanStreamError;

use crate::config::KeepAlive;

/// The holds on one model: the longest lifetime each user asked for.
#[derive(Debug, Default)]
pub struct Holds(BTreeMap<u32, KeepAlive>);

/// What `UnloadModel` may do once the caller's hold is given up.
#[derive(Debug, PartialEq, Eq)]
pub enum Unload {
    /// Nobody holds the model any more: it unloads.
    Now,
    /// Other users still hold it: it stays loaded for them.
    KeptByOthers,
}

impl Holds {
    /// Records that `user` keeps the model for `keep_alive` (`Forever`: a pin). A user's hold
    /// only ever lengthens.
    pub fn add(&mut self, user: u32, keep_alive: KeepAlive) {
        let held = self.0.entry(user).or_default();
        *held = (*held).max(keep_alive);
    }

    /// Whether `user` holds the model.
    pub fn by(&self, user: u32) -> bool {
        self.0.contains_key(&user)
    }

    /// The longest lifetime any holder asked for (`UntilLastClose` when nobody holds it).
    pub fn longest(&self) -> KeepAlive {
        self.0.values().copied().max().unwrap_or_default()
    }

    /// Gives up `user`'s hold for `UnloadModel`. An admin gives up everyone's. Refused, with
    /// nothing changed, when others hold the model and `user` does not.
    pub fn give_up(&mut self, user: u32, admin: bool) -> Result<Unload, LeanStreamError> {
        if admin {
            self.0.clear();
        } else if !self.0.is_empty() && self.0.remove(&user).is_none() {
            return Err(LeanStreamError::AccessDenied(
                "the model is kept loaded by another user; only they or an admin can unload it"
                    .into(),
            ));
        }
        Ok(if self.0.is_empty() {
            Unload::Now
        } else {
            Unload::KeptByOthers
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::time::Duration;

    use super::*;

    const ALICE: u32 = 1000;
    const BOB: u32 = 1001;

    fn idle(s: u64) -> KeepAlive {
        KeepAlive::Idle(Duration::from_secs(s))
    }

    #[test]
    fn a_users_hold_only_lengthens_and_the_longest_hold_wins() {
        let mut h = Holds::default();
        assert_eq!(h.longest(), KeepAlive::UntilLastClose);
        h.add(ALICE, idle(600));
        h.add(ALICE, idle(60));
        assert_eq!(h.longest(), idle(600));
        h.add(BOB, KeepAlive::Forever);
        assert_eq!(h.longest(), KeepAlive::Forever);
        assert!(h.by(ALICE) && h.by(BOB) && !h.by(7));
    }

    #[test]
    fn another_users_pin_cannot_be_given_up_by_a_stranger() {
        let mut h = Holds::default();
        h.add(ALICE, KeepAlive::Forever);
        assert!(matches!(
            h.give_up(BOB, false),
            Err(LeanStreamError::AccessDenied(_))
        ));
        // Nothing changed.
        assert!(h.by(ALICE));
        assert_eq!(h.longest(), KeepAlive::Forever);
    }

    #[test]
    fn a_holder_gives_up_only_its_own_hold_and_an_admin_gives_up_all() {
        let mut h = Holds::default();
        h.add(ALICE, KeepAlive::Forever);
        h.add(BOB, idle(60));
        assert_eq!(h.give_up(BOB, false).unwrap(), Unload::KeptByOthers);
        assert_eq!(h.longest(), KeepAlive::Forever);
        h.add(BOB, idle(60));
        assert_eq!(h.give_up(0, true).unwrap(), Unload::Now);
        assert!(!h.by(ALICE) && !h.by(BOB));
    }

    #[test]
    fn a_model_nobody_holds_may_be_unloaded_by_anyone() {
        let mut h = Holds::default();
        assert_eq!(h.give_up(BOB, false).unwrap(), Unload::Now);
    }
}
