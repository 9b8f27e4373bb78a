//! Speculative decoding through the scheduler: generations that draft and verify give the
//! tokens of plain decoding, alone or sharing passes, with lookup drafts and with drafts a
//! session makes from its head's shortlist; the KV cache they leave is the one plain decoding
//! leaves; the verification rows buffer is reserved and handed back.

use leanstream_engine::generate::speculate::MAX_DRAFT;
use leanstream_engine::generate::{Next, Speculation, StopRules};

use super::*;
use crate::scheduler::room::REALTIME_MAX_DRAFT;

/// Prompts that repeat themselves, so that lookup drafts find something to match.
const REPEATING: [&str; 4] = [
    "ab ab ab ab ab ab ab ab",
    "the cat the cat the cat",
    "one two one two one two",
    "sat on sat on sat on",
];

/// Tokens each generation of these tests runs: long enough for the drafts to pay, short
/// enough to fit the sessions' 64-token context after a prompt.
const LONG: usize = 32;

/// Model `file` loaded with the `[models.tiny]` keys `keys` and `speculate = "off"`, and
/// loaded with them as they are (speculation `auto`, the default). A model whose passes
/// would price drafts out (resident weights) gets them for free, so that they are certain.
fn off_and_auto(fx: &Fixture, file: &ModelFile, keys: &str) -> [Arc<LoadedModel>; 2] {
    let off = load(
        fx,
        file,
        &format!("[models.tiny]\n{keys}speculate = \"off\"\n"),
    );
    let mut auto = load(fx, file, &format!("[models.tiny]\n{keys}"));
    if auto.ffn.is_none() {
        auto.draft_row_cost = Some(0.0);
    }
    [Arc::new(off), Arc::new(auto)]
}

/// Whether a generation verified drafts: more than one token a decode pass, some accepted.
fn speculated(stats: &StreamStats) -> bool {
    stats.speculation_tokens_per_pass > 1.0 && stats.draft_acceptance > 0.0
}

#[test]
fn four_sessions_speculating_together_give_the_tokens_of_their_plain_solo_runs() {
    let fx = Fixture::new();
    let dense = off_and_auto(&fx, &fx.gguf("tiny"), "");
    // Half the chunks cached: the pipeline reads while the pass runs.
    let keys = "mode = \"leanstream\"\nsparsity = 0\ncache_share = 0.5\n";
    let streaming = off_and_auto(&fx, &fx.lsm("tiny", None), keys);
    for [off, auto] in [&dense, &streaming] {
        let mode = if auto.ffn.is_some() {
            "leanstream"
        } else {
            "dense"
        };
        let alone: Vec<Vec<StreamEvent>> = REPEATING
            .iter()
            .map(|p| generate_queued_for(&[(off, p)], LONG).remove(0))
            .collect();
        let runs: Vec<(&Arc<LoadedModel>, &str)> = REPEATING.iter().map(|p| (auto, *p)).collect();
        let together = generate_queued_for(&runs, LONG);
        let mut verified = 0;
        for (i, events) in together.iter().enumerate() {
            assert_eq!(
                ids(events),
                ids(&alone[i]),
                "{mode}: session {i}'s tokens, speculating beside the others"
            );
            assert_eq!(ids(events).len(), LONG, "{mode}: session {i}");
            let stats = done_stats(events);
            assert_eq!(done_stats(&alone[i]).speculation_tokens_per_pass, 0.0);
            verified += usize::from(speculated(stats));
        }
        assert!(verified > 0, "{mode}: no generation verified a draft");
    }
}

/// Runs `turns` one after the other on one session of `model` (each a prompt, greedy, `LONG`
/// tokens at most, ended by the stop strings given); returns each turn's events.
fn converse(model: &Arc<LoadedModel>, turns: &[(String, Vec<String>)]) -> Vec<Vec<StreamEvent>> {
    let (events, _events_rx) = tokio::sync::mpsc::unbounded_channel();
    let engine = Scheduler::start(events, budget(SharedLimit::new(u64::MAX))).unwrap();
    open(&engine, 1, model, exact(model, 128, KvType::F32));
    let mut streams = Vec::new();
    for (prompt, stop) in turns {
        let (read, out) = std::io::pipe().unwrap();
        let spec = GenSpec {
            stop: stop.clone(),
            ..spec(LONG, Priority::default())
        };
        send_generate(&engine.tx, 1, prompt, spec, out)
            .blocking_recv()
            .unwrap()
            .unwrap();
        streams.push(read_events(read));
    }
    engine.tx.send(Command::Shutdown).unwrap();
    engine.thread.join().unwrap();
    streams
}

