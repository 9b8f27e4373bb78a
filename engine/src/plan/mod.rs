//! The memory planner: given the bytes the whole process may hold, decides which weights stay
//! resident and which are read from storage for every token, and predicts what that costs.
//!
//! # The rule
//! Every dense weight (attention, FFN of a dense pass, output head) is needed by every token, so
//! a resident byte saves exactly one byte of reading per token wherever it sits: the planner
//! keeps as many bytes resident as fit and streams the rest. What does not fit streams as
//! *units* — consecutive [`pieces`] of one layer (row ranges of its matrices, at most
//! [`PIECE_BYTES`] together) or rows of the output head — read with `O_DIRECT` through the I/O
//! engine into a ring of [`SLOTS`] buffers, in compute order, ahead of the compute
//! ([`crate::stream::WeightStream`]). A unit is no larger than a piece unless one layer's pieces
//! are smaller (a small model's whole layer is one unit), so the ring holds tens of megabytes
//! whatever the model's size. Resident layers are spread evenly
//! between streamed ones so that reads overlap compute all through the token. The output head
//! is kept before any layer (it is needed last, so streaming it leaves nothing to overlap with at
//! the end of a token), row by row: when the whole head does not fit, its first rows fill the
//! room and only the rest streams, so no byte of the budget is left unused (a model whose tied
//! head is most of the file, like Gemma 3's, would otherwise stream all of it); the embedding
//! rows of a model whose embeddings are not resident are read one row per token.
//!
//! # The floor
//! Besides weights the process holds its runtime (code, libc, thread stacks, allocator slack:
//! [`RUNTIME_BYTES`], measured), the tokenizer, the f32 tables built at load (norms), one
//! session's scratch and KV cache for the planned context, and the ring. The budget less that
//! floor is what the weights may use; a budget under the floor plus the smallest ring is refused
//! with the numbers.

use std::fmt::Write as _;
use std::ops::Range;

mod pieces;
mod sparse;

pub use pieces::{PIECE_BYTES, Part, Piece, piece_matrices, pieces};
pub use sparse::{DiskSpeeds, SparseFfn};

use crate::io::{PAGE, align_down, align_up};
use crate::model::{LayerWeights, QRows, Weights};
use crate::{Error, Result};

/// Buffers of the streaming ring: one computed, one read ahead, one being read.
pub const SLOTS: usize = 3;

/// Resident memory of the process besides anything the engine accounts: code and data pages
/// of the binary and its libraries, thread stacks, allocator slack. Measured with `leanstream run`
/// on SmolLM2 in a cgroup (docs/memory.md, "The floor").
pub const RUNTIME_BYTES: u64 = 12 << 20;

/// Ranges closer than this are read as one (the bytes between are read and ignored: one
/// request of a few pages more costs less than a second request).
const MERGE_GAP: u64 = 64 << 10;

/// What a part of the model does in a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Read at load and kept.
    Resident,
    /// Read from storage every token it is needed.
    Streamed,
}

/// One streamed read unit, in compute order within a token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UnitKind {
    /// Consecutive pieces of layer `layer`.
    Layer { layer: usize, pieces: Vec<Piece> },
    /// Rows `rows` of the output head.
    Head { rows: Range<usize> },
}

/// A unit and where its bytes are: file ranges (exact), each read page-aligned into the slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unit {
    pub kind: UnitKind,
    /// The page-aligned file ranges read, in slot order: range `i` lands at slot offset
    /// `sum(len of ranges before i)`.
    pub reads: Vec<Range<u64>>,
    /// The end of the last byte the unit needs: the last read's page may run past the end of the
    /// file.
    pub end: u64,
}

impl Unit {
    /// Bytes one read of the unit transfers.
    pub fn bytes(&self) -> u64 {
        self.reads.iter().map(|r| r.end - r.start).sum()
    }

    /// Where file bytes `r` (inside one of the unit's reads) sit in the slot.
    pub fn slot_offset(&self, r: &Range<usize>) -> Option<usize> {
        let mut at = 0u64;
        for read in &self.reads {
            if read.start <= r.start as u64 && r.end as u64 <= read.end {
                return Some((at + r.start as u64 - read.start) as usize);
            }
            at += read.end - read.start;
        }
        None
    }
}

