//! Loading a model the way the config says (`[engine]` and `[models.NAME]`: mode, sparsity,
//! cache share): the dense forward pass, or a sparse pipeline over a `.lsm` file (see
//! `docs/bench/sparse.md`) with its neuron cache. One [`Executor`] per loaded model holds the cache
//! and the I/O threads and is shared by every session on the model (docs/architecture.md §3);
//! each session keeps its own KV cache.
//!
//! Memory is reserved before anything large is read or allocated: [`Footprint::of`] reads only
//! the file's header, the state owner reserves the footprint in the arbiter, and only then does
//! [`LoadedModel::load`] map the weights and allocate the cache.

use std::sync::{Arc, Mutex, OnceLock};

use leanstream::contract::LeanStreamError;
use leanstream_engine::backend::cpu::Precision;
#[cfg(feature = "cuda")]
use leanstream_engine::backend::cuda::CudaModel;
use leanstream_engine::chat::ChatTemplate;
use leanstream_engine::constrain::{ConstraintVocab, Grammar, GrammarKind};
use leanstream_engine::forward::{Model, Session};
use leanstream_engine::generate::{Decode, SpeculateMode, Speculation, speculation_for};
use leanstream_engine::kv::{KvPrefix, KvType};
use leanstream_engine::model::lsm::{ChunkLayout, LsmFile, PredictorKind};
use leanstream_engine::model::{load_bytes_estimate, map_file};
use leanstream_engine::pipeline::{Executor, ExecutorOptions, Mode, Policy, SparseModel};
use leanstream_engine::process::rss_bytes;

use crate::config::{Backend, ModelParams, Params};
use crate::models::ModelFile;

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

/// What a loaded model holds in memory, as the arbiter accounts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Footprint {
    /// Weights and tables kept for the model's lifetime.
    pub resident_bytes: u64,
    /// The neuron cache the configuration asks for (0 without one); the arbiter grants it
    /// between `cache_floor_bytes` and this as memory allows.
    pub cache_bytes: u64,
    /// The smallest neuron cache the model runs with (0 without one); it is what the model is
    /// loaded with, and the cache grows from there.
    pub cache_floor_bytes: u64,
}

impl Footprint {
    /// The footprint on `backend`. On CUDA the device copy of the resident weights (the whole
    /// file in `dense` mode) counts as resident too: on Jetson the GPU's memory is the host's,
    /// so the budget must hold both copies. (A discrete GPU's twin of the neuron cache is device
    /// memory outside the host budget and is not counted.)
    pub fn on_backend(self, backend: Backend) -> Footprint {
        match backend {
            Backend::Cpu => self,
            Backend::Cuda => Footprint {
                resident_bytes: 2 * self.resident_bytes,
                ..self
            },
        }
    }

