//! Compute-ready weights: every matrix as [`QRows`], every shape checked once at build time.

use super::{ImportedModel, ModelConfig, OwnedBytes, TensorBytes, TensorRef};
use crate::quant::DType;
use crate::quant::tiles::TILE_ROWS;
use crate::{Error, Result};

/// A matrix of quantised rows. Rows need not be contiguous: the `.lsm` file interleaves the gate
/// row, up row and down column of each neuron (a bundle) and groups bundles into 4 KiB-aligned
/// chunks, so row `i` lives at
/// `first + (i / group_rows) * group_stride + (i % group_rows) * row_stride`.
/// A plain matrix is one group with `row_stride = row_bytes`.
///
/// A plain matrix may also be stored as tiles ([`crate::quant::tiles`]): each whole group of
/// eight rows interleaved block by block, the last `rows % 8` rows as rows. Tiled rows are read
/// eight at a time through [`QRows::tile`]; [`QRows::row`] serves only the rows after the tiles.
#[derive(Clone, Debug)]
pub struct QRows {
    pub dtype: DType,
    pub rows: usize,
    /// Values per row.
    pub cols: usize,
    data: TensorBytes,
    first: usize,
    row_stride: usize,
    group_rows: usize,
    group_stride: usize,
    tiled: bool,
}

impl QRows {
    /// A contiguous row-major matrix. Returns `None` if `cols` is not a whole number of blocks or
    /// `data` has the wrong size.
    pub fn contiguous(dtype: DType, rows: usize, cols: usize, data: TensorBytes) -> Option<QRows> {
        let rb = dtype.row_bytes(cols)?;
        (rows.checked_mul(rb)? == data.len()).then_some(QRows {
            dtype,
            rows,
            cols,
            data,
            first: 0,
            row_stride: rb,
            group_rows: rows.max(1),
            group_stride: 0,
            tiled: false,
        })
    }

    /// Rows laid out in groups (see the type's docs). Returns `None` if any row would fall
    /// outside `data`.
    #[allow(clippy::too_many_arguments)]
    pub fn strided(
        dtype: DType,
        rows: usize,
        cols: usize,
        data: TensorBytes,
        first: usize,
        row_stride: usize,
        group_rows: usize,
        group_stride: usize,
    ) -> Option<QRows> {
        let rb = dtype.row_bytes(cols)?;
        if rows == 0 || group_rows == 0 || row_stride < rb {
            return None;
        }
        let q = QRows {
            dtype,
            rows,
            cols,
            data,
            first,
            row_stride,
            group_rows,
            group_stride,
            tiled: false,
        };
        let last_end = q.offset(rows - 1).checked_add(rb)?;
        (last_end <= q.data.len()).then_some(q)
    }

    fn offset(&self, i: usize) -> usize {
        self.first
            + (i / self.group_rows) * self.group_stride
            + (i % self.group_rows) * self.row_stride
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.dtype
            .row_bytes(self.cols)
            .expect("validated at construction")
    }

    /// This matrix with its bytes read as tiles: the caller has rewritten every whole group of
    /// eight rows with [`crate::quant::tiles::tile_in_place`]. `None` unless the type tiles and
    /// the rows are stored back to back.
    pub fn as_tiled(&self) -> Option<QRows> {
        let plain = self.group_stride == 0 && self.row_stride == self.row_bytes();
        (crate::quant::tiles::tiles(self.dtype) && plain).then(|| QRows {
            tiled: true,
            ..self.clone()
        })
    }

    /// Rows stored in tiles (a multiple of eight; 0 for a matrix stored as rows).
    #[inline]
    pub fn tiled_rows(&self) -> usize {
        if self.tiled {
            self.rows / TILE_ROWS * TILE_ROWS
        } else {
            0
        }
    }

    /// The bytes of rows `8g..8g + 8` as one tile. Panics unless those rows are tiled.
    #[inline]
    pub fn tile(&self, g: usize) -> &[u8] {
        self.tiles(g * TILE_ROWS..(g + 1) * TILE_ROWS)
    }

