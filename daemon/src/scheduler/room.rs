//! A generation's way to the budget (the scheduler's module docs, "Memory"): at its start, the
//! KV its prompt and first generated token will fill and the buffer of its verification rows;
//! then each KV block a decode step adds. Every reservation is absolute (the session's whole
//! bytes), so each one made here counts everything the run holds.

use leanstream::contract::{LeanStreamError, Priority};
use leanstream_engine::generate::speculate::MAX_DRAFT;
use leanstream_engine::generate::{Decode, Next, Stepper};

use super::run::Failure;
use super::{LoadedModel, SessionBudget};
use crate::arbiter::SessionId;

/// A session's way to the budget.
pub struct Room<'a> {
    pub id: SessionId,
    pub budget: &'a dyn SessionBudget,
    /// Bytes the run holds beside the session's own, in its reservation: the verification rows
    /// buffer ([`Run::rows_bytes`](super::run::Run::rows_bytes)). Every reservation made here
    /// counts them, so that raising it for the KV cache never drops them.
    pub beside: u64,
}

impl Room<'_> {
    /// Reserves at once what `session` will hold once the rest of `stepper`'s prompt and the first
    /// generated token are in its KV cache ([`need`]), and returns it (the run's
    /// [`Run::reserved`](super::run::Run::reserved)). `OverBudget` when that does not fit: the
    /// generation is then refused before it runs. Prompts that arrive together thus each get all
    /// the KV they will fill, or are refused one by one, instead of each growing block by block
    /// until all run out half-way.
    pub fn reserve_prompt(
        &self,
        session: &dyn Decode,
        stepper: &Stepper,
    ) -> Result<u64, LeanStreamError> {
        let bytes = need(session, stepper) + self.beside;
        if bytes > session.bytes() {
            self.budget.resize(self.id, bytes)?;
        }
        Ok(bytes)
    }

    /// Turns speculative decoding on for `stepper`, a generation of `class` on `model` (whose
    /// logits are `vocab` wide), when the model speculates and the buffer of its verification
    /// rows fits the budget beside `reserved`, the run's reservation, which then holds it too.
    /// Returns the stepper and the buffer, its capacity allocated once for the longest pass
    /// (empty without speculation). A budget that holds the prompt but not the rows runs the
    /// generation without speculation: the same tokens, one pass each.
    pub fn speculate(
        &self,
        stepper: Stepper,
        model: &LoadedModel,
        vocab: usize,
        class: Priority,
        reserved: &mut u64,
    ) -> (Stepper, Vec<f32>) {
        let drafts = max_draft(class);
        let Some(speculation) = model.speculation(drafts) else {
            return (stepper, Vec::new());
        };
        let len = (drafts + 1) * vocab;
        let bytes = (len * std::mem::size_of::<f32>()) as u64;
        match self.budget.resize(self.id, *reserved + bytes) {
            Ok(()) => {
                *reserved += bytes;
                (stepper.speculate(speculation), Vec::with_capacity(len))
            }
            Err(e) => {
                tracing::debug!("session {}: runs without speculation: {e}", self.id);
                (stepper, Vec::new())
            }
        }
    }

    /// Makes room in the KV cache for `tokens` more tokens: reserves the blocks they need
    /// first (unless `reserved`, the run's reservation, holds them already: a prompt's pieces),
    /// then allocates them. Nothing is allocated when the reservation is refused. The
    /// reservation is absolute, so it is only ever raised here, never set below `reserved`.
    pub fn grow(
        &self,
        session: &mut dyn Decode,
        tokens: usize,
        reserved: &mut u64,
    ) -> Result<(), Failure> {
        let extra = session.kv_growth_bytes(tokens);
        if extra == 0 {
            return Ok(());
        }
        let bytes = session.bytes() + extra + self.beside;
        if bytes > *reserved {
            self.budget
                .resize(self.id, bytes)
                .map_err(Failure::Budget)?;
            *reserved = bytes;
        }
        Ok(session.grow_kv(tokens)?)
    }
}

/// Most tokens a generation of the realtime class drafts a pass: a verification pass of more
/// rows takes longer, and that class is served for its latency, not its throughput.
pub const REALTIME_MAX_DRAFT: usize = 2;

/// Most tokens a generation of `class` drafts after each emitted token: the engine's
/// [`MAX_DRAFT`], or [`REALTIME_MAX_DRAFT`] for the realtime class.
pub fn max_draft(class: Priority) -> usize {
    match class {
        Priority::Realtime => REALTIME_MAX_DRAFT,
        Priority::Interactive | Priority::Background => MAX_DRAFT,
    }
}

/// The bytes `session` holds once what `stepper` still has to write up to its first generated
/// token is in its KV cache: the rest of the prompt and that token while it prefills, nothing
/// more after that (decode steps reserve block by block: [`Room::grow`]).
pub fn need(session: &dyn Decode, stepper: &Stepper) -> u64 {
    let ahead = match stepper.next() {
        Next::Prefill(rest) => rest.len() + 1,
        Next::Forward(_) | Next::Draft(..) | Next::Emit(_) | Next::Done(_) => 0,
    };
    session.bytes() + session.kv_growth_bytes(ahead)
}
