//! A model loaded under a memory budget ([`Model::load_within`]): the weights its [`Plan`]
//! keeps are read into memory, the others stream through a [`WeightStream`], and the forward
//! pass asks here for each layer's pieces, the head and the embedding rows instead of reading
//! `weights` directly. The results are the dense path's, bit for bit: the same kernels see the
//! same bytes in the same pieces, only from a slot instead of the image.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use super::Model;
use crate::io::DirectFile;
use crate::kv::{KvCache, KvType};
use crate::model::QRows;
use crate::plan::{
    Floor, Part, Piece, Placement, PlacementPolicy, Plan, PlanOptions, RUNTIME_BYTES, UnitKind,
    piece_matrices, pieces,
};
use crate::stream::{Lease, WeightStream, WeightStreamCounters};
use crate::{Error, Result};

/// The streamed side of a planned model.
#[derive(Debug)]
pub struct Planned {
    pub plan: Plan,
    pub stream: WeightStream,
    /// Per layer: its units in the stream (empty when the layer is resident).
    units_of_layer: Vec<Range<usize>>,
    /// The head's units, in row order.
    head_units: Vec<usize>,
}

/// Rows `rows` of the matrices of a part of a layer ([`Part::matrices`]' order), ready to compute.
pub(crate) struct PieceView {
    pub part: Part,
    pub rows: Range<usize>,
    pub m: Vec<QRows>,
}

/// A layer being computed piece by piece ([`Model::layer_pieces`]): from the resident weights,
/// or from the stream's slots, holding the lease of the unit in use until a piece of the next
/// one is asked for (views first, then the lease, are dropped).
pub(crate) struct LayerPieces<'a> {
    model: &'a Model,
    l: usize,
    /// The layer's units in the stream; empty when it is resident.
    units: Range<usize>,
    held: Option<(usize, Lease<'a>)>,
}

impl LayerPieces<'_> {
    /// Calls `f` with the pieces of `parts`, in compute order: at once when the layer is
    /// resident, else once per streamed unit holding some of them, after waiting for its read.
    /// Parts must be asked for in compute order: a unit is not read twice in one token.
    pub fn each(&mut self, parts: &[Part], f: &mut dyn FnMut(&[PieceView])) -> Result<()> {
        let layer = &self.model.weights.layers[self.l];
        let wanted = |p: &Piece| parts.contains(&p.part);
        if self.units.is_empty() {
            let views: Vec<PieceView> = pieces(layer, self.model.piece_bytes)
                .into_iter()
                .filter(wanted)
                .map(|p| self.view(&p, &mut |m| Some(m.clone())))
                .collect::<Result<_>>()?;
            f(&views);
            return Ok(());
        }
        let Some(p) = &self.model.planned else {
            unreachable!("only a planned model has streamed units")
        };
        for unit in self.units.clone() {
            let u = &p.stream.units()[unit];
            let UnitKind::Layer { pieces, .. } = &u.kind else {
                unreachable!("a layer's units hold its pieces")
            };
            if !pieces.iter().any(wanted) {
                continue;
            }
            if self.held.as_ref().map(|h| h.0) != Some(unit) {
                self.held = None;
                self.held = Some((unit, p.stream.acquire(unit)?));
            }
            let lease = &self.held.as_ref().expect("just acquired").1;
            let views: Vec<PieceView> = pieces
                .iter()
                .filter(|p| wanted(p))
                .map(|piece| {
                    self.view(piece, &mut |m: &QRows| {
                        let r = m.byte_range();
                        let at = u.slot_offset(&r)?;
                        Some(m.rebased(lease.bytes().slice(at, r.len())?))
                    })
                })
                .collect::<Result<_>>()?;
            f(&views);
        }
        Ok(())
    }

    /// `piece`'s matrices, each placed by `place` (`None`: its bytes are not where the plan put
    /// them, an error).
    fn view(
        &self,
        piece: &Piece,
        place: &mut dyn FnMut(&QRows) -> Option<QRows>,
    ) -> Result<PieceView> {
        let layer = &self.model.weights.layers[self.l];
        let missing = || Error::InvalidArgument {
            arg: "plan",
            reason: format!(
                "layer {}'s piece {piece:?} is not where the plan put it",
                self.l
            ),
        };
        let m = piece_matrices(layer, piece)
            .ok_or_else(missing)?
            .iter()
            .map(|m| place(m).ok_or_else(missing))
            .collect::<Result<_>>()?;
        Ok(PieceView {
            part: piece.part,
            rows: piece.rows.clone(),
            m,
        })
    }
}

/// Which rows of the output head a pass computes: all of them, only the resident ones (a
/// shortlist draft's logits) or only the streamed ones (the rest, for drafts' hidden states).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HeadSpan {
    All,
    Resident,
    Streamed,
}

/// One piece of the output head: rows `rows` of the logits come from `m`.
pub(crate) struct HeadPiece<'a> {
    pub rows: std::ops::Range<usize>,
    pub m: QRows,
    _lease: Option<Lease<'a>>,
}