    /// The tiles of rows `range`, back to back (each `8 · row_bytes` long). Panics unless the
    /// range is empty or starts and ends on tile boundaries inside the tiled rows.
    #[inline]
    pub fn tiles(&self, range: std::ops::Range<usize>) -> &[u8] {
        if range.is_empty() {
            return &[];
        }
        assert!(
            range.start.is_multiple_of(TILE_ROWS)
                && range.end.is_multiple_of(TILE_ROWS)
                && range.start <= range.end
                && range.end <= self.tiled_rows(),
            "rows {range:?} are not whole tiles of {} tiled rows",
            self.tiled_rows()
        );
        let rb = self.row_bytes();
        let at = self.first + range.start * rb;
        &self.data.as_slice()[at..at + range.len() * rb]
    }

    fn assert_not_tiled(&self, range: std::ops::Range<usize>) {
        assert!(
            range.is_empty() || range.start >= self.tiled_rows(),
            "rows {range:?} are stored in tiles ({} tiled rows)",
            self.tiled_rows()
        );
    }

    /// The stored bytes of row `i`. Panics if `i >= rows` (callers index by validated shapes) or
    /// the row is part of a tile.
    #[inline]
    pub fn row(&self, i: usize) -> &[u8] {
        assert!(i < self.rows, "row {i} of {}", self.rows);
        self.assert_not_tiled(i..i + 1);
        let off = self.offset(i);
        &self.data.as_slice()[off..off + self.row_bytes()]
    }

    /// The stored bytes of rows `range`, one exact-length slice per row, in order: what a loop
    /// over many rows uses instead of [`QRows::row`], which divides to find each row's group.
    /// Panics if `range` runs past the last row or into a tile.
    pub fn rows_in(&self, range: std::ops::Range<usize>) -> impl Iterator<Item = &[u8]> + '_ {
        assert!(
            range.start <= range.end && range.end <= self.rows,
            "rows {range:?} of {}",
            self.rows
        );
        self.assert_not_tiled(range.clone());
        let (rb, all) = (self.row_bytes(), self.data.as_slice());
        let mut group_at = self.first + (range.start / self.group_rows) * self.group_stride;
        let mut in_group = range.start % self.group_rows;
        range.map(move |_| {
            let off = group_at + in_group * self.row_stride;
            in_group += 1;
            if in_group == self.group_rows {
                (group_at, in_group) = (group_at + self.group_stride, 0);
            }
            &all[off..off + rb]
        })
    }

    /// Where row `i`'s bytes sit in the backing (file offsets for a file image or map).
    pub fn row_range(&self, i: usize) -> std::ops::Range<usize> {
        assert!(i < self.rows, "row {i} of {}", self.rows);
        self.assert_not_tiled(i..i + 1);
        let at = self.data.offset() + self.offset(i);
        at..at + self.row_bytes()
    }

    /// Dequantises row `i` into `out` (`out.len() == cols`).
    pub fn dequantize_row(&self, i: usize, out: &mut [f32]) {
        if i >= self.tiled_rows() {
            return crate::quant::dequantize_row(self.dtype, self.row(i), out);
        }
        // A tiled row, block by block (an embedding lookup of a tied head: one row a token).
        let (tile, lane) = (self.tile(i / TILE_ROWS), i % TILE_ROWS);
        let (n, mut block) = (
            self.dtype.block_len(),
            [0u8; crate::quant::tiles::MAX_BLOCK],
        );
        for (b, out) in out.chunks_exact_mut(n).enumerate() {
            let block = &mut block[..self.dtype.block_bytes()];
            crate::quant::tiles::block_of(self.dtype, tile, lane, b, block);
            crate::quant::dequantize_row(self.dtype, block, out);
        }
    }

    /// Total bytes of all rows (not counting padding between them).
    pub fn stored_bytes(&self) -> usize {
        self.rows * self.row_bytes()
    }

    /// The bytes the rows are views of (shared with other matrices of the same file).
    pub fn backing(&self) -> &TensorBytes {
        &self.data
    }

    /// Where the rows' bytes sit in their backing (file offsets for a file image or map).
    pub fn byte_range(&self) -> std::ops::Range<usize> {
        self.data.offset()..self.data.offset() + self.data.len()
    }

    /// Whether rows are stored in groups with other bytes between them (a `.lsm` layer's
    /// bundles), rather than one after another.
    pub fn is_grouped(&self) -> bool {
        self.group_stride != 0
    }

    /// Rows per group ([`QRows::is_grouped`]); all rows when they are not grouped.
    pub fn group_rows(&self) -> usize {
        self.group_rows
    }

    /// Rows `range` as a matrix of their own over the same backing, its bytes a slice of these
    /// (a piece the weight stream reads on its own). `None` if the range is empty or runs past
    /// the last row, or if the rows are grouped and `range` does not start a group.
    pub fn sub_rows(&self, range: std::ops::Range<usize>) -> Option<QRows> {
        let n = range.end.checked_sub(range.start)?;
        if n == 0 || range.end > self.rows {
            return None;
        }
        if self.group_stride != 0 && !range.start.is_multiple_of(self.group_rows) {
            return None;
        }
        // Tiles are not split: a piece starts at one and ends at one or at the last row.
        let whole = |r: usize| r.is_multiple_of(TILE_ROWS) || r >= self.tiled_rows();
        if self.tiled && !(whole(range.start) && (whole(range.end) || range.end == self.rows)) {
            return None;
        }
        let (rb, at) = (self.row_bytes(), self.offset(range.start));
        let mut q = QRows {
            rows: n,
            first: 0,
            data: self.data.clone(),
            group_rows: if self.group_stride == 0 {
                n
            } else {
                self.group_rows
            },
            ..self.clone()
        };
        let len = q.offset(n - 1) + rb;
        q.data = self.data.slice(at, len)?;
        Some(q)
    }

    /// The same matrix over other bytes of the same length: a copy of these bytes elsewhere
    /// (a file image instead of a map, a slot of the weight stream).
    pub fn rebased(&self, data: TensorBytes) -> QRows {
        assert_eq!(
            data.len(),
            self.data.len(),
            "a rebased matrix keeps its size"
        );
        QRows {
            data,
            ..self.clone()
        }
    }
}

