//! The CUDA kernels of `cuda-kernels/src/`, compiled as C++ for the host (`cuda_host.h`: each
//! CUDA thread a host thread, `__syncthreads` and warp shuffles as barriers) and driven through
//! [`KernelOps`], so the engine's conformance bodies check their indexing and arithmetic on a
//! machine without a GPU (`cuda-kernels/host-check`, `tests/conformance.rs`).
//!
//! [`HostKernels`] is the CUDA backend's `ops.rs` with host vectors for device buffers: the same
//! argument checks (`backend::ops`), the same launch geometry and argument codes
//! (`backend::launch`), the same kernels. A test harness only; nothing ships it.

use leanstream_engine::backend::launch::{self, Launch, dtype_code, int};
use leanstream_engine::backend::ops::{
    AttentionShape, FfnChunks, FfnOutput, KernelOps, Matrix, check_ffn, check_heads, check_rows,
    check_top_k, expect_len,
};
use leanstream_engine::model::RopeStyle;
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
        base: f32,
        style: i32,
    ) -> i32;
    fn ls_host_silu_mul(g: Geometry, gate: *mut f32, up: *const f32, n: i32) -> i32;
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

/// The kernels of `cuda-kernels/src/` running on the host's CPU.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostKernels;

impl KernelOps for HostKernels {
    fn name(&self) -> String {
        "cuda kernels on the host".into()
    }

    fn rmsnorm(&self, x: &[f32], weight: &[f32], eps: f32) -> Result<Vec<f32>> {
        let rows = check_rows(x, weight)?;
        let mut out = vec![0.0; x.len()];
        let g = launch::rmsnorm(rows)?.into();
        // SAFETY: rows × n values behind out and x, n behind weight; the call returns after the
        // kernel has finished with them.
        let code = unsafe {
            ls_host_rmsnorm(
                g,
                out.as_mut_ptr(),
                x.as_ptr(),
                weight.as_ptr(),
                int("n", weight.len())?,
                eps,
            )
        };
        launched("rmsnorm", code)?;
        Ok(out)
    }

    fn silu_mul(&self, gate: &[f32], up: &[f32]) -> Result<Vec<f32>> {
        expect_len("up", up, gate.len())?;
        let mut out = gate.to_vec();
        let (g, n) = (launch::elementwise(out.len())?.into(), int("n", out.len())?);
        // SAFETY: n values behind both pointers, for the duration of the call.
        let code = unsafe { ls_host_silu_mul(g, out.as_mut_ptr(), up.as_ptr(), n) };
        launched("silu_mul", code)?;
        Ok(out)
    }

    fn add(&self, a: &[f32], b: &[f32]) -> Result<Vec<f32>> {
        expect_len("b", b, a.len())?;
        let mut out = a.to_vec();
        let (g, n) = (launch::elementwise(out.len())?.into(), int("n", out.len())?);
        // SAFETY: n values behind both pointers, for the duration of the call.
        let code = unsafe { ls_host_add_inplace(g, out.as_mut_ptr(), b.as_ptr(), n) };
        launched("add_inplace", code)?;
        Ok(out)
    }

    fn matvec(&self, w: Matrix<'_>, x: &[f32], bias: Option<&[f32]>) -> Result<Vec<f32>> {
        w.check(x, bias)?;
        let mut y = vec![0.0; w.rows];
        let g = launch::matvec(w.rows)?.into();
        let bias = bias.map_or(std::ptr::null(), <[f32]>::as_ptr);
        // SAFETY: `check` above: w holds rows × row_bytes(cols), x cols values, bias (or null)
        // and y rows; all outlive the call.
        let code = unsafe {
            ls_host_matvec(
                g,
                w.bytes.as_ptr(),
                dtype_code(w.dtype),
                int("rows", w.rows)?,
                int("cols", w.cols)?,
                x.as_ptr(),
                bias,
                y.as_mut_ptr(),
            )
        };
        launched("matvec", code)?;
        Ok(y)
    }

    fn rope(
        &self,
        x: &[f32],
        head_dim: usize,
        pos: usize,
        base: f32,
        style: RopeStyle,
    ) -> Result<Vec<f32>> {
        let heads = check_heads(x, head_dim)?;
        let mut out = x.to_vec();
        let g = launch::rope(heads, head_dim)?.into();
        // SAFETY: heads × head_dim values behind out, for the duration of the call.
        let code = unsafe {
            ls_host_rope(
                g,
                out.as_mut_ptr(),
                int("head_dim", head_dim)?,
                int("pos", pos)?,
                base,
                launch::rope_style_code(style),
            )
        };
        launched("rope", code)?;
        Ok(out)
    }