/// The floors of a loaded model. They live beside [`Model`] rather than in [`crate::plan`],
/// which plans from the weights alone and knows nothing of models or sessions.
impl Floor {
    /// The floor of serving `model` with one session of `context` tokens in `kv`, without the
    /// ring.
    pub fn of(model: &Model, context: usize, kv: KvType) -> Floor {
        let w = &model.weights;
        let c = &w.config;
        Floor {
            runtime: RUNTIME_BYTES,
            tokenizer: model.tokenizer.heap_bytes(),
            tables: w.bytes().heap,
            session: super::session_open_bytes(model, context, kv)
                + KvCache::full_bytes(kv, c.n_layers, c.kv_dim(), context),
            ..Floor::default()
        }
    }

    /// The floor of the model alone (tokenizer, tables; the ring is added by the plan): for a
    /// caller that accounts the runtime and the sessions itself (the daemon).
    pub fn model_only(model: &Model) -> Floor {
        Floor {
            tokenizer: model.tokenizer.heap_bytes(),
            tables: model.weights.bytes().heap,
            ..Floor::default()
        }
    }
}

impl Model {
    /// Loads `path` (GGUF or `.lsm`) to run in a process budget of `budget` bytes with one
    /// session of `context` tokens: the [`Plan`] decides what is read now and what streams.
    /// Everything resident when it fits (then this is [`Model::load`] with a plan attached).
    /// FFN layers of a calibrated `.lsm` may stream by neuron (`placement` auto): such a model
    /// runs with the sparse executor of its plan ([`crate::pipeline::SparseModel::over`]).
    pub fn load_within(path: &Path, budget: u64, context: usize, kv: KvType) -> Result<Arc<Model>> {
        Model::load_within_placed(path, budget, context, kv, PlacementPolicy::Auto)
    }

    /// [`Model::load_within`] with the placement policy given.
    pub fn load_within_placed(
        path: &Path,
        budget: u64,
        context: usize,
        kv: KvType,
        placement: PlacementPolicy,
    ) -> Result<Arc<Model>> {
        let opts = PlanOptions::for_file(path, placement)?;
        Model::load_within_options(path, budget, context, kv, &opts)
    }

    /// [`Model::load_within`] planned with `opts` (tests and benches that set the disk's speeds
    /// or the size of pieces).
    pub fn load_within_options(
        path: &Path,
        budget: u64,
        context: usize,
        kv: KvType,
        opts: &PlanOptions,
    ) -> Result<Arc<Model>> {
        Model::load_planned(path, budget, &|m| Floor::of(m, context, kv), opts)
    }

    /// [`Model::load_within`] with the layers cut into pieces of at most `piece_bytes`.
    pub fn load_within_in_pieces(
        path: &Path,
        budget: u64,
        context: usize,
        kv: KvType,
        piece_bytes: usize,
    ) -> Result<Arc<Model>> {
        let opts = PlanOptions {
            piece_bytes,
            sparse: None,
        };
        Model::load_within_options(path, budget, context, kv, &opts)
    }

    /// Loads `path` so that the model itself holds at most `budget` bytes (weights, tokenizer,
    /// tables, ring), its sessions being accounted elsewhere: what the daemon's `max_bytes`
    /// asks for.
    pub fn load_with_max_bytes(path: &Path, budget: u64) -> Result<Arc<Model>> {
        Model::load_with_max_bytes_placed(path, budget, PlacementPolicy::Dense)
    }

    /// [`Model::load_with_max_bytes`] with the placement policy given: under `auto` the plan's
    /// neuron cache and predictor count in `budget` too (the caller builds the sparse executor
    /// with [`crate::pipeline::SparseModel::over`] and the plan's cache size).
    pub fn load_with_max_bytes_placed(
        path: &Path,
        budget: u64,
        placement: PlacementPolicy,
    ) -> Result<Arc<Model>> {
        let opts = PlanOptions::for_file(path, placement)?;
        Model::load_planned(path, budget, &Floor::model_only, &opts)
    }

