//! A bound on each client's calls in flight. zbus serves every incoming method call at once, so a
//! client that pipelines thousands of calls (without waiting for replies) would have thousands of
//! requests queued for the state owner, ahead of everyone else's. Each D-Bus method enters here
//! first; a client over [`MAX_CALLS_IN_FLIGHT`] is answered `Busy` at once, before any work.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use leanstream::contract::LeanStreamError;

/// Most calls one client (unique bus name) may have unanswered. A client library that waits for
/// its replies has one; one that overlaps a few requests stays far below.
pub const MAX_CALLS_IN_FLIGHT: u32 = 16;

/// Calls in flight per client. Holds an entry only while a client has a call in flight, so it
/// does not grow with the number of clients that ever called.
#[derive(Clone, Debug, Default)]
pub struct Calls(Arc<Mutex<HashMap<String, u32>>>);

/// One call in flight; leaving it (drop) frees its place.
#[derive(Debug)]
pub struct InFlight {
    calls: Calls,
    client: String,
}

impl Calls {
    /// Enters a call of `client`; `Busy` when it already has [`MAX_CALLS_IN_FLIGHT`].
    pub fn enter(&self, client: &str) -> Result<InFlight, LeanStreamError> {
        let mut map = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let n = map.entry(client.to_string()).or_default();
        if *n >= MAX_CALLS_IN_FLIGHT {
            return Err(LeanStreamError::Busy(format!(
                "this client already has {MAX_CALLS_IN_FLIGHT} calls in flight: \
                 wait for their replies"
            )));
        }
        *n += 1;
        Ok(InFlight {
            calls: self.clone(),
            client: client.to_string(),
        })
    }

    /// Clients with a call in flight.
    #[cfg(test)]
    fn clients(&self) -> usize {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut map = self.calls.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = map.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.client);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_client_over_its_calls_in_flight_is_busy_and_others_are_not() {
        let calls = Calls::default();
        let mut held: Vec<InFlight> = (0..MAX_CALLS_IN_FLIGHT)
            .map(|_| calls.enter(":1.5").unwrap())
            .collect();
        assert!(matches!(calls.enter(":1.5"), Err(LeanStreamError::Busy(_))));
        // Another client is not affected.
        let other = calls.enter(":1.6").unwrap();
        drop(other);
        // An answered call frees its place, and only one.
        held.pop();
        let again = calls.enter(":1.5").unwrap();
        assert!(calls.enter(":1.5").is_err());
        drop((again, held));
    }

    #[test]
    fn a_client_without_calls_in_flight_leaves_no_entry() {
        let calls = Calls::default();
        for i in 0..100 {
            let _call = calls.enter(&format!(":1.{i}")).unwrap();
        }
        assert_eq!(calls.clients(), 0);
    }
}
