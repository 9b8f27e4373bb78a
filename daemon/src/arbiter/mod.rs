//! The memory arbiter (docs/architecture.md §3): one byte budget for the whole daemon, shared
//! by resident weights, neuron caches, KV caches and working buffers. A pure state machine — no
//! I/O, no clock, no async — owned by the daemon's state task, which applies its decisions to
//! the engine.
//!
//! # Policy
//!
//! Memory falls into two kinds:
//!
//! - **Hard reservations**, never taken back by the arbiter: each loaded model's resident weights
//!   plus its *minimum* neuron cache, and each session's bytes (its KV cache, grown one block of
//!   tokens at a time as it is used, plus working buffers). A request is admitted only if all
//!   hard reservations, its own included, fit in the budget; otherwise it is refused with
//!   [`ArbiterError::OverBudget`] and nothing changes.
//!   The arbiter never evicts a session or unloads a model to make room: it refuses the newcomer.
//!   So a running session — whatever its priority — is never hurt by a later one.
//! - **Elastic neuron caches**: every byte not hard-reserved is handed to the models' caches,
//!   each between its minimum and its wanted size. Caches are what yields first: a new session
//!   is admitted by shrinking caches (down to their minimum) before anything is refused.
//!
//! After every change the free bytes are redistributed from scratch (so the split depends only on
//! the current state, never on history):
//!
//! 1. Each model's *tier* is the highest [`CacheClass`] among its open sessions; a model without
//!    sessions is in the lowest tier, below [`CacheClass::Background`].
//! 2. Tiers are served from the highest down: a tier's caches are filled up to their wanted size
//!    before a lower tier gets a byte. An idle model's cache therefore yields first, and a
//!    `Background` session's model yields to an `Interactive` one's.
//! 3. Inside a tier the bytes are split in proportion to what each cache wants above its minimum
//!    ([`share::proportional`]), so every cache of the tier gets the same fraction of its wish.
//!    Proportional rather than first-come keeps the split independent of load order, and a
//!    cache's hit ratio degrades with the fraction of its wish it gets, so equal fractions share
//!    the loss evenly.
//!
//! Nothing stays free while some cache is below its wanted size. The daemon reads the new sizes
//! ([`Arbiter::cache_bytes`] or [`Arbiter::report`]) after each successful call and resizes the
//! engine's caches; an engine may round a grant down (to whole chunks), never up. When opening a
//! session the daemon shrinks the caches before it allocates the KV cache.
//!
//! # What it knows
//!
//! Bytes only: each model's reservation, each session's bytes and its model's cache class, and
//! the models being dropped. Who owns a session, and whether it is generating, belong to the
//! state owner and the scheduler; all three key a session by the same [`SessionId`].
//!
//! A model is dropped in two steps: [`Arbiter::drop_model`] turns what it holds (weights and
//! the cache granted at that moment) into a hard reservation of its own, and
//! [`Arbiter::dropped`] ends it once the process has really let the memory go. In between,
//! the same model may load again and a cache may grow only into memory that is truly free.

mod audit;
mod error;
#[cfg(test)]
mod properties;
mod share;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

pub use error::{ArbiterError, Bytes};

/// A session's number, the same in the state owner, the scheduler and the ledger; the daemon
/// serves the session at `{SESSION_PATH_PREFIX}/{n}`.
pub type SessionId = u64;

/// Names a model being dropped, from [`Arbiter::drop_model`] to [`Arbiter::dropped`].
pub type DropTicket = u64;

/// How much a model's neuron cache deserves the free memory: the class of its most demanding
/// open session (a model's `priority` in the configuration). Ordered: `Background < Normal <
/// Interactive`. It only orders the neuron caches (see the module policy); it never evicts a
/// session and never admits one that does not fit. A request's urgency in the scheduler is
/// another thing, `leanstream::contract::Priority`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CacheClass {
    Background,
    #[default]
    Normal,
    Interactive,
}

/// What one loaded model holds. `cache_bytes` is within `min_cache_bytes..=wanted_cache_bytes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelUsage {
    pub name: String,
    /// Weights kept in memory for the model's lifetime.
    pub resident_bytes: u64,
    /// The neuron cache granted now.
    pub cache_bytes: u64,
    pub min_cache_bytes: u64,
    pub wanted_cache_bytes: u64,
    /// Open sessions on the model.
    pub sessions: usize,
}

