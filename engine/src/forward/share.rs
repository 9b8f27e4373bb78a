//! Prefix sharing between sessions: a conversation's first tokens (a robot's system prompt),
//! computed once, read by every session that starts with them.
//!
//! 1. A session that has run the prefix snapshots it: [`Session::share_prefix`] returns a
//!    [`KvPrefix`] holding its first blocks (the session stops paying for them);
//! 2. another session of the same model adopts it ([`Session::adopt_prefix`]) and runs the rest
//!    of its prompt from there;
//! 3. whoever writes into a block still shared copies it first: [`Session::kv_growth_bytes`]
//!    counts the copy, [`Session::grow_kv`] makes it, so the forward pass allocates none.

use super::Session;
use crate::kv::KvPrefix;
use crate::{Error, Result};

impl Session {
    /// The keys and values of this conversation's first `n` tokens, for other sessions of this
    /// model to [`Session::adopt_prefix`]. The blocks are shared, not copied: this session's
    /// [`Session::bytes`] drops by them and the prefix's holder pays for them
    /// ([`KvPrefix::bytes`]); this session's next write into one copies it back.
    ///
    /// Errors if `n` exceeds [`Session::position`].
    pub fn share_prefix(&self, n: usize) -> Result<KvPrefix> {
        if n > self.pos {
            return Err(Error::InvalidArgument {
                arg: "prefix",
                reason: format!("{n} tokens exceed the {} the session has run", self.pos),
            });
        }
        self.kv.prefix(n)
    }

