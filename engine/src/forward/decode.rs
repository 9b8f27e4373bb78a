//! [`Decode`]: one conversation's forward passes, whatever computes them. The CPU [`Session`]
//! implements it here, the GPU's `GpuSession` in `forward/gpu/`, and the sparse pipelines wrap
//! either (`pipeline::WithFfn`); the generation loop (`crate::generate`) drives any of them.

use super::{FfnExecutor, Session};
use crate::{Error, Result};

/// A forward pass that decodes one conversation: the CPU [`Session`], or with feature `cuda`
/// the GPU's `GpuSession`. `generate::generate` and `generate::score` run on either.
pub trait Decode: std::fmt::Debug {
    /// Runs `token` at the next position; returns the logits.
    fn forward(&mut self, token: u32) -> Result<&mut [f32]>;
    /// Runs `tokens` at the next positions; returns the logits of the last.
    fn forward_batch(&mut self, tokens: &[u32]) -> Result<&mut [f32]>;
    /// Tokens in the KV cache.
    fn position(&self) -> usize;
    /// Room of the KV cache, in tokens.
    fn max_context(&self) -> usize;
    /// Size of the vocabulary (the logits' length).
    fn vocab_size(&self) -> usize;
    /// Runs `token` with each layer's FFN computed by `exec` (the sparse pipelines).
    fn forward_with(&mut self, token: u32, exec: &mut dyn FfnExecutor) -> Result<&mut [f32]>;
    /// Runs `tokens` with each layer's FFN computed by `exec`; returns the logits of the last.
    /// Token by token unless the session can pass several rows at once (the CPU session: its
    /// streamed pieces are then read once per [`super::MAX_BATCH`] tokens, not once a
    /// token).
    fn forward_batch_through(
        &mut self,
        tokens: &[u32],
        exec: &mut dyn FfnExecutor,
    ) -> Result<&mut [f32]> {
        let (last, rest) = tokens.split_last().ok_or_else(|| Error::InvalidArgument {
            arg: "tokens",
            reason: "an empty batch".into(),
        })?;
        for &t in rest {
            self.forward_with(t, exec)?;
        }
        self.forward_with(*last, exec)
    }
    /// Runs `tokens` at the next positions, each layer's FFN through `exec` when given, and
    /// writes every token's logits into `out` (one row of [`Decode::vocab_size`]-or-wider
    /// logits each, in order): a verification pass of speculative decoding. Token by token
    /// unless the session can pass several rows at once (the CPU session reads each weight,
    /// streamed or not, once for all of them).
    fn forward_rows(
        &mut self,
        tokens: &[u32],
        mut exec: Option<&mut dyn FfnExecutor>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        out.clear();
        for &t in tokens {
            let logits = match exec.as_deref_mut() {
                Some(exec) => self.forward_with(t, exec)?,
                None => self.forward(t)?,
            };
            out.extend_from_slice(logits);
        }
        Ok(())
    }
    /// The size of the shortlist of head rows this session drafts from without reading
    /// anything ([`Session::forward_shortlist`]); `None` where it has none (the default).
    fn shortlist(&self) -> Option<usize> {
        None
    }
    /// Runs `token` and up to `n - 1` tokens drafted from the shortlist after it, writing the
    /// tokens run into `fed` and every position's full logits into `out`
    /// ([`Session::forward_shortlist`]). A session without a shortlist drafts nothing: it runs
    /// `token` alone (the default).
    fn forward_shortlist(
        &mut self,
        token: u32,
        n: usize,
        fed: &mut Vec<u32>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let _ = n;
        fed.clear();
        fed.push(token);
        self.forward_rows(&[token], None, out)
    }
    /// Forgets every token after the first `position` (the rejected tokens of a verification
    /// pass). Errors if `position` is past [`Decode::position`].
    fn rewind(&mut self, position: usize) -> Result<()>;
    /// Forgets the conversation (what it holds stays allocated for the next one).
    fn reset(&mut self);
    /// Every byte the session holds now, host and device (KV cache and scratch; not the shared
    /// model), from its allocations.
    fn bytes(&self) -> u64;
    /// Bytes that must be allocated so that `tokens` more tokens fit after
    /// [`Decode::position`]; 0 if they already fit. The caller checks `max_context` itself.
    fn kv_growth_bytes(&self, tokens: usize) -> u64;
    /// Allocates what [`Decode::kv_growth_bytes`]`(tokens)` counts; errors if `tokens` more do
    /// not fit in the context. Forward passes grow by themselves; a scheduler calls this after
    /// reserving the bytes.
    fn grow_kv(&mut self, tokens: usize) -> Result<()>;
    /// Forgets the conversation and frees the KV memory it can give back.
    fn release_kv(&mut self);
    /// The CPU session behind this one, which [`super::forward_each`] can batch with
    /// others; `None` for any other kind (the GPU's, a wrapper).
    fn as_cpu(&mut self) -> Option<&mut Session> {
        None
    }
    /// Bytes of GPU memory held (weights, KV cache, scratch); `None` on the CPU.
    fn device_bytes(&self) -> Option<u64> {
        None
    }
}

impl Decode for Session {
    fn forward(&mut self, token: u32) -> Result<&mut [f32]> {
        Session::forward(self, token)
    }
    fn forward_batch(&mut self, tokens: &[u32]) -> Result<&mut [f32]> {
        Session::forward_batch(self, tokens)
    }
    fn position(&self) -> usize {
        Session::position(self)
    }
    fn max_context(&self) -> usize {
        Session::max_context(self)
    }
    fn vocab_size(&self) -> usize {
        self.model().weights.config.vocab_size
    }
    fn forward_with(&mut self, token: u32, exec: &mut dyn FfnExecutor) -> Result<&mut [f32]> {
        Session::forward_with(self, token, exec)
    }
    fn forward_batch_through(
        &mut self,
        tokens: &[u32],
        exec: &mut dyn FfnExecutor,
    ) -> Result<&mut [f32]> {
        if tokens.is_empty() {
            return Err(Error::InvalidArgument {
                arg: "tokens",
                reason: "an empty batch".into(),
            });
        }
        Session::forward_batch_with(self, tokens, exec, &mut |_, _| Ok(()))?;
        Ok(self.logits())
    }
    fn forward_rows(
        &mut self,
        tokens: &[u32],
        exec: Option<&mut dyn FfnExecutor>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        Session::forward_rows(self, tokens, exec, out)
    }
    fn rewind(&mut self, position: usize) -> Result<()> {
        Session::rewind(self, position)
    }
    fn shortlist(&self) -> Option<usize> {
        Session::shortlist(self)
    }
    fn forward_shortlist(
        &mut self,
        token: u32,
        n: usize,
        fed: &mut Vec<u32>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        Session::forward_shortlist(self, token, n, fed, out)
    }
    fn reset(&mut self) {
        Session::reset(self)
    }
    fn bytes(&self) -> u64 {
        Session::bytes(self)
    }
    fn kv_growth_bytes(&self, tokens: usize) -> u64 {
        Session::kv_growth_bytes(self, tokens)
    }
    fn grow_kv(&mut self, tokens: usize) -> Result<()> {
        Session::grow_kv(self, tokens)
    }
    fn release_kv(&mut self) {
        Session::release_kv(self)
    }
    fn as_cpu(&mut self) -> Option<&mut Session> {
        Some(self)
    }
}
