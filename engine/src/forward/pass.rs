//! One forward pass over a batch of rows (tokens) that may belong to several conversations.
//!
//! A row is one token at one position of one conversation (its *seat*: KV cache, attention
//! scores, logits). A prompt is a batch of consecutive rows of one seat; a decode step of
//! several sessions on the same model is a batch of one row per seat. Every projection reads each
//! weight row once for the whole batch; attention reads each row's own KV cache. The kernels see
//! the same numbers for a row whatever else is in its batch, so a conversation's logits are the
//! same bit for bit whether it runs alone or beside others.

use std::ops::Range;

use super::layer::{self, Block, LayerSteps, Stop};
use super::planned::{HeadSpan, LayerPieces, PieceView};
use super::scratch::Work;
use super::{DOWN_PRECISION, FfnExecutor, MAX_BATCH, Model, finish_qkv, norm_rows};
use crate::Result;
use crate::backend::cpu::{self, Disjoint, Kernels, Precision, Prepared, TOKEN_GROUP};
use crate::kv::KvCache;
use crate::model::{FfnActivation, QRows};
use crate::plan::Part;

/// What a pass needs of one conversation.
pub(super) struct Seat<'a> {
    pub kv: &'a mut KvCache,
    /// `(n_heads, max_context)` attention weights.
    pub scores: &'a mut [f32],
    /// `vocab` logits, written by [`Pass::head`].
    pub logits: &'a mut [f32],
}

/// One token of the batch: the conversation it belongs to and its position there.
#[derive(Clone, Copy, Debug)]
pub(super) struct Row {
    pub seat: usize,
    pub pos: usize,
}

/// A forward pass in progress: the shared model, the batch's workspace (one session's scratch,
/// sized for [`MAX_BATCH`] rows) and the seats its rows belong to.
pub(super) struct Pass<'a> {
    pub model: &'a Model,
    pub kernels: &'static Kernels,
    pub precision: Precision,
    pub work: &'a mut Work,
    pub seats: Vec<Seat<'a>>,
    pub rows: Vec<Row>,
    /// The pieces of the layer being computed, from [`LayerSteps::begin_layer`] to the end of
    /// [`Pass::layers`].
    pub pieces: Option<LayerPieces<'a>>,
}

impl Pass<'_> {
    /// Writes the embeddings of `tokens` (one per row, in order) into the residual stream and
    /// their RoPE angles into the table.
    pub fn embed(&mut self, tokens: &[u32]) -> Result<()> {
        assert!(tokens.len() == self.rows.len() && tokens.len() <= MAX_BATCH);
        let c = &self.model.weights.config;
        let d = c.d_model;
        for (t, (&token, row)) in tokens.iter().zip(&self.rows).enumerate() {
            let x = &mut self.work.x[t * d..(t + 1) * d];
            self.model.embed_row(token as usize, x)?;
            if c.embedding_scale != 1.0 {
                x.iter_mut().for_each(|v| *v *= c.embedding_scale);
            }
            self.work.set_rope(t, row.pos);
        }
        Ok(())
    }

    /// Every layer ([`layer::layers`]), the FFN of the layers `exec` covers computed by it for
    /// all rows in one call, dense from the model's weights elsewhere; false if `stop` gave the
    /// pass up before a layer (see [`super::forward_each_unless`]).
    pub fn layers(&mut self, exec: Option<&mut dyn FfnExecutor>, stop: Stop<'_>) -> Result<bool> {
        if exec.is_none() && self.model.plan().is_some_and(|p| p.is_sparse()) {
            return Err(crate::Error::InvalidArgument {
                arg: "placement",
                reason: "this model's plan streams FFN layers by neuron: run it with the sparse \
                         executor of its plan (SparseModel::over), or load it with placement dense"
                    .into(),
            });
        }
        let config = &self.model.weights.config;
        let ran = layer::layers(self, config, exec, stop);
        self.pieces = None;
        ran
    }

    /// The output head over the rows listed in `rows` (indices into the batch, in order): final
    /// norm, then each one's logits into its seat, in one pass over the head's weights. A seat
    /// with several listed rows (a verification pass) gets them one after the other in its
    /// logits buffer, which holds that many rows of equal width.
    pub fn head(&mut self, rows: &[usize]) -> Result<()> {
        self.head_span(rows, HeadSpan::All)
    }

    /// [`Pass::head`] over the rows of `span` only: the others of each listed row's logits are
    /// left as they are.
    pub fn head_span(&mut self, rows: &[usize], span: HeadSpan) -> Result<()> {
        let w = &self.model.weights;
        let c = &w.config;
        let d = c.d_model;
        let s = &mut *self.work;
        for (i, &t) in rows.iter().enumerate() {
            let (xn, x) = (&mut s.xn[i * d..(i + 1) * d], &s.x[t * d..(t + 1) * d]);
            cpu::rmsnorm(xn, x, &w.output_norm, c.rms_eps);
        }
        let x = self
            .kernels
            .prepare(&s.xn[..rows.len() * d], self.precision, &mut s.acts);
        let k = self.kernels;
        let (seats, batch) = (&mut self.seats, &self.rows);
        let mut per_seat = vec![0usize; seats.len()];
        for &t in rows {
            per_seat[batch[t].seat] += 1;
        }
        self.model.for_each_head_piece(span, &mut |piece| {
            let mut slots: Vec<_> = seats
                .iter_mut()
                .zip(&per_seat)
                .map(|(s, &n)| {
                    let width = (s.logits.len() / n.max(1)).max(1);
                    s.logits.chunks_exact_mut(width)
                })
                .collect();
            let outs: Vec<&mut [f32]> = rows
                .iter()
                .map(|&t| {
                    let logits = slots[batch[t].seat]
                        .next()
                        .expect("a seat's logits hold a row for each of its head rows");
                    &mut logits[piece.rows.clone()]
                })
                .collect();
            k.matmat_each(x, &piece.m, outs);
            Ok(())
        })
    }
}