    fn attention_decode(
        &self,
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        shape: AttentionShape,
    ) -> Result<Vec<f32>> {
        shape.check(q, keys, values)?;
        let mut out = vec![0.0; q.len()];
        let g = launch::attention_decode(shape.n_heads, shape.head_dim)?.into();
        // SAFETY: `check` above: n_pos × kv_dim values behind keys and values, n_heads ×
        // head_dim behind q and out; all outlive the call.
        let code = unsafe {
            ls_host_attention_decode(
                g,
                q.as_ptr(),
                keys.as_ptr(),
                values.as_ptr(),
                out.as_mut_ptr(),
                int("n_pos", shape.n_pos)?,
                int("n_heads", shape.n_heads)?,
                int("n_kv_heads", shape.n_kv_heads)?,
                int("head_dim", shape.head_dim)?,
                int("kv_stride", shape.kv_dim())?,
            )
        };
        launched("attention_decode", code)?;
        Ok(out)
    }

    fn ffn_chunks(&self, f: &FfnChunks<'_>) -> Result<FfnOutput> {
        check_ffn(f)?;
        let l = f.layout;
        let (mut h, mut out, mut active) = (vec![0.0; l.n_ff], vec![0.0; l.d_model], 0u32);
        if f.chunks.is_empty() {
            return Ok(FfnOutput { h, out, active: 0 });
        }
        let a = launch::ffn(l, f.chunks.len(), f.activation)?;
        let ptrs: Vec<*const u8> = f.chunks.iter().map(|(_, bytes)| bytes.as_ptr()).collect();
        let index: Vec<u32> = f.chunks.iter().map(|&(c, _)| c as u32).collect();
        // SAFETY: `check_ffn` above: every listed chunk holds its neurons' bundles as the layout
        // describes, x holds d_model values, h n_ff, out d_model; all outlive both calls, and
        // the second starts after the first has finished writing h.
        let (gate_up, down) = unsafe {
            let gate_up = ls_host_ffn_gate_up_gathered(
                a.gate_up.into(),
                ptrs.as_ptr(),
                index.as_ptr(),
                a.n_chunks,
                a.chunk_neurons,
                a.n_ff,
                a.d_model,
                a.bundle_bytes,
                a.up_at,
                a.gate_dtype,
                a.up_dtype,
                a.act,
                f.threshold,
                f.x.as_ptr(),
                h.as_mut_ptr(),
                &mut active,
            );
            let down = ls_host_ffn_down_gathered(
                a.down.into(),
                ptrs.as_ptr(),
                index.as_ptr(),
                a.n_chunks,
                a.chunk_neurons,
                a.n_ff,
                a.d_model,
                a.bundle_bytes,
                a.down_at,
                a.down_dtype,
                h.as_ptr(),
                out.as_mut_ptr(),
            );
            (gate_up, down)
        };
        launched("ffn_gate_up_gathered", gate_up)?;
        launched("ffn_down_gathered", down)?;
        Ok(FfnOutput {
            h,
            out,
            active: active as usize,
        })
    }

    fn argmax(&self, logits: &[f32]) -> Result<u32> {
        check_top_k(logits, 1)?;
        let mut out = 0u32;
        // SAFETY: n values behind logits, one behind out, for the duration of the call.
        let code = unsafe {
            ls_host_argmax(
                launch::sampling().into(),
                logits.as_ptr(),
                int("n", logits.len())?,
                &mut out,
            )
        };
        launched("argmax", code)?;
        Ok(out)
    }

    fn top_k(&self, logits: &[f32], k: usize) -> Result<Vec<(u32, f32)>> {
        check_top_k(logits, k)?;
        let (mut v, mut i) = (vec![0.0f32; k], vec![0u32; k]);
        // SAFETY: n values behind logits, k behind v and i, for the duration of the call.
        let code = unsafe {
            ls_host_top_k(
                launch::sampling().into(),
                logits.as_ptr(),
                int("n", logits.len())?,
                int("k", k)?,
                v.as_mut_ptr(),
                i.as_mut_ptr(),
            )
        };
        launched("top_k", code)?;
        Ok(i.into_iter().zip(v).collect())
    }
}
