//! How the kernels of `cuda-kernels/src/` are launched: grid, block and dynamic shared memory of
//! each, and the kernels' integer codes for the engine's types. The one owner of these numbers:
//! the CUDA backend (`cuda/kernels.rs`) launches with them, and so does the host build of the
//! same kernels (`cuda-kernels/host/`, which runs them on the CPU in CI). Needs no CUDA.
//!
//! Each shape follows the kernel's header comment in its source (`Grid: ...; block: ...`).

use crate::model::lsm::ChunkLayout;
use crate::model::{FfnActivation, RopeStyle};
use crate::quant::DType;
use crate::{Error, Result};

/// One kernel launch: blocks in x, y, z, threads per block (x only; no kernel uses more) and
/// bytes of dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub shared_bytes: u32,
}

impl Launch {
    fn new(grid: (u32, u32, u32), block: u32) -> Launch {
        Launch {
            grid,
            block,
            shared_bytes: 0,
        }
    }
}

/// The kernel's `int`, or an error naming the argument that does not fit.
pub fn int(what: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::InvalidArgument {
        arg: what,
        reason: format!("{v} does not fit a kernel's int"),
    })
}

/// A grid dimension of `v` blocks (at least one).
fn blocks(what: &'static str, v: usize) -> Result<u32> {
    u32::try_from(v.max(1)).map_err(|_| Error::InvalidArgument {
        arg: what,
        reason: format!("{v} blocks"),
    })
}

/// The kernel type code of `dtype` (`cuda-kernels/src/common.cuh`: the order of [`DType::ALL`]).
pub fn dtype_code(dtype: DType) -> i32 {
    DType::ALL
        .iter()
        .position(|&d| d == dtype)
        .expect("every DType is in DType::ALL") as i32
}

/// The `style` argument of `rope`: 0 AdjacentPairs, 1 HalfSplit.
pub fn rope_style_code(style: RopeStyle) -> i32 {
    match style {
        RopeStyle::AdjacentPairs => 0,
        RopeStyle::HalfSplit => 1,
    }
}

/// The `act` argument of `gate_mul` and `ffn_gate_up_gathered` (`common.cuh`
/// `ls_activation`): 0 SiLU, 1 ReLU, 2 GELU (tanh approximation).
pub fn act_code(activation: FfnActivation) -> i32 {
    match activation {
        FfnActivation::Silu => 0,
        FfnActivation::Relu => 1,
        FfnActivation::GeluTanh => 2,
    }
}

/// `rmsnorm`: one block of 256 threads per row.
pub fn rmsnorm(rows: usize) -> Result<Launch> {
    Ok(Launch::new((blocks("rows", rows)?, 1, 1), 256))
}

/// `matvec`: 8 warps a block, one warp per row.
pub fn matvec(rows: usize) -> Result<Launch> {
    Ok(Launch::new((blocks("rows", rows.div_ceil(8))?, 1, 1), 256))
}

/// `rope`: one block per head, one thread per pair (rounded up to whole warps).
pub fn rope(n_heads: usize, head_dim: usize) -> Result<Launch> {
    let threads = blocks("head_dim", (head_dim / 2).next_multiple_of(32))?;
    Ok(Launch::new((blocks("n_heads", n_heads)?, 1, 1), threads))
}

/// `gate_mul` and `add_inplace`: one thread per element, 256 a block.
pub fn elementwise(n: usize) -> Result<Launch> {
    Ok(Launch::new((blocks("n", n.div_ceil(256))?, 1, 1), 256))
}

/// `attention_decode`: one block of 4 warps per query head; `head_dim` up to 256.
pub fn attention_decode(n_heads: usize, head_dim: usize) -> Result<Launch> {
    if head_dim == 0 || head_dim > 256 {
        return Err(Error::InvalidArgument {
            arg: "head_dim",
            reason: format!("{head_dim}: the kernel takes 1 to 256"),
        });
    }
    Ok(Launch::new((blocks("n_heads", n_heads)?, 1, 1), 128))
}

/// `argmax` and `top_k`: one block of 1024 threads.
pub fn sampling() -> Launch {
    Launch::new((1, 1, 1), 1024)
}

/// The launches and scalar arguments of `ffn_gate_up_gathered` then `ffn_down_gathered` over
/// `n_chunks` listed chunks of a layer, in the kernels' argument order.
#[derive(Clone, Copy, Debug)]
pub struct Ffn {
    /// 8 warps a block, one warp per neuron: (neurons / 8, chunks).
    pub gate_up: Launch,
    /// One thread per output element: (d_model / 256, chunks).
    pub down: Launch,
    pub n_chunks: i32,
    pub chunk_neurons: i32,
    pub n_ff: i32,
    pub d_model: i32,
    pub bundle_bytes: i32,
    pub up_at: i32,
    pub down_at: i32,
    pub gate_dtype: i32,
    pub up_dtype: i32,
    pub down_dtype: i32,
    /// 0 SiLU, 1 ReLU, 2 GELU (tanh approximation).
    pub act: i32,
}

/// The FFN launches for `n_chunks` (≥ 1) chunks of `layout`.
pub fn ffn(layout: &ChunkLayout, n_chunks: usize, activation: FfnActivation) -> Result<Ffn> {
    let l = layout;
    let act = act_code(activation);
    let chunks = blocks("chunks", n_chunks)?;
    let neuron_blocks = blocks("chunk_neurons", l.chunk_neurons.div_ceil(8))?;
    let output_blocks = blocks("d_model", l.d_model.div_ceil(256))?;
    Ok(Ffn {
        gate_up: Launch::new((neuron_blocks, chunks, 1), 256),
        down: Launch::new((output_blocks, chunks, 1), 256),
        n_chunks: int("chunks", n_chunks)?,
        chunk_neurons: int("chunk_neurons", l.chunk_neurons)?,
        n_ff: int("n_ff", l.n_ff)?,
        d_model: int("d_model", l.d_model)?,
        bundle_bytes: int("bundle_bytes", l.bundle_bytes)?,
        up_at: int("up_at", l.up_at)?,
        down_at: int("down_at", l.down_at)?,
        gate_dtype: dtype_code(l.gate_dtype),
        up_dtype: dtype_code(l.up_dtype),
        down_dtype: dtype_code(l.down_dtype),
        act,
    })
}
