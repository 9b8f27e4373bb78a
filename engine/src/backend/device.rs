//! A GPU as the engine sees it: memory at [`Addr`]esses, copies to and from the host, and one
//! launch per kernel of `cuda-kernels/src/`, queued in order.
//!
//! Two devices implement it: the CUDA backend (`backend::cuda`, feature `cuda`), and the same
//! kernels built as C++ for the host (`cuda-kernels/host/`, a test harness). Everything written
//! against this trait — the GPU's forward pass (`forward::gpu`) and the kernels' conformance
//! ([`KernelOps`] for every device, below) — therefore runs on the CPU in the test command,
//! through the kernels' own source, before it meets a GPU.
//!
//! Launch geometry and the kernels' argument codes are `backend::launch`'s; each method's
//! arguments follow the kernel's header comment in its source.

use std::fmt::Debug;
use std::marker::PhantomData;

use super::ops::{
    AttentionShape, FfnChunks, FfnOutput, KernelOps, Matrix, check_ffn, check_rope, check_rows,
    check_top_k, expect_len, invalid,
};
use crate::Result;
use crate::model::lsm::ChunkLayout;
use crate::model::{FfnActivation, RopeStyle};
use crate::quant::DType;

/// A byte address in a device's memory (for the host build, a host pointer). 0 is null: the
/// kernels' optional arguments.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Addr(pub u64);

impl Addr {
    pub const NULL: Addr = Addr(0);

    /// The address `n` values of `T` further on.
    pub fn offset<T>(self, n: usize) -> Addr {
        Addr(self.0 + (n * size_of::<T>()) as u64)
    }
}

/// Memory a device allocated, freed when dropped.
pub trait Allocation: Send + Sync + Debug {
    fn addr(&self) -> Addr;
}

/// Host memory mapped for a device's kernels to read in place ([`Device::map_host`]), until
/// dropped.
pub trait HostMapping: Send + Sync + Debug {
    /// The device address of the host byte at `host`, if the mapped range holds it.
    fn device_addr(&self, host: *const u8) -> Option<Addr>;
}

/// The neuron chunks of one [`Device::ffn_gathered`] launch.
#[derive(Clone, Copy, Debug)]
pub struct Gathered {
    /// `n` u64 device addresses, the first byte of each listed chunk.
    pub ptrs: Addr,
    /// `n` u32 chunk indices inside the layer.
    pub index: Addr,
    pub n: usize,
}

/// A GPU: its memory, and the kernels queued on it in order. Copies to the host wait for the
/// kernels queued before them; copies to the device are ordered after them.
///
/// The kernel methods are `unsafe` with one contract, written here once (their `# Safety`
/// sections point to it): every address is null only where the kernel says it may be, and
/// otherwise points into memory of this device that holds at least what the kernel's comment
/// names for the given sizes, and stays allocated until [`Device::sync`] (or a copy to the host)
/// has returned.
pub trait Device: Send + Sync + Debug {
    /// Which device this is, for messages.
    fn name(&self) -> String;
    /// True where the GPU shares the host's memory (Jetson, Orin).
    fn integrated(&self) -> bool;
    /// `bytes` (at least one) of zeroed device memory; `what` names it in errors.
    fn alloc(&self, what: &str, bytes: usize) -> Result<Box<dyn Allocation>>;
    /// Copies `bytes` to the device at `to`, after the work queued before.
    ///
    /// # Safety
    /// `to` holds `bytes.len()` bytes of this device's memory.
    unsafe fn write(&self, to: Addr, bytes: &[u8]) -> Result<()>;
    /// Copies device bytes at `from` into `into`, once the work queued before has run.
    ///
    /// # Safety
    /// `from` holds `into.len()` bytes of this device's memory.
    unsafe fn read(&self, from: Addr, into: &mut [u8]) -> Result<()>;
    /// Queues setting `bytes` bytes at `at` to zero.
    ///
    /// # Safety
    /// `at` holds `bytes` bytes of this device's memory.
    unsafe fn zero(&self, at: Addr, bytes: usize) -> Result<()>;
    /// Waits for everything queued.
    fn sync(&self) -> Result<()>;
    /// Maps `len` bytes of host memory at `host` for kernels to read in place, where this
    /// device reads host memory at its own memory's speed (an integrated GPU: the range is
    /// registered and page-locked; the host build: the memory itself). `None` where it does not
    /// (a discrete GPU: copy instead).
    ///
    /// # Safety
    /// The range is one allocation that outlives the mapping and is not mapped twice at once.
    unsafe fn map_host(&self, host: *mut u8, len: usize) -> Result<Option<Box<dyn HostMapping>>>;

