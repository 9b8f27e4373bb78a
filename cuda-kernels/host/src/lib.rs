//! The CUDA kernels of `cuda-kernels/src/`, compiled as C++ for the host (`cuda_host.h`: each
//! CUDA thread a host thread, `__syncthreads` and warp shuffles as barriers), as a
//! [`Device`] whose memory is host memory. Everything the engine writes against `Device` runs
//! on them: the conformance bodies (`tests/conformance.rs`), and the GPU's whole forward pass
//! against the CPU's (`tests/forward.rs`), so the kernels' indexing and arithmetic, and the
//! pass's buffers and offsets, are checked on a machine without a GPU
//! (`cuda-kernels/host-check`).
//!
//! [`HostKernels`] is the CUDA backend's `kernels.rs` with host pointers for device addresses:
//! the same launch geometry and argument codes (`backend::launch`), the same kernels. A launch
//! returns when the kernel has run, so the queue is always empty. A test harness only; nothing
//! ships it.

use leanstream_engine::backend::device::{Addr, Allocation, Device, Gathered, HostMapping};
use leanstream_engine::backend::launch::{self, Launch, dtype_code, int};
use leanstream_engine::backend::ops::AttentionShape;
use leanstream_engine::model::lsm::ChunkLayout;
use leanstream_engine::model::{FfnActivation, RopeStyle};
use leanstream_engine::quant::DType;
use leanstream_engine::{Error, Result};

/// A launch as `cuda_host.h` takes it (`LsLaunch`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Geometry {
    grid: [u32; 3],
    block: u32,
    shared_bytes: u32,
}

impl From<Launch> for Geometry {
    fn from(l: Launch) -> Geometry {
        Geometry {
            grid: [l.grid.0, l.grid.1, l.grid.2],
            block: l.block,
            shared_bytes: l.shared_bytes,
        }
    }
}

// The launchers of `launchers/*.cpp`: each runs one kernel over the whole grid and returns when
// every block has finished, with 0 or an `LS_HOST_*` code of `cuda_host.h`. The pointers follow
// the kernel's comment in its source.
unsafe extern "C" {
    fn ls_host_rmsnorm(
        g: Geometry,
        out: *mut f32,
        x: *const f32,
        weight: *const f32,
        n: i32,
        eps: f32,
    ) -> i32;
    fn ls_host_rope(
        g: Geometry,
        x: *mut f32,
        head_dim: i32,
        pos: i32,
        inv_freq: *const f32,
        style: i32,
    ) -> i32;
    fn ls_host_gate_mul(g: Geometry, gate: *mut f32, up: *const f32, n: i32, act: i32) -> i32;
    fn ls_host_add_inplace(g: Geometry, a: *mut f32, b: *const f32, n: i32) -> i32;
    fn ls_host_matvec(
        g: Geometry,
        w: *const u8,
        dtype: i32,
        rows: i32,
        cols: i32,
        x: *const f32,
        bias: *const f32,
        y: *mut f32,
    ) -> i32;
    fn ls_host_attention_decode(
        g: Geometry,
        q: *const f32,
        k_cache: *const f32,
        v_cache: *const f32,
        out: *mut f32,
        first: i32,
        n_pos: i32,
        n_heads: i32,
        n_kv_heads: i32,
        head_dim: i32,
        kv_stride: i32,
    ) -> i32;
    fn ls_host_ffn_gate_up_gathered(
        g: Geometry,
        chunk_ptrs: *const *const u8,
        chunk_index: *const u32,
        n_chunks: i32,
        chunk_neurons: i32,
        n_ff: i32,
        d_model: i32,
        bundle_bytes: i32,
        up_at: i32,
        gate_dtype: i32,
        up_dtype: i32,
        act: i32,
        threshold: f32,
        x: *const f32,
        h: *mut f32,
        active: *mut u32,
    ) -> i32;
    fn ls_host_ffn_down_gathered(
        g: Geometry,
        chunk_ptrs: *const *const u8,
        chunk_index: *const u32,
        n_chunks: i32,
        chunk_neurons: i32,
        n_ff: i32,
        d_model: i32,
        bundle_bytes: i32,
        down_at: i32,
        down_dtype: i32,
        h: *const f32,
        acc: *mut f32,
    ) -> i32;
    fn ls_host_argmax(g: Geometry, logits: *const f32, n: i32, out: *mut u32) -> i32;
    fn ls_host_top_k(
        g: Geometry,
        logits: *const f32,
        n: i32,
        k: i32,
        out_v: *mut f32,
        out_i: *mut u32,
    ) -> i32;
}

