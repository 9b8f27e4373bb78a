//! The `Memory()` report: the ledger's bytes joined with the session table's owners and each
//! model's plan, then redacted for the caller ([`crate::access`]).

use std::collections::BTreeMap;

use leanstream::contract::{
    ClientMemory, LeanStreamError, MemoryReport, ModelMemory, ModelParts, SessionMemory,
};

use super::port::path_of;
use super::{Port, State};
use crate::arbiter::ModelUsage;

/// How a model being dropped is shown: its mode until its memory is free.
const UNLOADING: &str = "unloading";
/// How a model is shown from its reservation until it is ready.
const LOADING: &str = "loading";

impl<P: Port> State<P> {
    /// The report as `client` may see it: everything for an administrator, else its own
    /// sessions and the other clients as one total. A client that has left the bus gets
    /// nothing.
    pub(super) async fn report_for(
        &mut self,
        client: &str,
    ) -> Result<MemoryReport, LeanStreamError> {
        let caller = self.admit_client(client).await?;
        let report = self.memory_report();
        Ok(if caller.admin {
            report
        } else {
            crate::access::redact(report, client)
        })
    }

    /// Every figure, unredacted.
    pub(super) fn memory_report(&self) -> MemoryReport {
        let ledger = self.ledger.report();
        let owner = |id| self.sessions.get(&id).map_or("", |s| s.client.as_str());
        let sessions: Vec<SessionMemory> = (ledger.sessions.iter())
            .map(|s| SessionMemory {
                path: path_of(s.id),
                model: s.model.clone(),
                client: owner(s.id).to_string(),
                bytes: s.bytes,
            })
            .collect();
        let mut clients: BTreeMap<&str, ClientMemory> = BTreeMap::new();
        for s in &sessions {
            let c = clients.entry(&s.client).or_insert_with(|| ClientMemory {
                client: s.client.clone(),
                sessions: 0,
                bytes: 0,
            });
            c.sessions += 1;
            c.bytes += s.bytes;
        }
        let clients = clients.into_values().collect();
        let dropping = ledger.dropping.iter().map(|d| ModelMemory {
            name: d.name.clone(),
            resident_bytes: d.bytes,
            cache_bytes: 0,
            cache_floor_bytes: 0,
            cache_wanted_bytes: 0,
            mode: UNLOADING.into(),
            streamed_bytes_per_token: 0,
            idle_seconds: 0,
            unload_in_seconds: -1,
            parts: ModelParts::default(),
        });
        let models = (ledger.models.iter())
            .map(|m| self.model_memory(m))
            .chain(dropping)
            .collect();
        MemoryReport {
            budget_bytes: ledger.budget_bytes,
            used_bytes: ledger.used_bytes,
            rss_bytes: leanstream_engine::process::rss_bytes(),
            models,
            sessions,
            clients,
        }
    }

    /// One loaded model's line: the ledger's bytes and what its plan says.
    fn model_memory(&self, m: &ModelUsage) -> ModelMemory {
        let model = self.models.get(&m.name).and_then(|e| e.ready());
        let plan = model.and_then(|model| model.model.plan());
        let loading = self
            .models
            .get(&m.name)
            .is_some_and(|e| e.ready().is_none());
        let mode = match plan {
            _ if loading => LOADING.into(),
            Some(p) if p.is_sparse() => "dense+neuron".into(),
            // Params never change, so this is the mode the model was loaded in.
            _ => self.params.model(&m.name).mode.name().into(),
        };
        let parts = match model {
            Some(model) => {
                let f = model.model.footprint();
                ModelParts {
                    weights: f.weights.image,
                    tokenizer: f.tokenizer,
                    tables: f.weights.heap,
                    ring: f.ring,
                    streamed_whole: plan.map_or(0, |p| p.unit_bytes_per_token()),
                    streamed_sparse: plan.map_or(0, |p| p.sparse_ffn_bytes()),
                }
            }
            None => ModelParts::default(),
        };
        ModelMemory {
            name: m.name.clone(),
            resident_bytes: m.resident_bytes,
            cache_bytes: m.cache_bytes,
            cache_floor_bytes: m.min_cache_bytes,
            cache_wanted_bytes: m.wanted_cache_bytes,
            mode,
            // What the memory planner reads per token: dense pieces and, where it streams FFN
            // layers by neuron, the expected misses.
            streamed_bytes_per_token: plan.map_or(0, |p| p.read_bytes_per_token()),
            idle_seconds: self.idle_for(&m.name).map_or(0, |idle| idle.as_secs()),
            unload_in_seconds: self.unload_in_seconds(&m.name),
            parts,
        }
    }
}
