//! [`Device`] for the CUDA backend: memory through the driver, and typed launches of the
//! `cuda-kernels/` kernels queued on the backend's stream (nothing here waits but `sync` and the
//! copies to the host). Grid and block sizes, and the kernels' codes for the engine's types,
//! come from `backend::launch` (shared with the kernels' host build). Kernel pointers are passed
//! as the raw u64 device addresses of [`Addr`].

use std::ffi::c_void;

use cust::function::{BlockSize, GridSize};
use cust::memory::DeviceBuffer;
use cust::prelude::*;
use cust::sys;

use super::memory::{HostRegistration, check};
use super::{CudaBackend, cuda};
use crate::backend::device::{Addr, Allocation, Device, Gathered, HostMapping};
use crate::backend::launch::{self, Launch, dtype_code, int};
use crate::backend::ops::AttentionShape;
use crate::model::lsm::ChunkLayout;
use crate::model::{FfnActivation, RopeStyle};
use crate::quant::DType;
use crate::{Error, Result};

/// cust's grid, block and shared bytes of a launch.
fn shape(l: Launch) -> (GridSize, BlockSize, u32) {
    (l.grid.into(), l.block.into(), l.shared_bytes)
}

impl Allocation for DeviceBuffer<u8> {
    fn addr(&self) -> Addr {
        Addr(self.as_device_ptr().as_raw())
    }
}

impl HostMapping for HostRegistration {
    fn device_addr(&self, host: *const u8) -> Option<Addr> {
        self.device_ptr(host).map(|p| Addr(p.as_raw()))
    }
}

impl Device for CudaBackend {
    fn name(&self) -> String {
        format!("cuda ({})", self.device())
    }

    fn integrated(&self) -> bool {
        self.integrated
    }

    fn alloc(&self, what: &str, bytes: usize) -> Result<Box<dyn Allocation>> {
        self.bind()?;
        let b = DeviceBuffer::<u8>::zeroed(bytes.max(1))
            .map_err(|e| Error::Cuda(format!("allocating {what} ({bytes} bytes): {e}")))?;
        Ok(Box::new(b))
    }

    unsafe fn write(&self, to: Addr, bytes: &[u8]) -> Result<()> {
        // The synchronous copy runs on the legacy stream, which does not wait for this
        // non-blocking stream: wait for the kernels queued before, which may read `to`.
        self.sync()?;
        // SAFETY: the caller's contract.
        let r = unsafe { sys::cuMemcpyHtoD_v2(to.0, bytes.as_ptr().cast::<c_void>(), bytes.len()) };
        check(r, "copying to the device")
    }

    unsafe fn read(&self, from: Addr, into: &mut [u8]) -> Result<()> {
        self.sync()?;
        // SAFETY: the caller's contract.
        let r =
            unsafe { sys::cuMemcpyDtoH_v2(into.as_mut_ptr().cast::<c_void>(), from.0, into.len()) };
        check(r, "copying to the host")
    }

    unsafe fn zero(&self, at: Addr, bytes: usize) -> Result<()> {
        // SAFETY: the caller's contract; queued on the stream every kernel runs on.
        let r = unsafe { sys::cuMemsetD8Async(at.0, 0, bytes, self.stream.as_inner()) };
        check(r, "clearing device memory")
    }

    fn sync(&self) -> Result<()> {
        self.stream.synchronize().map_err(cuda("synchronising"))
    }

    unsafe fn map_host(&self, host: *mut u8, len: usize) -> Result<Option<Box<dyn HostMapping>>> {
        if !self.integrated {
            return Ok(None);
        }
        self.bind()?;
        // SAFETY: the caller's contract.
        let r = unsafe { HostRegistration::new(host, len)? };
        Ok(Some(Box::new(r)))
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
        let f = self.function("elementwise", "rmsnorm")?;
        let stream = &self.stream;
        let (grid, block, shared) = shape(launch::rmsnorm(rows)?);
        let n = int("n", n)?;
        // SAFETY: the trait's contract.
        unsafe {
            launch!(f<<<grid, block, shared, stream>>>(out.0, x.0, weight.0, n, eps))
                .map_err(cuda("launching rmsnorm"))
        }
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
        let f = self.function("matvec", "matvec")?;
        let stream = &self.stream;
        let (r, c) = (int("rows", rows)?, int("cols", cols)?);
        let (grid, block, shared) = shape(launch::matvec(rows)?);
        let code = dtype_code(dtype);
        // SAFETY: the trait's contract.
        unsafe {
            launch!(f<<<grid, block, shared, stream>>>(w.0, code, r, c, x.0, bias.0, y.0))
                .map_err(cuda("launching matvec"))
        }
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
        let f = self.function("elementwise", "rope")?;
        let stream = &self.stream;
        let (grid, block, shared) = shape(launch::rope(n_heads, head_dim)?);
        let (hd, p) = (int("head_dim", head_dim)?, int("pos", pos)?);
        let style = launch::rope_style_code(style);
        // SAFETY: the trait's contract.
        unsafe {
            launch!(f<<<grid, block, shared, stream>>>(x.0, hd, p, inv_freq.0, style))
                .map_err(cuda("launching rope"))
        }
    }

