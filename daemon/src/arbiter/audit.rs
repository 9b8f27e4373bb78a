//! Reading the ledger: the report of every figure, and every invariant checked from scratch.

use std::collections::BTreeMap;

use super::{Arbiter, DroppingUsage, ModelUsage, SessionUsage, UsageReport};

impl Arbiter {
    /// Every figure, for `Manager.Memory`.
    pub fn report(&self) -> UsageReport {
        UsageReport {
            budget_bytes: self.budget_bytes,
            used_bytes: self.used_bytes(),
            models: (self.models.iter())
                .map(|(name, m)| ModelUsage {
                    name: name.clone(),
                    resident_bytes: m.resident_bytes,
                    cache_bytes: m.cache_bytes,
                    min_cache_bytes: m.min_cache_bytes,
                    wanted_cache_bytes: m.wanted_cache_bytes,
                    sessions: m.sessions,
                })
                .collect(),
            dropping: (self.dropping.iter())
                .map(|(&ticket, d)| DroppingUsage {
                    ticket,
                    name: d.name.clone(),
                    bytes: d.bytes,
                })
                .collect(),
            sessions: (self.sessions.iter())
                .map(|(&id, s)| SessionUsage {
                    id,
                    model: s.model.clone(),
                    bytes: s.bytes,
                    class: s.class,
                })
                .collect(),
        }
    }

    /// Checks every invariant from scratch; `Err` says which one broke.
    pub fn check_invariants(&self) -> Result<(), String> {
        let budget = u128::from(self.budget_bytes);
        let reserved: u128 = (self.models.values().map(|m| u128::from(m.reserved())))
            .chain(self.sessions.values().map(|s| u128::from(s.bytes)))
            .chain(self.dropping.values().map(|d| u128::from(d.bytes)))
            .sum();
        if reserved != u128::from(self.reserved) {
            return Err(format!(
                "reserved total {} != recomputed {reserved}",
                self.reserved
            ));
        }
        let elastic: u128 = (self.models.values())
            .map(|m| u128::from(m.cache_bytes.saturating_sub(m.min_cache_bytes)))
            .sum();
        let used = reserved + elastic;
        if used > budget {
            return Err(format!("used {used} > budget {budget}"));
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
        if let Some((id, s)) =
            (self.sessions.iter()).find(|(_, s)| !self.models.contains_key(&s.model))
        {
            return Err(format!("session {id} on unloaded model `{}`", s.model));
        }
        let unmet = (self.models.values()).any(|m| m.cache_bytes < m.wanted_cache_bytes);
        if unmet && used < budget {
            return Err(format!(
                "{} bytes free while a cache is below its wish",
                budget - used
            ));
        }
        self.check_tiers()
    }

    /// Higher tiers are full before a lower tier's cache grows past its minimum.
    fn check_tiers(&self) -> Result<(), String> {
        let tiers: BTreeMap<&str, _> = self.tiers();
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
}
