//! What a hostile local client must not be able to do to the scheduler: slow the others down
//! with requests that are refused, crash it with a deep grammar, starve prompts that arrive
//! together of memory, or learn another user's prompts from what was cached.

use std::sync::atomic::AtomicU64;

use leanstream_engine::kv::KV_BLOCK_TOKENS;

use super::*;

/// A budget of `limit` bytes for every session together, the way the arbiter holds it: each
/// session's reservation is absolute, and one that would take the sum over the limit is refused.
#[derive(Clone, Default)]
struct Pool {
    limit: Arc<AtomicU64>,
    held: Arc<Mutex<BTreeMap<SessionId, u64>>>,
}

impl Pool {
    /// Session `id` holds `bytes` (its scratch, reserved when it opened).
    fn hold(&self, id: SessionId, bytes: u64) {
        self.held.lock().unwrap().insert(id, bytes);
    }
}

impl SessionBudget for Pool {
    fn resize(&self, id: SessionId, bytes: u64) -> Result<(), LeanStreamError> {
        let mut held = self.held.lock().unwrap();
        let others: u64 = held.iter().filter(|(k, _)| **k != id).map(|(_, v)| v).sum();
        let limit = self.limit.load(Ordering::SeqCst);
        if others + bytes > limit {
            return Err(LeanStreamError::OverBudget(format!(
                "session {id} needs {bytes} bytes; {others} of {limit} are taken"
            )));
        }
        held.insert(id, bytes);
        Ok(())
    }

    fn grow_model(&self, _name: &str, _bytes: u64) -> Result<(), LeanStreamError> {
        Ok(())
    }

    fn shrink_model(&self, _name: &str, _bytes: u64) {}
}

#[test]
fn a_refused_request_raises_no_urgency_mark_and_a_background_pass_runs_on() {
    let fx = Fixture::new();
    let model = Arc::new(load(&fx, &fx.gguf("tiny"), ""));
    let mut s = ByHand::new(SharedLimit::new(u64::MAX));
    open_as(&s.inbox, 1, &model, exact(&model, 64, KvType::F32), USER);
    // The attacker's session holds a few tokens more than PROMPT.
    let context = model.model.tokenizer.encode(PROMPT).unwrap().len() + 4;
    let attacker = exact(&model, context, KvType::F32);
    open_as(&s.inbox, 2, &model, attacker, USER + 1);
    let (read, _accepted) = request(&s.inbox, 1, PROMPT, spec(TOKENS, Priority::Background));
    s.admit();
    assert!(!s.worker.take_commands());
    let step = s.worker.wanted(1).expect("a prompt piece");
    // Interactive requests that fail: a regex that does not compile, a prompt longer than the
    // context.
    let mut bad_regex = spec(4, Priority::Interactive);
    bad_regex.grammar = Some((GrammarKind::Regex, "(".into()));
    let long = PROMPT.repeat(2);
    assert!(model.model.tokenizer.encode(&long).unwrap().len() > context);
    let refused = [
        (PROMPT, bad_regex, "regex"),
        (&long, spec(4, Priority::Interactive), "context"),
    ];
    for (prompt, spec, why) in refused {
        let (stream, mut answer) = request(&s.inbox, 2, prompt, spec);
        s.admit();
        // Refused at once: the state owner hears of it first, then the caller.
        assert!(
            matches!(
                s.reports.try_recv(),
                Ok(Report::Finished {
                    id: 2,
                    outcome: None,
                    ..
                })
            ),
            "{prompt}: reported"
        );
        let answer = answer.try_recv().unwrap();
        assert!(
            matches!(&answer, Err(LeanStreamError::InvalidArgument(m)) if m.contains(why)),
            "{prompt}: {answer:?}"
        );
        assert!(read_events(stream).is_empty(), "{prompt}: no stream");
        assert_eq!(s.mark(), 0, "{prompt}: a refused request raises no mark");
    }
    // The background pass in flight runs: no refused request made it give itself up.
    s.worker.run_pass(&[step], Priority::Background);
    assert_eq!(
        s.worker.sessions[&1].seen.len(),
        step.tokens,
        "the pass ran"
    );
    assert!(!s.worker.take_commands());
    assert!(
        s.worker.sessions[&2].run.is_none(),
        "the worker never saw the refused requests"
    );
    // An admitted interactive request still pre-empts it.
    let (_stream, _accepted) = request(&s.inbox, 2, PROMPT, spec(1, Priority::Interactive));
    s.admit();
    assert_eq!(s.mark(), urgency(Priority::Interactive));
    let step = s.worker.wanted(1).expect("a prompt piece or decode step");
    let seen = s.worker.sessions[&1].seen.len();
    s.worker.run_pass(&[step], Priority::Background);
    assert_eq!(s.worker.sessions[&1].seen.len(), seen, "the pass gave way");
    s.worker.sessions.clear();
    drop(read);
}