    /// `rmsnorm`: `rows` rows of `n` values (`out` may be `x`).
    ///
    /// # Safety
    /// The kernel contract of [`Device`].
    unsafe fn rmsnorm(
        &self,
        out: Addr,
        x: Addr,
        weight: Addr,
        n: usize,
        rows: usize,
        eps: f32,
    ) -> Result<()>;
    /// `matvec`: `y = W x (+ bias)`, `rows` rows of `cols` values of `dtype`; `bias` nullable.
    ///
    /// # Safety
    /// The kernel contract of [`Device`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn matvec(
        &self,
        w: Addr,
        dtype: DType,
        rows: usize,
        cols: usize,
        x: Addr,
        bias: Addr,
        y: Addr,
    ) -> Result<()>;
    /// `rope` in place over `n_heads` heads, with `head_dim / 2` frequencies at `inv_freq`.
    ///
    /// # Safety
    /// The kernel contract of [`Device`].
    unsafe fn rope(
        &self,
        x: Addr,
        n_heads: usize,
        head_dim: usize,
        pos: usize,
        inv_freq: Addr,
        style: RopeStyle,
    ) -> Result<()>;
    /// `gate_mul`: `gate = activation(gate) · up` over `n` values.
    ///
    /// # Safety
    /// The kernel contract of [`Device`].
    unsafe fn gate(&self, activation: FfnActivation, gate: Addr, up: Addr, n: usize) -> Result<()>;
    /// `add_inplace`: `a += b` over `n` values.
    ///
    /// # Safety
    /// The kernel contract of [`Device`].
    unsafe fn add(&self, a: Addr, b: Addr, n: usize) -> Result<()>;
    /// `attention_decode`: positions `shape.first..shape.n_pos` of caches whose positions are
    /// `kv_stride` values apart.
    ///
    /// # Safety
    /// The kernel contract of [`Device`].
    unsafe fn attention(
        &self,
        q: Addr,
        keys: Addr,
        values: Addr,
        out: Addr,
        shape: AttentionShape,
        kv_stride: usize,
    ) -> Result<()>;
    /// `ffn_gate_up_gathered` then `ffn_down_gathered` over `chunks` of a layer laid out as
    /// `layout`: activations into `h`, down contributions added to `acc`, kept neurons counted
    /// into `active` (nullable).
    ///
    /// # Safety
    /// The kernel contract of [`Device`].
    #[allow(clippy::too_many_arguments)]
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
    ) -> Result<()>;
    /// `argmax` of `n` logits into one u32 at `out`.
    ///
    /// # Safety
    /// The kernel contract of [`Device`].
    unsafe fn argmax(&self, logits: Addr, n: usize, out: Addr) -> Result<()>;
    /// `top_k` of `n` logits into `k` f32 at `out_v` and `k` u32 at `out_i`.
    ///
    /// # Safety
    /// The kernel contract of [`Device`].
    unsafe fn top_k(
        &self,
        logits: Addr,
        n: usize,
        k: usize,
        out_v: Addr,
        out_i: Addr,
    ) -> Result<()>;
}

/// The values a device buffer can hold: plain numbers, whose bytes are their value.
pub trait Plain: Copy + Default + Send + 'static {}
impl Plain for f32 {}
impl Plain for u32 {}
impl Plain for u64 {}
impl Plain for u8 {}

fn bytes_of<T: Plain>(v: &[T]) -> &[u8] {
    // SAFETY: `Plain` types have no padding and every byte pattern of them is initialised.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

fn bytes_of_mut<T: Plain>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: as above, and every byte pattern is a valid f32, u32, u64 or u8.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), std::mem::size_of_val(v)) }
}

/// `len` values of `T` in a device's memory.
#[derive(Debug)]
pub struct Buffer<T> {
    mem: Box<dyn Allocation>,
    len: usize,
    _values: PhantomData<T>,
}

impl<T: Plain> Buffer<T> {
    /// `len` zeroed values.
    pub fn zeros(dev: &dyn Device, what: &str, len: usize) -> Result<Buffer<T>> {
        Ok(Buffer {
            mem: dev.alloc(what, (len * size_of::<T>()).max(1))?,
            len,
            _values: PhantomData,
        })
    }

    /// A copy of `values`.
    pub fn upload(dev: &dyn Device, what: &str, values: &[T]) -> Result<Buffer<T>> {
        let b = Buffer::zeros(dev, what, values.len())?;
        b.write(dev, values)?;
        Ok(b)
    }

    /// The first value's address.
    pub fn addr(&self) -> Addr {
        self.mem.addr()
    }

    /// The address of value `i` (at most `len`: the end).
    pub fn at(&self, i: usize) -> Addr {
        assert!(i <= self.len, "value {i} of a buffer of {}", self.len);
        self.addr().offset::<T>(i)
    }

