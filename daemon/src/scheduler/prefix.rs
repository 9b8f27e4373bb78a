//! Shared prompt prefixes: a session whose prompt starts with tokens another session of the
//! same user and model has already run (a robot's system prompt) starts from their keys and
//! values instead of computing them.
//!
//! Policy:
//! - Sharing stays within one user (the uid that owns the session): a session looks only at
//!   its own user's stored prefixes and open sessions, and a prefix is stored under the user
//!   whose session computed it. **Invariant:** a `done` event's `cached_prompt_tokens` counts
//!   only tokens that a session of the same user computed, so how much of a prompt was cached
//!   tells a client nothing about another user's prompts (a second user who knew an app's
//!   system prompt could otherwise probe it with guesses of what follows and read which one
//!   matched longer).
//! - A new prompt first looks in its model's stored prefixes ([`LoadedModel::prefixes`]) of
//!   its user for the longest one it starts with.
//! - Failing that, it looks at the user's other open sessions of the model: when one has run
//!   at least [`MIN_SHARED_TOKENS`] of the same first tokens, those positions are snapshotted
//!   (no copy: the blocks become shared) and stored, so later sessions of the user find them
//!   even after that session is gone.
//! - A stored prefix is paid once, in the model's reservation (the sessions sharing its blocks
//!   do not pay for them). A model keeps at most [`MAX_PREFIXES`], so one-off prompts cannot
//!   pile up: a new one takes the place of the least recently used prefix that no session
//!   reads (one that sessions read stays: they do not pay for its blocks), and its bytes go
//!   back to the budget. Only CPU sessions of the same precision and KV type share.
//! - Nothing here is required for correctness: when a step is refused (the budget, a layout
//!   that does not match) the prompt is simply computed.

use std::collections::BTreeMap;
use std::sync::{Arc, PoisonError};
use std::time::Instant;

use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::forward::Session;
use leanstream_engine::kv::KvType;

use super::room::need;
use super::{Entry, SessionBudget};
use crate::arbiter::SessionId;
use crate::loader::{LoadedModel, SharedPrefix};

/// Fewest tokens worth sharing: one KV block. Shorter prefixes (a chat template's header) cost
/// less to compute than a slot in the store.
pub const MIN_SHARED_TOKENS: usize = leanstream_engine::kv::KV_BLOCK_TOKENS;

/// Most prefixes a model keeps.
pub const MAX_PREFIXES: usize = 4;

/// Starts session `id` (reset, holding nothing) from the longest shared prefix of `ids`, when
/// there is one; returns how many tokens it holds now (0: none). Always leaves at least one
/// token of `ids` to run, which gives the logits to sample from.
pub fn adopt(
    sessions: &mut BTreeMap<SessionId, Entry>,
    budget: &dyn SessionBudget,
    id: SessionId,
    ids: &[u32],
) -> usize {
    let Some(entry) = sessions.get(&id) else {
        return 0;
    };
    let model = Arc::clone(&entry.model);
    let mut store = model
        .prefixes
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let Some(mut me) = sessions.remove(&id) else {
        return 0;
    };
    let user = me.user;
    let adopted = match me.session.as_cpu() {
        Some(cpu) => {
            let stored = best_stored(&store, user, cpu, ids);
            let stored_len = stored.map_or(0, |i| store[i].tokens.len());
            let found = match live_source(sessions, &model, user, cpu, ids, stored_len) {
                Some(source) => store_from(&mut store, sessions, budget, &model, source, ids),
                None => stored,
            };
            found.and_then(|i| {
                let prefix = &mut store[i];
                cpu.adopt_prefix(&prefix.kv).ok()?;
                prefix.last_used = Instant::now();
                Some(prefix.tokens.len())
            })
        }
        None => None,
    };
    if let Some(n) = adopted {
        me.seen = ids[..n].to_vec();
        // Adopting freed what the session held of its own in those positions: a decrease.
        let _ = budget.resize(id, me.session.bytes());
        tracing::debug!("session {id}: starts from a shared prefix of {n} tokens");
    }
    sessions.insert(id, me);
    adopted.unwrap_or(0)
}

/// What keys and values must share to be read by another session: the precision they were
/// computed in and the type they are stored in (the model is checked apart).
fn numbers(session: &Session) -> (Precision, KvType) {
    (session.precision(), session.kv_type())
}

/// Whether `session` can read keys and values computed as `prefix`'s were.
fn compatible(prefix: &SharedPrefix, session: &Session) -> bool {
    (prefix.precision, prefix.kv.kv_type()) == numbers(session)
}