#[test]
fn prompts_that_arrive_together_each_reserve_their_kv_or_are_refused_before_they_run() {
    const FIT: usize = 2;
    const SENT: usize = 5;
    let fx = Fixture::new();
    let model = Arc::new(load(&fx, &fx.gguf("tiny"), ""));
    // Prompts that fill two KV blocks, in pieces of a block or less.
    let prompt = "the cat sat on the mat and the dog sat on the log. ".repeat(3);
    let n = model.model.tokenizer.encode(&prompt).unwrap().len();
    assert!(
        n > KV_BLOCK_TOKENS && n + TOKENS < 2 * KV_BLOCK_TOKENS,
        "{n} tokens"
    );
    let pool = Pool::default();
    // A gate session holds the worker inside its first pass until every request is admitted,
    // so that all of them start in the same round.
    let (release, held) = gate(&model);
    let gate_id = SENT as SessionId + 1;
    let gate_tokens = model.model.tokenizer.encode(PROMPT).unwrap().len();
    pool.hold(gate_id, held.bytes());
    let mut limit = held.bytes() + held.kv_growth_bytes(gate_tokens + 1);
    let sessions: Vec<_> = (1..=SENT)
        .map(|i| {
            let session = exact(&model, 256, KvType::F16);
            pool.hold(i as SessionId, session.bytes());
            limit += session.bytes();
            session
        })
        .collect();
    // Room for FIT prompts' KV, and half of one more.
    let kv = exact(&model, 256, KvType::F16).kv_growth_bytes(n + 1);
    limit += FIT as u64 * kv + kv / 2;
    pool.limit.store(limit, Ordering::SeqCst);

    let (reports, mut reports_rx) = tokio::sync::mpsc::unbounded_channel();
    let engine = Scheduler::start(reports, budget(pool.clone())).unwrap();
    open(&engine, gate_id, &model, Box::new(held));
    let (_gate_stream, gate_answer) =
        request(&engine.tx, gate_id, PROMPT, spec(1, Priority::default()));
    let mut streams = Vec::new();
    let mut answers = Vec::new();
    for (i, session) in sessions.into_iter().enumerate() {
        let id = i as SessionId + 1;
        // Users apart: nothing is shared between them.
        open_as(&engine.tx, id, &model, session, USER + id as u32);
        let (read, answer) = request(&engine.tx, id, &prompt, spec(TOKENS, Priority::default()));
        streams.push(read);
        answers.push(answer);
    }
    handed_on(&engine, &model);
    release.send(()).unwrap();
    gate_answer.blocking_recv().unwrap().unwrap();
    let answers: Vec<_> = answers
        .into_iter()
        .map(|a| a.blocking_recv().unwrap())
        .collect();
    let events: Vec<Vec<StreamEvent>> = streams.into_iter().map(read_events).collect();
    engine.tx.send(Command::Shutdown).unwrap();
    engine.thread.join().unwrap();
    for (i, (answer, events)) in answers.iter().zip(&events).enumerate() {
        if i < FIT {
            assert!(answer.is_ok(), "request {i}: {answer:?}");
            assert_eq!(ids(events).len(), TOKENS, "request {i}: {events:?}");
            assert!(
                matches!(events.last(), Some(StreamEvent::Done { .. })),
                "request {i} runs to its end: {events:?}"
            );
        } else {
            assert!(
                matches!(answer, Err(LeanStreamError::OverBudget(_))),
                "request {i} is refused up front: {answer:?}"
            );
            assert!(events.is_empty(), "request {i}: {events:?}");
        }
    }
    let mut refused = Vec::new();
    while let Ok(report) = reports_rx.try_recv() {
        if let Report::Finished {
            id, outcome: None, ..
        } = report
        {
            refused.push(id);
        }
    }
    refused.sort();
    let expected: Vec<SessionId> = (FIT + 1..=SENT).map(|i| i as SessionId).collect();
    assert_eq!(refused, expected, "refusals reported to the state owner");
}