    /// The address of values `i..i + n`; panics unless the buffer holds them (a kernel about to
    /// write `n` values there cannot run past its end).
    pub fn span(&self, i: usize, n: usize) -> Addr {
        assert!(
            i.checked_add(n).is_some_and(|end| end <= self.len),
            "values {i}..{i}+{n} of a buffer of {}",
            self.len
        );
        self.addr().offset::<T>(i)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of device memory held.
    pub fn bytes(&self) -> usize {
        self.len * size_of::<T>()
    }

    /// Copies `values` to the start of the buffer.
    pub fn write(&self, dev: &dyn Device, values: &[T]) -> Result<()> {
        self.check(values.len())?;
        // SAFETY: the buffer holds at least `values.len()` values (checked).
        unsafe { dev.write(self.addr(), bytes_of(values)) }
    }

    /// Copies `values` into the buffer from value `at`.
    pub fn write_at(&self, dev: &dyn Device, at: usize, values: &[T]) -> Result<()> {
        self.check(at.saturating_add(values.len()))?;
        // SAFETY: the buffer holds at least `at + values.len()` values (checked).
        unsafe { dev.write(self.at(at), bytes_of(values)) }
    }

    /// Copies the first `into.len()` values to the host.
    pub fn read(&self, dev: &dyn Device, into: &mut [T]) -> Result<()> {
        self.check(into.len())?;
        // SAFETY: the buffer holds at least `into.len()` values (checked).
        unsafe { dev.read(self.addr(), bytes_of_mut(into)) }
    }

    /// The first `n` values, copied to the host.
    pub fn to_vec(&self, dev: &dyn Device, n: usize) -> Result<Vec<T>> {
        let mut v = vec![T::default(); n];
        self.read(dev, &mut v)?;
        Ok(v)
    }

    /// Queues zeroing the whole buffer.
    pub fn clear(&self, dev: &dyn Device) -> Result<()> {
        // SAFETY: the buffer's own bytes.
        unsafe { dev.zero(self.addr(), self.bytes()) }
    }

    fn check(&self, n: usize) -> Result<()> {
        if n > self.len {
            return Err(invalid(
                "values",
                format!("{n} values for a buffer of {}", self.len),
            ));
        }
        Ok(())
    }
}

/// Every device runs the conformance bodies: copy the inputs over, launch, copy the result back.
/// The argument checks are the CPU backend's (`backend::ops`), so every backend refuses the same
/// inputs.
impl<D: Device> KernelOps for D {
    fn name(&self) -> String {
        Device::name(self)
    }

    fn rmsnorm(&self, x: &[f32], weight: &[f32], eps: f32) -> Result<Vec<f32>> {
        let rows = check_rows(x, weight)?;
        let (dx, dw) = (
            Buffer::upload(self, "x", x)?,
            Buffer::upload(self, "w", weight)?,
        );
        // SAFETY: rows × n values behind x (and out, the same buffer), n behind weight.
        unsafe {
            let n = weight.len();
            Device::rmsnorm(self, dx.addr(), dx.addr(), dw.addr(), n, rows, eps)?;
        }
        dx.to_vec(self, x.len())
    }

    fn gate(&self, activation: FfnActivation, gate: &[f32], up: &[f32]) -> Result<Vec<f32>> {
        // SAFETY: n values behind both (checked by `binary`).
        binary(self, gate, up, |g, u, n| unsafe {
            Device::gate(self, activation, g, u, n)
        })
    }

    fn add(&self, a: &[f32], b: &[f32]) -> Result<Vec<f32>> {
        // SAFETY: n values behind both (checked by `binary`).
        binary(self, a, b, |a, b, n| unsafe { Device::add(self, a, b, n) })
    }

    fn matvec(&self, w: Matrix<'_>, x: &[f32], bias: Option<&[f32]>) -> Result<Vec<f32>> {
        w.check(x, bias)?;
        let (dw, dx) = (
            Buffer::upload(self, "w", w.bytes)?,
            Buffer::upload(self, "x", x)?,
        );
        let db = bias.map(|b| Buffer::upload(self, "bias", b)).transpose()?;
        let y = Buffer::<f32>::zeros(self, "y", w.rows)?;
        let b = db.as_ref().map_or(Addr::NULL, Buffer::addr);
        // SAFETY: `check` above: w holds rows × row_bytes(cols), x cols, bias (or null) and y
        // rows values.
        unsafe {
            Device::matvec(
                self,
                dw.addr(),
                w.dtype,
                w.rows,
                w.cols,
                dx.addr(),
                b,
                y.addr(),
            )?;
        }
        y.to_vec(self, w.rows)
    }