/// The launcher's result as the engine's error, naming the kernel.
fn launched(kernel: &str, code: i32) -> Result<()> {
    let why = match code {
        0 => return Ok(()),
        1 => "an empty grid or a block of 0 or more than 1024 threads",
        2 => "dynamic shared memory asked for (no kernel uses it)",
        3 => "the block's host threads could not be started",
        4 => "a warp shuffle read a lane that had returned, or had a partial mask",
        _ => "an unknown launcher result",
    };
    Err(Error::Cuda(format!(
        "{kernel} on the host: {why} (code {code})"
    )))
}

/// Host memory standing in for device memory: u64 words, so every type the kernels read is
/// aligned, freed on drop.
#[derive(Debug)]
struct HostMemory {
    words: *mut [u64],
}

// SAFETY: the memory is owned by this value alone and never touched through `&self`; what is
// written through its address is the caller's business, as on a GPU.
unsafe impl Send for HostMemory {}
// SAFETY: as above.
unsafe impl Sync for HostMemory {}

impl Allocation for HostMemory {
    fn addr(&self) -> Addr {
        Addr(self.words.cast::<u64>() as u64)
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        // SAFETY: made by `Box::into_raw` in `alloc`, freed once here.
        drop(unsafe { Box::from_raw(self.words) });
    }
}

/// A device address as the host pointer it is.
fn ptr<T>(a: Addr) -> *mut T {
    a.0 as usize as *mut T
}

/// The kernels of `cuda-kernels/src/` running on the host's CPU, over host memory. Like a
/// Jetson ([`HostKernels::INTEGRATED`], the default) it maps host memory for the kernels to read
/// in place; like a discrete GPU ([`HostKernels::DISCRETE`]) it does not, so its callers copy.
#[derive(Clone, Copy, Debug)]
pub struct HostKernels {
    integrated: bool,
}

impl HostKernels {
    pub const INTEGRATED: HostKernels = HostKernels { integrated: true };
    pub const DISCRETE: HostKernels = HostKernels { integrated: false };
}

impl Default for HostKernels {
    fn default() -> HostKernels {
        HostKernels::INTEGRATED
    }
}

/// A host range mapped for the host kernels: its addresses are its own.
#[derive(Debug)]
struct InPlace {
    start: usize,
    len: usize,
}

impl HostMapping for InPlace {
    fn device_addr(&self, host: *const u8) -> Option<Addr> {
        let off = (host as usize).checked_sub(self.start)?;
        (off < self.len).then_some(Addr(host as usize as u64))
    }
}

impl Device for HostKernels {
    fn name(&self) -> String {
        let kind = if self.integrated {
            "integrated"
        } else {
            "discrete"
        };
        format!("cuda kernels on the host (as an {kind} GPU)")
    }

    fn integrated(&self) -> bool {
        self.integrated
    }

    fn alloc(&self, _what: &str, bytes: usize) -> Result<Box<dyn Allocation>> {
        let words = vec![0u64; bytes.div_ceil(8).max(1)].into_boxed_slice();
        Ok(Box::new(HostMemory {
            words: Box::into_raw(words),
        }))
    }

    unsafe fn write(&self, to: Addr, bytes: &[u8]) -> Result<()> {
        // SAFETY: the caller's contract: `to` holds as many bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), ptr(to), bytes.len()) };
        Ok(())
    }

    unsafe fn read(&self, from: Addr, into: &mut [u8]) -> Result<()> {
        // SAFETY: the caller's contract: `from` holds as many bytes.
        unsafe { std::ptr::copy_nonoverlapping(ptr(from), into.as_mut_ptr(), into.len()) };
        Ok(())
    }