/// The down projection, in the layout its source stores it.
#[derive(Clone, Debug)]
pub enum Down {
    /// `(d_model, n_ff)`: row `j` is output `j` over all neurons (GGUF, safetensors).
    Rows(QRows),
    /// `(n_ff, d_model)`: row `i` is the down column of neuron `i` (the `.lsm` bundles).
    Neurons(QRows),
}

/// One layer's gated FFN, neuron-major: row `i` of `gate` and `up` belongs to neuron `i`.
#[derive(Clone, Debug)]
pub struct FfnWeights {
    pub gate: QRows, // (n_ff, d_model)
    pub up: QRows,   // (n_ff, d_model)
    pub down: Down,
}

impl FfnWeights {
    fn map(&self, f: &mut dyn FnMut(&QRows) -> QRows) -> FfnWeights {
        FfnWeights {
            gate: f(&self.gate),
            up: f(&self.up),
            down: match &self.down {
                Down::Rows(m) => Down::Rows(f(m)),
                Down::Neurons(m) => Down::Neurons(f(m)),
            },
        }
    }
}

/// A matrix a load stores as tiles ([`Weights::tile_plan`]): where its bytes sit in the backing
/// (file offsets), its type and its rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TiledMatrix {
    pub bytes: std::ops::Range<usize>,
    pub dtype: DType,
    pub rows: usize,
}

/// One transformer block.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,  // (d_model)
    pub wq: QRows,            // (n_heads * head_dim, d_model)
    pub wk: QRows,            // (n_kv_heads * head_dim, d_model)
    pub wv: QRows,            // (n_kv_heads * head_dim, d_model)
    pub wo: QRows,            // (d_model, n_heads * head_dim)
    pub bq: Option<Vec<f32>>, // (n_heads * head_dim), Qwen2-style bias
    pub bk: Option<Vec<f32>>, // (n_kv_heads * head_dim)
    pub bv: Option<Vec<f32>>, // (n_kv_heads * head_dim)
    /// Per-head RMSNorm weights of Q and K (`head_dim` each), when the config has `qk_norm`.
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    /// RMSNorm of the attention output before its residual add, when the config has
    /// `post_norms` (`d_model`).
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>, // (d_model)
    pub ffn: FfnWeights,
    /// RMSNorm of the FFN output before its residual add, with `post_norms` (`d_model`).
    pub post_ffn_norm: Option<Vec<f32>>,
}

