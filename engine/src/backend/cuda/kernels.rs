//! Typed launches of the `cuda-kernels/` kernels on device pointers, queued on the backend's
//! stream (nothing here waits). Grid and block sizes, and the kernels' codes for the engine's
//! types, come from `backend::launch` (shared with the kernels' host build).
//!
//! Safety contract of every launcher: the pointers are device (or mapped host) memory of this
//! context holding at least the sizes the kernel's comment names for the given arguments, and
//! stay alive until the stream has run the kernel. The callers (`ops.rs`, `session.rs`) keep
//! their buffers alive across a synchronisation of the stream.

use cust::function::{BlockSize, GridSize};
use cust::memory::DevicePointer;
use cust::prelude::*;

use super::{CudaBackend, cuda};
use crate::backend::launch::{self, Launch, dtype_code, int};
use crate::model::lsm::ChunkLayout;
use crate::model::{FfnActivation, RopeStyle};
use crate::quant::DType;
use crate::{Error, Result};

/// A device pointer to f32 values.
pub type F32Ptr = DevicePointer<f32>;

/// The neuron chunks of one [`CudaBackend::ffn_gathered`] launch.
#[derive(Clone, Copy, Debug)]
pub struct GatheredChunks {
    /// `n` device addresses, the first byte of each listed chunk.
    pub ptrs: DevicePointer<u64>,
    /// `n` chunk indices inside the layer.
    pub index: DevicePointer<u32>,
    pub n: usize,
}

/// cust's grid, block and shared bytes of a launch.
fn shape(l: Launch) -> (GridSize, BlockSize, u32) {
    (l.grid.into(), l.block.into(), l.shared_bytes)
}

impl CudaBackend {
    /// RMSNorm of `rows` rows of `n` values: `out = x / rms(x) * weight`.
    pub fn rmsnorm_on(
        &self,
        out: F32Ptr,
        x: F32Ptr,
        weight: F32Ptr,
        n: usize,
        rows: usize,
        eps: f32,
    ) -> Result<()> {
        let f = self.function("elementwise", "rmsnorm")?;
        let stream = &self.stream;
        let (grid, block, shared) = shape(launch::rmsnorm(rows)?);
        // SAFETY: the module contract above; rows × n values behind out and x, n behind weight.
        unsafe {
            launch!(f<<<grid, block, shared, stream>>>(out, x, weight, int("n", n)?, eps))
                .map_err(cuda("launching rmsnorm"))
        }
    }