#[test]
fn a_prefix_is_shared_only_between_sessions_of_one_user() {
    let fx = Fixture::new();
    let model = Arc::new(load(&fx, &fx.gguf("tiny"), ""));
    let system = "the cat sat on the mat and the dog sat on the log. ".repeat(4);
    let n_system = model.model.tokenizer.encode(&system).unwrap().len();
    assert!(n_system > prefix::MIN_SHARED_TOKENS, "{n_system} tokens");
    let (reports, _reports_rx) = tokio::sync::mpsc::unbounded_channel();
    let engine = Scheduler::start(reports, budget(SharedLimit::new(u64::MAX))).unwrap();
    let (alice, bob) = (1000, 1001);
    // Session `id` of `user` runs the system prompt and `question`; returns its cached prompt
    // tokens.
    let run = |id: SessionId, user: u32, question: &str| {
        open_as(
            &engine.tx,
            id,
            &model,
            exact(&model, 256, KvType::F16),
            user,
        );
        let prompt = format!("{system}{question}");
        let (read, answer) = request(&engine.tx, id, &prompt, spec(2, Priority::Interactive));
        answer.blocking_recv().unwrap().unwrap();
        done_stats(&read_events(read)).cached_prompt_tokens
    };
    assert_eq!(
        run(1, alice, "a bird sang"),
        0,
        "the first session computes"
    );
    // Bob knows the system prompt, and Alice's session has run it: he computes it all the same.
    assert_eq!(
        run(2, bob, "a bird sang"),
        0,
        "another user's session computes"
    );
    // Alice's second session starts from her first one's keys and values (and stores them).
    let cached = run(3, alice, "one two three");
    assert!(cached >= n_system - 1, "{cached} cached");
    {
        let store = model.prefixes.lock().unwrap();
        assert_eq!(store.len(), 1);
        assert_eq!(store[0].user, alice, "stored for the user who computed it");
    }
    // Once Bob's own session is gone, the prefix Alice stored is still not his.
    engine.tx.send(Command::Close { id: 2 }).unwrap();
    assert_eq!(
        run(4, bob, "four five"),
        0,
        "a stored prefix of another user"
    );
    // Alice's later sessions find hers in the store, her sessions closed or not.
    engine.tx.send(Command::Close { id: 1 }).unwrap();
    engine.tx.send(Command::Close { id: 3 }).unwrap();
    assert!(run(5, alice, "six seven") >= n_system - 1);
    engine.tx.send(Command::Shutdown).unwrap();
    engine.thread.join().unwrap();
}

/// Greedy constrained generations of at most `max_tokens` tokens on a fresh scheduler, one per
/// grammar; returns each one's answer and text.
fn constrained(
    model: &Arc<LoadedModel>,
    grammars: Vec<(GrammarKind, String)>,
    max_tokens: usize,
) -> Vec<(Result<(), LeanStreamError>, String)> {
    let (reports, _reports_rx) = tokio::sync::mpsc::unbounded_channel();
    let engine = Scheduler::start(reports, budget(SharedLimit::new(u64::MAX))).unwrap();
    let mut out = Vec::new();
    for (i, grammar) in grammars.into_iter().enumerate() {
        let id = i as SessionId + 1;
        open(&engine, id, model, exact(model, 64, KvType::F32));
        let mut spec = spec(max_tokens, Priority::Interactive);
        spec.grammar = Some(grammar);
        let (read, answer) = request(&engine.tx, id, PROMPT, spec);
        let answer = answer.blocking_recv().unwrap();
        let text = text(&read_events(read));
        out.push((answer, text));
    }
    engine.tx.send(Command::Shutdown).unwrap();
    engine.thread.join().unwrap();
    out
}

/// A Lark grammar whose rules chain `rules` deep: each rule is the next one, the last "yes".
fn lark_chain(rules: usize) -> String {
    let mut lark = String::from("start: r1\n");
    for i in 1..rules - 1 {
        lark.push_str(&format!("r{i}: r{}\n", i + 1));
    }
    lark.push_str(&format!("r{}: \"yes\"\n", rules - 1));
    lark
}

/// A JSON Schema of a boolean behind a chain of `links` bare `$ref`s.
fn schema_chain(links: usize) -> String {
    let defs: serde_json::Map<String, serde_json::Value> = (0..links)
        .map(|i| {
            let def = match i + 1 {
                next if next < links => serde_json::json!({"$ref": format!("#/$defs/d{next}")}),
                _ => serde_json::json!({"type": "boolean"}),
            };
            (format!("d{i}"), def)
        })
        .collect();
    serde_json::json!({"$defs": defs, "$ref": "#/$defs/d0"}).to_string()
}

#[test]
fn a_grammar_as_deep_as_the_engine_allows_is_compiled_at_admission_and_followed() {
    use leanstream_engine::constrain::{MAX_LARK_DEPTH, MAX_SCHEMA_DEPTH};
    let fx = Fixture::new();
    let model = Arc::new(load(&fx, &fx.gguf("tiny"), ""));
    // Near the engine's bounds: compiled on the admission thread, masked at every step on the
    // worker's (both with stacks far beyond what the bounds let a grammar use).
    let deep = vec![
        (GrammarKind::Lark, lark_chain(MAX_LARK_DEPTH - 4)),
        (GrammarKind::JsonSchema, schema_chain(MAX_SCHEMA_DEPTH - 4)),
    ];
    for (answer, text) in constrained(&model, deep, 8) {
        answer.unwrap();
        assert!(["yes", "true", "false"].contains(&text.as_str()), "{text}");
    }
    // Past them: refused at admission, before anything is built.
    let deeper = vec![
        (GrammarKind::Lark, lark_chain(2 * MAX_LARK_DEPTH)),
        (GrammarKind::JsonSchema, schema_chain(2 * MAX_SCHEMA_DEPTH)),
    ];
    for (answer, text) in constrained(&model, deeper, 8) {
        assert!(
            matches!(answer, Err(LeanStreamError::InvalidArgument(_))),
            "{answer:?}"
        );
        assert!(text.is_empty());
    }
}