/// What the process holds besides weights, by part, in bytes (serialised as
/// `{"runtime":…,"tokenizer":…,"tables":…,"session":…,"ring":…}` in `run --json`'s plan).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Floor {
    pub runtime: u64,
    pub tokenizer: u64,
    /// f32 tables built at load (norms, biases) and the layer table.
    pub tables: u64,
    /// One session's scratch and its KV cache grown to the planned context.
    pub session: u64,
    /// The streaming ring (0 when everything is resident).
    pub ring: u64,
    /// The predictor's tables, when some FFN layers stream by neuron.
    #[serde(default)]
    pub predictor: u64,
    /// The neuron cache of the layers that stream by neuron (its smallest size, one layer's
    /// chunks, and whatever the plan gives it beyond).
    #[serde(default)]
    pub cache: u64,
}

/// Where every weight of a model goes under a budget, and what it costs per token.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The process budget the plan was made for.
    pub budget: u64,
    pub floor: Floor,
    /// `Resident` when the whole output head is; `Streamed` when some of its rows stream.
    pub head: Placement,
    /// Rows `0..head_resident_rows` of the output head are kept (all of them when `head` is
    /// `Resident`); the others stream in pieces after the layers.
    pub head_resident_rows: usize,
    /// Token embeddings (the head's bytes when tied: then always placed with it).
    pub embeddings: Placement,
    pub layers: Vec<Placement>,
    /// Streamed units in compute order (layers, then head pieces).
    pub units: Vec<Unit>,
    /// Bytes of one ring slot (the largest unit); 0 when nothing streams.
    pub slot_bytes: u64,
    /// Weight bytes read at load and kept.
    pub resident_bytes: u64,
    /// File ranges to read at load (merged, sorted).
    pub resident_ranges: Vec<Range<u64>>,
    /// Weights one dense decode step reads, resident or not.
    pub dense_bytes_per_token: u64,
    /// Bytes of one embedding row.
    pub row_bytes: u64,
    /// The largest piece the layers are cut into ([`pieces`]).
    pub piece_bytes: usize,
    /// Per layer: its FFN streams by neuron through the neuron cache (only the chunks the
    /// predictor selects are read), not dense.
    pub sparse_ffn: Vec<bool>,
    /// Bytes the sparse layers are expected to read per token, through the cache.
    pub sparse_bytes_per_token: u64,
    /// File bytes of the FFN of the layers `sparse_ffn` marks: every chunk of them
    /// ([`Plan::sparse_ffn_bytes`]).
    sparse_ffn_file_bytes: u64,
}

/// Whether a plan may stream FFN layers by neuron: `auto` where that reads faster than dense
/// (a calibrated `.lsm` only), `dense` never.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PlacementPolicy {
    #[default]
    Auto,
    Dense,
}

impl PlacementPolicy {
    pub fn name(self) -> &'static str {
        match self {
            PlacementPolicy::Auto => "auto",
            PlacementPolicy::Dense => "dense",
        }
    }
}

impl std::fmt::Display for PlacementPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for PlacementPolicy {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(PlacementPolicy::Auto),
            "dense" => Ok(PlacementPolicy::Dense),
            other => Err(format!("unknown placement `{other}` (auto or dense)")),
        }
    }
}

/// How to plan, beyond the budget.
#[derive(Clone, Debug)]
pub struct PlanOptions {
    /// The largest piece the layers are cut into ([`PIECE_BYTES`]).
    pub piece_bytes: usize,
    /// A calibrated `.lsm`'s FFN, whose layers may stream by neuron where that is faster
    /// (`placement = auto`); `None` plans every layer dense (`placement = dense`).
    pub sparse: Option<SparseFfn>,
}

impl PlanOptions {
    /// How to plan the model at `path`: with its sparse FFN where `placement` allows it and the
    /// file is a calibrated `.lsm` with per-neuron selection probabilities.
    pub fn for_file(path: &std::path::Path, placement: PlacementPolicy) -> Result<PlanOptions> {
        use crate::model::{Residency, SourceKind, lsm::LsmFile};
        let sparse = match placement {
            PlacementPolicy::Auto if SourceKind::detect(path)? == SourceKind::Lsm => {
                SparseFfn::of(&LsmFile::open_with(path, Residency::Mapped)?, path)?
            }
            _ => None,
        };
        Ok(PlanOptions {
            piece_bytes: PIECE_BYTES,
            sparse,
        })
    }
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            piece_bytes: PIECE_BYTES,
            sparse: None,
        }
    }
}