/// What one session holds: its KV cache and working buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionUsage {
    pub id: SessionId,
    pub model: String,
    pub bytes: u64,
    pub class: CacheClass,
}

/// A model being dropped, and the bytes it still holds until it is gone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DroppingUsage {
    pub ticket: DropTicket,
    pub name: String,
    pub bytes: u64,
}

/// The ledger's figures, each list sorted by name, ticket or id. `used_bytes` is resident
/// weights + caches + sessions + models being dropped, and `used_bytes <= budget_bytes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsageReport {
    pub budget_bytes: u64,
    pub used_bytes: u64,
    pub models: Vec<ModelUsage>,
    pub dropping: Vec<DroppingUsage>,
    pub sessions: Vec<SessionUsage>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Model {
    resident_bytes: u64,
    min_cache_bytes: u64,
    wanted_cache_bytes: u64,
    cache_bytes: u64,
    sessions: usize,
}

impl Model {
    /// Resident weights plus the minimum cache: what the model holds whatever happens.
    fn reserved(&self) -> u64 {
        self.resident_bytes + self.min_cache_bytes
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Session {
    model: String,
    bytes: u64,
    class: CacheClass,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Dropping {
    name: String,
    bytes: u64,
}

/// The memory arbiter. Two arbiters compare equal when every reservation and cache is the same.
///
/// Invariants, checked after every change in debug builds and by [`Arbiter::check_invariants`]:
/// hard reservations and the used total stay within the budget; each cache stays between its
/// minimum and wanted size; no byte stays free while a cache is below its wish; higher tiers are
/// full before a lower tier's cache grows past its minimum; each model counts its sessions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Arbiter {
    budget_bytes: u64,
    models: BTreeMap<String, Model>,
    sessions: BTreeMap<SessionId, Session>,
    dropping: BTreeMap<DropTicket, Dropping>,
    next_ticket: DropTicket,
    /// Sum of every model's `reserved()`, every session's bytes and every dropping model's
    /// bytes; `<= budget_bytes`.
    reserved: u64,
}

impl Arbiter {
    /// An arbiter of `budget_bytes` with nothing loaded.
    pub fn new(budget_bytes: u64) -> Arbiter {
        Arbiter {
            budget_bytes,
            models: BTreeMap::new(),
            sessions: BTreeMap::new(),
            dropping: BTreeMap::new(),
            next_ticket: 1,
            reserved: 0,
        }
    }

    /// Reserves a model's resident weights plus its minimum neuron cache, shrinking other caches
    /// as needed; its cache then grows toward `wanted_cache_bytes` as free memory allows. The
    /// dense engine passes `0, 0` for the cache.
    ///
    /// Refused, changing nothing, when the name is loaded, `min > wanted`, or
    /// `resident + min` does not fit beside the other hard reservations (`OverBudget`).
    pub fn load_model(
        &mut self,
        name: &str,
        resident_bytes: u64,
        min_cache_bytes: u64,
        wanted_cache_bytes: u64,
    ) -> Result<(), ArbiterError> {
        if self.models.contains_key(name) {
            return Err(ArbiterError::ModelAlreadyLoaded(name.to_owned()));
        }
        if min_cache_bytes > wanted_cache_bytes {
            return Err(ArbiterError::BadCacheRange {
                model: name.to_owned(),
                min_cache_bytes,
                wanted_cache_bytes,
            });
        }
        let needed = resident_bytes.saturating_add(min_cache_bytes);
        self.admit(needed, || {
            format!(
                "loading model `{name}` ({} resident + {} minimum cache)",
                Bytes(resident_bytes),
                Bytes(min_cache_bytes)
            )
        })?;
        self.models.insert(
            name.to_owned(),
            Model {
                resident_bytes,
                min_cache_bytes,
                wanted_cache_bytes,
                cache_bytes: min_cache_bytes,
                sessions: 0,
            },
        );
        self.reserved += needed;
        self.settle();
        Ok(())
    }

    /// Adds `extra_bytes` to a loaded model's resident reservation (something it keeps for
    /// its lifetime, built after the load: the grammar parser's token trie), shrinking other
    /// caches as needed. Refused, changing nothing, when the model is not loaded or the bytes
    /// do not fit beside the other hard reservations (`OverBudget`).
    pub fn grow_resident(&mut self, name: &str, extra_bytes: u64) -> Result<(), ArbiterError> {
        if !self.models.contains_key(name) {
            return Err(ArbiterError::UnknownModel(name.to_owned()));
        }
        self.admit(extra_bytes, || {
            format!("keeping {} more for model `{name}`", Bytes(extra_bytes))
        })?;
        if let Some(m) = self.models.get_mut(name) {
            m.resident_bytes += extra_bytes;
        }
        self.reserved += extra_bytes;
        self.settle();
        Ok(())
    }

    /// Takes `bytes` (at most what it holds) off a loaded model's resident reservation,
    /// something it kept and has dropped (a shared prompt prefix); the caches grow into them.
    pub fn shrink_resident(&mut self, name: &str, bytes: u64) -> Result<(), ArbiterError> {
        let m = self
            .models
            .get_mut(name)
            .ok_or_else(|| ArbiterError::UnknownModel(name.to_owned()))?;
        let bytes = bytes.min(m.resident_bytes);
        m.resident_bytes -= bytes;
        self.reserved -= bytes;
        self.settle();
        Ok(())
    }

    /// Starts dropping a model: what it holds now (weights and the cache granted) stays
    /// reserved under the returned ticket until [`Arbiter::dropped`], and the name is free to
    /// load again at once. Refused with `ModelInUse` while the model has sessions.
    pub fn drop_model(&mut self, name: &str) -> Result<DropTicket, ArbiterError> {
        let model = self
            .models
            .get(name)
            .ok_or_else(|| ArbiterError::UnknownModel(name.to_owned()))?;
        if model.sessions > 0 {
            return Err(ArbiterError::ModelInUse {
                model: name.to_owned(),
                sessions: model.sessions,
            });
        }
        let bytes = model.resident_bytes + model.cache_bytes;
        // The cache above its floor was elastic; it stays held until the model is gone.
        self.reserved += model.cache_bytes - model.min_cache_bytes;
        self.models.remove(name);
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        let name = name.to_owned();
        self.dropping.insert(ticket, Dropping { name, bytes });
        self.settle();
        Ok(ticket)
    }

    /// The model dropped under `ticket` has let its memory go; the caches grow into it. A
    /// ticket ends once: an unknown one changes nothing.
    pub fn dropped(&mut self, ticket: DropTicket) {
        if let Some(d) = self.dropping.remove(&ticket) {
            self.reserved -= d.bytes;
            self.settle();
        }
    }

    /// Reserves `bytes` (the KV cache for the session's context plus its working buffers) for a
    /// new session on `model`, shrinking neuron caches toward their minimum as needed, and
    /// re-splits the caches by the new classes.
    ///
    /// Refused, changing nothing, when the id is taken, the model is not loaded, or the bytes do
    /// not fit even with every cache at its minimum (`OverBudget`).
    pub fn open_session(
        &mut self,
        id: SessionId,
        model: &str,
        bytes: u64,
        class: CacheClass,
    ) -> Result<(), ArbiterError> {
        if self.sessions.contains_key(&id) {
            return Err(ArbiterError::SessionAlreadyOpen(id));
        }
        if !self.models.contains_key(model) {
            return Err(ArbiterError::UnknownModel(model.to_owned()));
        }
        self.admit(bytes, || format!("session {id} on model `{model}`"))?;
        if let Some(m) = self.models.get_mut(model) {
            m.sessions += 1;
        }
        let model = model.to_owned();
        self.sessions.insert(
            id,
            Session {
                model,
                bytes,
                class,
            },
        );
        self.reserved += bytes;
        self.settle();
        Ok(())
    }

    /// Sets a session's reservation to `bytes` (its KV cache grew or was released). Growing is
    /// admitted like a new request — caches shrink toward their minimum first — and refused with
    /// `OverBudget`, changing nothing, when the extra bytes do not fit; shrinking always
    /// succeeds and the caches grow into what it frees.
    pub fn resize_session(&mut self, id: SessionId, bytes: u64) -> Result<(), ArbiterError> {
        let session = self
            .sessions
            .get(&id)
            .ok_or(ArbiterError::UnknownSession(id))?;
        let old = session.bytes;
        if bytes > old {
            self.admit(bytes - old, || {
                format!(
                    "growing session {id} on model `{}` from {} to {}",
                    session.model,
                    Bytes(old),
                    Bytes(bytes)
                )
            })?;
        }
        if let Some(s) = self.sessions.get_mut(&id) {
            s.bytes = bytes;
        }
        self.reserved = self.reserved - old + bytes;
        self.settle();
        Ok(())
    }

    /// Releases a session's bytes; the caches grow into them.
    pub fn close_session(&mut self, id: SessionId) -> Result<(), ArbiterError> {
        let session = self
            .sessions
            .remove(&id)
            .ok_or(ArbiterError::UnknownSession(id))?;
        if let Some(m) = self.models.get_mut(&session.model) {
            m.sessions -= 1;
        }
        self.reserved -= session.bytes;
        self.settle();
        Ok(())
    }

    /// Resident weights + neuron caches + sessions + models being dropped. Never above the
    /// budget.
    pub fn used_bytes(&self) -> u64 {
        self.reserved
            + self
                .models
                .values()
                .map(|m| m.cache_bytes - m.min_cache_bytes)
                .sum::<u64>()
    }

    #[cfg(test)]
    /// Hard reservations: resident weights, minimum caches, sessions and models being dropped —
    /// what stays used if every cache shrinks to its minimum.
    pub fn reserved_bytes(&self) -> u64 {
        self.reserved
    }

    /// The budget less the hard reservations: the most a new request can get.
    pub fn available_bytes(&self) -> u64 {
        self.budget_bytes.saturating_sub(self.reserved)
    }

    /// The neuron cache granted to a loaded model.
    pub fn cache_bytes(&self, model: &str) -> Option<u64> {
        self.models.get(model).map(|m| m.cache_bytes)
    }

    /// Refuses `needed` more hard-reserved bytes unless they fit beside the others.
    fn admit(&self, needed: u64, what: impl FnOnce() -> String) -> Result<(), ArbiterError> {
        let available = self.available_bytes();
        if needed > available {
            return Err(ArbiterError::OverBudget {
                what: what(),
                needed,
                available,
                budget: self.budget_bytes,
            });
        }
        Ok(())
    }

    /// Each model's tier: the highest class among its sessions, `None` without sessions.
    fn tiers(&self) -> BTreeMap<&str, Option<CacheClass>> {
        let mut tiers: BTreeMap<&str, Option<CacheClass>> = self
            .models
            .keys()
            .map(|name| (name.as_str(), None))
            .collect();
        for s in self.sessions.values() {
            let tier = tiers.entry(s.model.as_str()).or_default();
            *tier = (*tier).max(Some(s.class));
        }
        tiers
    }

    /// Re-splits the free bytes among the caches (module policy), then checks the invariants in
    /// debug builds.
    fn settle(&mut self) {
        let mut by_tier: BTreeMap<Option<CacheClass>, Vec<String>> = BTreeMap::new();
        for (name, tier) in self.tiers() {
            by_tier.entry(tier).or_default().push(name.to_owned());
        }
        let mut free = self.available_bytes();
        for names in by_tier.values().rev() {
            let wants: Vec<u64> = names
                .iter()
                .map(|n| {
                    self.models
                        .get(n)
                        .map_or(0, |m| m.wanted_cache_bytes - m.min_cache_bytes)
                })
                .collect();
            let grants = share::proportional(free, &wants);
            for (name, grant) in names.iter().zip(grants) {
                if let Some(m) = self.models.get_mut(name) {
                    m.cache_bytes = m.min_cache_bytes + grant;
                }
                free -= grant;
            }
        }
        if cfg!(debug_assertions)
            && let Err(broken) = self.check_invariants()
        {
            panic!("memory arbiter invariant broken: {broken}");
        }
    }
}
