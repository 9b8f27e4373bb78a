//! Typed launches of the `cuda-kernels/` kernels on device pointers, queued on the backend's
//! stream (nothing here waits). Grid and block sizes follow each kernel's comment in
//! `cuda-kernels/src/`.
//!
//! Safety contract of every launcher: the pointers are device (or mapped host) memory of this
//! context holding at least the sizes the kernel's comment names for the given arguments, and
//! stay alive until the stream has run the kernel. The callers (`ops.rs`, `session.rs`) keep
//! their buffers alive across a synchronisation of the stream.

use cust::memory::DevicePointer;
use cust::prelude::*;

use super::{CudaBackend, cuda, dtype_code};
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

/// The kernel's `int`, or an error naming the argument that does not fit.
fn int(what: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::InvalidArgument {
        arg: what,
        reason: format!("{v} does not fit a kernel's int"),
    })
}

fn grid(what: &'static str, v: usize) -> Result<u32> {
    u32::try_from(v.max(1)).map_err(|_| Error::InvalidArgument {
        arg: what,
        reason: format!("{v} blocks"),
    })
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
        // SAFETY: the module contract above; rows × n values behind out and x, n behind weight.
        unsafe {
            launch!(f<<<grid("rows", rows)?, 256, 0, stream>>>(out, x, weight, int("n", n)?, eps))
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
        // SAFETY: the module contract; w holds rows × row_bytes(cols), x cols, y and bias rows.
        unsafe {
            launch!(f<<<grid("rows", rows.div_ceil(8))?, 256, 0, stream>>>(
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
        let style = match style {
            RopeStyle::AdjacentPairs => 0i32,
            RopeStyle::HalfSplit => 1,
        };
        let threads = grid("head_dim", (head_dim / 2).next_multiple_of(32))?;
        // SAFETY: the module contract; n_heads × head_dim values behind x.
        unsafe {
            launch!(f<<<grid("n_heads", n_heads)?, threads, 0, stream>>>(
                x,
                int("head_dim", head_dim)?,
                int("pos", pos)?,
                base,
                style
            ))
            .map_err(cuda("launching rope"))
        }
    }

    /// An in-place element-wise kernel `name(float* a, const float* b, int n)`:
    /// `silu_mul` or `add_inplace`.
    pub fn binary_on(&self, name: &'static str, a: F32Ptr, b: F32Ptr, n: usize) -> Result<()> {
        let f = self.function("elementwise", name)?;
        let stream = &self.stream;
        // SAFETY: the module contract; n values behind a and b.
        unsafe {
            launch!(f<<<grid("n", n.div_ceil(256))?, 256, 0, stream>>>(a, b, int("n", n)?))
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
        if head_dim > 256 || !head_dim.is_multiple_of(32) {
            return Err(Error::InvalidArgument {
                arg: "head_dim",
                reason: format!("{head_dim}: the kernel takes multiples of 32 up to 256"),
            });
        }
        let f = self.function("attention", "attention_decode")?;
        let stream = &self.stream;
        // SAFETY: the module contract; n_pos × kv_stride values behind keys and values,
        // n_heads × head_dim behind q and out.
        unsafe {
            launch!(f<<<grid("n_heads", n_heads)?, 128, 0, stream>>>(
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
        let l = layout;
        let act = match activation {
            FfnActivation::Silu => 0i32,
            FfnActivation::Relu => 1,
            FfnActivation::GeluTanh => {
                return Err(Error::InvalidArgument {
                    arg: "activation",
                    reason: "the CUDA FFN kernels have no GeGLU yet".into(),
                });
            }
        };
        let (n, cn, n_ff, d) = (
            int("chunks", chunks.n)?,
            int("chunk_neurons", l.chunk_neurons)?,
            int("n_ff", l.n_ff)?,
            int("d_model", l.d_model)?,
        );
        let (bundle, up_at, down_at) = (
            int("bundle_bytes", l.bundle_bytes)?,
            int("up_at", l.up_at)?,
            int("down_at", l.down_at)?,
        );
        let rows_grid = (
            grid("chunk_neurons", l.chunk_neurons.div_ceil(8))?,
            n as u32,
        );
        let cols_grid = (grid("d_model", l.d_model.div_ceil(256))?, n as u32);
        let gate_up = self.function("ffn", "ffn_gate_up_gathered")?;
        let down = self.function("ffn", "ffn_down_gathered")?;
        let stream = &self.stream;
        let (gate_dtype, up_dtype, down_dtype) = (
            dtype_code(l.gate_dtype),
            dtype_code(l.up_dtype),
            dtype_code(l.down_dtype),
        );
        // SAFETY: the module contract; every listed chunk holds its neurons' bundles as
        // `layout` describes, x holds d_model values, h n_ff, acc d_model. The down launch
        // follows the gate/up launch on the same stream, so it reads the h that one wrote.
        unsafe {
            launch!(gate_up<<<rows_grid, 256, 0, stream>>>(
                chunks.ptrs,
                chunks.index,
                n,
                cn,
                n_ff,
                d,
                bundle,
                up_at,
                gate_dtype,
                up_dtype,
                act,
                threshold,
                x,
                h,
                active
            ))
            .map_err(cuda("launching ffn_gate_up_gathered"))?;
            launch!(down<<<cols_grid, 256, 0, stream>>>(
                chunks.ptrs,
                chunks.index,
                n,
                cn,
                n_ff,
                d,
                bundle,
                down_at,
                down_dtype,
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
        // SAFETY: the module contract; n values behind logits, one behind out.
        unsafe {
            launch!(f<<<1, 1024, 0, stream>>>(logits, int("n", n)?, out))
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
        // SAFETY: the module contract; n values behind logits, k behind out_v and out_i.
        unsafe {
            launch!(f<<<1, 1024, 0, stream>>>(
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