impl LayerSteps for Pass<'_> {
    fn begin_layer(&mut self, l: usize, exec: Option<&mut dyn FfnExecutor>) -> Result<()> {
        self.pieces = None; // the last layer's lease goes before this one's is taken
        self.pieces = Some(self.model.layer_pieces(l));
        if let Some(exec) = exec {
            let (d, n) = (self.model.weights.config.d_model, self.rows.len());
            for x in self.work.x[..n * d].chunks_exact(d) {
                exec.begin_layer(l, x);
            }
        }
        Ok(())
    }

    fn norm_input(&mut self, l: usize, block: Block) -> Result<()> {
        let c = &self.model.weights.config;
        let layer = &self.model.weights.layers[l];
        let weight = match block {
            Block::Attention => &layer.attn_norm,
            Block::Ffn => &layer.ffn_norm,
        };
        let (n, d, s) = (self.rows.len(), c.d_model, &mut *self.work);
        norm_each_row(&mut s.xn[..n * d], &s.x[..n * d], weight, c.rms_eps);
        Ok(())
    }

    fn qkv(&mut self, _l: usize) -> Result<()> {
        let c = &self.model.weights.config;
        let (d, kv_dim, q_dim, n) = (c.d_model, c.kv_dim(), c.q_dim(), self.rows.len());
        let (k, precision, s, pieces) = self.apart();
        let x = k.prepare(&s.xn[..n * d], precision, &mut s.acts);
        let (q, kk, v) = (
            &mut s.q[..n * q_dim],
            &mut s.k[..n * kv_dim],
            &mut s.v[..n * kv_dim],
        );
        pieces.each(&[Part::Q, Part::K, Part::V], &mut |views| {
            let mut jobs = Vec::new();
            for (part, out, width) in [
                (Part::Q, &mut *q, q_dim),
                (Part::K, &mut *kk, kv_dim),
                (Part::V, &mut *v, kv_dim),
            ] {
                jobs.extend(pieces_into(views, part, out, width));
            }
            k.matmat_jobs(x, n, jobs);
        })
    }

    fn position(&mut self, l: usize) -> Result<()> {
        let c = &self.model.weights.config;
        let layer = &self.model.weights.layers[l];
        let (kv_dim, q_dim, n) = (c.kv_dim(), c.q_dim(), self.rows.len());
        let s = &mut *self.work;
        // Biases, QK-norms and RoPE, row by row over the team; then each row's key and value
        // go to its cache at its position, in the cache's type.
        let ropes: [Range<usize>; MAX_BATCH] =
            std::array::from_fn(|t| if t < n { s.rope_range(l, t) } else { 0..0 });
        {
            let (q, kk, v) = (
                Disjoint::new(&mut s.q[..n * q_dim]),
                Disjoint::new(&mut s.k[..n * kv_dim]),
                Disjoint::new(&mut s.v[..n * kv_dim]),
            );
            let rope = &s.rope;
            each_row(n, |t| {
                // SAFETY: each row is handed out once, and row `t` owns these ranges.
                let (q, kk, v) = unsafe {
                    (
                        q.range(t * q_dim..(t + 1) * q_dim),
                        kk.range(t * kv_dim..(t + 1) * kv_dim),
                        v.range(t * kv_dim..(t + 1) * kv_dim),
                    )
                };
                finish_qkv(c, layer, &rope[ropes[t].clone()], q, kk, v);
            });
        }
        for (t, row) in self.rows.iter().enumerate() {
            let (kk, v) = (
                &s.k[t * kv_dim..(t + 1) * kv_dim],
                &s.v[t * kv_dim..(t + 1) * kv_dim],
            );
            self.seats[row.seat].kv.write(l, row.pos, kk, v);
        }
        Ok(())
    }

    fn attend(&mut self, l: usize, window: Option<usize>) -> Result<()> {
        // Causal attention, one query head per task (every row in order, row `t` seeing its
        // seat's positions `0..=pos`); GQA maps `group` query heads to a KV head.
        let c = &self.model.weights.config;
        let (hd, kv_dim, q_dim) = (c.head_dim, c.kv_dim(), c.q_dim());
        let (k, s) = (self.kernels, &mut *self.work);
        let group = c.n_heads / c.n_kv_heads;
        let q = &s.q;
        let (kvs, scores): (Vec<&KvCache>, Vec<Disjoint<'_>>) = self
            .seats
            .iter_mut()
            .map(|seat| (&*seat.kv, Disjoint::new(seat.scores)))
            .unzip();
        let rows = &self.rows;
        let att = Disjoint::new(&mut s.att);
        cpu::for_each_chunk(c.n_heads, 1, |heads| {
            for h in heads {
                for (t, row) in rows.iter().enumerate() {
                    let (kv, seat_scores) = (kvs[row.seat], &scores[row.seat]);
                    let ctx = seat_scores.len() / c.n_heads;
                    let o = t * q_dim + h * hd;
                    // SAFETY: each head is handed out once; head `h` alone uses its score row of
                    // every seat and its `hd` outputs of every row.
                    let (out, scores) = unsafe {
                        (
                            att.range(o..o + hd),
                            seat_scores.range(h * ctx..h * ctx + row.pos + 1),
                        )
                    };
                    let kv_off = (h / group) * hd;
                    let spans = kv.spans(l, row.pos + 1);
                    let first = window.map_or(0, |w| (row.pos + 1).saturating_sub(w));
                    cpu::attend_spans(k, &q[o..o + hd], spans, kv_dim, kv_off, first, scores, out);
                }
            }
        });
        Ok(())
    }

    fn project_out(&mut self, _l: usize) -> Result<()> {
        let c = &self.model.weights.config;
        let (d, q_dim, n) = (c.d_model, c.q_dim(), self.rows.len());
        let (k, precision, s, pieces) = self.apart();
        let x = k.prepare(&s.att[..n * q_dim], precision, &mut s.acts);
        let proj = &mut s.proj[..n * d];
        pieces.each(&[Part::O], &mut |views| {
            k.matmat_jobs(x, n, pieces_into(views, Part::O, &mut *proj, d));
        })
    }

    fn ffn(
        &mut self,
        l: usize,
        activation: FfnActivation,
        exec: Option<&mut dyn FfnExecutor>,
    ) -> Result<()> {
        let layer = &self.model.weights.layers[l];
        let (d, n) = (self.model.weights.config.d_model, self.rows.len());
        match exec {
            Some(exec) => {
                let s = &mut *self.work;
                exec.ffn_rows(l, layer, &s.xn[..n * d], &mut s.proj[..n * d])
            }
            None => self.dense_ffn(activation),
        }
    }

    fn add_residual(&mut self, l: usize, block: Block) -> Result<()> {
        let c = &self.model.weights.config;
        let layer = &self.model.weights.layers[l];
        let norm = match block {
            Block::Attention => &layer.post_attn_norm,
            Block::Ffn => &layer.post_ffn_norm,
        };
        let (n, d, s) = (self.rows.len(), c.d_model, &mut *self.work);
        add_normed_rows(&mut s.x[..n * d], &mut s.proj[..n * d], d, norm, c.rms_eps);
        Ok(())
    }
}