    /// `y = W x (+ bias)`: `rows` rows of `cols` values of `dtype` back to back from `w`;
    /// `bias` may be null.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_on(
        &self,
        w: DevicePointer<u8>,
        dtype: DType,
        rows: usize,
        cols: usize,
        x: F32Ptr,
        bias: F32Ptr,
        y: F32Ptr,
    ) -> Result<()> {
        let f = self.function("matvec", "matvec")?;
        let stream = &self.stream;
        let (r, c) = (int("rows", rows)?, int("cols", cols)?);
        let (grid, block, shared) = shape(launch::matvec(rows)?);
        // SAFETY: the module contract; w holds rows × row_bytes(cols), x cols, y and bias rows.
        unsafe {
            launch!(f<<<grid, block, shared, stream>>>(
                w,
                dtype_code(dtype),
                r,
                c,
                x,
                bias,
                y
            ))
            .map_err(cuda("launching matvec"))
        }
    }

    /// RoPE in place over `n_heads` heads of `head_dim` values at position `pos`.
    pub fn rope_on(
        &self,
        x: F32Ptr,
        n_heads: usize,
        head_dim: usize,
        pos: usize,
        base: f32,
        style: RopeStyle,
    ) -> Result<()> {
        let f = self.function("elementwise", "rope")?;
        let stream = &self.stream;
        let (grid, block, shared) = shape(launch::rope(n_heads, head_dim)?);
        // SAFETY: the module contract; n_heads × head_dim values behind x.
        unsafe {
            launch!(f<<<grid, block, shared, stream>>>(
                x,
                int("head_dim", head_dim)?,
                int("pos", pos)?,
                base,
                launch::rope_style_code(style)
            ))
            .map_err(cuda("launching rope"))
        }
    }

    /// An in-place element-wise kernel `name(float* a, const float* b, int n)`:
    /// `silu_mul` or `add_inplace`.
    pub fn binary_on(&self, name: &'static str, a: F32Ptr, b: F32Ptr, n: usize) -> Result<()> {
        let f = self.function("elementwise", name)?;
        let stream = &self.stream;
        let (grid, block, shared) = shape(launch::elementwise(n)?);
        // SAFETY: the module contract; n values behind a and b.
        unsafe {
            launch!(f<<<grid, block, shared, stream>>>(a, b, int("n", n)?))
                .map_err(|e| Error::Cuda(format!("launching {name}: {e}")))
        }
    }

    /// Decode attention of `n_heads` query heads over `n_pos` cached positions (rows of
    /// `kv_stride` values) into `out`.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_on(
        &self,
        q: F32Ptr,
        keys: F32Ptr,
        values: F32Ptr,
        out: F32Ptr,
        n_pos: usize,
        [n_heads, n_kv_heads, head_dim]: [usize; 3],
        kv_stride: usize,
    ) -> Result<()> {
        let (grid, block, shared) = shape(launch::attention_decode(n_heads, head_dim)?);
        let f = self.function("attention", "attention_decode")?;
        let stream = &self.stream;
        // SAFETY: the module contract; n_pos × kv_stride values behind keys and values,
        // n_heads × head_dim behind q and out.
        unsafe {
            launch!(f<<<grid, block, shared, stream>>>(
                q,
                keys,
                values,
                out,
                int("n_pos", n_pos)?,
                int("n_heads", n_heads)?,
                int("n_kv_heads", n_kv_heads)?,
                int("head_dim", head_dim)?,
                int("kv_stride", kv_stride)?
            ))
            .map_err(cuda("launching attention_decode"))
        }
    }

    /// The sparse FFN over `chunks` of a layer laid out as `layout`: activations into `h`
    /// (`n_ff` values; only the listed chunks' neurons written), their down contributions
    /// added to `acc` (`d_model` values), kept neurons added to `active` (may be null).
    #[allow(clippy::too_many_arguments)]
    pub fn ffn_gathered(
        &self,
        layout: &ChunkLayout,
        chunks: GatheredChunks,
        activation: FfnActivation,
        threshold: f32,
        x: F32Ptr,
        h: F32Ptr,
        acc: F32Ptr,
        active: DevicePointer<u32>,
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
        // SAFETY: the module contract; every listed chunk holds its neurons' bundles as
        // `layout` describes, x holds d_model values, h n_ff, acc d_model. The down launch
        // follows the gate/up launch on the same stream, so it reads the h that one wrote.
        unsafe {
            launch!(gate_up<<<gate_up_grid, gate_up_block, gate_up_shared, stream>>>(
                chunks.ptrs,
                chunks.index,
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
                x,
                h,
                active
            ))
            .map_err(cuda("launching ffn_gate_up_gathered"))?;
            launch!(down<<<down_grid, down_block, down_shared, stream>>>(
                chunks.ptrs,
                chunks.index,
                a.n_chunks,
                a.chunk_neurons,
                a.n_ff,
                a.d_model,
                a.bundle_bytes,
                a.down_at,
                a.down_dtype,
                h,
                acc
            ))
            .map_err(cuda("launching ffn_down_gathered"))
        }
    }

    /// The index of the largest of `n` logits (the lowest among equals) into `out`.
    pub fn argmax_on(&self, logits: F32Ptr, n: usize, out: DevicePointer<u32>) -> Result<()> {
        let f = self.function("sample", "argmax")?;
        let stream = &self.stream;
        let (grid, block, shared) = shape(launch::sampling());
        // SAFETY: the module contract; n values behind logits, one behind out.
        unsafe {
            launch!(f<<<grid, block, shared, stream>>>(logits, int("n", n)?, out))
                .map_err(cuda("launching argmax"))
        }
    }

    /// The `k` largest of `n` logits, largest first, into `out_v` and `out_i`.
    pub fn top_k_on(
        &self,
        logits: F32Ptr,
        n: usize,
        k: usize,
        out_v: F32Ptr,
        out_i: DevicePointer<u32>,
    ) -> Result<()> {
        let f = self.function("sample", "top_k")?;
        let stream = &self.stream;
        let (grid, block, shared) = shape(launch::sampling());
        // SAFETY: the module contract; n values behind logits, k behind out_v and out_i.
        unsafe {
            launch!(f<<<grid, block, shared, stream>>>(
                logits,
                int("n", n)?,
                int("k", k)?,
                out_v,
                out_i
            ))
            .map_err(cuda("launching top_k"))
        }
    }
}