    /// The footprint of `file` run as `p` says, from the file's header alone (nothing is
    /// loaded before the footprint is reserved):
    ///
    /// - `dense`: the engine's bound of what the loaded model holds (every weight is read into
    ///   owned memory, plus its tokenizer and tables: [`load_bytes_estimate`]);
    /// - `mmap`: at least the whole file: the OS page cache may keep every page of the map;
    /// - `on-demand`, `prefetch`, `leanstream`: the same bound without the streamed FFN section
    ///   (only the I/O threads read it, into the cache), plus a cache wanted at `cache_share` of
    ///   the streamed bytes, rounded down to whole chunks, with a floor of one layer's chunks.
    ///
    /// Sparse modes need a `.lsm` file; a GGUF file is refused with the command that converts it.
    pub fn of(file: &ModelFile, p: &ModelParams) -> Result<Footprint, LoadError> {
        let failed = |e: leanstream_engine::Error| LoadError::from_engine(&file.name, &e);
        if p.mode == Mode::Dense {
            let all = load_bytes_estimate(&file.path, false).map_err(failed)?;
            return Ok(Footprint {
                // Under `max_bytes` the plan holds at most that (what does not fit streams).
                resident_bytes: p.max_bytes.map_or(all, |m| m.min(all)),
                cache_bytes: 0,
                cache_floor_bytes: 0,
            });
        }
        if file.format != "lsm" {
            return Err(LoadError::Invalid(format!(
                "model {0} is a {1} file, but `{2}` = \"{3}\" streams from a .lsm file: convert it \
                 with `leanstream convert {0}.{1} -o {0}.lsm` in the model directory",
                file.name, file.format, p.mode_key, p.mode
            )));
        }
        if p.mode == Mode::Mmap {
            // The page cache may keep every page of the map; the heap part is the estimate's.
            let estimate = load_bytes_estimate(&file.path, false).map_err(failed)?;
            return Ok(Footprint {
                resident_bytes: estimate.max(file.bytes),
                cache_bytes: 0,
                cache_floor_bytes: 0,
            });
        }
        let lsm =
            LsmFile::parse(&file.path, map_file(&file.path).map_err(failed)?).map_err(failed)?;
        let layout = ChunkLayout::from_header(&file.path, &lsm.header).map_err(failed)?;
        let total = layout.total_chunks();
        let chunks = ((p.cache_share * total as f64).floor() as usize).min(total);
        let wanted = (chunks * layout.chunk_bytes) as u64;
        Ok(Footprint {
            resident_bytes: load_bytes_estimate(&file.path, true).map_err(failed)?,
            cache_bytes: wanted,
            // A wanted size below the floor is refused at load with the key to raise.
            cache_floor_bytes: (layout.floor_bytes() as u64).min(wanted),
        })
    }
}

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
    pub gpu: Option<Arc<leanstream_engine::backend::cuda::CudaModel>>,
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
        let ffn = self.ffn.as_ref().filter(|_| !self.cache_in_plan)?;
        let mut exec = ffn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Some(exec.resize_cache(bytes as usize).map(|held| held as u64))
    }

    /// The neuron cache's size now; `None` for a model without a cache.
    pub fn cache_held(&self) -> Option<u64> {
        let ffn = self.ffn.as_ref().filter(|_| !self.cache_in_plan)?;
        let exec = ffn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Some(exec.cache_bytes() as u64)
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
            let s = leanstream_engine::backend::cuda::CudaSession::new(Arc::clone(m), context)?;
            return Ok(Box::new(s));
        }
        Ok(Box::new(Session::new(
            Arc::clone(&self.model),
            context,
            precision,
            kv,
        )?))
    }

    /// Loads `file` as `params` say for its model, with a neuron cache of `cache_bytes` (its
    /// [`Footprint`]'s floor, already reserved; the state owner grows it afterwards). Blocking:
    /// call on a loader thread.
    ///
    /// Sparse modes refuse: a file without calibration unless sparsity is off (the engine's
    /// message names `leanstream calibrate`); a configured sparsity other than the file's
    /// calibrated target (naming `leanstream calibrate --sparsity S`); a cache smaller than one
    /// layer's chunks (naming the bytes needed and the key to raise).
    pub fn load(
        file: &ModelFile,
        params: &Params,
        cache_bytes: u64,
    ) -> Result<LoadedModel, LoadError> {
        let p = params.model(&file.name);
        let failed = |e: leanstream_engine::Error| {
            LoadError::from_engine(&format!("loading model {}", file.name), &e)
        };
        let cache_in_plan = p.mode == Mode::Dense && p.max_bytes.is_some();
        let (model, ffn) = if p.mode == Mode::Dense {
            let model = match p.max_bytes {
                Some(max) => Model::load_with_max_bytes_placed(&file.path, max, p.placement)
                    .map_err(|e| match e {
                        leanstream_engine::Error::OverBudget { .. } => LoadError::Invalid(format!(
                            "model {}: `models.{}.max_bytes` = {max} is too small: {e}",
                            file.name, file.name
                        )),
                        e => failed(e),
                    })?,
                None => Model::load(&file.path).map_err(failed)?,
            };
            if let Some(plan) = model.plan() {
                tracing::info!(
                    "model {}: planned within {} bytes: {} resident, {} read per token ({} \
                     of {} FFN layers by neuron, neuron cache {} bytes)",
                    file.name,
                    plan.budget,
                    plan.resident_bytes,
                    plan.read_bytes_per_token(),
                    plan.sparse_ffn.iter().filter(|s| **s).count(),
                    plan.sparse_ffn.len(),
                    plan.floor.cache
                );
            }
            let leanstream = Policy::for_mode(Mode::LeanStream).expect("a cache-backed mode");
            let ffn = Executor::for_plan(&model, leanstream, params.io_threads, params.precision)
                .map_err(failed)?;
            (model, ffn)
        } else {
            let sm = open_sparse(file, p)?;
            let off = p.sparsity == Some(0.0);
            let exec = Executor::new(
                &sm,
                ExecutorOptions {
                    mode: p.mode,
                    policy: None,
                    cache_bytes: cache_bytes as usize,
                    io_threads: params.io_threads,
                    io_gap_bytes: leanstream_engine::io::DEFAULT_MAX_GAP_BYTES,
                    precision: params.precision,
                    predictor: (!off).then_some(PredictorKind::LowRank),
                    verify_chunks: true,
                },
            )
            .map_err(|e| match e {
                leanstream_engine::Error::OverBudget { .. } => LoadError::Invalid(format!(
                    "model {}: `{}` = {} makes a neuron cache of {cache_bytes} bytes, less than \
                     one layer's chunks: raise it ({e})",
                    file.name, p.cache_share_key, p.cache_share
                )),
                e => failed(e),
            })?;
            tracing::info!(
                "model {}: {} mode, sparsity {}, neuron cache {} bytes ({} of the streamed FFN)",
                file.name,
                p.mode,
                if off {
                    "off".to_string()
                } else {
                    format!("{:.2}", sm.sparsity)
                },
                exec.cache_bytes(),
                p.cache_share
            );
            (Arc::clone(&sm.model), Some(exec))
        };
        #[cfg(feature = "cuda")]
        let (gpu, ffn) = {
            let mut ffn = ffn;
            let gpu = match params.backend {
                Backend::Cpu => None,
                Backend::Cuda => {
                    let backend = crate::gpu::shared().map_err(failed)?;
                    if let Some(e) = &mut ffn {
                        e.use_cuda(Arc::clone(&backend)).map_err(failed)?;
                    }
                    let dense = ffn.is_none();
                    let m = CudaModel::new(backend, Arc::clone(&model), dense).map_err(failed)?;
                    tracing::info!(
                        "model {}: {} bytes of weights on the GPU",
                        file.name,
                        m.device_bytes()
                    );
                    Some(Arc::new(m))
                }
            };
            (gpu, ffn)
        };
        let ffn = ffn.map(Mutex::new);
        let template = ChatTemplate::for_model(model.chat_template.as_deref(), &model.tokenizer)
            .map_err(failed)?;
        Ok(LoadedModel {
            name: file.name.clone(),
            model,
            template,
            ffn,
            cache_in_plan,
            #[cfg(feature = "cuda")]
            gpu,
            constraint_vocab: OnceLock::new(),
            prefixes: Mutex::new(Vec::new()),
            speculate: p.speculate,
            #[cfg(test)]
            draft_row_cost: None,
        })
    }
}