/// Sorted ranges, merged where closer than `gap` bytes.
fn merged(mut ranges: Vec<Range<u64>>, gap: u64) -> Vec<Range<u64>> {
    ranges.sort_by_key(|r| r.start);
    let mut out: Vec<Range<u64>> = Vec::new();
    for r in ranges {
        match out.last_mut() {
            Some(last) if r.start <= last.end + gap => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

fn range_of(q: &QRows) -> Range<u64> {
    let r = q.byte_range();
    r.start as u64..r.end as u64
}

/// The file ranges of the pieces of `l` that a dense plan reads: all of them, or the
/// attention's only when its FFN streams by neuron (`sparse`). From the pieces, not the
/// matrices: a `.lsm` layer's FFN matrices are views of the whole streamed section.
fn layer_ranges(l: &LayerWeights, sparse: bool, piece_bytes: usize) -> Vec<Range<u64>> {
    let dense: Vec<Piece> = pieces(l, piece_bytes)
        .into_iter()
        .filter(|p| !(sparse && p.part.is_ffn()))
        .collect();
    piece_ranges(l, &dense)
}

/// The file ranges of `pieces` of `layer`, merged.
fn piece_ranges(layer: &LayerWeights, pieces: &[Piece]) -> Vec<Range<u64>> {
    let ranges = pieces
        .iter()
        .flat_map(|p| piece_matrices(layer, p).expect("the layer's own pieces"))
        .map(|m| range_of(&m))
        .collect();
    merged(ranges, MERGE_GAP)
}

/// The units a streamed layer is read in: its pieces (of at most `piece_bytes`) in order, packed
/// while the unit's read stays within `piece_bytes` (a piece larger than that is a unit alone).
fn layer_units(l: usize, layer: &LayerWeights, piece_bytes: usize, sparse: bool) -> Vec<Unit> {
    let mut units = Vec::new();
    let mut group: Vec<Piece> = Vec::new();
    let unit = |group: Vec<Piece>| {
        let exact = piece_ranges(layer, &group);
        Unit {
            kind: UnitKind::Layer {
                layer: l,
                pieces: group,
            },
            reads: aligned(&exact),
            end: exact.last().map_or(0, |r| r.end),
        }
    };
    for p in pieces(layer, piece_bytes) {
        if sparse && p.part.is_ffn() {
            continue;
        }
        group.push(p);
        if group.len() > 1 && total(&aligned(&piece_ranges(layer, &group))) > piece_bytes as u64 {
            let last = group.pop().expect("just pushed");
            units.push(unit(std::mem::replace(&mut group, vec![last])));
        }
    }
    if !group.is_empty() {
        units.push(unit(group));
    }
    units
}

fn aligned(ranges: &[Range<u64>]) -> Vec<Range<u64>> {
    ranges
        .iter()
        .map(|r| align_down(r.start, PAGE as u64)..align_up(r.end, PAGE as u64))
        .collect()
}

fn total(ranges: &[Range<u64>]) -> u64 {
    ranges.iter().map(|r| r.end - r.start).sum()
}

/// `k` of `n` indices spread evenly (each of the first `k` multiples of `n / k`).
fn spread(n: usize, k: usize) -> Vec<bool> {
    let mut keep = vec![false; n];
    for i in 0..k {
        keep[i * n / k] = true;
    }
    keep
}

impl Floor {
    /// Every part together.
    pub fn total(&self) -> u64 {
        self.runtime
            + self.tokenizer
            + self.tables
            + self.session
            + self.ring
            + self.predictor
            + self.cache
    }
}

impl Plan {
    /// The plan for `w` in a process budget of `budget` bytes whose non-weight part is `floor`
    /// (its `ring` is filled in here). Errors, naming the bytes, if the budget cannot hold the
    /// floor and the ring.
    pub fn new(w: &Weights, budget: u64, floor: Floor) -> Result<Plan> {
        Plan::in_pieces(w, budget, floor, PIECE_BYTES)
    }

    /// [`Plan::new`] with the layers cut into pieces of at most `piece_bytes`.
    pub fn in_pieces(w: &Weights, budget: u64, floor: Floor, piece_bytes: usize) -> Result<Plan> {
        let opts = PlanOptions {
            piece_bytes,
            ..PlanOptions::default()
        };
        Plan::with_options(w, budget, floor, &opts)
    }

    /// The plan for `w` in `budget` as `opts` say. With a sparse FFN, a model that does not fit
    /// streams by neuron the layers where that reads faster than dense (their FFN is then
    /// neither resident nor in the ring); the neuron cache first takes the chunks worth more
    /// than a resident dense byte, then what the dense placement leaves.
    pub fn with_options(
        w: &Weights,
        budget: u64,
        mut floor: Floor,
        opts: &PlanOptions,
    ) -> Result<Plan> {
        let c = &w.config;
        let dense_layers = |sparse: &[bool]| -> u64 {
            w.layers
                .iter()
                .zip(sparse)
                .map(|(l, &s)| total(&layer_ranges(l, s, opts.piece_bytes)))
                .sum()
        };
        let fits = |sparse: &[bool]| {
            let head = range_of(&w.output);
            let embd = if c.tied_embeddings {
                0
            } else {
                total(&[range_of(&w.token_embd)])
            };
            head.end - head.start + embd + dense_layers(sparse)
                <= budget.saturating_sub(floor.total())
        };
        let none = vec![false; c.n_layers];
        let sparse_ffn: Vec<bool> = match &opts.sparse {
            Some(s) if !fits(&none) => w
                .layers
                .iter()
                .enumerate()
                .map(|(l, layer)| {
                    let ffn = total(&layer_ranges(layer, false, opts.piece_bytes))
                        - total(&layer_ranges(layer, true, opts.piece_bytes));
                    s.pays(l, ffn)
                })
                .collect(),
            _ => none,
        };
        let sparse_layers: Vec<usize> = (0..c.n_layers).filter(|&l| sparse_ffn[l]).collect();
        let mut hot = 0;
        if let Some(s) = opts.sparse.as_ref().filter(|_| !sparse_layers.is_empty()) {
            floor.predictor = s.predictor_bytes;
            floor.cache = s.cache_floor_bytes;
            // The hottest chunks are worth more than any resident dense byte: they go first,
            // within the room the dense placement leaves beside its ring.
            let units = w
                .layers
                .iter()
                .enumerate()
                .flat_map(|(l, layer)| layer_units(l, layer, opts.piece_bytes, sparse_ffn[l]));
            let ring = SLOTS as u64 * units.map(|u| u.bytes()).max().unwrap_or(0);
            let room = budget.saturating_sub(floor.total() + ring);
            hot = s
                .hot_bytes(&sparse_layers)
                .saturating_sub(floor.cache)
                .min(room);
        }
        // The dense placement may need a little more than the ring estimated (a streamed head's
        // pieces are a page wider): give the hot chunks back a quarter at a time until it fits.
        let mut plan = loop {
            let with_hot = Floor {
                cache: floor.cache + hot,
                ..floor
            };
            match Plan::dense(w, budget, with_hot, opts.piece_bytes, &sparse_ffn) {
                Err(Error::OverBudget { .. }) if hot > 0 => {
                    hot = align_down(hot / 4 * 3, PAGE as u64)
                }
                other => break other?,
            }
        };
        if let Some(s) = opts.sparse.as_ref().filter(|_| !sparse_layers.is_empty()) {
            // What the dense placement left goes to the cache too.
            let left = budget.saturating_sub(plan.planned_bytes());
            let all = s.all_bytes(&sparse_layers);
            plan.floor.cache = (plan.floor.cache + left).min(all.max(plan.floor.cache));
            plan.sparse_bytes_per_token = s.miss_bytes(&sparse_layers, plan.floor.cache) as u64;
            plan.sparse_ffn_file_bytes = all;
        }
        Ok(plan)
    }

    /// The dense placement of everything but the FFN of the layers `sparse_ffn` marks.
    fn dense(
        w: &Weights,
        budget: u64,
        floor: Floor,
        piece_bytes: usize,
        sparse_ffn: &[bool],
    ) -> Result<Plan> {
        let c = &w.config;
        let head_range = range_of(&w.output);
        let head_bytes = head_range.end - head_range.start;
        let embd_bytes = if c.tied_embeddings {
            0
        } else {
            let r = range_of(&w.token_embd);
            r.end - r.start
        };
        let layer_reads: Vec<Vec<Range<u64>>> = w
            .layers
            .iter()
            .zip(sparse_ffn)
            .map(|(l, &s)| layer_ranges(l, s, piece_bytes))
            .collect();
        let layer_bytes: Vec<u64> = layer_reads.iter().map(|r| total(r)).collect();
        let all = head_bytes + embd_bytes + layer_bytes.iter().sum::<u64>();
        let dense_bytes_per_token = w.dense_bytes_per_token() as u64;

        let mut plan = Plan {
            budget,
            floor,
            head: Placement::Resident,
            head_resident_rows: w.output.rows,
            embeddings: Placement::Resident,
            layers: vec![Placement::Resident; c.n_layers],
            units: Vec::new(),
            slot_bytes: 0,
            resident_bytes: 0,
            resident_ranges: Vec::new(),
            dense_bytes_per_token,
            row_bytes: w.token_embd.row_bytes() as u64,
            piece_bytes,
            sparse_ffn: sparse_ffn.to_vec(),
            sparse_bytes_per_token: 0,
            sparse_ffn_file_bytes: 0,
        };
        let weights_room = budget.saturating_sub(floor.total());
        if all > weights_room {
            plan.stream_what_does_not_fit(w, weights_room, head_bytes, &layer_reads)?;
        }
        plan.resident_ranges = plan.resident_ranges_of(w, &layer_reads);
        plan.resident_bytes = total(&plan.resident_ranges);
        Ok(plan)
    }

    fn stream_what_does_not_fit(
        &mut self,
        w: &Weights,
        room: u64,
        head_bytes: u64,
        layer_reads: &[Vec<Range<u64>>],
    ) -> Result<()> {
        let units: Vec<Vec<Unit>> = w
            .layers
            .iter()
            .enumerate()
            .map(|(l, layer)| layer_units(l, layer, self.piece_bytes, self.sparse_ffn[l]))
            .collect();
        let slot = units
            .iter()
            .flatten()
            .map(Unit::bytes)
            .max()
            .unwrap_or(0)
            .max(PAGE as u64);
        // Head pieces hold as many rows as a layer's slot; a piece's page-aligned read spans at
        // most its rows rounded up to pages plus one page. The ring is sized for that before
        // anything is placed, so that the room the head and the layers share is exact.
        let row_bytes = w.output.row_bytes() as u64;
        let rows_per_piece = (slot / row_bytes).max(1);
        let head_streams = head_bytes > room.saturating_sub(SLOTS as u64 * slot);
        self.slot_bytes = if head_streams {
            slot.max(align_up(rows_per_piece * row_bytes, PAGE as u64) + PAGE as u64)
        } else {
            slot
        };
        self.floor.ring = SLOTS as u64 * self.slot_bytes;
        self.embeddings = Placement::Streamed;
        let need = self.floor.total();
        if self.budget < need {
            return Err(Error::OverBudget {
                needed: need,
                budget: self.budget,
                what: format!(
                    "the smallest plan: runtime {} + tokenizer {} + tables {} + session {} + ring \
                     of {SLOTS} × {} (largest unit: layer pieces or head rows){}",
                    mib(self.floor.runtime),
                    mib(self.floor.tokenizer),
                    mib(self.floor.tables),
                    mib(self.floor.session),
                    mib(self.slot_bytes),
                    if self.floor.cache > 0 {
                        format!(
                            " + predictor {} + neuron cache {} (the chunks of one layer, and \
                             those selected more often than a dense byte is worth)",
                            mib(self.floor.predictor),
                            mib(self.floor.cache)
                        )
                    } else {
                        String::new()
                    }
                ),
            });
        }
        let mut room = room.saturating_sub(self.floor.ring);
        if !head_streams {
            room -= head_bytes;
            if w.config.tied_embeddings {
                self.embeddings = Placement::Resident;
            }
        }
        // As many layers as fit, spread evenly; the rest stream. Counted at the largest layer's
        // size, so that whichever layers the spread picks fit (a model's layers have one shape).
        // A streamed head gets what they leave, row by row: a byte of either is read once a
        // token, but a resident body lets speculative decoding draft from the head's resident
        // rows without reading anything (see `generate::speculate`).
        let largest = layer_reads
            .iter()
            .map(|r| total(r))
            .max()
            .unwrap_or(0)
            .max(1);
        let k = ((room / largest) as usize).min(self.layers.len());
        room -= k as u64 * largest;
        let keep = spread(self.layers.len(), k);
        for ((l, keep), units) in keep.into_iter().enumerate().zip(units) {
            if !keep {
                self.layers[l] = Placement::Streamed;
                self.units.extend(units);
            }
        }
        if head_streams {
            // The head's first rows fill what the layers left.
            self.head = Placement::Streamed;
            self.head_resident_rows = ((room / row_bytes) as usize).min(w.output.rows);
        }
        if self.head == Placement::Streamed {
            let rows_per_piece = rows_per_piece as usize;
            let start = range_of(&w.output).start;
            let mut r0 = self.head_resident_rows;
            while r0 < w.output.rows {
                let r1 = (r0 + rows_per_piece).min(w.output.rows);
                let bytes = start + r0 as u64 * row_bytes..start + r1 as u64 * row_bytes;
                self.units.push(Unit {
                    kind: UnitKind::Head { rows: r0..r1 },
                    reads: aligned(std::slice::from_ref(&bytes)),
                    end: bytes.end,
                });
                r0 = r1;
            }
            debug_assert!(
                self.units.iter().all(|u| u.bytes() <= self.slot_bytes),
                "a head piece's read is wider than the slot it was sized for"
            );
        }
        Ok(())
    }

    fn resident_ranges_of(&self, w: &Weights, layer_reads: &[Vec<Range<u64>>]) -> Vec<Range<u64>> {
        let mut out = Vec::new();
        let head = range_of(&w.output);
        match self.head {
            Placement::Resident => out.push(head),
            Placement::Streamed if self.head_resident_rows > 0 => {
                let kept = self.head_resident_rows as u64 * w.output.row_bytes() as u64;
                out.push(head.start..head.start + kept);
            }
            Placement::Streamed => {}
        }
        if self.embeddings == Placement::Resident {
            out.push(range_of(&w.token_embd));
        }
        for (l, p) in self.layers.iter().enumerate() {
            if *p == Placement::Resident {
                out.extend(layer_reads[l].iter().cloned());
            }
        }
        merged(out, 0)
    }

    /// Whether anything streams.
    pub fn streams(&self) -> bool {
        !self.units.is_empty()
    }

    /// Bytes of units read per decoded token: every unit once, page-aligned.
    pub fn unit_bytes_per_token(&self) -> u64 {
        self.units.iter().map(Unit::bytes).sum()
    }

    /// Bytes read from storage per decoded token: the units and, when the embeddings stream,
    /// the pages of one row (at most two pages more than the row).
    pub fn streamed_bytes_per_token(&self) -> u64 {
        let rows = if self.embeddings == Placement::Streamed {
            self.row_bytes.next_multiple_of(PAGE as u64) + PAGE as u64
        } else {
            0
        };
        self.unit_bytes_per_token() + rows
    }

    /// What the process is planned to hold: floor plus resident weights.
    pub fn planned_bytes(&self) -> u64 {
        self.floor.total() + self.resident_bytes
    }

    /// Bytes read per decoded token: the dense stream and the sparse layers' expected misses.
    pub fn read_bytes_per_token(&self) -> u64 {
        self.streamed_bytes_per_token() + self.sparse_bytes_per_token
    }

    /// The head's resident leading rows when they can serve as a draft's shortlist: the head
    /// streams, some of its rows and every layer are resident and no FFN streams by neuron, so
    /// a token's pass over the body and those rows reads nothing but its embedding row.
    /// `None` otherwise.
    pub fn shortlist_rows(&self) -> Option<usize> {
        let body_resident = self.layers.iter().all(|l| *l == Placement::Resident);
        (self.head == Placement::Streamed
            && self.head_resident_rows > 0
            && body_resident
            && !self.is_sparse())
        .then_some(self.head_resident_rows)
    }

    /// Whether any layer's FFN streams by neuron.
    pub fn is_sparse(&self) -> bool {
        self.sparse_ffn.iter().any(|&s| s)
    }

    /// File bytes of the FFN of every layer that streams by neuron (`sparse_ffn`): all their
    /// chunks, which the neuron cache streams from (neither resident nor in the ring); 0 for a
    /// dense plan.
    pub fn sparse_ffn_bytes(&self) -> u64 {
        self.sparse_ffn_file_bytes
    }

    /// Tokens per second if reading were the only cost: the dense stream at `disk.dense` and
    /// the sparse misses at `disk.sparse` (`None` when nothing is read).
    pub fn io_bound_tok_s(&self, disk: DiskSpeeds) -> Option<f64> {
        let seconds = self.streamed_bytes_per_token() as f64 / disk.dense
            + self.sparse_bytes_per_token as f64 / disk.sparse;
        ((self.streams() || self.is_sparse()) && seconds > 0.0).then(|| 1.0 / seconds)
    }

    /// The placement as a human-readable table.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let streamed_layers = self
            .layers
            .iter()
            .filter(|p| **p == Placement::Streamed)
            .count();
        let _ = writeln!(s, "budget            {:>10}", mib(self.budget));
        let f = &self.floor;
        let _ = writeln!(s, "  runtime         {:>10}", mib(f.runtime));
        let _ = writeln!(s, "  tokenizer       {:>10}", mib(f.tokenizer));
        let _ = writeln!(s, "  tables          {:>10}", mib(f.tables));
        let _ = writeln!(s, "  session + KV    {:>10}", mib(f.session));
        let _ = writeln!(
            s,
            "  stream ring     {:>10}  ({SLOTS} × {})",
            mib(f.ring),
            mib(self.slot_bytes)
        );
        if self.is_sparse() {
            let _ = writeln!(s, "  predictor       {:>10}", mib(f.predictor));
            let _ = writeln!(s, "  neuron cache    {:>10}", mib(f.cache));
        }
        let _ = writeln!(s, "  resident weights{:>10}", mib(self.resident_bytes));
        let _ = writeln!(s, "  planned total   {:>10}", mib(self.planned_bytes()));
        let _ = write!(s, "output head       {:?}", self.head);
        if self.head == Placement::Streamed && self.head_resident_rows > 0 {
            let _ = write!(s, " ({} leading rows resident)", self.head_resident_rows);
        }
        let _ = writeln!(s);
        let _ = writeln!(s, "embeddings        {:?}", self.embeddings);
        let _ = writeln!(
            s,
            "layers            {} resident, {} streamed{}",
            self.layers.len() - streamed_layers,
            streamed_layers,
            if streamed_layers > 0 {
                format!(
                    " ({})",
                    self.layers
                        .iter()
                        .map(|p| if *p == Placement::Resident { 'R' } else { 's' })
                        .collect::<String>()
                )
            } else {
                String::new()
            }
        );
        if self.is_sparse() {
            let _ = writeln!(
                s,
                "FFN by neuron     {} of {} layers ({})",
                self.sparse_ffn.iter().filter(|&&x| x).count(),
                self.sparse_ffn.len(),
                self.sparse_ffn
                    .iter()
                    .map(|&x| if x { 'n' } else { 'd' })
                    .collect::<String>()
            );
        }
        let _ = writeln!(
            s,
            "read per token    {:>10}  of {} dense ({} streamed dense, {} by neuron)",
            mib(self.read_bytes_per_token()),
            mib(self.dense_bytes_per_token),
            mib(self.streamed_bytes_per_token()),
            mib(self.sparse_bytes_per_token)
        );
        s
    }
}

/// Parses a size: binary (`KiB`, `MiB`, `GiB`, `TiB`, and the short `K`, `M`, `G`, `T`) and
/// decimal (`kB`, `MB`, `GB`, `TB`) units, case-insensitive; no unit means bytes; fractions
/// allowed (`1.5GiB`).
pub fn parse_bytes(text: &str) -> std::result::Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    if number.is_empty() {
        return Err(format!("`{text}` does not start with a number"));
    }
    let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        other => return Err(format!("unknown unit `{other}` in `{text}`")),
    };
    let bytes = if let Ok(n) = number.parse::<u64>() {
        n.checked_mul(multiplier)
    } else {
        let f: f64 = number
            .parse()
            .map_err(|_| format!("`{number}` is not a number"))?;
        let b = f * multiplier as f64;
        (b.is_finite() && b >= 0.0 && b < u64::MAX as f64).then_some(b as u64)
    };
    bytes.ok_or_else(|| format!("`{text}` is too large"))
}