#[test]
fn a_conversation_continued_after_a_speculative_generation_reuses_what_plain_decoding_leaves() {
    let fx = Fixture::new();
    let [off, auto] = off_and_auto(&fx, &fx.gguf("tiny"), "");
    let prompt = REPEATING[1].to_string();
    // A stop string that ends the output half-way (its first half): the generation that
    // speculates has likely accepted drafts past it, which the session must forget.
    let plain = text(&converse(&off, &[(prompt.clone(), Vec::new())])[0]);
    let stop = plain
        .get(..plain.len() / 2)
        .expect("ASCII output")
        .to_string();
    let first = (prompt.clone(), vec![stop]);
    let stopped = converse(&off, std::slice::from_ref(&first)).remove(0);
    let next = format!("{prompt}{} and", text(&stopped));
    let turns = [first, (next, Vec::new())];
    let expected = converse(&off, &turns);
    let got = converse(&auto, &turns);
    assert!(
        matches!(expected[0].last(), Some(StreamEvent::Done { reason, .. }) if reason == "stop_string"),
        "{:?}",
        expected[0]
    );
    assert!(speculated(done_stats(&got[0])), "{:?}", done_stats(&got[0]));
    for (turn, (want, have)) in expected.iter().zip(&got).enumerate() {
        assert_eq!(ids(have), ids(want), "turn {turn}");
        // The second turn starts from the same cache: what the first one left, and no more.
        assert_eq!(
            done_stats(have).cached_prompt_tokens,
            done_stats(want).cached_prompt_tokens,
            "turn {turn}"
        );
    }
    assert!(done_stats(&expected[1]).cached_prompt_tokens > 0);
}

/// A budget that grants every session up to a limit and records each reservation it grants.
#[derive(Clone)]
struct Recorder {
    limit: u64,
    granted: Arc<Mutex<Vec<u64>>>,
}

impl SessionBudget for Recorder {
    fn resize(&self, id: SessionId, bytes: u64) -> Result<(), LeanStreamError> {
        if bytes > self.limit {
            return Err(LeanStreamError::OverBudget(format!(
                "session {id} needs {bytes} bytes, over {}",
                self.limit
            )));
        }
        self.granted.lock().unwrap().push(bytes);
        Ok(())
    }

    fn grow_model(&self, _name: &str, _bytes: u64) -> Result<(), LeanStreamError> {
        Ok(())
    }

    fn shrink_model(&self, _name: &str, _bytes: u64) {}
}

/// One generation of `prompt` in class `priority` on a scheduler whose budget grants a session
/// at most `limit` bytes; its stats and the reservations granted, in order.
fn reserving(
    model: &Arc<LoadedModel>,
    prompt: &str,
    priority: Priority,
    limit: u64,
) -> (StreamStats, Vec<u64>) {
    let granted = Arc::new(Mutex::new(Vec::new()));
    let recorder = Recorder {
        limit,
        granted: Arc::clone(&granted),
    };
    let (events, _events_rx) = tokio::sync::mpsc::unbounded_channel();
    let engine = Scheduler::start(events, budget(recorder)).unwrap();
    open(&engine, 1, model, exact(model, 64, KvType::F32));
    let (read, out) = std::io::pipe().unwrap();
    send_generate(&engine.tx, 1, prompt, spec(LONG, priority), out)
        .blocking_recv()
        .unwrap()
        .unwrap();
    let events = read_events(read);
    engine.tx.send(Command::Shutdown).unwrap();
    engine.thread.join().unwrap();
    let granted = granted.lock().unwrap().clone();
    (done_stats(&events).clone(), granted)
}

#[test]
fn the_verification_rows_are_reserved_for_the_run_and_handed_back_at_its_end() {
    let fx = Fixture::new();
    let [_, auto] = off_and_auto(&fx, &fx.gguf("tiny"), "");
    let prompt = REPEATING[0];
    let tokens = auto.model.tokenizer.encode(prompt).unwrap().len();
    // What the session holds with the whole generation in its KV cache: all in the blocks the
    // prompt's reservation pays for, so that the run reserves nothing else.
    let session = exact(&auto, 64, KvType::F32);
    let kv = session.bytes() + session.kv_growth_bytes(tokens + LONG);
    assert_eq!(
        session.kv_growth_bytes(tokens + 1),
        session.kv_growth_bytes(tokens + LONG),
        "the test wants the generation within the prompt's KV blocks"
    );
    let vocab = session.vocab_size() as u64;
    for (priority, drafts) in [
        (Priority::Interactive, MAX_DRAFT),
        (Priority::Realtime, REALTIME_MAX_DRAFT),
    ] {
        let rows = (drafts as u64 + 1) * vocab * 4;
        let (stats, granted) = reserving(&auto, prompt, priority, u64::MAX);
        assert!(speculated(&stats), "{priority:?}: {stats:?}");
        assert!(
            stats.speculation_tokens_per_pass <= drafts as f64 + 1.0,
            "{priority:?}: {stats:?}"
        );
        // The prompt's KV and the rows at the start; the KV alone at the end.
        assert_eq!(granted.iter().max(), Some(&(kv + rows)), "{priority:?}");
        assert_eq!(granted.last(), Some(&kv), "{priority:?}: {granted:?}");
        // A budget that holds the prompt but not the rows runs it, without speculation.
        let (stats, granted) = reserving(&auto, prompt, priority, kv + rows - 1);
        assert_eq!(stats.generated_tokens, LONG, "{priority:?}");
        assert_eq!(stats.speculation_tokens_per_pass, 0.0, "{priority:?}");
        assert_eq!(granted.iter().max(), Some(&kv), "{priority:?}");
    }
}

