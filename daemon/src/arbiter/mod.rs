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
//! 1. Each model's *tier* is the highest [`Priority`] among its open sessions; a model without
//!    sessions is in the lowest tier, below [`Priority::Background`].
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

mod error;
#[cfg(test)]
mod properties;
mod share;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

pub use error::{ArbiterError, Bytes};

/// A session's number; the daemon serves it at `{SESSION_PATH_PREFIX}/{n}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SessionId(pub u64);

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// How much a session's model deserves the free memory. Ordered: `Background < Normal <
/// Interactive`. It only orders the neuron caches (see the module policy); it never evicts a
/// session and never admits one that does not fit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Priority {
    Background,
    #[default]
    Normal,
    Interactive,
}

/// The arbiter's limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArbiterConfig {
    /// Bytes the daemon may use in all (`[memory] budget`).
    pub budget_bytes: u64,
    /// Sessions open at once, all clients together.
    pub max_sessions: usize,
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
    /// Unique bus name of the owner, e.g. `:1.42`.
    pub client: String,
    pub bytes: u64,
    pub priority: Priority,
}

/// What one client holds: the sum of its sessions. Clients without sessions are not listed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientUsage {
    pub client: String,
    pub sessions: usize,
    pub bytes: u64,
}

/// The arbiter's figures for `Manager.Memory`, each list sorted by name or id.
/// `used_bytes` is resident weights + caches + sessions, and `used_bytes <= budget_bytes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsageReport {
    pub budget_bytes: u64,
    pub used_bytes: u64,
    pub models: Vec<ModelUsage>,
    pub sessions: Vec<SessionUsage>,
    pub clients: Vec<ClientUsage>,
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
    client: String,
    bytes: u64,
    priority: Priority,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Client {
    sessions: BTreeSet<SessionId>,
    bytes: u64,
}

/// The memory arbiter. Two arbiters compare equal when every reservation and cache is the same.
///
/// Invariants, checked after every change in debug builds and by [`Arbiter::check_invariants`]:
/// hard reservations and the used total stay within the budget; each cache stays between its
/// minimum and wanted size; no byte stays free while a cache is below its wish; higher tiers are
/// full before a lower tier's cache grows past its minimum; the per-client and per-model
/// indexes match the sessions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Arbiter {
    config: ArbiterConfig,
    models: BTreeMap<String, Model>,
    sessions: BTreeMap<SessionId, Session>,
    clients: BTreeMap<String, Client>,
    /// Sum of every model's `reserved()` and every session's bytes; `<= budget_bytes`.
    reserved: u64,
}

