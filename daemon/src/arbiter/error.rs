//! The arbiter's errors, and byte counts written for people.

use std::fmt;

use super::SessionId;

/// Why the arbiter refused an operation. A refused operation changes nothing.
///
/// [`ArbiterError::wire_name`] gives the D-Bus error name each variant maps to.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ArbiterError {
    /// The request does not fit even after every neuron cache shrinks to its minimum.
    /// `available` is what is free at that point: the budget less every hard reservation
    /// (resident weights, minimum caches, sessions).
    #[error(
        "{what} needs {}, {} free of a {} budget",
        Bytes(*needed),
        Bytes(*available),
        Bytes(*budget)
    )]
    OverBudget {
        /// The request, in words: "session 7 on model `smollm2`".
        what: String,
        /// Bytes the request reserves.
        needed: u64,
        /// Bytes free once every cache is at its minimum (`needed > available`).
        available: u64,
        /// The whole budget.
        budget: u64,
    },
    /// The model cannot be unloaded while sessions use it.
    #[error("model `{model}` has {sessions} open session(s); close them first")]
    ModelInUse { model: String, sessions: usize },
    #[error("no model `{0}` is loaded")]
    UnknownModel(String),
    #[error("no session {0} is open")]
    UnknownSession(SessionId),
    #[error("model `{0}` is already loaded")]
    ModelAlreadyLoaded(String),
    #[error("session {0} is already open")]
    SessionAlreadyOpen(SessionId),
    /// A model's minimum neuron cache is larger than the cache it wants.
    #[error(
        "model `{model}`: minimum cache {} is larger than the wanted cache {}",
        Bytes(*min_cache_bytes),
        Bytes(*wanted_cache_bytes)
    )]
    BadCacheRange {
        model: String,
        min_cache_bytes: u64,
        wanted_cache_bytes: u64,
    },
}

#[cfg(test)]
impl ArbiterError {
    /// The D-Bus error name (without the `io.github.leanstream.LeanStream1.Error.` prefix) the
    /// daemon sends for this error.
    pub fn wire_name(&self) -> &'static str {
        match self {
            ArbiterError::OverBudget { .. } => "OverBudget",
            ArbiterError::ModelInUse { .. } => "Busy",
            ArbiterError::UnknownModel(_) => "ModelNotFound",
            ArbiterError::UnknownSession(_)
            | ArbiterError::ModelAlreadyLoaded(_)
            | ArbiterError::SessionAlreadyOpen(_)
            | ArbiterError::BadCacheRange { .. } => "InvalidArgument",
        }
    }
}

/// A byte count written for people in binary units: `512 B`, `3.5 MiB`, `512 MiB`. Whole
/// multiples of a unit print without a fraction; others with one decimal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bytes(pub u64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
        let n = self.0;
        if n < 1024 {
            return write!(f, "{n} B");
        }
        let mut unit = 1024u64;
        let mut name = UNITS[0];
        for next in &UNITS[1..] {
            match unit.checked_mul(1024) {
                Some(bigger) if n >= bigger => {
                    unit = bigger;
                    name = next;
                }
                _ => break,
            }
        }
        if n.is_multiple_of(unit) {
            write!(f, "{} {name}", n / unit)
        } else {
            // Precision loss above 2^53 bytes is far below the one decimal shown.
            let value = n as f64 / unit as f64;
            write!(f, "{value:.1} {name}")
        }
    }
}