    unsafe fn zero(&self, at: Addr, bytes: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::write_bytes(ptr::<u8>(at), 0, bytes) };
        Ok(())
    }

    fn sync(&self) -> Result<()> {
        Ok(())
    }

    unsafe fn map_host(&self, host: *mut u8, len: usize) -> Result<Option<Box<dyn HostMapping>>> {
        Ok(self.integrated.then(|| {
            Box::new(InPlace {
                start: host as usize,
                len,
            }) as Box<dyn HostMapping>
        }))
    }

    unsafe fn rmsnorm(
        &self,
        out: Addr,
        x: Addr,
        weight: Addr,
        n: usize,
        rows: usize,
        eps: f32,
    ) -> Result<()> {
        let g = launch::rmsnorm(rows)?.into();
        let n = int("n", n)?;
        // SAFETY: the trait's contract; the call returns after the kernel has run.
        launched("rmsnorm", unsafe {
            ls_host_rmsnorm(g, ptr(out), ptr(x), ptr(weight), n, eps)
        })
    }

    unsafe fn matvec(
        &self,
        w: Addr,
        dtype: DType,
        rows: usize,
        cols: usize,
        x: Addr,
        bias: Addr,
        y: Addr,
    ) -> Result<()> {
        let g = launch::matvec(rows)?.into();
        let (r, c) = (int("rows", rows)?, int("cols", cols)?);
        let code = dtype_code(dtype);
        // SAFETY: the trait's contract; the call returns after the kernel has run.
        launched("matvec", unsafe {
            ls_host_matvec(g, ptr(w), code, r, c, ptr(x), ptr(bias), ptr(y))
        })
    }

    unsafe fn rope(
        &self,
        x: Addr,
        n_heads: usize,
        head_dim: usize,
        pos: usize,
        inv_freq: Addr,
        style: RopeStyle,
    ) -> Result<()> {
        let g = launch::rope(n_heads, head_dim)?.into();
        let (hd, p) = (int("head_dim", head_dim)?, int("pos", pos)?);
        let style = launch::rope_style_code(style);
        // SAFETY: the trait's contract; the call returns after the kernel has run.
        launched("rope", unsafe {
            ls_host_rope(g, ptr(x), hd, p, ptr(inv_freq), style)
        })
    }

    unsafe fn gate(&self, activation: FfnActivation, gate: Addr, up: Addr, n: usize) -> Result<()> {
        let g = launch::elementwise(n)?.into();
        let (n, act) = (int("n", n)?, launch::act_code(activation));
        // SAFETY: the trait's contract; the call returns after the kernel has run.
        launched("gate_mul", unsafe {
            ls_host_gate_mul(g, ptr(gate), ptr(up), n, act)
        })
    }

    unsafe fn add(&self, a: Addr, b: Addr, n: usize) -> Result<()> {
        let g = launch::elementwise(n)?.into();
        let n = int("n", n)?;
        // SAFETY: the trait's contract; the call returns after the kernel has run.
        launched("add_inplace", unsafe {
            ls_host_add_inplace(g, ptr(a), ptr(b), n)
        })
    }

    unsafe fn attention(
        &self,
        q: Addr,
        keys: Addr,
        values: Addr,
        out: Addr,
        s: AttentionShape,
        kv_stride: usize,
    ) -> Result<()> {
        let g = launch::attention_decode(s.n_heads, s.head_dim)?.into();
        // SAFETY: the trait's contract; the call returns after the kernel has run.
        let code = unsafe {
            ls_host_attention_decode(
                g,
                ptr(q),
                ptr(keys),
                ptr(values),
                ptr(out),
                int("first", s.first)?,
                int("n_pos", s.n_pos)?,
                int("n_heads", s.n_heads)?,
                int("n_kv_heads", s.n_kv_heads)?,
                int("head_dim", s.head_dim)?,
                int("kv_stride", kv_stride)?,
            )
        };
        launched("attention_decode", code)
    }

    unsafe fn ffn_gathered(
        &self,
        layout: &ChunkLayout,
        chunks: Gathered,
        activation: FfnActivation,
        threshold: f32,
        x: Addr,
        h: Addr,
        acc: Addr,
        active: Addr,
    ) -> Result<()> {
        if chunks.n == 0 {
            return Ok(());
        }
        let a = launch::ffn(layout, chunks.n, activation)?;
        // SAFETY: the trait's contract; the second call starts after the first has finished
        // writing h.
        let (gate_up, down) = unsafe {
            let gate_up = ls_host_ffn_gate_up_gathered(
                a.gate_up.into(),
                ptr(chunks.ptrs),
                ptr(chunks.index),
                a.n_chunks,
                a.chunk_neurons,
                a.n_ff,
                a.d_model,
                a.bundle_bytes,
                a.up_at,
                a.gate_dtype,
                a.up_dtype,
                a.act,
                threshold,
                ptr(x),
                ptr(h),
                ptr(active),
            );
            let down = ls_host_ffn_down_gathered(
                a.down.into(),
                ptr(chunks.ptrs),
                ptr(chunks.index),
                a.n_chunks,
                a.chunk_neurons,
                a.n_ff,
                a.d_model,
                a.bundle_bytes,
                a.down_at,
                a.down_dtype,
                ptr(h),
                ptr(acc),
            );
            (gate_up, down)
        };
        launched("ffn_gate_up_gathered", gate_up)?;
        launched("ffn_down_gathered", down)
    }

    unsafe fn argmax(&self, logits: Addr, n: usize, out: Addr) -> Result<()> {
        let n = int("n", n)?;
        // SAFETY: the trait's contract; the call returns after the kernel has run.
        launched("argmax", unsafe {
            ls_host_argmax(launch::sampling().into(), ptr(logits), n, ptr(out))
        })
    }

    unsafe fn top_k(
        &self,
        logits: Addr,
        n: usize,
        k: usize,
        out_v: Addr,
        out_i: Addr,
    ) -> Result<()> {
        let (n, k) = (int("n", n)?, int("k", k)?);
        let g = launch::sampling().into();
        // SAFETY: the trait's contract; the call returns after the kernel has run.
        launched("top_k", unsafe {
            ls_host_top_k(g, ptr(logits), n, k, ptr(out_v), ptr(out_i))
        })
    }
}
