//! A model's [`Footprint`]: what it will hold in memory once loaded, worked out from its file's
//! header alone, so that the state owner can reserve it before anything large is read.

use leanstream_engine::forward::load_bytes_estimate;
use leanstream_engine::model::lsm::{ChunkLayout, LsmFile};
use leanstream_engine::model::map_file;
use leanstream_engine::pipeline::Mode;

use super::LoadError;
use crate::config::{Backend, ModelParams};
use crate::models::ModelFile;

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