    /// Starts a new conversation from `prefix`: as if this session had been reset and had run
    /// the prefix's tokens, without computing them. Its blocks are shared (no allocation): the
    /// first write into a shared block copies it ([`Session::kv_growth_bytes`] counts it).
    /// The logits are not adopted: run at least one more token before sampling.
    ///
    /// The prefix must come from a session of this model with this precision: a prefix knows
    /// only its shape, and keys and values of other weights fit it as well. Errors, changing
    /// nothing, if its KV type or shape (layers, KV row width) differ from this session's or it
    /// does not fit in [`Session::max_context`] laid out the same way (see
    /// [`crate::kv::KvCache::adopt`]).
    pub fn adopt_prefix(&mut self, prefix: &KvPrefix) -> Result<()> {
        self.kv.adopt(prefix)?;
        self.pos = prefix.tokens();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::Arc;

    use super::*;
    use crate::backend::cpu::Precision;
    use crate::forward::{Model, session_open_bytes};
    use crate::kv::{KV_BLOCK_TOKENS, KvCache, KvType};
    use crate::model::gguf::{TinyArch, TinyLlama};
    use crate::quant::DType;
    use crate::sample::argmax;

    /// The tiny Llama of seed 7 with `layers` layers (its context is 256 tokens).
    fn tiny(dir: &Path, layers: usize) -> Arc<Model> {
        let path = dir.join(format!("tiny-{layers}.gguf"));
        TinyLlama::with_layers(7, TinyArch::Llama, layers)
            .write_gguf(&path, DType::Q8_0)
            .unwrap();
        Model::load(&path).unwrap()
    }

    fn open(model: &Arc<Model>, max_context: usize, kv: KvType) -> Session {
        Session::new(Arc::clone(model), max_context, Precision::Exact, kv).unwrap()
    }

    /// `n` token ids of the tiny vocabulary (128), varied, drawn by `seed`.
    fn tokens(n: usize, seed: usize) -> Vec<u32> {
        (0..n)
            .map(|i| ((i * 37 + seed * 11 + 5) % 128) as u32)
            .collect()
    }

    /// Logits of the rest of `prompt` after `s.position()` tokens, then of `steps` greedy steps.
    fn finish(s: &mut Session, prompt: &[u32], steps: usize) -> Vec<Vec<f32>> {
        let mut out = vec![s.forward_batch(&prompt[s.position()..]).unwrap().to_vec()];
        for _ in 0..steps {
            let next = argmax(out.last().unwrap());
            out.push(s.forward(next).unwrap().to_vec());
        }
        out
    }

    /// Bytes of one whole KV block of `model` in `kv` (held to what the allocator hands out by
    /// `tests/session_bytes.rs`).
    fn block_bytes(model: &Arc<Model>, kv: KvType) -> u64 {
        let c = &model.weights.config;
        KvCache::full_bytes(kv, c.n_layers, c.kv_dim(), KV_BLOCK_TOKENS)
    }

    #[test]
    fn a_session_adopting_a_prefix_computes_what_it_would_have_computed_running_the_prompt() {
        let dir = tempfile::tempdir().unwrap();
        let model = tiny(dir.path(), 2);
        let prompt = tokens(150, 0);
        for kv in KvType::ALL {
            let want = finish(&mut open(&model, 256, kv), &prompt, 8);
            for n in [KV_BLOCK_TOKENS, 70, 130] {
                // The source ran the prefix and then went elsewhere: its blocks beyond `n` hold
                // other tokens, which the adopter must overwrite before it reads them.
                let mut source = open(&model, 256, kv);
                source.forward_batch(&prompt[..n]).unwrap();
                source.forward_batch(&tokens(20, 1)).unwrap();
                let prefix = source.share_prefix(n).unwrap();
                let mut adopter = open(&model, 256, kv);
                adopter.adopt_prefix(&prefix).unwrap();
                assert_eq!(adopter.position(), n);
                let got = finish(&mut adopter, &prompt, 8);
                assert!(want == got, "{kv}, prefix of {n}: logits differ");

                // The check can fail: a prefix of other tokens gives other logits.
                let mut other = open(&model, 256, kv);
                other.forward_batch(&tokens(n, 2)).unwrap();
                let mut wrong = open(&model, 256, kv);
                wrong.adopt_prefix(&other.share_prefix(n).unwrap()).unwrap();
                assert!(
                    want != finish(&mut wrong, &prompt, 8),
                    "{kv}, prefix of {n}"
                );
            }
        }
    }

    #[test]
    fn writes_after_sharing_reach_only_the_session_that_makes_them() {
        let dir = tempfile::tempdir().unwrap();
        let model = tiny(dir.path(), 2);
        let (shared, mine, theirs) = (tokens(70, 0), tokens(40, 3), tokens(40, 4));
        let alone = |rest: &[u32]| {
            let mut s = open(&model, 256, KvType::F16);
            s.forward_batch(&shared).unwrap();
            s.forward_batch(rest).unwrap().to_vec()
        };
        let mut source = open(&model, 256, KvType::F16);
        source.forward_batch(&shared).unwrap();
        let prefix = source.share_prefix(70).unwrap();
        let mut adopter = open(&model, 256, KvType::F16);
        adopter.adopt_prefix(&prefix).unwrap();
        // Both write positions 70..110 of the one block 1 they share, interleaved: each must
        // read back its own tokens there, not the other's.
        for (a, b) in mine.chunks(8).zip(theirs.chunks(8)) {
            adopter.forward_batch(a).unwrap();
            source.forward_batch(b).unwrap();
        }
        assert_eq!(
            adopter.logits(),
            alone(&mine),
            "the adopter reads its own rows"
        );
        assert_eq!(
            source.logits(),
            alone(&theirs),
            "the source reads its own rows"
        );
        assert_ne!(alone(&mine), alone(&theirs), "the two continuations differ");
        // The prefix itself still holds the source's first 70 tokens.
        let mut late = open(&model, 256, KvType::F16);
        late.adopt_prefix(&prefix).unwrap();
        late.forward_batch(&mine).unwrap();
        assert_eq!(late.logits(), alone(&mine), "the prefix is unchanged");
    }

    #[test]
    fn sessions_adopting_one_prefix_decode_together_as_each_would_alone() {
        let dir = tempfile::tempdir().unwrap();
        let model = tiny(dir.path(), 2);
        let shared = tokens(70, 0);
        let mut source = open(&model, 256, KvType::F32);
        source.forward_batch(&shared).unwrap();
        let prefix = source.share_prefix(70).unwrap();
        let (mut a, mut b) = (
            open(&model, 256, KvType::F32),
            open(&model, 256, KvType::F32),
        );
        let (mut a_alone, mut b_alone) = (
            open(&model, 256, KvType::F32),
            open(&model, 256, KvType::F32),
        );
        a.adopt_prefix(&prefix).unwrap();
        b.adopt_prefix(&prefix).unwrap();
        a_alone.forward_batch(&shared).unwrap();
        b_alone.forward_batch(&shared).unwrap();
        // Every step writes one position of block 1 in both, which they share at first.
        for step in 0..6u32 {
            let t = [10 + step, 90 + step];
            super::super::forward_each(&mut [&mut a, &mut b], &[&t[..1], &t[1..]]).unwrap();
            assert_eq!(a.logits(), a_alone.forward(t[0]).unwrap(), "a, step {step}");
            assert_eq!(b.logits(), b_alone.forward(t[1]).unwrap(), "b, step {step}");
        }
        assert_ne!(a.logits(), b.logits());
    }

    #[test]
    fn shared_blocks_are_paid_once_by_the_prefix_and_copied_before_a_write() {
        let dir = tempfile::tempdir().unwrap();
        let model = tiny(dir.path(), 2);
        let pointer = std::mem::size_of::<usize>() as u64;
        for kv in [KvType::F32, KvType::F16] {
            let (block, open_bytes) =
                (block_bytes(&model, kv), session_open_bytes(&model, 256, kv));
            let mut source = open(&model, 256, kv);
            source.forward_batch(&tokens(100, 0)).unwrap();
            assert_eq!(source.bytes(), open_bytes + 2 * block, "{kv}");

            // Sharing moves the two blocks from the source's count to the prefix's.
            let prefix = source.share_prefix(70).unwrap();
            assert_eq!(source.bytes(), open_bytes, "{kv}");
            assert_eq!(
                prefix.bytes(),
                2 * block + 2 * pointer,
                "{kv}: blocks and list"
            );
            let mut adopter = open(&model, 256, kv);
            adopter.adopt_prefix(&prefix).unwrap();
            assert_eq!(
                adopter.bytes(),
                open_bytes,
                "{kv}: adopting allocates nothing"
            );
            // What the three hold: two sessions, two blocks and the prefix's list of them.
            assert_eq!(
                source.bytes() + adopter.bytes() + prefix.bytes(),
                2 * open_bytes + 2 * block + 2 * pointer,
                "{kv}"
            );

            // Both next write position 70 or 100, in block 1: each needs a copy of it.
            assert_eq!(adopter.kv_growth_bytes(1), block, "{kv}");
            assert_eq!(source.kv_growth_bytes(1), block, "{kv}");
            adopter.grow_kv(1).unwrap();
            assert_eq!(adopter.kv_growth_bytes(1), 0, "{kv}: copied");
            assert_eq!(adopter.bytes(), open_bytes + block, "{kv}");
            // The forward pass then copies nothing more (a copy would raise bytes()).
            adopter.forward(5).unwrap();
            assert_eq!(adopter.bytes(), open_bytes + block, "{kv}");
            assert_eq!(
                prefix.bytes(),
                2 * block + 2 * pointer,
                "{kv}: still the prefix's"
            );

            // Growth across a shared block and into a new one counts both; a forward pass
            // makes them by itself when nobody grew first.
            assert_eq!(source.kv_growth_bytes(60), 2 * block, "{kv}");
            source.forward_batch(&tokens(60, 1)).unwrap();
            assert_eq!(source.bytes(), open_bytes + 2 * block, "{kv}");

            // The last holder pays: without the adopter and the prefix, block 0 is the source's.
            drop(adopter);
            drop(prefix);
            assert_eq!(source.bytes(), open_bytes + 3 * block, "{kv}");

            // A prefix of whole blocks: the adopter's next write starts a block of its own.
            let whole = source.share_prefix(KV_BLOCK_TOKENS).unwrap();
            assert_eq!(whole.bytes(), block + pointer, "{kv}");
            let mut adopter = open(&model, 256, kv);
            adopter.adopt_prefix(&whole).unwrap();
            assert_eq!(adopter.kv_growth_bytes(1), block, "{kv}: a new block");
            adopter.grow_kv(1).unwrap();
            assert_eq!(adopter.bytes(), open_bytes + block, "{kv}");
            assert_eq!(whole.bytes(), block + pointer, "{kv}: block 0 still shared");
        }
    }

    #[test]
    fn a_prefix_of_another_kv_type_shape_or_block_layout_is_refused_and_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (model, deeper) = (tiny(dir.path(), 2), tiny(dir.path(), 3));
        let mut source = open(&model, 256, KvType::F16);
        source.forward_batch(&tokens(70, 0)).unwrap();
        let err = source.share_prefix(71).unwrap_err().to_string();
        assert!(err.contains("71 tokens exceed the 70"), "{err}");
        let prefix = source.share_prefix(70).unwrap();

        let refused = |mut s: Session, why: &str| {
            s.forward_batch(&tokens(3, 1)).unwrap();
            let err = s.adopt_prefix(&prefix).unwrap_err().to_string();
            assert!(err.contains(why), "{why}: {err}");
            assert_eq!(s.position(), 3, "{why}: the session is unchanged");
        };
        refused(open(&model, 256, KvType::F32), "cache of f32 KV, 2 layers");
        refused(open(&deeper, 256, KvType::F16), "cache of f16 KV, 3 layers");
        refused(
            open(&model, 64, KvType::F16),
            "does not fit in a context of 64",
        );
        // A context of 100 cuts block 1 at 36 tokens; the prefix's holds 64.
        refused(
            open(&model, 100, KvType::F16),
            "block 1 of the prefix holds 64 tokens",
        );
        // The same the other way round: a prefix made in a context of 100.
        let mut short = open(&model, 100, KvType::F16);
        short.forward_batch(&tokens(70, 0)).unwrap();
        let mut s = open(&model, 256, KvType::F16);
        let err = s
            .adopt_prefix(&short.share_prefix(70).unwrap())
            .unwrap_err();
        assert!(err.to_string().contains("holds 36 tokens"), "{err}");
        // Any context whose blocks hold what the prefix's do will take it.
        let mut s = open(&model, 200, KvType::F16);
        s.adopt_prefix(&prefix).unwrap();
        assert_eq!(s.position(), 70);
    }
}