impl LayerWeights {
    /// Every matrix of the layer, in one order (attention, then the FFN).
    pub fn matrices(&self) -> [&QRows; 7] {
        let down = match &self.ffn.down {
            Down::Rows(m) | Down::Neurons(m) => m,
        };
        [
            &self.wq,
            &self.wk,
            &self.wv,
            &self.wo,
            &self.ffn.gate,
            &self.ffn.up,
            down,
        ]
    }

    /// The layer with every matrix replaced by `f(matrix)` (vectors are copied).
    pub fn map(&self, f: &mut dyn FnMut(&QRows) -> QRows) -> LayerWeights {
        LayerWeights {
            wq: f(&self.wq),
            wk: f(&self.wk),
            wv: f(&self.wv),
            wo: f(&self.wo),
            ffn: self.ffn.map(f),
            attn_norm: self.attn_norm.clone(),
            bq: self.bq.clone(),
            bk: self.bk.clone(),
            bv: self.bv.clone(),
            q_norm: self.q_norm.clone(),
            k_norm: self.k_norm.clone(),
            post_attn_norm: self.post_attn_norm.clone(),
            ffn_norm: self.ffn_norm.clone(),
            post_ffn_norm: self.post_ffn_norm.clone(),
        }
    }

    /// Every f32 vector of the layer (norms and biases), for counting their bytes.
    fn vectors(&self) -> impl Iterator<Item = &Vec<f32>> {
        [&self.attn_norm, &self.ffn_norm].into_iter().chain(
            [
                &self.bq,
                &self.bk,
                &self.bv,
                &self.q_norm,
                &self.k_norm,
                &self.post_attn_norm,
                &self.post_ffn_norm,
            ]
            .into_iter()
            .flatten(),
        )
    }
}

/// All weights of a model, immutable and shared by every session.
#[derive(Clone, Debug)]
pub struct Weights {
    pub config: ModelConfig,
    pub token_embd: QRows,     // (vocab, d_model)
    pub output_norm: Vec<f32>, // (d_model)
    pub output: QRows,         // (vocab, d_model); shares token_embd's bytes when tied
    pub layers: Vec<LayerWeights>,
}

/// Looks up tensors by name and checks their shapes, naming the source path in every error.
pub(crate) struct TensorTable<'a> {
    pub model: &'a ImportedModel,
}

impl TensorTable<'_> {
    fn err(&self, name: &str, reason: String) -> Error {
        Error::Tensor {
            path: self.model.path.clone(),
            tensor: name.to_string(),
            reason,
        }
    }

    fn get(&self, name: &str) -> Result<&TensorRef> {
        self.model
            .tensors
            .get(name)
            .ok_or_else(|| self.err(name, "missing".into()))
    }

    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<QRows> {
        let t = self.get(name)?;
        if t.shape != [rows, cols] {
            return Err(self.err(
                name,
                format!("shape {:?}, expected [{rows}, {cols}]", t.shape),
            ));
        }
        QRows::contiguous(t.dtype, rows, cols, t.data.clone()).ok_or_else(|| {
            self.err(
                name,
                format!(
                    "{} bytes do not fit {rows}x{cols} of {}",
                    t.data.len(),
                    t.dtype
                ),
            )
        })
    }

    pub fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>> {
        let t = self.get(name)?;
        if t.shape != [n] {
            return Err(self.err(name, format!("shape {:?}, expected [{n}]", t.shape)));
        }
        if t.dtype.block_len() != 1 || t.dtype.row_bytes(n) != Some(t.data.len()) {
            return Err(self.err(
                name,
                format!(
                    "a vector must be f32/f16/bf16 with {n} values, found {}",
                    t.dtype
                ),
            ));
        }
        let mut v = vec![0f32; n];
        crate::quant::dequantize_row(t.dtype, &t.data, &mut v);
        Ok(v)
    }

    /// The vector `name` when `present` says the model has it (a config feature), else `None`.
    pub fn vector_if(&self, present: bool, name: &str, n: usize) -> Result<Option<Vec<f32>>> {
        present.then(|| self.vector(name, n)).transpose()
    }

    pub fn optional_vector(&self, name: &str, n: usize) -> Result<Option<Vec<f32>>> {
        if self.model.tensors.contains_key(name) {
            self.vector(name, n).map(Some)
        } else {
            Ok(None)
        }
    }
}

