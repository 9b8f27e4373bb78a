//! The streaming pipeline's chunk computations on the GPU ([`ChunkCompute`]).
//!
//! The neuron cache's arena is registered with the driver once ([`HostRegistration`]), so the
//! I/O workers' O_DIRECT reads land in page-locked memory the GPU can address. Then, per stage of
//! arrived chunks:
//! - on Jetson/Orin (integrated: one memory) the kernels read the cache slots in place through
//!   their mapped device addresses: zero copies;
//! - on a discrete GPU each slot has a twin in a device arena of the same size; a chunk is
//!   copied to its twin asynchronously, on the compute stream, the first time it is computed
//!   after it arrived (a slot refilled with another chunk is copied again), so a chunk that
//!   stays cached crosses the bus once.
//!
//! The host learns per chunk that data has arrived (the I/O completion of that chunk) and hands
//! the arrived set of each stage to the kernels, so reads of later chunks overlap the GPU's work
//! on earlier ones exactly as on the CPU. Each stage ends with one synchronisation, after which
//! the stage's activations and output are back on the host for the refinement policy.
//!
//! The GPU's dot products are always exact f32 (`Precision::Fast` applies to the CPU kernels).

use std::sync::Arc;

use cust::memory::DevicePointer;

use super::CudaBackend;
use super::memory::{HostRegistration, copy_to_device_async};
use crate::backend::chunks::{BLOCKS, ChunkCompute, Unit};
use crate::backend::device::{Buffer, Device, Gathered};
use crate::model::lsm::ChunkLayout;
use crate::{Error, Result};

/// The device twin of the cache arena (discrete GPUs) and which chunk each twin slot holds.
struct Mirror {
    arena: Buffer<u8>,
    holds: Vec<Option<(usize, usize)>>, // per slot: (layer, chunk) copied there
}

/// [`ChunkCompute`] on a CUDA device.
pub struct CudaChunks {
    gpu: Arc<CudaBackend>,
    arena: HostRegistration,
    mirror: Option<Mirror>,
    slot_bytes: usize,
    x: Buffer<f32>,      // (d_model)
    h: Buffer<f32>,      // (n_ff)
    acc: Buffer<f32>,    // (BLOCKS, d_model): one sum per unit of a stage
    active: Buffer<u32>, // (1)
    ptrs: Buffer<u64>,   // (chunks_per_layer)
    index: Buffer<u32>,  // (chunks_per_layer)
    host_ptrs: Vec<u64>,
    host_index: Vec<u32>,
    host_h: Vec<f32>,
    host_acc: Vec<f32>,
    host_active: [u32; 1],
    /// Bytes copied host → device into the mirror (0 on integrated GPUs).
    pub copied_bytes: u64,
}

impl std::fmt::Debug for CudaChunks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaChunks")
            .field("device", &self.gpu.device())
            .field("zero_copy", &self.mirror.is_none())
            .field("arena_bytes", &self.arena.len())
            .finish_non_exhaustive()
    }
}

impl CudaChunks {
    /// Registers the cache arena (`arena`, `len` bytes of slots of `layout.chunk_bytes`) with
    /// the device and allocates the stage buffers (and, on a discrete GPU, the arena's twin).
    ///
    /// # Safety
    /// The arena must outlive the returned value and only ever hold cache slots (the neuron
    /// cache of the pipeline that will own this compute: `StreamingFfn::use_cuda` upholds it).
    pub unsafe fn new(
        gpu: Arc<CudaBackend>,
        arena: std::ptr::NonNull<u8>,
        len: usize,
        layout: &ChunkLayout,
    ) -> Result<CudaChunks> {
        gpu.bind()?;
        // SAFETY: the caller's contract.
        let registration = unsafe { HostRegistration::new(arena.as_ptr(), len)? };
        let slots = len / layout.chunk_bytes.max(1);
        let dev: &dyn Device = &*gpu;
        let mirror = if gpu.integrated() {
            None
        } else {
            Some(Mirror {
                arena: Buffer::zeros(dev, "the neuron cache's device twin", len)?,
                holds: vec![None; slots],
            })
        };
        let n = layout.chunks_per_layer;
        Ok(CudaChunks {
            arena: registration,
            mirror,
            slot_bytes: layout.chunk_bytes,
            x: Buffer::zeros(dev, "x", layout.d_model)?,
            h: Buffer::zeros(dev, "h", layout.n_ff)?,
            acc: Buffer::zeros(dev, "acc", BLOCKS * layout.d_model)?,
            active: Buffer::zeros(dev, "active", 1)?,
            ptrs: Buffer::zeros(dev, "chunk pointers", n)?,
            index: Buffer::zeros(dev, "chunk index", n)?,
            host_ptrs: vec![0; n.max(1)],
            host_index: vec![0; n.max(1)],
            host_h: vec![0.0; layout.n_ff],
            host_acc: vec![0.0; BLOCKS * layout.d_model],
            host_active: [0],
            copied_bytes: 0,
            gpu,
        })
    }

