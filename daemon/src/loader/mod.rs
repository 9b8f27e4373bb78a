//! Loading a model the way the config says (`[engine]` and `[models.NAME]`: mode, sparsity,
//! cache share): the dense forward pass, or a sparse pipeline over a `.lsm` file (see
//! `docs/bench/sparse.md`) with its neuron cache. One [`Executor`] per loaded model holds the cache
//! and the I/O threads and is shared by every session on the model (docs/architecture.md §3);
//! each session keeps its own KV cache.
//!
//! Memory is reserved before anything large is read or allocated: [`Footprint::of`] reads only
//! the file's header, the state owner reserves the footprint in the arbiter, and only then does
//! [`LoadedModel::load`] map the weights and allocate the cache.
//!
//! The parts, one file each:
//!
//! - this file: [`LoadedModel`], what a loaded model offers the scheduler and the state owner
//!   (its sessions, its grammars, its neuron cache's size, its speculation), and the prompt
//!   prefixes it keeps;
//! - [`footprint`]: what a model will hold, worked out from its file's header before it loads;
//! - [`load`]: loading it the way the config says;
//! - [`error`]: why a load failed.

mod error;
mod footprint;
mod load;
#[cfg(test)]
mod tests;

use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use leanstream::contract::LeanStreamError;
use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::chat::ChatTemplate;
use leanstream_engine::constrain::{ConstraintVocab, Grammar, GrammarKind};
use leanstream_engine::forward::{Model, Session};
use leanstream_engine::generate::{Decode, SpeculateMode, Speculation, speculation_for};
use leanstream_engine::kv::{KvPrefix, KvType};
use leanstream_engine::pipeline::Executor;
use leanstream_engine::process::rss_bytes;

pub use error::LoadError;
pub use footprint::Footprint;

/// A loaded model, shared by all sessions on it.
#[derive(Debug)]
pub struct LoadedModel {
    pub name: String,
    /// Weights, tokenizer and chat template. In a sparse mode its FFN weights are views of the
    /// memory map that the pipeline never touches (it reads chunks into its cache instead).
    pub model: Arc<Model>,
    pub template: ChatTemplate,
    /// The sparse FFN pipeline with the model's neuron cache and I/O threads; `None` in `dense`
    /// mode. Only the scheduler thread locks it, one forward pass at a time, so the lock is never
    /// contended; it is there because the model is shared with the state owner.
    pub ffn: Option<Mutex<Executor>>,
    /// The neuron cache is part of the model's plan (`max_bytes` with layers streamed by
    /// neuron): sized once inside `max_bytes`, not granted by the arbiter.
    cache_in_plan: bool,
    /// The weights on the GPU (backend `cuda`): resident weights, plus the whole FFN in `dense`
    /// mode; the pipeline's chunk computations run there too.
    #[cfg(feature = "cuda")]
    pub gpu: Option<Arc<leanstream_engine::forward::GpuModel>>,
    /// The vocabulary as the grammar parser walks it (a token trie), built on the first
    /// constrained generation and shared by every later one.
    constraint_vocab: OnceLock<Arc<ConstraintVocab>>,
    /// Prompt prefixes whose keys and values sessions of this model share, each only between
    /// sessions of the user who computed it ([`crate::scheduler`]'s prefix module decides what
    /// goes in). Paid for once, in the model's reservation, and kept for the model's life. Only
    /// the scheduler's worker thread locks it.
    pub prefixes: Mutex<Vec<SharedPrefix>>,
    /// Whether generations on the model decode speculatively (the `speculate` key): the
    /// scheduler asks [`LoadedModel::speculation`] when it starts one.
    pub speculate: SpeculateMode,
    /// A test's price of a draft row, in place of the engine's prior: lets a test make drafts
    /// certain on a model whose passes would otherwise price them out.
    #[cfg(test)]
    pub draft_row_cost: Option<f64>,
}

/// The keys and values of a prompt prefix that sessions of one model and one user share.
#[derive(Debug)]
pub struct SharedPrefix {
    /// The uid of the user whose session computed it: only sessions of that user adopt it
    /// (another user would learn from its length what that user's prompts hold).
    pub user: u32,
    /// The prefix's tokens.
    pub tokens: Vec<u32>,
    /// The precision the keys and values were computed in: only sessions with the same one
    /// adopt them (they would compute other numbers).
    pub precision: Precision,
    pub kv: KvPrefix,
    /// When a session last started from it (or it was stored): the store evicts the least
    /// recently used prefix that no session reads.
    pub last_used: std::time::Instant,
}

