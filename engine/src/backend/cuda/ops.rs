//! [`KernelOps`] for the CUDA backend: copy the inputs to the device, launch, wait, copy the
//! result back. Argument checks are the CPU backend's (`backend::ops`), so both refuse the same
//! inputs.

use cust::memory::DevicePointer;

use super::CudaBackend;
use super::kernels::GatheredChunks;
use super::memory::{download, upload, zeros};
use crate::Result;
use crate::backend::ops::{
    AttentionShape, FfnChunks, FfnOutput, KernelOps, Matrix, check_ffn, check_heads, check_rows,
    check_top_k, expect_len,
};
use crate::model::RopeStyle;

impl KernelOps for CudaBackend {
    fn name(&self) -> String {
        format!("cuda ({})", self.device())
    }

    fn rmsnorm(&self, x: &[f32], weight: &[f32], eps: f32) -> Result<Vec<f32>> {
        let rows = check_rows(x, weight)?;
        let (dx, dw) = (upload("x", x)?, upload("weight", weight)?);
        let out = zeros::<f32>("out", x.len())?;
        let p = |b: &cust::memory::DeviceBuffer<f32>| b.as_device_ptr();
        self.rmsnorm_on(p(&out), p(&dx), p(&dw), weight.len(), rows, eps)?;
        self.sync()?;
        download(&out, x.len())
    }

    fn silu_mul(&self, gate: &[f32], up: &[f32]) -> Result<Vec<f32>> {
        self.binary(gate, up, "silu_mul")
    }

    fn add(&self, a: &[f32], b: &[f32]) -> Result<Vec<f32>> {
        self.binary(a, b, "add_inplace")
    }

    fn matvec(&self, w: Matrix<'_>, x: &[f32], bias: Option<&[f32]>) -> Result<Vec<f32>> {
        w.check(x, bias)?;
        let (dw, dx) = (upload("w", w.bytes)?, upload("x", x)?);
        let db = bias.map(|b| upload("bias", b)).transpose()?;
        let y = zeros::<f32>("y", w.rows)?;
        let bias_ptr = db
            .as_ref()
            .map_or(DevicePointer::null(), |b| b.as_device_ptr());
        self.matvec_on(
            dw.as_device_ptr(),
            w.dtype,
            w.rows,
            w.cols,
            dx.as_device_ptr(),
            bias_ptr,
            y.as_device_ptr(),
        )?;
        self.sync()?;
        download(&y, w.rows)
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
        let dx = upload("x", x)?;
        self.rope_on(dx.as_device_ptr(), heads, head_dim, pos, base, style)?;
        self.sync()?;
        download(&dx, x.len())
    }

    fn attention_decode(
        &self,
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        shape: AttentionShape,
    ) -> Result<Vec<f32>> {
        shape.check(q, keys, values)?;
        let (dq, dk, dv) = (
            upload("q", q)?,
            upload("keys", keys)?,
            upload("values", values)?,
        );
        let out = zeros::<f32>("out", q.len())?;
        self.attention_on(
            dq.as_device_ptr(),
            dk.as_device_ptr(),
            dv.as_device_ptr(),
            out.as_device_ptr(),
            shape.n_pos,
            [shape.n_heads, shape.n_kv_heads, shape.head_dim],
            shape.kv_dim(),
        )?;
        self.sync()?;
        download(&out, q.len())
    }

    fn ffn_chunks(&self, f: &FfnChunks<'_>) -> Result<FfnOutput> {
        check_ffn(f)?;
        let l = f.layout;
        // Each listed chunk in its own device buffer, as the cache's slots would be scattered.
        let bufs = f
            .chunks
            .iter()
            .map(|(_, bytes)| upload("chunk", bytes))
            .collect::<Result<Vec<_>>>()?;
        let ptrs: Vec<u64> = bufs.iter().map(|b| b.as_device_ptr().as_raw()).collect();
        let index: Vec<u32> = f.chunks.iter().map(|&(c, _)| c as u32).collect();
        let (dptrs, dindex) = (
            upload("chunk pointers", &ptrs)?,
            upload("chunk index", &index)?,
        );
        let dx = upload("x", f.x)?;
        let h = zeros::<f32>("h", l.n_ff)?;
        let acc = zeros::<f32>("acc", l.d_model)?;
        let active = zeros::<u32>("active", 1)?;
        let chunks = GatheredChunks {
            ptrs: dptrs.as_device_ptr(),
            index: dindex.as_device_ptr(),
            n: f.chunks.len(),
        };
        self.ffn_gathered(
            l,
            chunks,
            f.activation,
            f.threshold,
            dx.as_device_ptr(),
            h.as_device_ptr(),
            acc.as_device_ptr(),
            active.as_device_ptr(),
        )?;
        self.sync()?;
        Ok(FfnOutput {
            h: download(&h, l.n_ff)?,
            out: download(&acc, l.d_model)?,
            active: download(&active, 1)?[0] as usize,
        })
    }

    fn argmax(&self, logits: &[f32]) -> Result<u32> {
        check_top_k(logits, 1)?;
        let dl = upload("logits", logits)?;
        let out = zeros::<u32>("out", 1)?;
        self.argmax_on(dl.as_device_ptr(), logits.len(), out.as_device_ptr())?;
        self.sync()?;
        Ok(download(&out, 1)?[0])
    }

    fn top_k(&self, logits: &[f32], k: usize) -> Result<Vec<(u32, f32)>> {
        check_top_k(logits, k)?;
        let dl = upload("logits", logits)?;
        let (out_v, out_i) = (zeros::<f32>("values", k)?, zeros::<u32>("indices", k)?);
        self.top_k_on(
            dl.as_device_ptr(),
            logits.len(),
            k,
            out_v.as_device_ptr(),
            out_i.as_device_ptr(),
        )?;
        self.sync()?;
        let (v, i) = (download(&out_v, k)?, download(&out_i, k)?);
        Ok(i.into_iter().zip(v).collect())
    }
}

impl CudaBackend {
    /// Runs the in-place element-wise kernel `name` on copies of `a` and `b`.
    fn binary(&self, a: &[f32], b: &[f32], name: &'static str) -> Result<Vec<f32>> {
        expect_len("b", b, a.len())?;
        let (da, db) = (upload("a", a)?, upload("b", b)?);
        self.binary_on(name, da.as_device_ptr(), db.as_device_ptr(), a.len())?;
        self.sync()?;
        download(&da, a.len())
    }
}