/// Bytes as MiB with one decimal.
pub fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merging_bridges_small_gaps_only() {
        let m = merged(
            vec![100..200, 0..50, 250..300, 300 + MERGE_GAP + 1..400_000],
            MERGE_GAP,
        );
        assert_eq!(m, vec![0..300, 300 + MERGE_GAP + 1..400_000]);
        assert_eq!(merged(vec![10..20, 0..10, 30..40], 0), vec![0..20, 30..40]);
    }

    #[test]
    fn spread_keeps_k_evenly() {
        assert_eq!(spread(4, 2), vec![true, false, true, false]);
        assert_eq!(spread(3, 0), vec![false; 3]);
        assert_eq!(spread(3, 3), vec![true; 3]);
    }

    #[test]
    fn sparse_ffn_bytes_are_the_ffn_of_the_layers_by_neuron() {
        use crate::model::lsm::synth::{SynthOptions, SynthShape, SynthTokenizer, synthesize};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.lsm");
        let mut synth = SynthOptions::new(SynthShape {
            n_layers: 4,
            ..SynthShape::TINY
        });
        synth.sparsity = 0.8;
        synth.chunk_neurons = 1;
        synthesize(&path, &synth, &SynthTokenizer::tiny(), &mut |_, _| {}).unwrap();
        let (w, _, _) = crate::model::load_mapped(&path).unwrap();
        let mut opts = PlanOptions::for_file(&path, PlacementPolicy::Auto).unwrap();
        opts.piece_bytes = 64 << 10;
        let sparse = opts.sparse.as_mut().expect("a calibrated synthetic model");
        // A disk as fast for chunks as for large reads: every layer pays by neuron but layer 1,
        // whose every chunk is read.
        sparse.disk = DiskSpeeds {
            dense: 1e9,
            sparse: 1e9,
        };
        sparse.chunk_probability[1].fill(1.0);
        // The smallest budget (in 64 KiB steps) under the weights that holds the plan.
        let mut budget = sparse.predictor_bytes + sparse.cache_floor_bytes;
        let plan = loop {
            if let Ok(p) = Plan::with_options(&w, budget, Floor::default(), &opts) {
                break p;
            }
            budget += 64 << 10;
            assert!(budget < 64 << 20, "no budget holds the plan");
        };
        assert_eq!(plan.sparse_ffn, vec![true, false, true, true]);
        // Each sparse layer's FFN is its chunks in the file: its bundles, each chunk padded.
        let layout = crate::model::lsm::ChunkLayout::from_header(
            &path,
            &crate::model::lsm::LsmFile::open(&path).unwrap().header,
        )
        .unwrap();
        let layer = (layout.chunks_per_layer * layout.chunk_bytes) as u64;
        assert_eq!(plan.sparse_ffn_bytes(), 3 * layer);
        // The layer's bundles in one piece span all of it but the last chunk's padding.
        let bundles: Vec<Range<u64>> = pieces(&w.layers[0], usize::MAX)
            .iter()
            .filter(|p| p.part.is_ffn())
            .flat_map(|p| piece_matrices(&w.layers[0], p).unwrap())
            .map(|m| range_of(&m))
            .collect();
        let data = total(&merged(bundles, 0));
        assert!(
            data <= layer && layer - data < layout.chunk_bytes as u64,
            "{data}"
        );
        // Nothing streams by neuron in a dense plan, resident or not.
        let dense = PlanOptions {
            piece_bytes: 64 << 10,
            sparse: None,
        };
        for budget in [budget, u64::MAX / 2] {
            let plan = Plan::with_options(&w, budget, Floor::default(), &dense).unwrap();
            assert_eq!(plan.sparse_ffn_bytes(), 0);
        }
    }

    #[test]
    fn slot_offsets_follow_the_reads() {
        let u = Unit {
            kind: UnitKind::Head { rows: 0..1 },
            reads: vec![4096..8192, 16384..24576],
            end: 20000,
        };
        assert_eq!(u.bytes(), 4096 + 8192);
        assert_eq!(u.slot_offset(&(4100..4200)), Some(4));
        assert_eq!(u.slot_offset(&(16384..16400)), Some(4096));
        assert_eq!(u.slot_offset(&(8000..9000)), None);
    }
}
