//! Reading the `.lsm` as the GGUF writer asks for each tensor: resident tensors in pieces, one FFN
//! layer's chunks at a time, `ffn_down` re-encoded from columns to rows.

use super::*;

/// Reads the input as the writer asks for each tensor.
pub(super) struct Reader<'a> {
    pub(super) src: &'a Path,
    pub(super) file: &'a File,
    pub(super) header: &'a Header,
    pub(super) recipe: &'a Recipe,
    /// The FFN layer `buf` holds.
    pub(super) layer: Option<usize>,
    pub(super) buf: Vec<u8>,
    /// Checksum of the resident section up to `resident_pos` (from its start).
    pub(super) resident_crc: crc32fast::Hasher,
    pub(super) resident_pos: u64,
    pub(super) down: DownStats,
}

#[derive(Default)]
pub(super) struct DownStats {
    pub(super) max_abs: f32,
    pub(super) sq_err: f64,
    pub(super) sq_src: f64,
}

impl Reader<'_> {
    pub(super) fn write(&mut self, origin: Origin, sink: &mut TensorSink) -> Result<()> {
        match origin {
            Origin::Held => Ok(()),
            Origin::Resident { entry, permute } => self.resident(entry, permute, sink),
            Origin::Gate(l) => self.rows(l, 0, self.recipe.gate_row, sink),
            Origin::Up(l) => self.rows(l, self.recipe.up_at, self.recipe.up_row, sink),
            Origin::Down(l) => self.down(l, sink),
        }
    }

    /// Feeds the resident section's bytes `[resident_pos, to)` to its checksum.
    fn checksum_to(&mut self, to: u64) -> Result<()> {
        let start = self.header.resident.offset;
        let mut piece = vec![0u8; COPY_PIECE.min(to.saturating_sub(self.resident_pos) as usize)];
        while self.resident_pos < to {
            let n = piece.len().min((to - self.resident_pos) as usize);
            read_at(
                self.src,
                self.file,
                start + self.resident_pos,
                &mut piece[..n],
            )?;
            self.resident_crc.update(&piece[..n]);
            self.resident_pos += n as u64;
        }
        Ok(())
    }

    fn resident(&mut self, e: usize, permute: Option<usize>, sink: &mut TensorSink) -> Result<()> {
        let h = self.header;
        let t = &h.tensors[e];
        // Padding before it (tensors are copied in file order).
        self.checksum_to(t.offset)?;
        let at = h.resident.offset + t.offset;
        if let Some(heads) = permute {
            let mut bytes = vec![0u8; t.len as usize];
            read_at(self.src, self.file, at, &mut bytes)?;
            self.resident_crc.update(&bytes);
            let rb = row_bytes_of(t.dtype, &t.shape).unwrap_or(bytes.len());
            sink.write(&permute_rows(&bytes, rb, heads))?;
        } else {
            let mut piece = vec![0u8; COPY_PIECE.min(t.len as usize)];
            let mut done = 0u64;
            while done < t.len {
                let n = piece.len().min((t.len - done) as usize);
                read_at(self.src, self.file, at + done, &mut piece[..n])?;
                self.resident_crc.update(&piece[..n]);
                sink.write(&piece[..n])?;
                done += n as u64;
            }
        }
        self.resident_pos = t.offset + t.len;
        if self
            .recipe
            .resident
            .last()
            .is_some_and(|&(last, _)| last == e)
        {
            self.checksum_to(h.resident.len)?;
            let crc = std::mem::take(&mut self.resident_crc).finalize();
            if crc != h.resident.crc32 {
                return Err(Error::invalid_file(
                    self.src,
                    "resident section checksum mismatch: the file is corrupted",
                ));
            }
        }
        Ok(())
    }

    /// Reads FFN layer `l`'s chunks into `buf` (once for its three tensors), checking each
    /// chunk's checksum.
    fn load_layer(&mut self, l: usize) -> Result<()> {
        if self.layer == Some(l) {
            return Ok(());
        }
        let h = self.header;
        let ffn = &h.ffn;
        let chunks = ffn.chunks_per_layer(h.config.n_ff);
        self.layer = None;
        self.buf.resize(chunks * ffn.chunk_bytes, 0);
        let at = h.streamed.offset + ffn.layer_offsets[l];
        read_at(self.src, self.file, at, &mut self.buf)?;
        let bad = self
            .buf
            .par_chunks(ffn.chunk_bytes)
            .zip(&ffn.chunk_crc32[l])
            .position_first(|(chunk, &crc)| crc32fast::hash(chunk) != crc);
        if let Some(k) = bad {
            return Err(Error::invalid_file(
                self.src,
                format!("FFN layer {l} chunk {k} checksum mismatch: the file is corrupted"),
            ));
        }
        self.layer = Some(l);
        Ok(())
    }

    /// Byte offset in `buf` of neuron `i`'s bundle.
    fn bundle(&self, i: usize) -> usize {
        let ffn = &self.header.ffn;
        (i / ffn.chunk_neurons) * ffn.chunk_bytes + (i % ffn.chunk_neurons) * ffn.bundle_bytes
    }

    /// Writes the `len`-byte row at `offset` of every neuron's bundle of layer `l`.
    fn rows(&mut self, l: usize, offset: usize, len: usize, sink: &mut TensorSink) -> Result<()> {
        self.load_layer(l)?;
        for i in 0..self.header.config.n_ff {
            let at = self.bundle(i) + offset;
            sink.write(&self.buf[at..at + len])?;
        }
        Ok(())
    }

    /// Writes layer `l`'s down matrix as `d_model` rows of `n_ff` values: `tile` rows at a time,
    /// every column's segment dequantised, then each row re-encoded in the same type.
    fn down(&mut self, l: usize, sink: &mut TensorSink) -> Result<()> {
        self.load_layer(l)?;
        let (d, n_ff) = (self.header.config.d_model, self.header.config.n_ff);
        let dtype = self.header.ffn.down_dtype;
        let p = self.recipe;
        let (bl, bb, tile) = (dtype.block_len(), dtype.block_bytes(), p.tile);
        let mut segments = vec![0f32; n_ff * tile];
        let mut rows = vec![0u8; tile * p.down_row];
        let this = &*self;
        let mut stats = DownStats::default();
        for r0 in (0..d).step_by(tile) {
            let t = tile.min(d - r0);
            // Neuron i's values of rows r0..r0 + t (whole blocks: r0 and d are).
            let (from, to) = (r0 / bl * bb, (r0 + t) / bl * bb);
            segments
                .par_chunks_mut(tile)
                .enumerate()
                .for_each(|(i, seg)| {
                    let col = this.bundle(i) + p.down_at;
                    let col = &this.buf[col..col + p.down_col];
                    dequantize_row(dtype, &col[from..to], &mut seg[..t]);
                });
            let part = rows[..t * p.down_row]
                .par_chunks_mut(p.down_row)
                .enumerate()
                .map_init(
                    || (vec![0f32; n_ff], vec![0f32; n_ff]),
                    |(row, back), (r, out)| {
                        for (i, x) in row.iter_mut().enumerate() {
                            *x = segments[i * tile + r];
                        }
                        quantize_row_into(dtype, row, out);
                        dequantize_row(dtype, out, back);
                        let mut s = DownStats::default();
                        for (a, b) in row.iter().zip(back.iter()) {
                            s.max_abs = s.max_abs.max((a - b).abs());
                            s.sq_err += f64::from(a - b).powi(2);
                            s.sq_src += f64::from(*a).powi(2);
                        }
                        s
                    },
                )
                .reduce(DownStats::default, DownStats::merge);
            stats = stats.merge(part);
            sink.write(&rows[..t * p.down_row])?;
        }
        self.down = std::mem::take(&mut self.down).merge(stats);
        Ok(())
    }
}

impl DownStats {
    fn merge(self, o: DownStats) -> DownStats {
        DownStats {
            max_abs: self.max_abs.max(o.max_abs),
            sq_err: self.sq_err + o.sq_err,
            sq_src: self.sq_src + o.sq_src,
        }
    }
}

/// Rows of `bytes` (`row` bytes each) reordered per head as llama.cpp's converter does for Q/K
/// (`permute` in `convert_hf_to_gguf.py`): within each head of `rows / heads` rows, row
/// `j·half + i` moves to `2i + j`.
pub(super) fn permute_rows(bytes: &[u8], row: usize, heads: usize) -> Vec<u8> {
    let rows = bytes.len() / row;
    let hd = rows / heads;
    let mut out = vec![0u8; bytes.len()];
    for h in 0..heads {
        for i in 0..hd / 2 {
            for j in 0..2 {
                let (src, dst) = (h * hd + j * (hd / 2) + i, h * hd + 2 * i + j);
                out[dst * row..(dst + 1) * row].copy_from_slice(&bytes[src * row..(src + 1) * row]);
            }
        }
    }
    out
}
