//! Loading a model the way the config says: the dense forward pass (within `max_bytes` when
//! it is set), or a sparse pipeline over a `.lsm` file with its neuron cache; on backend `cuda`,
//! with its weights on the GPU.

use std::sync::{Arc, Mutex, OnceLock};

use leanstream_engine::chat::ChatTemplate;
#[cfg(feature = "cuda")]
use leanstream_engine::forward::GpuModel;
use leanstream_engine::forward::Model;
use leanstream_engine::model::lsm::PredictorKind;
use leanstream_engine::pipeline::{Executor, ExecutorOptions, Mode, Policy, SparseModel};

use super::{LoadError, LoadedModel};
#[cfg(feature = "cuda")]
use crate::config::Backend;
use crate::config::{ModelParams, Params};
use crate::models::ModelFile;

impl LoadedModel {
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
                None => {
                    Model::load_for(&file.path, params.precision, params.backend).map_err(failed)?
                }
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
                    let m = GpuModel::new(backend, Arc::clone(&model), dense).map_err(failed)?;
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