/// Opens `file` for a sparse mode and checks its calibration against the configured sparsity.
/// With sparsity off the thresholds are cleared, so every neuron counts and the pipeline
/// computes the dense FFN.
fn open_sparse(file: &ModelFile, p: &ModelParams) -> Result<Arc<SparseModel>, LoadError> {
    let name = &file.name;
    let off = p.sparsity == Some(0.0);
    let mut sm = SparseModel::open_for_mode(&file.path, p.mode, !off).map_err(|e| {
        LoadError::Invalid(format!(
            "model {name} cannot run in `{}` mode: {e} (or set `{}` = 0 to stream it without \
             sparsity)",
            p.mode, p.sparsity_key
        ))
    })?;
    if off {
        #[allow(clippy::expect_used)]
        let m = Arc::get_mut(&mut sm)
            .expect("broken invariant: SparseModel::open returns an unshared model");
        m.thresholds.fill(0.0);
        m.sparsity = 0.0;
    } else if let Some(want) = p.sparsity
        && (f64::from(sm.sparsity) - want).abs() > 1e-4
    {
        return Err(LoadError::Invalid(format!(
            "model {name} is calibrated for sparsity {:.2}, but `{}` = {want}: run `leanstream \
             calibrate --sparsity {want} {name}.lsm` in the model directory, or unset the key to \
             use the file's",
            sm.sparsity, p.sparsity_key
        )));
    }
    Ok(sm)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::testing::Fixture;

    /// Loads `file` the way the state owner does: footprint first, then the model.
    fn load(file: &ModelFile, params: &Params) -> Result<(Footprint, LoadedModel), LoadError> {
        let fp = Footprint::of(file, params.model(&file.name))?.on_backend(params.backend);
        Ok((fp, LoadedModel::load(file, params, fp.cache_bytes)?))
    }

    fn failure(r: Result<(Footprint, LoadedModel), LoadError>) -> String {
        match r {
            Err(LoadError::Invalid(m)) => m,
            other => panic!("expected a load failure, got {other:?}"),
        }
    }

    #[test]
    fn max_bytes_plans_a_dense_model_within_it_and_computes_the_same_tokens() {
        let fx = Fixture::new();
        let file = fx.deep_gguf("deep");
        let (full_fp, full) = load(&file, &fx.params("")).unwrap();
        let max = full_fp.resident_bytes / 2;
        let params = fx.params(&format!("[models.deep]\nmax_bytes = {max}\n"));
        let (fp, half) = load(&file, &params).unwrap();
        assert_eq!(fp.resident_bytes, max, "the reservation is max_bytes");
        assert!(half.model.bytes() <= max, "{} > {max}", half.model.bytes());
        let plan = half.model.plan().unwrap();
        assert!(plan.streams(), "half the model cannot be resident");
        let tokens = |m: &LoadedModel| {
            let mut s = m.open_session(8, Precision::Exact, KvType::F32).unwrap();
            (1..6u32)
                .map(|t| leanstream_engine::sample::argmax(s.forward(t).unwrap()))
                .collect::<Vec<_>>()
        };
        assert_eq!(tokens(&half), tokens(&full));
        let small = fx.params("[models.deep]\nmax_bytes = 4096\n");
        assert!(failure(load(&file, &small)).contains("max_bytes"));
    }

    #[test]
    fn max_bytes_with_placement_auto_streams_sparse_layers_by_neuron_inside_it() {
        let fx = Fixture::new();
        let file = fx.synth_lsm("synth", 0.9);
        let (full_fp, _) = load(&file, &fx.params("")).unwrap();
        let max = full_fp.resident_bytes * 9 / 10;
        let run = |placement: &str| {
            let params = fx.params(&format!(
                "[models.synth]\nmax_bytes = {max}\nplacement = \"{placement}\"\n"
            ));
            let (fp, model) = load(&file, &params).unwrap();
            assert_eq!(fp.resident_bytes, max, "the reservation is max_bytes");
            let plan = model.model.plan().unwrap().clone();
            assert!(plan.planned_bytes() <= max, "{placement}: {plan:?}");
            let mut s = model
                .open_session(16, Precision::Exact, KvType::F32)
                .unwrap();
            let ids: Vec<u32> = (1..6u32)
                .map(|t| {
                    let logits = match &model.ffn {
                        Some(exec) => s.forward_with(t, &mut *exec.lock().unwrap()),
                        None => s.forward(t),
                    };
                    leanstream_engine::sample::argmax(logits.unwrap())
                })
                .collect();
            (plan, model, ids)
        };
        let (dense_plan, dense, _) = run("dense");
        assert!(!dense_plan.is_sparse() && dense.ffn.is_none());
        let (plan, sparse, ids) = run("auto");
        assert!(
            plan.is_sparse(),
            "sparsity 0.9 pays by neuron: {:?}",
            plan.sparse_ffn
        );
        assert!(plan.read_bytes_per_token() < dense_plan.read_bytes_per_token());
        assert_eq!(ids.len(), 5);
        // The cache is the plan's, inside max_bytes: the arbiter neither sees nor resizes it.
        assert!(sparse.ffn.is_some());
        assert_eq!(sparse.cache_held(), None);
        assert!(sparse.resize_cache(0).is_none());
    }

    #[test]
    fn a_streaming_mode_accounts_the_resident_part_and_its_cache() {
        let fx = Fixture::new();
        let file = fx.lsm("tiny", None);
        let header = LsmFile::open(&file.path).unwrap().header;
        let layout = ChunkLayout::from_header(&file.path, &header).unwrap();
        assert_eq!(layout.total_chunks(), 16);
        let params =
            fx.params("[models.tiny]\nmode = \"leanstream\"\nsparsity = 0\ncache_share = 0.75\n");
        let (fp, model) = load(&file, &params).unwrap();
        // The streamed FFN section is not resident: it is read into the cache. The reservation
        // is the engine's bound of what the loaded model holds, and holds it.
        assert!(header.streamed.len > 0);
        let dense_bound = load_bytes_estimate(&file.path, false).unwrap();
        assert!(
            fp.resident_bytes <= dense_bound - header.streamed.len,
            "{fp:?}"
        );
        assert!(fp.resident_bytes >= model.model.bytes(), "{fp:?}");
        assert_eq!(fp.cache_floor_bytes, layout.floor_bytes() as u64);
        // 0.75 of 16 chunks, in whole chunks; the engine allocates exactly that.
        assert_eq!(fp.cache_bytes, 12 * layout.chunk_bytes as u64);
        let exec = model.ffn.as_ref().unwrap().lock().unwrap();
        assert_eq!(exec.cache_bytes() as u64, fp.cache_bytes);
        drop(exec);

        // Dense mode keeps the whole file (and its tokenizer) and has no pipeline.
        let (fp, model) = load(&file, &fx.params("")).unwrap();
        assert!(fp.resident_bytes >= file.bytes, "{fp:?}");
        assert!(fp.resident_bytes >= model.model.bytes(), "{fp:?}");
        assert_eq!(fp.cache_bytes, 0);
        assert!(model.ffn.is_none());

        // On the GPU the device copy of the resident weights counts too; the cache does not
        // change (on Jetson the GPU reads it in place).
        assert_eq!(fp.on_backend(Backend::Cpu), fp);
        let gpu = fp.on_backend(Backend::Cuda);
        assert_eq!(
            (gpu.resident_bytes, gpu.cache_bytes),
            (2 * fp.resident_bytes, fp.cache_bytes)
        );
    }

    #[test]
    fn a_cache_smaller_than_one_layer_is_refused_with_the_bytes_needed() {
        let fx = Fixture::new();
        let file = fx.lsm("tiny", None);
        let header = LsmFile::open(&file.path).unwrap().header;
        let layout = ChunkLayout::from_header(&file.path, &header).unwrap();
        let one_layer = layout.chunks_per_layer * layout.chunk_bytes;
        // 0.25 of the model is half a layer.
        let params =
            fx.params("[models.tiny]\nmode = \"on-demand\"\nsparsity = 0\ncache_share = 0.25\n");
        let msg = failure(load(&file, &params));
        assert!(msg.contains(&one_layer.to_string()), "{msg}");
        assert!(msg.contains("models.tiny.cache_share"), "{msg}");
    }

    #[test]
    fn a_streaming_mode_needs_a_calibrated_file_unless_sparsity_is_off() {
        let fx = Fixture::new();
        let file = fx.lsm("tiny", None);
        let msg = failure(load(&file, &fx.params("[engine]\nmode = \"leanstream\"\n")));
        assert!(msg.contains("leanstream calibrate"), "{msg}");
        assert!(msg.contains("engine.sparsity"), "{msg}");
        let off =
            fx.params("[models.tiny]\nmode = \"leanstream\"\nsparsity = 0\ncache_share = 1.0\n");
        assert!(load(&file, &off).is_ok());
    }

    #[test]
    fn a_sparsity_other_than_the_calibrated_target_is_refused() {
        let fx = Fixture::new();
        let file = fx.lsm("tiny", Some(0.4));
        let at = |s: &str| {
            fx.params(&format!(
                "[models.tiny]\nmode = \"leanstream\"\ncache_share = 1.0\n{s}"
            ))
        };
        let msg = failure(load(&file, &at("sparsity = 0.5\n")));
        assert!(msg.contains("leanstream calibrate --sparsity 0.5"), "{msg}");
        assert!(msg.contains("models.tiny.sparsity"), "{msg}");
        assert!(msg.contains("0.40"), "names the file's target: {msg}");
        // The file's own target, asked for or not, loads.
        assert!(load(&file, &at("sparsity = 0.4\n")).is_ok());
        assert!(load(&file, &at("")).is_ok());
    }

    #[test]
    fn a_gguf_file_in_a_streaming_mode_asks_for_leanstream_convert() {
        let fx = Fixture::new();
        let file = fx.gguf("tiny");
        let msg = failure(load(
            &file,
            &fx.params("[models.tiny]\nmode = \"prefetch\"\n"),
        ));
        assert!(msg.contains("leanstream convert"), "{msg}");
        assert!(msg.contains("models.tiny.mode"), "{msg}");
    }
}