impl LoadedModel {
    /// Compiles a grammar the output of a generation on this model must match. The first call
    /// builds the model's token trie (15 MiB for SmolLM2's 49k tokens, 39 MiB for Gemma 3's
    /// 262k) and asks `reserve` for what it took, for the model's lifetime: the growth of the
    /// process's resident memory while it was built (on the scheduler's admission thread; what
    /// other threads allocate or free meanwhile, a generation's KV block, counts too, so the
    /// figure is close, not exact). When `reserve` refuses, the trie is dropped and its error
    /// returned.
    pub fn grammar(
        &self,
        kind: GrammarKind,
        text: &str,
        reserve: impl FnOnce(u64) -> Result<(), LeanStreamError>,
    ) -> Result<Grammar, LeanStreamError> {
        let vocab = match self.constraint_vocab.get() {
            Some(v) => v,
            None => {
                let before = rss_bytes();
                let built = ConstraintVocab::new(&self.model.tokenizer)
                    .map_err(|e| LeanStreamError::Internal(e.to_string()))?;
                let bytes = rss_bytes().saturating_sub(before);
                reserve(bytes).map_err(|e| match e {
                    LeanStreamError::OverBudget(m) => LeanStreamError::OverBudget(format!(
                        "the grammar parser's token trie for model {}: {m}",
                        self.name
                    )),
                    other => other,
                })?;
                tracing::info!(
                    "model {}: grammar token trie built, {} KiB reserved",
                    self.name,
                    bytes / 1024
                );
                self.constraint_vocab.get_or_init(|| built)
            }
        };
        Grammar::new(vocab, kind, text).map_err(|e| LeanStreamError::InvalidArgument(e.to_string()))
    }

    /// Resizes the neuron cache to `bytes` (rounded down to whole chunks by the engine) and
    /// returns the size it holds now; `None` for a model without a cache. Blocks while the
    /// scheduler runs a forward pass of this model (the executor is locked for one pass).
    pub fn resize_cache(&self, bytes: u64) -> Option<leanstream_engine::Result<u64>> {
        let mut exec = self.granted_cache()?;
        Some(exec.resize_cache(bytes as usize).map(|held| held as u64))
    }

    /// The neuron cache's size now; `None` for a model without a cache.
    pub fn cache_held(&self) -> Option<u64> {
        Some(self.granted_cache()?.cache_bytes() as u64)
    }

    /// The pipeline whose neuron cache the arbiter grants, locked; `None` for a model without
    /// one (`dense` mode, or a cache sized inside the model's plan). Blocks while the scheduler
    /// runs a forward pass of this model.
    fn granted_cache(&self) -> Option<MutexGuard<'_, Executor>> {
        let ffn = self.ffn.as_ref().filter(|_| !self.cache_in_plan)?;
        Some(ffn.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// The speculation a generation on this model starts with, drafting at most `max_draft`
    /// tokens a pass; `None` when `speculate` is `off`. The engine prices a draft row as cheap
    /// where the model's plan streams weights ([`speculation_for`]); a sparse mode streams its
    /// FFN through the model's pipeline, outside any plan, and is priced the same way. Either
    /// price is only a start: the speculation measures its passes and corrects it.
    pub fn speculation(&self, max_draft: usize) -> Option<Speculation> {
        let spec = speculation_for(&self.model, self.speculate, max_draft)?;
        #[cfg(test)]
        if let Some(cost) = self.draft_row_cost {
            return Some(Speculation::with_row_cost(max_draft, cost));
        }
        if self.ffn.is_some() && self.model.plan().is_none() {
            return Some(Speculation::new(max_draft));
        }
        Some(spec)
    }

    /// Whether its sessions run on the GPU (backend `cuda`).
    pub fn on_gpu(&self) -> bool {
        #[cfg(feature = "cuda")]
        if self.gpu.is_some() {
            return true;
        }
        false
    }

    /// A new conversation on this model, on the backend it was loaded for.
    pub fn open_session(
        &self,
        context: usize,
        precision: Precision,
        kv: KvType,
    ) -> leanstream_engine::Result<Box<dyn Decode + Send>> {
        #[cfg(feature = "cuda")]
        if let Some(m) = &self.gpu {
            let s = leanstream_engine::forward::GpuSession::new(Arc::clone(m), context)?;
            return Ok(Box::new(s));
        }
        Ok(Box::new(Session::new(
            Arc::clone(&self.model),
            context,
            precision,
            kv,
        )?))
    }
}
