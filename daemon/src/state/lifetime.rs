//! How long a model stays loaded without sessions. An unused model's `keep_alive` is one
//! deadline per model, re-armed whenever it becomes unused: the owner's loop sleeps until the
//! earliest one ([`State::next_unload`]), with no timer task per request.

use std::time::{Duration, Instant};

use super::{Port, State};
use crate::config::KeepAlive;

impl<P: Port> State<P> {
    /// Whether model `name` is loaded, not pinned by a user, and has no session (its
    /// configuration may still keep it forever: its idle time is then reported all the same).
    fn unused(&self, name: &str) -> bool {
        self.models.get(name).is_some_and(|m| {
            m.holds.longest() != KeepAlive::Forever
                && m.ready().is_some()
                && !self.sessions.values().any(|s| s.model == name)
        })
    }

    /// Called when a model may have lost its last session, or was given a new lifetime:
    /// unloads it at once, or (re)starts its wait of `keep_alive` from now, or keeps it.
    pub(super) fn unload_if_unused(&mut self, name: &str) {
        if !self.unused(name) {
            return;
        }
        if self.keep_alive(name) == KeepAlive::UntilLastClose {
            self.release(name);
            tracing::info!("model {name} unloaded (no sessions left)");
            return;
        }
        if let Some(m) = self.models.get_mut(name) {
            m.idle_since = Some(Instant::now());
        }
    }

    /// How long model `name` stays loaded without sessions: its configured `keep_alive`, or
    /// the longest hold a user has on it (a pin is `Forever`), whichever is longer.
    fn keep_alive(&self, name: &str) -> KeepAlive {
        let configured = self.params.model(name).keep_alive;
        self.models
            .get(name)
            .map_or(configured, |m| configured.max(m.holds.longest()))
    }

    /// How long an unused, unpinned model has been without sessions.
    pub(super) fn idle_for(&self, name: &str) -> Option<Duration> {
        let since = self.models.get(name)?.idle_since?;
        self.unused(name).then(|| since.elapsed())
    }

    /// Seconds until model `name` unloads on its own; -1 when it will not.
    pub(super) fn unload_in_seconds(&self, name: &str) -> i64 {
        match (self.keep_alive(name), self.idle_for(name)) {
            (KeepAlive::Idle(after), Some(idle)) => after.saturating_sub(idle).as_secs() as i64,
            _ => -1,
        }
    }

    /// The moment the first unused model's `keep_alive` runs out, if one will.
    pub(super) fn next_unload(&self) -> Option<Instant> {
        (self.models.iter())
            .filter(|(name, _)| self.unused(name))
            .filter_map(|(name, m)| match self.keep_alive(name) {
                KeepAlive::Idle(after) => m.idle_since.map(|since| since + after),
                _ => None,
            })
            .min()
    }

    /// Unloads every unused model whose `keep_alive` has run out.
    pub(super) fn unload_idle(&mut self) {
        let now = Instant::now();
        let due: Vec<(String, KeepAlive)> = (self.models.iter())
            .filter(|(name, _)| self.unused(name))
            .map(|(name, m)| (name, m, self.keep_alive(name)))
            .filter(|(_, m, keep_alive)| match keep_alive {
                KeepAlive::Idle(after) => m.idle_since.is_some_and(|since| since + *after <= now),
                _ => false,
            })
            .map(|(name, _, keep_alive)| (name.clone(), keep_alive))
            .collect();
        for (name, keep_alive) in due {
            self.release(&name);
            tracing::info!("model {name} unloaded (idle for its keep_alive, {keep_alive:?})");
        }
    }
}

/// Sleeps until `deadline`; forever when there is none.
pub(super) async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}
