//! A model loaded under a memory budget ([`Model::load_within`]): the weights its [`Plan`]
//! keeps are read into memory, the others stream through a [`WeightStream`], and the forward
//! pass asks for each layer, the head and the embedding rows here instead of reading
//! `weights` directly. The results are the dense path's, bit for bit: the same kernels see the
//! same bytes, only from a slot instead of the image.

use std::ops::Deref;
use std::path::Path;
use std::sync::Arc;

use super::Model;
use crate::io::DirectFile;
use crate::kv::KvType;
use crate::model::{LayerWeights, QRows};
use crate::plan::{Floor, Placement, Plan, UnitKind};
use crate::stream::{Lease, StreamStats, WeightStream};
use crate::{Error, Result};

/// The streamed side of a planned model.
#[derive(Debug)]
pub struct Planned {
    pub plan: Plan,
    pub stream: WeightStream,
    /// Per layer: its unit in the stream, if it streams.
    unit_of_layer: Vec<Option<usize>>,
    /// The head's units, in row order.
    head_units: Vec<usize>,
}

/// A layer to compute: borrowed from the resident weights, or a view of a stream slot that
/// goes back to the reader when dropped (the view first, then the lease).
pub(crate) enum LayerRef<'a> {
    Resident(&'a LayerWeights),
    Streamed {
        layer: Box<LayerWeights>,
        _lease: Lease<'a>,
    },
}

impl Deref for LayerRef<'_> {
    type Target = LayerWeights;
    fn deref(&self) -> &LayerWeights {
        match self {
            LayerRef::Resident(l) => l,
            LayerRef::Streamed { layer, .. } => layer,
        }
    }
}

/// One piece of the output head: rows `rows` of the logits come from `m`.
pub(crate) struct HeadPiece<'a> {
    pub rows: std::ops::Range<usize>,
    pub m: QRows,
    _lease: Option<Lease<'a>>,
}

impl Model {
    /// Loads `path` (GGUF or `.lsm`) to run in a process budget of `budget` bytes with one
    /// session of `context` tokens: the [`Plan`] decides what is read now and what streams.
    /// Everything resident when it fits (then this is [`Model::load`] with a plan attached).
    pub fn load_within(path: &Path, budget: u64, context: usize, kv: KvType) -> Result<Arc<Model>> {
        Model::load_planned(path, budget, &|m| Floor::of(m, context, kv))
    }

    /// Loads `path` so that the model itself holds at most `budget` bytes (weights, tokenizer,
    /// tables, ring), its sessions being accounted elsewhere: what the daemon's `max_bytes`
    /// asks for.
    pub fn load_with_max_bytes(path: &Path, budget: u64) -> Result<Arc<Model>> {
        Model::load_planned(path, budget, &Floor::model_only)
    }

    /// Loads `path` under the plan for `budget` with the non-weight part `floor` says.
    fn load_planned(
        path: &Path,
        budget: u64,
        floor: &dyn Fn(&Model) -> Floor,
    ) -> Result<Arc<Model>> {
        let (mapped, tokenizer, chat_template) = crate::model::load_mapped(path)?;
        let probe = Model {
            path: path.to_path_buf(),
            weights: mapped,
            tokenizer,
            chat_template,
            planned: None,
        };
        let plan = Plan::new(&probe.weights, budget, floor(&probe))?;
        // The map's tokenizer parse left many small allocations free: hand them back before
        // the image is read, or the load peaks above the plan by what they held (Gemma 3's
        // 262k-token vocabulary: ~30 MiB).
        crate::alloc::trim();
        let image = crate::model::read_ranges(path, &plan.resident_ranges)?;
        let weights = probe.weights.rebased_onto(&image)?;
        let max_row = weights.token_embd.row_bytes();
        let stream = WeightStream::start(&plan, Arc::new(DirectFile::open(path)?), max_row)?;
        let mut unit_of_layer = vec![None; plan.layers.len()];
        let mut head_units = Vec::new();
        for (i, u) in plan.units.iter().enumerate() {
            match u.kind {
                UnitKind::Layer(l) => unit_of_layer[l] = Some(i),
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
                unit_of_layer,
                head_units,
            }),
        }))
    }

    /// The memory plan the model was loaded with ([`Model::load_within`]).
    pub fn plan(&self) -> Option<&Plan> {
        self.planned.as_ref().map(|p| &p.plan)
    }

    /// The weight stream's counters (`None` unless loaded with a plan).
    pub fn stream_stats(&self) -> Option<StreamStats> {
        self.planned.as_ref().map(|p| p.stream.stats())
    }

    /// Layer `l`'s weights, waiting for the stream if the layer is not resident.
    pub(crate) fn layer(&self, l: usize) -> Result<LayerRef<'_>> {
        let resident = &self.weights.layers[l];
        let Some((p, unit)) = self
            .planned
            .as_ref()
            .and_then(|p| p.unit_of_layer[l].map(|u| (p, u)))
        else {
            return Ok(LayerRef::Resident(resident));
        };
        let lease = p.stream.acquire(unit)?;
        let u = &p.stream.units()[unit];
        let mut missing = None;
        let layer = resident.map(&mut |q: &QRows| {
            let r = q.byte_range();
            match u
                .slot_offset(&r)
                .and_then(|at| lease.bytes().slice(at, r.len()))
            {
                Some(data) => q.rebased(data),
                None => {
                    missing = Some(r);
                    q.clone()
                }
            }
        });
        if let Some(r) = missing {
            return Err(Error::InvalidArgument {
                arg: "plan",
                reason: format!("layer {l}'s bytes {r:?} are not in its stream unit"),
            });
        }
        Ok(LayerRef::Streamed {
            layer: Box::new(layer),
            _lease: lease,
        })
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
    pub(crate) fn for_each_head_piece(
        &self,
        f: &mut dyn FnMut(HeadPiece<'_>) -> Result<()>,
    ) -> Result<()> {
        let out = &self.weights.output;
        let Some(p) = self
            .planned
            .as_ref()
            .filter(|p| p.plan.head == Placement::Streamed)
        else {
            return f(HeadPiece {
                rows: 0..out.rows,
                m: out.clone(),
                _lease: None,
            });
        };
        let kept = p.plan.head_resident_rows;
        if kept > 0 {
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
