//! Speculative decoding on the real models gives the greedy ids of plain decoding on every
//! fixture prompt: fully loaded (drafts priced as if the model streamed, so that they run) and
//! under the budgets of the capped benchmarks, where the plan's own speculation runs (SmolLM2 at
//! 59 MB and Gemma 3 at 101 MB stream layers and draft by lookup; Gemma 3 at 152 MB keeps its
//! body and drafts from its head's resident rows).

use std::path::Path;
use std::sync::Arc;

use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::forward::{Model, Session};
use leanstream_engine::generate::speculate::MAX_DRAFT;
use leanstream_engine::generate::{
    DraftKind, SpeculateMode, Speculation, generate_constrained, speculation_for,
};
use leanstream_engine::kv::KvType;
use leanstream_engine::sample::SamplerConfig;
use leanstream_engine::testing;

use crate::common::FIXTURE;

const CONTEXT: usize = 256;
const TOKENS: usize = 24;

/// Greedy ids of `prompt` on `model`, with `speculation` when given, and its counts.
fn greedy(
    model: &Arc<Model>,
    prompt: &[u32],
    speculation: Option<Speculation>,
) -> (Vec<u32>, [usize; 3]) {
    let mut s = Session::new(
        Arc::clone(model),
        CONTEXT,
        Precision::Exact,
        KvType::default(),
    )
    .expect("session");
    let g = generate_constrained(
        &mut s,
        prompt,
        TOKENS,
        &SamplerConfig::default(),
        &[],
        None,
        speculation,
        |_| true,
    )
    .expect("generate");
    let drafted = g.stats.speculation.map_or([0; 3], |s| s.drafted);
    (g.ids, drafted)
}

/// Every prompt's greedy ids with speculation equal its plain ids, fully loaded and under each
/// of `budgets`; returns the tokens drafted per kind under each budget.
fn check(path: &Path, prompts: &[Vec<u32>], budgets: &[u64]) -> Vec<[usize; 3]> {
    let whole = Model::load(path).expect("load");
    let planned: Vec<Arc<Model>> = budgets
        .iter()
        .map(|&b| Model::load_within(path, b, CONTEXT, KvType::default()).expect("plan"))
        .collect();
    let mut drafted = vec![[0; 3]; budgets.len()];
    for prompt in prompts {
        let (plain, _) = greedy(&whole, prompt, None);
        let (fast, _) = greedy(&whole, prompt, Some(Speculation::new(MAX_DRAFT)));
        assert_eq!(fast, plain, "{}: fully loaded", path.display());
        for ((model, budget), sum) in planned.iter().zip(budgets).zip(&mut drafted) {
            let speculation = speculation_for(model, SpeculateMode::Auto, MAX_DRAFT);
            assert!(speculation.is_some(), "the plan streams: speculation is on");
            let (fast, kinds) = greedy(model, prompt, speculation);
            assert_eq!(fast, plain, "{} under {budget} bytes", path.display());
            for (s, k) in sum.iter_mut().zip(kinds) {
                *s += k;
            }
        }
    }
    drafted
}

#[test]
fn smollm2_speculating_under_59_mb_gives_the_plain_greedy_ids() {
    let prompts: Vec<Vec<u32>> = FIXTURE.iter().map(|c| c.prompt_ids.to_vec()).collect();
    let drafted = check(&testing::real_model(), &prompts, &[59_000_000]);
    assert!(
        drafted[0][DraftKind::Lookup as usize] > 0,
        "lookup drafts ran: {drafted:?}"
    );
}

#[test]
fn gemma3_speculating_under_60_and_40_percent_gives_the_plain_greedy_ids() {
    #[derive(serde::Deserialize)]
    struct Case {
        prompt_ids: Vec<u32>,
    }
    #[derive(serde::Deserialize)]
    struct Fixture {
        prompts: Vec<Case>,
    }
    let fixture: Fixture =
        serde_json::from_str(include_str!("../fixtures/gemma3-270m.json")).expect("fixture");
    let prompts: Vec<Vec<u32>> = fixture.prompts.into_iter().map(|c| c.prompt_ids).collect();
    let drafted = check(
        &testing::gemma_model(),
        &prompts,
        &[152_000_000, 101_000_000],
    );
    assert!(
        drafted[0][DraftKind::Shortlist as usize] > 0,
        "at 152 MB the body is resident and the head's shortlist drafts: {drafted:?}"
    );
    assert!(
        drafted[1][DraftKind::Shortlist as usize] == 0,
        "at 101 MB layers stream: no shortlist: {drafted:?}"
    );
}