impl<'a> Pass<'a> {
    /// The kernels, the precision, the workspace and the layer's pieces, borrowed apart (a step
    /// computes from the pieces into the workspace).
    fn apart(&mut self) -> (&'static Kernels, Precision, &mut Work, &mut LayerPieces<'a>) {
        let pieces = self.pieces.as_mut();
        let pieces = pieces.expect("a layer's steps run after begin_layer");
        (self.kernels, self.precision, self.work, pieces)
    }

    /// The FFN of the batch's normed rows from the model's weights, piece by piece: gate and up
    /// rows of a range of neurons (the activation applied in place), then the down rows; or,
    /// for a `.lsm` layer, each range of neurons' gate, up and down together, the ranges' down
    /// sums added in order.
    fn dense_ffn(&mut self, activation: FfnActivation) -> Result<()> {
        let c = &self.model.weights.config;
        let (d, n_ff, n) = (c.d_model, c.n_ff, self.rows.len());
        let (k, p, s, pieces) = self.apart();
        let x = k.prepare(&s.xn[..n * d], p, &mut s.acts);
        let (gate, up) = (&mut s.gate[..n * n_ff], &mut s.up[..n * n_ff]);
        let (proj, partials) = (&mut s.proj[..n * d], &mut s.partials);
        let mut first = true;
        // A later piece's down sum, added to the first's: sized once, only for a layer cut in
        // several pieces of neurons.
        let mut sum: Vec<f32> = Vec::new();
        pieces.each(&[Part::GateUp, Part::Neurons], &mut |views| {
            for v in views {
                gate_up(k, x, n, n_ff, v, &mut *gate, &mut *up, activation);
                if v.part == Part::Neurons {
                    for t in 0..n {
                        let act = &gate[t * n_ff..(t + 1) * n_ff][v.rows.clone()];
                        let out = &mut proj[t * d..(t + 1) * d];
                        if first {
                            cpu::down_neurons(k, &v.m[2], act, partials, out);
                        } else {
                            sum.resize(d, 0.0);
                            cpu::down_neurons(k, &v.m[2], act, partials, &mut sum);
                            cpu::add_inplace(out, &sum);
                        }
                    }
                    first = false;
                }
            }
        })?;
        let acts = k.prepare(&s.gate[..n * n_ff], DOWN_PRECISION, &mut s.acts);
        let proj = &mut s.proj[..n * d];
        pieces.each(&[Part::Down], &mut |views| {
            k.matmat_jobs(acts, n, pieces_into(views, Part::Down, &mut *proj, d));
        })
    }
}