    /// Loads `path` under the plan for `budget` with the non-weight part `floor` says.
    fn load_planned(
        path: &Path,
        budget: u64,
        floor: &dyn Fn(&Model) -> Floor,
        opts: &PlanOptions,
    ) -> Result<Arc<Model>> {
        let piece_bytes = opts.piece_bytes;
        let (mapped, tokenizer, chat_template) = crate::model::load_mapped(path)?;
        let probe = Model {
            path: path.to_path_buf(),
            weights: mapped,
            tokenizer,
            chat_template,
            planned: None,
            piece_bytes,
        };
        let plan = Plan::with_options(&probe.weights, budget, floor(&probe), opts)?;
        // The map's tokenizer parse left many small allocations free: hand them back before
        // the image is read, or the load peaks above the plan by what they held (Gemma 3's
        // 262k-token vocabulary: ~30 MiB).
        crate::alloc::trim();
        let image = crate::model::read_ranges(path, &plan.resident_ranges)?;
        let weights = probe.weights.rebased_onto(&image)?;
        let max_row = weights.token_embd.row_bytes();
        let stream = WeightStream::start(&plan, DirectFile::open(path)?, max_row)?;
        let mut units_of_layer = vec![0..0; plan.layers.len()];
        let mut head_units = Vec::new();
        for (i, u) in plan.units.iter().enumerate() {
            match u.kind {
                UnitKind::Layer { layer, .. } if units_of_layer[layer].is_empty() => {
                    units_of_layer[layer] = i..i + 1
                }
                UnitKind::Layer { layer, .. } => units_of_layer[layer].end = i + 1,
                UnitKind::Head { .. } => head_units.push(i),
            }
        }
        // The layout pass left small allocations free.
        crate::alloc::trim();
        Ok(Arc::new(Model {
            path: probe.path,
            weights,
            tokenizer: probe.tokenizer,
            chat_template: probe.chat_template,
            planned: Some(Planned {
                plan,
                stream,
                units_of_layer,
                head_units,
            }),
            piece_bytes,
        }))
    }

    /// The memory plan the model was loaded with ([`Model::load_within`]).
    pub fn plan(&self) -> Option<&Plan> {
        self.planned.as_ref().map(|p| &p.plan)
    }

    /// The weight stream's counters (`None` unless loaded with a plan).
    pub fn stream_counters(&self) -> Option<WeightStreamCounters> {
        self.planned.as_ref().map(|p| p.stream.counters())
    }

    /// Whether layer `l`'s matrices are in memory (not streamed by a plan).
    pub(crate) fn layer_resident(&self, l: usize) -> bool {
        self.planned
            .as_ref()
            .is_none_or(|p| p.units_of_layer[l].is_empty())
    }

    /// Layer `l`'s matrices, piece by piece ([`LayerPieces::each`]).
    pub(crate) fn layer_pieces(&self, l: usize) -> LayerPieces<'_> {
        let units = self
            .planned
            .as_ref()
            .map_or(0..0, |p| p.units_of_layer[l].clone());
        LayerPieces {
            model: self,
            l,
            units,
            held: None,
        }
    }

    /// Writes the embedding of `token` into `out`, reading its row from storage when the
    /// embeddings are not resident.
    pub(crate) fn embed_row(&self, token: usize, out: &mut [f32]) -> Result<()> {
        let e = &self.weights.token_embd;
        match &self.planned {
            Some(p) if p.plan.embeddings == Placement::Streamed => {
                let r = e.row_range(token);
                p.stream.read_row(r.start as u64..r.end as u64, |b| {
                    crate::quant::dequantize_row(e.dtype, b, out)
                })
            }
            _ => {
                e.dequantize_row(token, out);
                Ok(())
            }
        }
    }

    /// The output head in the pieces it is computed in, in row order: the whole matrix when
    /// resident, else its resident leading rows (if any) and then each streamed piece as it
    /// arrives (call `f` once per piece).
    ///
    /// `span` picks the resident pieces, the streamed ones or both.
    pub(crate) fn for_each_head_piece(
        &self,
        span: HeadSpan,
        f: &mut dyn FnMut(HeadPiece<'_>) -> Result<()>,
    ) -> Result<()> {
        let out = &self.weights.output;
        let Some(p) = self
            .planned
            .as_ref()
            .filter(|p| p.plan.head == Placement::Streamed)
        else {
            if span == HeadSpan::Streamed {
                return Ok(());
            }
            return f(HeadPiece {
                rows: 0..out.rows,
                m: out.clone(),
                _lease: None,
            });
        };
        let kept = p.plan.head_resident_rows;
        if kept > 0 && span != HeadSpan::Streamed {
            let m = out
                .backing()
                .slice(0, kept * out.row_bytes())
                .and_then(|d| QRows::contiguous(out.dtype, kept, out.cols, d))
                .ok_or_else(|| Error::InvalidArgument {
                    arg: "plan",
                    reason: format!("the head's {kept} resident rows are not in the image"),
                })?;
            f(HeadPiece {
                rows: 0..kept,
                m,
                _lease: None,
            })?;
        }
        if span == HeadSpan::Resident {
            return Ok(());
        }
        for &unit in &p.head_units {
            let lease = p.stream.acquire(unit)?;
            let u = &p.stream.units()[unit];
            let UnitKind::Head { rows } = u.kind.clone() else {
                unreachable!("head_units holds head pieces only")
            };
            let first = out.row_range(rows.start);
            let len = out.row_bytes() * rows.len();
            let data = u
                .slot_offset(&(first.start..first.start + len))
                .and_then(|at| lease.bytes().slice(at, len));
            let m = data
                .and_then(|d| QRows::contiguous(out.dtype, rows.len(), out.cols, d))
                .ok_or_else(|| Error::InvalidArgument {
                    arg: "plan",
                    reason: format!("head rows {rows:?} are not in their stream unit"),
                })?;
            f(HeadPiece {
                rows,
                m,
                _lease: Some(lease),
            })?;
        }
        Ok(())
    }
}