impl Arbiter {
    /// An arbiter with nothing loaded.
    pub fn new(config: ArbiterConfig) -> Arbiter {
        Arbiter {
            config,
            models: BTreeMap::new(),
            sessions: BTreeMap::new(),
            clients: BTreeMap::new(),
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

    /// Releases a model's weights and cache; the other caches grow into them. Refused with
    /// `ModelInUse` while the model has sessions.
    pub fn unload_model(&mut self, name: &str) -> Result<(), ArbiterError> {
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
        let freed = model.reserved();
        self.models.remove(name);
        self.reserved -= freed;
        self.settle();
        Ok(())
    }

    /// Reserves `bytes` (the KV cache for the session's context plus its working buffers) for a
    /// new session of `client` on `model`, shrinking neuron caches toward their minimum as
    /// needed, and re-splits the caches by the new priorities.
    ///
    /// Refused, changing nothing, when the id is taken, the model is not loaded, the session
    /// limit is reached (`TooManySessions`), or the bytes do not fit even with every cache at its
    /// minimum (`OverBudget`).
    pub fn open_session(
        &mut self,
        id: SessionId,
        model: &str,
        client: &str,
        bytes: u64,
        priority: Priority,
    ) -> Result<(), ArbiterError> {
        if self.sessions.contains_key(&id) {
            return Err(ArbiterError::SessionAlreadyOpen(id));
        }
        if !self.models.contains_key(model) {
            return Err(ArbiterError::UnknownModel(model.to_owned()));
        }
        if self.sessions.len() >= self.config.max_sessions {
            return Err(ArbiterError::TooManySessions {
                limit: self.config.max_sessions,
            });
        }
        self.admit(bytes, || {
            format!("session {id} on model `{model}` for client `{client}`")
        })?;
        if let Some(m) = self.models.get_mut(model) {
            m.sessions += 1;
        }
        let entry = self.clients.entry(client.to_owned()).or_default();
        entry.sessions.insert(id);
        entry.bytes += bytes;
        self.sessions.insert(
            id,
            Session {
                model: model.to_owned(),
                client: client.to_owned(),
                bytes,
                priority,
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
        let client = session.client.clone();
        if let Some(s) = self.sessions.get_mut(&id) {
            s.bytes = bytes;
        }
        if let Some(c) = self.clients.get_mut(&client) {
            c.bytes = c.bytes - old + bytes;
        }
        self.reserved = self.reserved - old + bytes;
        self.settle();
        Ok(())
    }

    /// Releases a session's bytes; the caches grow into them.
    pub fn close_session(&mut self, id: SessionId) -> Result<(), ArbiterError> {
        self.remove_session(id)?;
        self.settle();
        Ok(())
    }

    /// Closes every session of `client` at once (the client left the bus) and returns their ids,
    /// in order. A client without sessions changes nothing and gets an empty list.
    pub fn client_gone(&mut self, client: &str) -> Vec<SessionId> {
        let ids: Vec<SessionId> = self
            .clients
            .get(client)
            .map(|c| c.sessions.iter().copied().collect())
            .unwrap_or_default();
        if ids.is_empty() {
            return ids;
        }
        for &id in &ids {
            if let Err(e) = self.remove_session(id) {
                panic!("arbiter client index lists session {id} that is not open: {e}");
            }
        }
        self.settle();
        ids
    }

    /// Resident weights + neuron caches + sessions. Never above the budget.
    pub fn used_bytes(&self) -> u64 {
        self.reserved
            + self
                .models
                .values()
                .map(|m| m.cache_bytes - m.min_cache_bytes)
                .sum::<u64>()
    }

    #[cfg(test)]
    /// Hard reservations: resident weights, minimum caches and sessions — what stays used if every
    /// cache shrinks to its minimum.
    pub fn reserved_bytes(&self) -> u64 {
        self.reserved
    }

    /// The budget less the hard reservations: the most a new request can get.
    pub fn available_bytes(&self) -> u64 {
        self.config.budget_bytes.saturating_sub(self.reserved)
    }

    /// The neuron cache granted to a loaded model.
    pub fn cache_bytes(&self, model: &str) -> Option<u64> {
        self.models.get(model).map(|m| m.cache_bytes)
    }

    pub fn is_loaded(&self, model: &str) -> bool {
        self.models.contains_key(model)
    }

    #[cfg(test)]
    pub fn session_count(&self) -> usize {
        self.sessions.len()
    }

    #[cfg(test)]
    pub fn session(&self, id: SessionId) -> Option<SessionUsage> {
        self.sessions.get(&id).map(|s| session_usage(id, s))
    }

    /// Every figure for `Manager.Memory`.
    pub fn report(&self) -> UsageReport {
        UsageReport {
            budget_bytes: self.config.budget_bytes,
            used_bytes: self.used_bytes(),
            models: self
                .models
                .iter()
                .map(|(name, m)| ModelUsage {
                    name: name.clone(),
                    resident_bytes: m.resident_bytes,
                    cache_bytes: m.cache_bytes,
                    min_cache_bytes: m.min_cache_bytes,
                    wanted_cache_bytes: m.wanted_cache_bytes,
                    sessions: m.sessions,
                })
                .collect(),
            sessions: self
                .sessions
                .iter()
                .map(|(&id, s)| session_usage(id, s))
                .collect(),
            clients: self
                .clients
                .iter()
                .map(|(client, c)| ClientUsage {
                    client: client.clone(),
                    sessions: c.sessions.len(),
                    bytes: c.bytes,
                })
                .collect(),
        }
    }

    /// Checks every invariant from scratch; `Err` says which one broke.
    pub fn check_invariants(&self) -> Result<(), String> {
        let budget = u128::from(self.config.budget_bytes);
        let reserved: u128 = self
            .models
            .values()
            .map(|m| u128::from(m.reserved()))
            .chain(self.sessions.values().map(|s| u128::from(s.bytes)))
            .sum();
        if reserved != u128::from(self.reserved) {
            return Err(format!(
                "reserved total {} != recomputed {reserved}",
                self.reserved
            ));
        }
        let used: u128 = reserved
            + self
                .models
                .values()
                .map(|m| u128::from(m.cache_bytes.saturating_sub(m.min_cache_bytes)))
                .sum::<u128>();
        if used > budget {
            return Err(format!("used {used} > budget {budget}"));
        }
        if self.sessions.len() > self.config.max_sessions {
            return Err(format!(
                "{} sessions > limit {}",
                self.sessions.len(),
                self.config.max_sessions
            ));
        }
        for (name, m) in &self.models {
            if m.cache_bytes < m.min_cache_bytes || m.cache_bytes > m.wanted_cache_bytes {
                return Err(format!(
                    "model `{name}` cache {} outside {}..={}",
                    m.cache_bytes, m.min_cache_bytes, m.wanted_cache_bytes
                ));
            }
            let count = self.sessions.values().filter(|s| &s.model == name).count();
            if count != m.sessions {
                return Err(format!(
                    "model `{name}` counts {} sessions, {count} open",
                    m.sessions
                ));
            }
        }
        let mut clients: BTreeMap<&str, Client> = BTreeMap::new();
        for (&id, s) in &self.sessions {
            if !self.models.contains_key(&s.model) {
                return Err(format!("session {id} on unloaded model `{}`", s.model));
            }
            let c = clients.entry(s.client.as_str()).or_default();
            c.sessions.insert(id);
            c.bytes += s.bytes;
        }
        let indexed: BTreeMap<&str, Client> = self
            .clients
            .iter()
            .map(|(k, c)| (k.as_str(), c.clone()))
            .collect();
        if indexed != clients {
            return Err(format!("client index {indexed:?} != sessions {clients:?}"));
        }
        let unmet = self
            .models
            .values()
            .any(|m| m.cache_bytes < m.wanted_cache_bytes);
        if unmet && used < budget {
            return Err(format!(
                "{} bytes free while a cache is below its wish",
                budget - used
            ));
        }
        let tiers = self.tiers();
        for (name, m) in &self.models {
            if m.cache_bytes == m.min_cache_bytes {
                continue;
            }
            let tier = tiers.get(name.as_str()).copied().flatten();
            for (other, o) in &self.models {
                let other_tier = tiers.get(other.as_str()).copied().flatten();
                if other_tier > tier && o.cache_bytes < o.wanted_cache_bytes {
                    return Err(format!(
                        "model `{name}` ({tier:?}) holds cache above its minimum while `{other}` \
                         ({other_tier:?}) is below its wish"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Refuses `needed` more hard-reserved bytes unless they fit beside the others.
    fn admit(&self, needed: u64, what: impl FnOnce() -> String) -> Result<(), ArbiterError> {
        let available = self.available_bytes();
        if needed > available {
            return Err(ArbiterError::OverBudget {
                what: what(),
                needed,
                available,
                budget: self.config.budget_bytes,
            });
        }
        Ok(())
    }

    /// Removes a session from every index without re-splitting the caches.
    fn remove_session(&mut self, id: SessionId) -> Result<(), ArbiterError> {
        let session = self
            .sessions
            .remove(&id)
            .ok_or(ArbiterError::UnknownSession(id))?;
        if let Some(m) = self.models.get_mut(&session.model) {
            m.sessions -= 1;
        }
        if let Some(c) = self.clients.get_mut(&session.client) {
            c.sessions.remove(&id);
            c.bytes -= session.bytes;
            if c.sessions.is_empty() {
                self.clients.remove(&session.client);
            }
        }
        self.reserved -= session.bytes;
        Ok(())
    }

    /// Each model's tier: the highest priority among its sessions, `None` without sessions.
    fn tiers(&self) -> BTreeMap<&str, Option<Priority>> {
        let mut tiers: BTreeMap<&str, Option<Priority>> = self
            .models
            .keys()
            .map(|name| (name.as_str(), None))
            .collect();
        for s in self.sessions.values() {
            let tier = tiers.entry(s.model.as_str()).or_default();
            *tier = (*tier).max(Some(s.priority));
        }
        tiers
    }

    /// Re-splits the free bytes among the caches (module policy), then checks the invariants in
    /// debug builds.
    fn settle(&mut self) {
        let mut by_tier: BTreeMap<Option<Priority>, Vec<String>> = BTreeMap::new();
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

fn session_usage(id: SessionId, s: &Session) -> SessionUsage {
    SessionUsage {
        id,
        model: s.model.clone(),
        client: s.client.clone(),
        bytes: s.bytes,
        priority: s.priority,
    }
}
