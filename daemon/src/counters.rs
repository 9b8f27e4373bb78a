//! Counters for operators since the daemon started, read with `Manager.Counters()` as an
//! `a{st}` dictionary (a name per counter, so that new counters do not change the signature).
//!
//! | name | counts |
//! |---|---|
//! | `uptime_seconds` | seconds since the daemon started |
//! | `requests.METHOD` | calls of each D-Bus method (`Generate`, `OpenSession`, …), refused ones included |
//! | `refusals.ERROR` | calls answered with an error, by its name (`Busy`, `OverBudget`, …) |
//! | `generations.CLASS` | generations admitted, by class (`realtime`, `interactive`, `background`) |
//! | `ends.END` | how admitted generations ended: `eos`, `max_tokens`, `stop_string`, `context_full`, an error name (`Cancelled`, `OverBudget`, `Internal`, …), or `stream_closed` (the reader closed its end) |
//! | `tokens.prompt`, `tokens.prompt_cached`, `tokens.generated` | prompt tokens (of them, those already in memory) and generated tokens |
//! | `ttft_us.CLASS.count`, `.sum`, `.max` | time to first token by class, in microseconds, from the request's arrival |
//! | `model_loads.MODEL` | times each model was loaded |
//! | `model_load_ms.MODEL` | how long its last load took, in milliseconds |
//!
//! Written by the bus face (requests, refusals) and the state owner (generations, loads); a
//! mutex around one map, since they change a few times per request, never per token.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use leanstream::contract::LeanStreamError;
use zbus::DBusError;

use crate::scheduler::Outcome;

/// The daemon's counters (see the module docs); clones share them.
#[derive(Clone, Debug)]
pub struct Counters(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    started: Instant,
    values: Mutex<BTreeMap<String, u64>>,
}

impl Default for Counters {
    fn default() -> Counters {
        Counters(Arc::new(Inner {
            started: Instant::now(),
            values: Mutex::default(),
        }))
    }
}

impl Counters {
    /// Applies `f` to the map, under its lock.
    fn with<R>(&self, f: impl FnOnce(&mut BTreeMap<String, u64>) -> R) -> R {
        f(&mut self.0.values.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// A call of `method` answered with `error` (`None`: answered with success).
    pub fn call(&self, method: &str, error: Option<&LeanStreamError>) {
        self.with(|m| {
            add(m, format!("requests.{method}"), 1);
            if let Some(e) = error {
                add(m, format!("refusals.{}", error_name(e)), 1);
            }
        });
    }

    /// An admitted generation is over.
    pub fn generation(&self, o: &Outcome) {
        let class = o.priority.name();
        self.with(|m| {
            add(m, format!("generations.{class}"), 1);
            add(m, format!("ends.{}", o.end), 1);
            add(m, "tokens.prompt".into(), o.prompt_tokens);
            add(m, "tokens.prompt_cached".into(), o.cached_prompt_tokens);
            add(m, "tokens.generated".into(), o.generated);
            if let Some(after) = o.first_token_after {
                let us = micros(after);
                add(m, format!("ttft_us.{class}.count"), 1);
                add(m, format!("ttft_us.{class}.sum"), us);
                let max = m.entry(format!("ttft_us.{class}.max")).or_default();
                *max = (*max).max(us);
            }
        });
    }

    /// Model `name` was loaded in `took`.
    pub fn model_loaded(&self, name: &str, took: Duration) {
        self.with(|m| {
            add(m, format!("model_loads.{name}"), 1);
            m.insert(format!("model_load_ms.{name}"), took.as_millis() as u64);
        });
    }

    /// Every counter now, `uptime_seconds` included.
    pub fn snapshot(&self) -> HashMap<String, u64> {
        let mut all: HashMap<String, u64> = self.with(|m| m.clone()).into_iter().collect();
        all.insert("uptime_seconds".into(), self.0.started.elapsed().as_secs());
        all
    }
}

fn add(m: &mut BTreeMap<String, u64>, key: String, n: u64) {
    let v = m.entry(key).or_default();
    *v = v.saturating_add(n);
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// The error's name without the interface prefix (`Busy`).
fn error_name(e: &LeanStreamError) -> String {
    let name = e.name();
    let name = name.as_str();
    name.rsplit('.').next().unwrap_or(name).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::DecodePasses;
    use leanstream::contract::Priority;

    fn outcome(priority: Priority, ttft_ms: Option<u64>, end: &str) -> Outcome {
        Outcome {
            priority,
            prompt_tokens: 10,
            cached_prompt_tokens: 4,
            generated: 5,
            passes: DecodePasses::default(),
            first_token_after: ttft_ms.map(Duration::from_millis),
            end: end.into(),
        }
    }

    #[test]
    fn calls_and_refusals_are_counted_by_name() {
        let c = Counters::default();
        c.call("Generate", None);
        c.call("Generate", Some(&LeanStreamError::Busy("x".into())));
        c.call(
            "OpenSession",
            Some(&LeanStreamError::OverBudget("y".into())),
        );
        let s = c.snapshot();
        assert_eq!(s["requests.Generate"], 2);
        assert_eq!(s["requests.OpenSession"], 1);
        assert_eq!(s["refusals.Busy"], 1);
        assert_eq!(s["refusals.OverBudget"], 1);
        assert!(!s.contains_key("refusals.InvalidArgument"));
        assert!(s.contains_key("uptime_seconds"));
    }

    #[test]
    fn generations_add_tokens_and_time_to_first_token_per_class() {
        let c = Counters::default();
        c.generation(&outcome(Priority::Interactive, Some(20), "eos"));
        c.generation(&outcome(Priority::Interactive, Some(50), "max_tokens"));
        c.generation(&outcome(Priority::Background, None, "Cancelled"));
        let s = c.snapshot();
        assert_eq!(s["generations.interactive"], 2);
        assert_eq!(s["generations.background"], 1);
        assert_eq!(s["ends.eos"], 1);
        assert_eq!(s["ends.Cancelled"], 1);
        assert_eq!(s["tokens.prompt"], 30);
        assert_eq!(s["tokens.prompt_cached"], 12);
        assert_eq!(s["tokens.generated"], 15);
        assert_eq!(s["ttft_us.interactive.count"], 2);
        assert_eq!(s["ttft_us.interactive.sum"], 70_000);
        assert_eq!(s["ttft_us.interactive.max"], 50_000);
        // No token came: no time to first token.
        assert!(!s.contains_key("ttft_us.background.count"));
    }

    #[test]
    fn a_load_keeps_the_last_time_and_counts_loads() {
        let c = Counters::default();
        c.model_loaded("m", Duration::from_millis(1500));
        c.model_loaded("m", Duration::from_millis(300));
        let s = c.snapshot();
        assert_eq!(s["model_loads.m"], 2);
        assert_eq!(s["model_load_ms.m"], 300);
    }
}
