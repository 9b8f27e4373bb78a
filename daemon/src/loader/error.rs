//! Why a model's load failed, sorted by who can fix it.

use leanstream::contract::LeanStreamError;

/// Why a load failed. Cloneable, unlike the wire error, because every request waiting for the
/// model gets the answer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// The footprint does not fit the budget beside what is already reserved.
    #[error("{0}")]
    OverBudget(String),
    /// The file, or a setting the file cannot satisfy: the caller or the administrator can fix
    /// it, and the daemon is fine (`InvalidModel` on the wire).
    #[error("{0}")]
    Invalid(String),
    /// The daemon could not do it: an I/O or device error, a loader thread lost (`Internal`).
    #[error("{0}")]
    Failed(String),
}

impl LoadError {
    /// Sorts an engine error: reading the file or using the device failed (the daemon's
    /// problem), or the file itself cannot be served (anything else).
    pub fn from_engine(context: &str, e: &leanstream_engine::Error) -> LoadError {
        use leanstream_engine::Error as E;
        let message = format!("{context}: {e}");
        match e {
            E::Io { .. } | E::Read { .. } | E::Os { .. } | E::Cuda(_) => LoadError::Failed(message),
            _ => LoadError::Invalid(message),
        }
    }

    pub fn to_wire(&self) -> LeanStreamError {
        match self {
            LoadError::OverBudget(m) => LeanStreamError::OverBudget(m.clone()),
            LoadError::Invalid(m) => LeanStreamError::InvalidModel(m.clone()),
            LoadError::Failed(m) => LeanStreamError::Internal(m.clone()),
        }
    }
}