/// The longest prefix stored by `user` that `ids` starts with (and goes beyond).
fn best_stored(store: &[SharedPrefix], user: u32, session: &Session, ids: &[u32]) -> Option<usize> {
    (0..store.len())
        .filter(|&i| {
            let p = &store[i];
            p.user == user
                && p.tokens.len() < ids.len()
                && ids.starts_with(&p.tokens)
                && compatible(p, session)
        })
        .max_by_key(|&i| store[i].tokens.len())
}

/// The open session of `user` on `model` that has run the longest common prefix with `ids`,
/// when that is at least [`MIN_SHARED_TOKENS`] and longer than `than`: its id and the prefix's
/// length.
fn live_source(
    sessions: &mut BTreeMap<SessionId, Entry>,
    model: &Arc<LoadedModel>,
    user: u32,
    me: &Session,
    ids: &[u32],
    than: usize,
) -> Option<(SessionId, usize)> {
    sessions
        .iter_mut()
        .filter(|(_, e)| e.user == user && Arc::ptr_eq(&e.model, model))
        .filter_map(|(&other, e)| {
            let cpu = e.session.as_cpu()?;
            let same = numbers(cpu) == numbers(me);
            // The other session's KV cache holds `seen` up to its position.
            let run = e.seen.len().min(cpu.position());
            let common = e.seen[..run]
                .iter()
                .zip(ids)
                .take_while(|(a, b)| a == b)
                .count()
                .min(ids.len() - 1);
            same.then_some((other, common))
        })
        .filter(|&(_, n)| n >= MIN_SHARED_TOKENS && n > than)
        .max_by_key(|&(_, n)| n)
}

/// Snapshots the first `n` positions of session `source` into the store, paid by the model
/// and kept for the source's user; returns its index. `None` when the store is full of prefixes
/// sessions read, the budget refuses, or the snapshot fails.
fn store_from(
    store: &mut Vec<SharedPrefix>,
    sessions: &mut BTreeMap<SessionId, Entry>,
    budget: &dyn SessionBudget,
    model: &LoadedModel,
    (source, n): (SessionId, usize),
    ids: &[u32],
) -> Option<usize> {
    if store.len() >= MAX_PREFIXES && !evict_unused(store, budget, &model.name) {
        return None;
    }
    let e = sessions.get_mut(&source)?;
    let user = e.user;
    let cpu = e.session.as_cpu()?;
    let kv = cpu.share_prefix(n).ok()?;
    if let Err(err) = budget.grow_model(&model.name, kv.bytes()) {
        tracing::debug!("model {}: a shared prefix does not fit: {err}", model.name);
        return None; // dropping `kv` gives the blocks back to the source alone
    }
    // The source no longer pays for the shared blocks: a decrease. A prompt it is still
    // running keeps reserved what its rest will fill (the copy of a shared block it writes
    // into included, which costs less than the blocks it no longer pays for), and its
    // verification rows buffer.
    let keep = match &mut e.run {
        Some(r) => {
            r.reserved = (need(&*cpu, &r.stepper) + r.rows_bytes()).min(r.reserved);
            r.reserved
        }
        None => cpu.bytes(),
    };
    let _ = budget.resize(source, keep);
    tracing::info!(
        "model {}: prefix of {n} tokens shared ({} KiB, {} stored)",
        model.name,
        kv.bytes() / 1024,
        store.len() + 1
    );
    store.push(SharedPrefix {
        user,
        tokens: ids[..n].to_vec(),
        precision: cpu.precision(),
        kv,
        last_used: Instant::now(),
    });
    Some(store.len() - 1)
}

/// Drops the least recently used prefix of `store` that no session reads, handing its bytes
/// back to model `model`'s reservation; false when every prefix is read.
fn evict_unused(store: &mut Vec<SharedPrefix>, budget: &dyn SessionBudget, model: &str) -> bool {
    let Some(i) = (0..store.len())
        .filter(|&i| !store[i].kv.in_use())
        .min_by_key(|&i| store[i].last_used)
    else {
        return false;
    };
    let gone = store.remove(i);
    let bytes = gone.kv.bytes();
    drop(gone); // the blocks are the store's alone: freed here
    budget.shrink_model(model, bytes);
    tracing::info!(
        "model {model}: least recently used prefix evicted ({} KiB)",
        bytes / 1024
    );
    true
}
