//! Speculative decoding gives the tokens of plain decoding: a verification pass's rows are the
//! logits of token-by-token passes, a rewind forgets the rejected positions, and a generation
//! with drafts emits the same ids, greedy or sampled with a seed, on a dense session and on a
//! plan that streams layers by neuron.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::forward::{Model, Session};
use leanstream_engine::generate::{Decode, Speculation, generate_constrained};
use leanstream_engine::kv::KvType;
use leanstream_engine::pipeline::{Executor, Mode, Policy, WithFfn};
use leanstream_engine::sample::SamplerConfig;

use super::unified::{CONTEXT, planned, synth};

/// A prompt that repeats itself, so that lookup drafts find something to propose.
const PROMPT: [u32; 12] = [5, 17, 3, 99, 42, 7, 5, 17, 3, 99, 42, 7];

/// Opens a fresh decoder of one kind.
type Opener<'a> = Box<dyn Fn() -> Box<dyn Decode> + 'a>;

fn dense(model: &Arc<Model>) -> Box<dyn Decode> {
    Box::new(Session::new(Arc::clone(model), CONTEXT, Precision::Exact, KvType::F32).unwrap())
}

fn through_plan(model: &Arc<Model>) -> Box<dyn Decode> {
    let leanstream = Policy::for_mode(Mode::LeanStream).unwrap();
    let exec = Executor::for_plan(model, leanstream, 2, Precision::Exact)
        .unwrap()
        .expect("the plan streams layers by neuron");
    Box::new(WithFfn {
        decoder: dense(model),
        exec,
    })
}

#[test]
fn a_verification_pass_gives_each_rows_logits_of_token_by_token_and_a_rewind_forgets_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let path = synth(dir.path());
    let planned = planned(&path, &[1]);
    let whole = Model::load(&path).unwrap();
    let opens: [(&str, Opener<'_>); 2] = [
        ("dense", Box::new(|| dense(&whole))),
        ("plan", Box::new(|| through_plan(&planned))),
    ];
    for (name, open) in opens {
        let mut one = open();
        one.forward_batch(&PROMPT).unwrap();
        let mut expected = Vec::new();
        for t in [8, 9, 10] {
            expected.extend_from_slice(one.forward(t).unwrap());
        }
        let mut rows = open();
        rows.forward_batch(&PROMPT).unwrap();
        let mut got = Vec::new();
        rows.forward_rows(&[8, 9, 10], None, &mut got).unwrap();
        assert_eq!(got, expected, "{name}: rows of one pass");
        // Keep the first two positions; the third is written anew by another token.
        rows.rewind(PROMPT.len() + 2).unwrap();
        assert_eq!(rows.position(), PROMPT.len() + 2);
        one.rewind(PROMPT.len() + 2).unwrap();
        assert_eq!(
            rows.forward(11).unwrap().to_vec(),
            one.forward(11).unwrap().to_vec(),
            "{name}: after a rewind"
        );
        assert!(
            rows.rewind(rows.position() + 1).is_err(),
            "no rewind forward"
        );
    }
}