    unsafe fn gate(&self, activation: FfnActivation, gate: Addr, up: Addr, n: usize) -> Result<()> {
        let f = self.function("elementwise", "gate_mul")?;
        let stream = &self.stream;
        let (grid, block, shared) = shape(launch::elementwise(n)?);
        let (n, act) = (int("n", n)?, launch::act_code(activation));
        // SAFETY: the trait's contract.
        unsafe {
            launch!(f<<<grid, block, shared, stream>>>(gate.0, up.0, n, act))
                .map_err(cuda("launching gate_mul"))
        }
    }

    unsafe fn add(&self, a: Addr, b: Addr, n: usize) -> Result<()> {
        let f = self.function("elementwise", "add_inplace")?;
        let stream = &self.stream;
        let (grid, block, shared) = shape(launch::elementwise(n)?);
        let n = int("n", n)?;
        // SAFETY: the trait's contract.
        unsafe {
            launch!(f<<<grid, block, shared, stream>>>(a.0, b.0, n))
                .map_err(cuda("launching add_inplace"))
        }
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
        let (grid, block, shared) = shape(launch::attention_decode(s.n_heads, s.head_dim)?);
        let f = self.function("attention", "attention_decode")?;
        let stream = &self.stream;
        let (first, n_pos) = (int("first", s.first)?, int("n_pos", s.n_pos)?);
        let (heads, kv_heads) = (int("n_heads", s.n_heads)?, int("n_kv_heads", s.n_kv_heads)?);
        let (hd, stride) = (int("head_dim", s.head_dim)?, int("kv_stride", kv_stride)?);
        // SAFETY: the trait's contract.
        unsafe {
            launch!(f<<<grid, block, shared, stream>>>(
                q.0, keys.0, values.0, out.0, first, n_pos, heads, kv_heads, hd, stride
            ))
            .map_err(cuda("launching attention_decode"))
        }
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
        let gate_up = self.function("ffn", "ffn_gate_up_gathered")?;
        let down = self.function("ffn", "ffn_down_gathered")?;
        let stream = &self.stream;
        let (gate_up_grid, gate_up_block, gate_up_shared) = shape(a.gate_up);
        let (down_grid, down_block, down_shared) = shape(a.down);
        // SAFETY: the trait's contract. The down launch follows the gate/up launch on the same
        // stream, so it reads the h that one wrote.
        unsafe {
            launch!(gate_up<<<gate_up_grid, gate_up_block, gate_up_shared, stream>>>(
                chunks.ptrs.0,
                chunks.index.0,
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
                x.0,
                h.0,
                active.0
            ))
            .map_err(cuda("launching ffn_gate_up_gathered"))?;
            launch!(down<<<down_grid, down_block, down_shared, stream>>>(
                chunks.ptrs.0,
                chunks.index.0,
                a.n_chunks,
                a.chunk_neurons,
                a.n_ff,
                a.d_model,
                a.bundle_bytes,
                a.down_at,
                a.down_dtype,
                h.0,
                acc.0
            ))
            .map_err(cuda("launching ffn_down_gathered"))
        }
    }

    unsafe fn argmax(&self, logits: Addr, n: usize, out: Addr) -> Result<()> {
        let f = self.function("sample", "argmax")?;
        let stream = &self.stream;
        let (grid, block, shared) = shape(launch::sampling());
        let n = int("n", n)?;
        // SAFETY: the trait's contract.
        unsafe {
            launch!(f<<<grid, block, shared, stream>>>(logits.0, n, out.0))
                .map_err(cuda("launching argmax"))
        }
    }

    unsafe fn top_k(
        &self,
        logits: Addr,
        n: usize,
        k: usize,
        out_v: Addr,
        out_i: Addr,
    ) -> Result<()> {
        let f = self.function("sample", "top_k")?;
        let stream = &self.stream;
        let (grid, block, shared) = shape(launch::sampling());
        let (n, k) = (int("n", n)?, int("k", k)?);
        // SAFETY: the trait's contract.
        unsafe {
            launch!(f<<<grid, block, shared, stream>>>(logits.0, n, k, out_v.0, out_i.0))
                .map_err(cuda("launching top_k"))
        }
    }
}