    /// Bytes of device memory this takes beyond the registered arena (the twin on a discrete
    /// GPU, plus the stage buffers): what the daemon adds to the model's GPU share.
    pub fn device_bytes(&self) -> usize {
        self.mirror.as_ref().map_or(0, |m| m.arena.bytes())
            + 4 * (self.x.len() + self.acc.len() + self.h.len() + 1)
            + 12 * self.ptrs.len()
    }

    /// The device address of `bytes` (a Ready slot of the arena), copying it to the twin
    /// first on a discrete GPU.
    fn device_address(&mut self, l: usize, c: usize, bytes: &[u8]) -> Result<u64> {
        let host = bytes.as_ptr();
        let mapped = self.arena.device_ptr(host).ok_or_else(|| {
            Error::Cuda(format!(
                "chunk {c} of layer {l} is outside the registered cache"
            ))
        })?;
        let Some(mirror) = self.mirror.as_mut() else {
            return Ok(mapped.as_raw());
        };
        let offset = host as usize - self.arena.host_start() as usize;
        let dst = DevicePointer::<u8>::from_raw(mirror.arena.at(offset).0);
        let slot = offset / self.slot_bytes;
        if mirror.holds[slot] != Some((l, c)) {
            // SAFETY: `bytes` is a Ready slot: registered (page-locked), not written while the
            // chunk stays cached, and pinned by the pipeline until this stage has synchronised;
            // `dst` is the same range of the twin, which only this stream touches.
            unsafe { copy_to_device_async(dst, host, bytes.len(), &self.gpu.stream)? };
            mirror.holds[slot] = Some((l, c));
            self.copied_bytes += bytes.len() as u64;
        }
        Ok(dst.as_raw())
    }
}

impl ChunkCompute for CudaChunks {
    /// All units of the stage in one round trip: their chunk lists go up together, each unit's
    /// launches sum into its own slice of `acc`, and one synchronisation ends the stage. The
    /// GPU computes one row at a time (a GPU session runs alone), so every unit has the same
    /// input; units of different inputs are refused.
    fn compute<'b>(
        &mut self,
        l: usize,
        units: &mut [Unit<'_>],
        bytes_of: &(dyn Fn(usize) -> &'b [u8] + Sync),
    ) -> Result<usize> {
        let Some(first) = units.first() else {
            return Ok(0);
        };
        let (layout, x) = (first.math.layout, first.x);
        let (d, listed) = (
            layout.d_model,
            units.iter().map(|u| u.chunks.len()).sum::<usize>(),
        );
        if units.iter().any(|u| !std::ptr::eq(u.x, x))
            || units.len() > BLOCKS
            || listed > self.host_ptrs.len()
        {
            return Err(Error::InvalidArgument {
                arg: "units",
                reason: format!(
                    "{} units of {listed} chunks: the GPU takes at most {BLOCKS} units of one \
                     row and {} chunks a stage",
                    units.len(),
                    self.host_ptrs.len()
                ),
            });
        }
        self.gpu.bind()?;
        let mut i = 0;
        for u in units.iter() {
            for &c in u.chunks {
                self.host_ptrs[i] = self.device_address(l, c, bytes_of(c))?;
                self.host_index[i] = c as u32;
                i += 1;
            }
        }
        let dev: &dyn Device = &*self.gpu;
        self.ptrs.write(dev, &self.host_ptrs[..i])?;
        self.index.write(dev, &self.host_index[..i])?;
        self.x.write(dev, x)?;
        self.acc.clear(dev)?;
        self.active.clear(dev)?;
        let mut start = 0;
        for (k, u) in units.iter().enumerate() {
            let listed = Gathered {
                ptrs: self.ptrs.at(start),
                index: self.index.at(start),
                n: u.chunks.len(),
            };
            start += u.chunks.len();
            // SAFETY: the chunk addresses are Ready slots of the registered arena (or their
            // twins), pinned until this stage's synchronisation below; x holds d_model values,
            // h n_ff, acc BLOCKS × d_model (k < BLOCKS, checked above), active one.
            unsafe {
                dev.ffn_gathered(
                    layout,
                    listed,
                    u.math.activation,
                    u.math.threshold,
                    self.x.addr(),
                    self.h.addr(),
                    self.acc.at(k * d),
                    self.active.addr(),
                )?;
            }
        }
        self.h.read(dev, &mut self.host_h)?;
        self.acc.read(dev, &mut self.host_acc)?;
        self.active.read(dev, &mut self.host_active)?;
        for (k, u) in units.iter_mut().enumerate() {
            for &c in u.chunks {
                let r = layout.neurons(c);
                let (a, b) = (r.start - u.h_start, r.end - u.h_start);
                u.h[a..b].copy_from_slice(&self.host_h[r]);
            }
            crate::backend::cpu::add_inplace(u.out, &self.host_acc[k * d..(k + 1) * d]);
        }
        Ok(self.host_active[0] as usize)
    }
}