impl Weights {
    /// The same weights over `image`, which holds the file's bytes at the same offsets as the
    /// backing they view now (a file image replacing a map of the same file).
    pub fn rebased_onto(&self, image: &TensorBytes) -> Result<Weights> {
        let mut bad = None;
        let mut f = |q: &QRows| {
            let r = q.byte_range();
            match image.slice(r.start, r.len()) {
                Some(data) => q.rebased(data),
                None => {
                    bad = Some(r);
                    q.clone()
                }
            }
        };
        let token_embd = f(&self.token_embd);
        let output = f(&self.output);
        let layers = self.layers.iter().map(|l| l.map(&mut f)).collect();
        if let Some(r) = bad {
            return Err(Error::InvalidArgument {
                arg: "image",
                reason: format!("bytes {r:?} are outside an image of {} bytes", image.len()),
            });
        }
        Ok(Weights {
            config: self.config.clone(),
            token_embd,
            output_norm: self.output_norm.clone(),
            output,
            layers,
        })
    }

    /// The matrices to store as tiles for kernels that read `tiles(dtype)` as tiles: every
    /// projection of the fast path (attention's four and the FFN's gate and up) and the output
    /// head, with the embeddings when they share its bytes. The down projection always runs
    /// with f32 activations and stays as rows. Matrices whose type does not tile, whose rows
    /// are grouped or that have fewer than eight rows are left out; each byte range is listed
    /// once.
    pub fn tile_plan(&self, tiles: &dyn Fn(DType) -> bool) -> Vec<TiledMatrix> {
        let mut plan: Vec<TiledMatrix> = Vec::new();
        let mut add = |q: &QRows| {
            let t = TiledMatrix {
                bytes: q.byte_range(),
                dtype: q.dtype,
                rows: q.rows,
            };
            if tiles(q.dtype) && q.rows >= TILE_ROWS && q.as_tiled().is_some() && !plan.contains(&t)
            {
                plan.push(t);
            }
        };
        add(&self.output);
        for l in &self.layers {
            for q in [&l.wq, &l.wk, &l.wv, &l.wo, &l.ffn.gate, &l.ffn.up] {
                add(q);
            }
        }
        plan
    }

    /// These weights with the matrices of `plan` read as tiles: their bytes have been rewritten
    /// by [`crate::quant::tiles::tile_matrix_in_place`]. Every matrix over one of those byte
    /// ranges is marked (a tied head and its embeddings both).
    pub fn tiled(&self, plan: &[TiledMatrix]) -> Weights {
        let mut f = |q: &QRows| match plan.iter().any(|t| t.bytes == q.byte_range()) {
            true => q.as_tiled().expect("a planned matrix tiles"),
            false => q.clone(),
        };
        Weights {
            config: self.config.clone(),
            token_embd: f(&self.token_embd),
            output_norm: self.output_norm.clone(),
            output: f(&self.output),
            layers: self.layers.iter().map(|l| l.map(&mut f)).collect(),
        }
    }