/// Calls `f(t)` for every row `t` of a batch of `n`, the rows split over the compute team: a
/// prompt's elementwise steps (norms, RoPE, residual adds) would otherwise run on one thread.
/// A single row (a decode step) runs on the caller.
fn each_row(n: usize, f: impl Fn(usize) + Sync) {
    cpu::for_each_chunk(n, 1, |rows| rows.for_each(&f));
}

/// `xn[t] = rmsnorm(x[t]) · weight` for every row of `weight.len()` values, over the team.
fn norm_each_row(xn: &mut [f32], x: &[f32], weight: &[f32], eps: f32) {
    let d = weight.len();
    let xn = Disjoint::new(xn);
    each_row(x.len() / d, |t| {
        // SAFETY: each row is handed out once, and row `t` owns these values.
        let xn = unsafe { xn.range(t * d..(t + 1) * d) };
        cpu::rmsnorm(xn, &x[t * d..(t + 1) * d], weight, eps);
    });
}

/// `x[t] += norm(out[t])` for every row of `d` values (`norm`: a sub-block's post-norm where the
/// model has one, applied to `out` in place), over the team.
fn add_normed_rows(x: &mut [f32], out: &mut [f32], d: usize, norm: &Option<Vec<f32>>, eps: f32) {
    assert_eq!(x.len(), out.len(), "residual and output rows");
    let (x, out) = (Disjoint::new(x), Disjoint::new(out));
    each_row(out.len() / d, |t| {
        // SAFETY: each row is handed out once, and row `t` owns these values.
        let (x, out) = unsafe { (x.range(t * d..(t + 1) * d), out.range(t * d..(t + 1) * d)) };
        norm_rows(norm, out, d, eps);
        cpu::add_inplace(x, out);
    });
}