#[test]
fn a_speculative_generation_emits_the_plain_tokens_greedy_and_sampled() {
    let dir = tempfile::tempdir().unwrap();
    let path = synth(dir.path());
    let planned = planned(&path, &[1]);
    let whole = Model::load(&path).unwrap();
    let sampled = |seed| SamplerConfig {
        temperature: 0.9,
        top_k: 40,
        seed,
        ..SamplerConfig::default()
    };
    let mut drafted = 0;
    let opens: [(&str, Opener<'_>); 2] = [
        ("dense", Box::new(|| dense(&whole))),
        ("plan", Box::new(|| through_plan(&planned))),
    ];
    for (name, open) in opens {
        for sampler in [SamplerConfig::default(), sampled(1), sampled(2)] {
            let generate = |speculation| {
                let mut s = open();
                let g = generate_constrained(
                    &mut *s,
                    &PROMPT,
                    40,
                    &sampler,
                    &[],
                    None,
                    speculation,
                    |_| true,
                )
                .unwrap();
                (g, s.position())
            };
            let (plain, plain_at) = generate(None);
            let (fast, fast_at) = generate(Some(Speculation::new(8)));
            assert_eq!(fast.ids, plain.ids, "{name} {sampler:?}");
            assert_eq!(
                fast_at, plain_at,
                "{name}: the session ends where plain decoding does"
            );
            let spec = fast.stats.speculation.unwrap();
            assert_eq!(spec.sampled, plain.ids.len() - 1, "{name}: {spec:?}");
            drafted += spec.drafted.iter().sum::<usize>();
        }
    }
    assert!(
        drafted > 0,
        "the repeated prompt gave lookup drafts to verify"
    );
}

/// A synthetic model whose output head (a 16k vocabulary) outweighs its body, planned in the
/// smallest budget that keeps every layer and some leading rows of the head resident and
/// streams the rest of the head: the plan a shortlist draft runs on. Placement `dense`, so no
/// FFN layer streams by neuron.
fn head_heavy(dir: &std::path::Path) -> (Arc<Model>, Arc<Model>) {
    use leanstream_engine::model::lsm::synth::{
        SynthOptions, SynthShape, SynthTokenizer, synthesize,
    };
    use leanstream_engine::plan::PlacementPolicy;
    let path = dir.join("head-heavy.lsm");
    let opts = SynthOptions::new(SynthShape {
        vocab_size: 16384,
        ..SynthShape::TINY
    });
    // SmolLM2's tokenizer cut to the first 16k ids (byte-level BPE ids follow merge order).
    let donor = Model::load(&leanstream_engine::testing::real_model()).unwrap();
    let tokenizer =
        SynthTokenizer::from_tokenizer(&donor.tokenizer, None, "SmolLM2".into()).unwrap();
    synthesize(&path, &opts, &tokenizer, &mut |_, _| {}).unwrap();
    let whole = Model::load(&path).unwrap();
    let mut budget = 1 << 20;
    loop {
        if let Ok(m) =
            Model::load_within_placed(&path, budget, CONTEXT, KvType::F32, PlacementPolicy::Dense)
            && m.plan().and_then(|p| p.shortlist_rows()).is_some()
        {
            return (m, whole);
        }
        budget += 64 << 10;
        assert!(
            budget < 64 << 20,
            "no budget keeps the body and part of the head"
        );
    }
}

#[test]
fn a_shortlist_draft_reads_the_rest_of_the_head_once_and_gives_the_plain_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let (planned, whole) = head_heavy(dir.path());
    let kept = planned.plan().unwrap().shortlist_rows().unwrap();
    assert!(kept < planned.weights.config.vocab_size);
    let open = |m: &Arc<Model>| {
        Session::new(Arc::clone(m), CONTEXT, Precision::Exact, KvType::F32).unwrap()
    };

    // The rows of a shortlist pass are those of a verification pass of the tokens it ran.
    let mut drafting = open(&planned);
    drafting.forward_batch(&PROMPT).unwrap();
    let (mut fed, mut rows) = (Vec::new(), Vec::new());
    drafting
        .forward_shortlist(8, 4, &mut fed, &mut rows)
        .unwrap();
    assert_eq!((fed.len(), fed[0]), (4, 8));
    assert_eq!(drafting.position(), PROMPT.len() + 4);
    let width = rows.len() / 4;
    for (i, pair) in fed.windows(2).enumerate() {
        let shortlist = &rows[i * width..i * width + kept];
        assert_eq!(
            pair[1],
            leanstream_engine::sample::argmax(shortlist),
            "draft {i}"
        );
    }
    let mut checking = open(&whole);
    checking.forward_batch(&PROMPT).unwrap();
    let mut expected = Vec::new();
    checking.forward_rows(&fed, None, &mut expected).unwrap();
    assert_eq!(rows, expected, "the full logits of every drafted position");

    // A whole generation drafting from the shortlist emits the plain tokens.
    let generate = |model: &Arc<Model>, speculation| {
        let mut s = open(model);
        let g = generate_constrained(
            &mut s,
            &PROMPT,
            40,
            &SamplerConfig::default(),
            &[],
            None,
            speculation,
            |_| true,
        )
        .unwrap();
        (g, s.position())
    };
    let speculation = leanstream_engine::generate::speculation_for(
        &planned,
        leanstream_engine::generate::SpeculateMode::Auto,
        8,
    );
    assert!(speculation.is_some());
    let (plain, plain_at) = generate(&whole, None);
    let (fast, fast_at) = generate(&planned, speculation);
    assert_eq!(fast.ids, plain.ids);
    assert_eq!(fast_at, plain_at);
    let spec = fast.stats.speculation.unwrap();
    let shortlist = leanstream_engine::generate::DraftKind::Shortlist as usize;
    assert!(spec.drafted[shortlist] > 0, "{spec:?}");
    eprintln!(
        "shortlist of {kept} rows: {} of {} drafts accepted, {:.2} tokens a pass",
        spec.accepted[shortlist],
        spec.drafted[shortlist],
        spec.tokens_per_pass()
    );
}