    /// Memory these weights hold that the process owns: each distinct backing of the matrices
    /// once (the file image, less skipped ranges; nothing for a memory map) and the f32 tables
    /// derived at build time (norms, biases) with the layer table, on the heap.
    pub fn bytes(&self) -> OwnedBytes {
        let mut seen: Vec<usize> = Vec::new();
        let mut out = OwnedBytes::default();
        let mut rows = |q: &QRows| {
            let b = q.backing();
            if !seen.contains(&b.backing_id()) {
                seen.push(b.backing_id());
                out += b.backing_bytes();
            }
        };
        let f32s = |v: &Vec<f32>| (v.capacity() * 4) as u64;
        let mut tables = f32s(&self.output_norm)
            + (self.layers.capacity() * std::mem::size_of::<LayerWeights>()) as u64;
        rows(&self.token_embd);
        rows(&self.output);
        for l in &self.layers {
            for q in l.matrices() {
                rows(q);
            }
            tables += l.vectors().map(f32s).sum::<u64>();
        }
        out.heap += tables;
        out
    }

    /// Bytes of weights one dense decode step reads: every projection of every layer, the output
    /// head, and one embedding row (norm vectors are negligible and not counted).
    pub fn dense_bytes_per_token(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| l.matrices().iter().map(|m| m.stored_bytes()).sum::<usize>())
            .sum();
        layers + self.output.stored_bytes() + self.token_embd.row_bytes()
    }

    /// Arranges an imported model's tensors for compute, checking every name and shape.
    pub fn from_imported(m: &ImportedModel) -> Result<Weights> {
        let t = TensorTable { model: m };
        let (d, ff) = (m.config.d_model, m.config.n_ff);
        Weights::build(m, &mut |l| {
            let n = |s: &str| format!("blk.{l}.{s}");
            Ok(FfnWeights {
                gate: t.matrix(&n("ffn_gate.weight"), ff, d)?,
                up: t.matrix(&n("ffn_up.weight"), ff, d)?,
                down: Down::Rows(t.matrix(&n("ffn_down.weight"), d, ff)?),
            })
        })
    }

    /// Arranges everything but the FFN from `m`'s tensors; `ffn(layer)` supplies each layer's FFN
    /// (from GGUF tensors, or from the neuron bundles of a `.lsm` file).
    pub(crate) fn build(
        m: &ImportedModel,
        ffn: &mut dyn FnMut(usize) -> Result<FfnWeights>,
    ) -> Result<Weights> {
        let c = &m.config;
        c.validate()
            .map_err(|reason| Error::invalid_file(&m.path, reason))?;
        let t = TensorTable { model: m };
        let (d, q, kv) = (c.d_model, c.q_dim(), c.kv_dim());
        let token_embd = t.matrix("token_embd.weight", c.vocab_size, d)?;
        let output = if c.tied_embeddings {
            token_embd.clone()
        } else {
            t.matrix("output.weight", c.vocab_size, d)?
        };
        let mut layers = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            let n = |s: &str| format!("blk.{l}.{s}");
            layers.push(LayerWeights {
                attn_norm: t.vector(&n("attn_norm.weight"), d)?,
                wq: t.matrix(&n("attn_q.weight"), q, d)?,
                wk: t.matrix(&n("attn_k.weight"), kv, d)?,
                wv: t.matrix(&n("attn_v.weight"), kv, d)?,
                wo: t.matrix(&n("attn_output.weight"), d, q)?,
                bq: t.optional_vector(&n("attn_q.bias"), q)?,
                bk: t.optional_vector(&n("attn_k.bias"), kv)?,
                bv: t.optional_vector(&n("attn_v.bias"), kv)?,
                q_norm: t.vector_if(c.qk_norm, &n("attn_q_norm.weight"), c.head_dim)?,
                k_norm: t.vector_if(c.qk_norm, &n("attn_k_norm.weight"), c.head_dim)?,
                post_attn_norm: t.vector_if(c.post_norms, &n("post_attention_norm.weight"), d)?,
                ffn_norm: t.vector(&n("ffn_norm.weight"), d)?,
                ffn: ffn(l)?,
                post_ffn_norm: t.vector_if(c.post_norms, &n("post_ffw_norm.weight"), d)?,
            });
        }
        Ok(Weights {
            config: c.clone(),
            token_embd,
            output_norm: t.vector("output_norm.weight", d)?,
            output,
            layers,
        })
    }
}