#[test]
fn a_trimmed_pass_keeps_the_token_emitted_last_and_the_first_drafts() {
    let rules = StopRules {
        max_tokens: 16,
        eos: Vec::new(),
        strings: Vec::new(),
    };
    let vocab = 16;
    let prompt = [1, 2, 3, 1, 2, 3, 1, 2];
    let mut s = Stepper::new(&prompt, &[], 64, SamplerConfig::default(), vocab, rules)
        .unwrap()
        .speculate(Speculation::with_row_cost(MAX_DRAFT, 0.0));
    // Logits whose greedy choice is `id`.
    let peak = |id: usize| {
        let mut l = vec![0.0; vocab];
        l[id] = 1.0;
        l
    };
    s.prefilled(prompt.len(), &mut peak(3), None).unwrap();
    s.emit(None).unwrap();
    // After "1 2 3 1 2 3 1 2 3" a lookup drafts "1 2 3 …".
    let Next::Forward(tokens) = s.next() else {
        panic!("a forward pass is due: {:?}", s.next());
    };
    assert!(tokens.len() > 2, "{tokens:?}");
    s.trim_pass(2);
    assert_eq!(s.next(), Next::Forward(&[3, 1]));
    s.trim_pass(0);
    assert_eq!(s.next(), Next::Forward(&[3]), "the emitted token stays");
    let kept = s.forwarded(&mut peak(1), None).unwrap();
    assert_eq!((kept, s.next()), (1, Next::Emit(1)));
}

/// Writes `models/NAME.lsm` in `fx`: a synthetic model whose output head (a 16k vocabulary,
/// SmolLM2's tokenizer cut down) outweighs its body; returns it with the `max_bytes` that keeps
/// the body and some leading rows of the head resident and streams the rest of the head: the
/// plan a session drafts from its head's shortlist on.
fn head_heavy(fx: &Fixture, name: &str) -> (ModelFile, u64) {
    use leanstream_engine::forward::Model;
    use leanstream_engine::model::lsm::synth::{
        SynthOptions, SynthShape, SynthTokenizer, synthesize,
    };
    use leanstream_engine::plan::PlacementPolicy;
    let opts = SynthOptions::new(SynthShape {
        vocab_size: 16384,
        ..SynthShape::TINY
    });
    let donor = Model::load(&leanstream_engine::testing::real_model()).unwrap();
    let tokenizer =
        SynthTokenizer::from_tokenizer(&donor.tokenizer, None, "SmolLM2".into()).unwrap();
    let dir = fx.dir.path().join("models");
    synthesize(
        &dir.join(format!("{name}.lsm")),
        &opts,
        &tokenizer,
        &mut |_, _| {},
    )
    .unwrap();
    let file = crate::models::resolve(&dir.canonicalize().unwrap(), name).unwrap();
    let mut max = 1 << 20;
    loop {
        if let Ok(m) = Model::load_with_max_bytes_placed(&file.path, max, PlacementPolicy::Dense)
            && m.plan().and_then(|p| p.shortlist_rows()).is_some()
        {
            return (file, max);
        }
        max += 64 << 10;
        assert!(
            max < 64 << 20,
            "no max_bytes keeps the body and part of the head"
        );
    }
}

#[test]
fn sessions_drafting_from_their_heads_shortlist_give_the_plain_tokens() {
    let fx = Fixture::new();
    let (file, max) = head_heavy(&fx, "hh");
    let keys = format!("max_bytes = {max}\nplacement = \"dense\"\n");
    let load = |speculate: &str| {
        let toml = format!("[models.hh]\n{keys}speculate = \"{speculate}\"\n");
        Arc::new(load(&fx, &file, &toml))
    };
    let (off, auto) = (load("off"), load("auto"));
    let prompts = &REPEATING[..2];
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| ids(&generate_queued_for(&[(&off, p)], LONG)[0]))
        .collect();
    // Two at once: their prompts share a pass; without speculation their decode steps do too,
    // while a step that drafts from the shortlist runs alone.
    let mut shared = [0; 2];
    for (model, shared) in [&off, &auto].into_iter().zip(&mut shared) {
        let runs: Vec<(&Arc<LoadedModel>, &str)> = prompts.iter().map(|p| (model, *p)).collect();
        for (i, events) in generate_queued_for(&runs, LONG).iter().enumerate() {
            assert_eq!(
                ids(events),
                alone[i],
                "{}: session {i}",
                model.speculate.name()
            );
            *shared += done_stats(events).shared_decode_passes;
        }
    }
    assert!(
        shared[1] < shared[0],
        "no step drafted from the shortlist: {shared:?}"
    );
}