    fn rope(
        &self,
        x: &[f32],
        head_dim: usize,
        pos: usize,
        inv_freq: &[f32],
        style: RopeStyle,
    ) -> Result<Vec<f32>> {
        let heads = check_rope(x, head_dim, inv_freq)?;
        let (dx, df) = (
            Buffer::upload(self, "x", x)?,
            Buffer::upload(self, "inv_freq", inv_freq)?,
        );
        // SAFETY: heads × head_dim values behind x, head_dim / 2 behind inv_freq.
        unsafe { Device::rope(self, dx.addr(), heads, head_dim, pos, df.addr(), style)? };
        dx.to_vec(self, x.len())
    }

    fn attention_decode(
        &self,
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        shape: AttentionShape,
    ) -> Result<Vec<f32>> {
        shape.check(q, keys, values)?;
        let dq = Buffer::upload(self, "q", q)?;
        let (dk, dv) = (
            Buffer::upload(self, "keys", keys)?,
            Buffer::upload(self, "values", values)?,
        );
        let out = Buffer::<f32>::zeros(self, "out", q.len())?;
        // SAFETY: `check` above: n_pos × kv_dim values behind keys and values, n_heads ×
        // head_dim behind q and out.
        unsafe {
            Device::attention(
                self,
                dq.addr(),
                dk.addr(),
                dv.addr(),
                out.addr(),
                shape,
                shape.kv_dim(),
            )?;
        }
        out.to_vec(self, q.len())
    }

    fn ffn_chunks(&self, f: &FfnChunks<'_>) -> Result<FfnOutput> {
        check_ffn(f)?;
        let l = f.layout;
        // Each listed chunk in its own buffer, as the cache's slots would be scattered.
        let bufs = f
            .chunks
            .iter()
            .map(|(_, bytes)| Buffer::upload(self, "chunk", bytes))
            .collect::<Result<Vec<_>>>()?;
        let ptrs: Vec<u64> = bufs.iter().map(|b| b.addr().0).collect();
        let index: Vec<u32> = f.chunks.iter().map(|&(c, _)| c as u32).collect();
        let (dptrs, dindex) = (
            Buffer::upload(self, "chunk pointers", &ptrs)?,
            Buffer::upload(self, "chunk index", &index)?,
        );
        let dx = Buffer::upload(self, "x", f.x)?;
        let h = Buffer::<f32>::zeros(self, "h", l.n_ff)?;
        let acc = Buffer::<f32>::zeros(self, "acc", l.d_model)?;
        let active = Buffer::<u32>::zeros(self, "active", 1)?;
        let chunks = Gathered {
            ptrs: dptrs.addr(),
            index: dindex.addr(),
            n: f.chunks.len(),
        };
        // SAFETY: `check_ffn` above: every listed chunk holds its neurons' bundles as the layout
        // says; x holds d_model values, h n_ff, acc d_model, active one.
        unsafe {
            Device::ffn_gathered(
                self,
                l,
                chunks,
                f.activation,
                f.threshold,
                dx.addr(),
                h.addr(),
                acc.addr(),
                active.addr(),
            )?;
        }
        Ok(FfnOutput {
            h: h.to_vec(self, l.n_ff)?,
            out: acc.to_vec(self, l.d_model)?,
            active: active.to_vec(self, 1)?[0] as usize,
        })
    }

    fn argmax(&self, logits: &[f32]) -> Result<u32> {
        check_top_k(logits, 1)?;
        let dl = Buffer::upload(self, "logits", logits)?;
        let out = Buffer::<u32>::zeros(self, "argmax", 1)?;
        // SAFETY: n values behind logits, one behind out.
        unsafe { Device::argmax(self, dl.addr(), logits.len(), out.addr())? };
        Ok(out.to_vec(self, 1)?[0])
    }

    fn top_k(&self, logits: &[f32], k: usize) -> Result<Vec<(u32, f32)>> {
        check_top_k(logits, k)?;
        let dl = Buffer::upload(self, "logits", logits)?;
        let out_v = Buffer::<f32>::zeros(self, "top values", k)?;
        let out_i = Buffer::<u32>::zeros(self, "top indices", k)?;
        // SAFETY: n values behind logits, k behind out_v and out_i.
        unsafe { Device::top_k(self, dl.addr(), logits.len(), k, out_v.addr(), out_i.addr())? };
        let (v, i) = (out_v.to_vec(self, k)?, out_i.to_vec(self, k)?);
        Ok(i.into_iter().zip(v).collect())
    }
}

/// An in-place element-wise kernel `launch(a, b, n)` on copies of `a` and `b` (of one length).
fn binary<D: Device>(
    dev: &D,
    a: &[f32],
    b: &[f32],
    launch: impl FnOnce(Addr, Addr, usize) -> Result<()>,
) -> Result<Vec<f32>> {
    expect_len("b", b, a.len())?;
    let (da, db) = (Buffer::upload(dev, "a", a)?, Buffer::upload(dev, "b", b)?);
    launch(da.addr(), db.addr(), a.len())?;
    da.to_vec(dev, a.len())
}