/// The matrix-times-batch jobs of the `part` pieces among `views`: each piece's rows of every
/// token's output in `out` (`width` values per token).
fn pieces_into<'v, 'o>(
    views: &'v [PieceView],
    part: Part,
    out: &'o mut [f32],
    width: usize,
) -> Vec<(&'v QRows, Vec<&'o mut [f32]>)> {
    let mine: Vec<&PieceView> = views.iter().filter(|v| v.part == part).collect();
    let rows: Vec<Range<usize>> = mine.iter().map(|v| v.rows.clone()).collect();
    mine.iter()
        .map(|v| &v.m[0])
        .zip(carve(out, width, &rows))
        .collect()
}

/// Per range of `rows` (ascending, disjoint), per token, its slice of `out` (tokens of `width`
/// values one after another).
fn carve<'o>(out: &'o mut [f32], width: usize, rows: &[Range<usize>]) -> Vec<Vec<&'o mut [f32]>> {
    let mut per: Vec<Vec<&mut [f32]>> = rows.iter().map(|_| Vec::new()).collect();
    for token in out.chunks_exact_mut(width) {
        let (mut rest, mut at) = (token, 0);
        for (r, slices) in rows.iter().zip(&mut per) {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(r.start - at);
            let (mine, tail) = tail.split_at_mut(r.len());
            slices.push(mine);
            (rest, at) = (tail, r.end);
        }
    }
    per
}

/// The gate and up rows of piece `v`'s neurons for every token of the batch, the activation
/// applied in place into `gate` (`n_ff` values per token); one task per range of neurons.
#[allow(clippy::too_many_arguments)]
fn gate_up(
    k: &Kernels,
    x: Prepared<'_>,
    n: usize,
    n_ff: usize,
    v: &PieceView,
    gate: &mut [f32],
    up: &mut [f32],
    activation: crate::model::FfnActivation,
) {
    let (gm, um) = (&v.m[0], &v.m[1]);
    let (gate, up) = (Disjoint::new(gate), Disjoint::new(up));
    // Whole tiles per task: a range of rows never starts inside one.
    let chunk = v
        .rows
        .len()
        .div_ceil(4 * cpu::compute_threads())
        .max(cpu::FUSED_ROWS)
        .next_multiple_of(crate::quant::tiles::TILE_ROWS);
    cpu::for_each_chunk(v.rows.len(), chunk, |r| {
        for t0 in (0..n).step_by(TOKEN_GROUP) {
            let t1 = (t0 + TOKEN_GROUP).min(n);
            let mut g: [&mut [f32]; TOKEN_GROUP] = Default::default();
            let mut u: [&mut [f32]; TOKEN_GROUP] = Default::default();
            for (t, (g, u)) in (t0..t1).zip(g.iter_mut().zip(&mut u)) {
                let at = t * n_ff + v.rows.start;
                let o = at + r.start..at + r.end;
                // SAFETY: each neuron range is handed out once, so these sub-slices of
                // distinct tasks do not overlap.
                (*g, *u) = unsafe { (gate.range(o.clone()), up.range(o)) };
            }
            let (g, u) = (&mut g[..t1 - t0], &mut u[..t1 - t0]);
            let xt = x.tokens(t0..t1, n);
            k.rows_dot_each(gm, r.start, xt, g);
            k.rows_dot_each(um, r.start, xt, u);
            for (g, u) in g.iter_mut().zip(u.iter()) {
                k.gate(activation, g, u);
            }
        }
    });
}
