//! Prompt prefixes shared between sessions of one model: a prompt that starts like another
//! session's reuses its keys and values and keeps its tokens; a full store evicts the least
//! recently used prefix that no session reads.

use super::*;

#[test]
fn a_prompt_starting_like_another_sessions_reuses_its_keys_and_values_and_keeps_its_tokens() {
    let fx = Fixture::new();
    let file = fx.gguf("tiny");
    let model = Arc::new(load(&fx, &file, ""));
    let system = "the cat sat on the mat and the dog sat on the log. ".repeat(4);
    let n_system = model.model.tokenizer.encode(&system).unwrap().len();
    assert!(n_system > prefix::MIN_SHARED_TOKENS, "{n_system} tokens");
    let prompts = [
        format!("{system}a bird sang"),
        format!("{system}one two three"),
        format!("{system}four five"),
    ];
    let (reports, _reports_rx) = tokio::sync::mpsc::unbounded_channel();
    let engine = Scheduler::start(reports, budget(SharedLimit::new(u64::MAX))).unwrap();
    let open_256 = |id, model: &Arc<LoadedModel>| {
        open(&engine, id, model, exact(model, 256, KvType::F16));
    };
    let run = |id, prompt: &str| {
        let (read, out) = std::io::pipe().unwrap();
        let spec = spec(TOKENS, Priority::Interactive);
        send_generate(&engine.tx, id, prompt, spec, out)
            .blocking_recv()
            .unwrap()
            .unwrap();
        read_events(read)
    };
    for (i, prompt) in prompts.iter().enumerate() {
        // The reference: the same file loaded apart, nothing to share with.
        let apart = Arc::new(load(&fx, &file, ""));
        open_256(10 + i as SessionId, &apart);
        let alone = run(10 + i as SessionId, prompt);
        assert_eq!(done_stats(&alone).cached_prompt_tokens, 0, "apart");
        open_256(1 + i as SessionId, &model);
        let shared = run(1 + i as SessionId, prompt);
        let cached = done_stats(&shared).cached_prompt_tokens;
        if i == 0 {
            assert_eq!(cached, 0, "the first session computes its prompt");
            // The first stays open for the second to share with, then goes.
        } else {
            assert!(cached >= n_system - 1, "session {i}: {cached} cached");
        }
        assert_eq!(ids(&shared), ids(&alone), "session {i}'s tokens");
        if i == 1 {
            engine.tx.send(Command::Close { id: 1 }).unwrap();
        }
    }
    // The third found the prefix in the model's store: the session it came from is closed.
    assert_eq!(model.prefixes.lock().unwrap().len(), 1);
    engine.tx.send(Command::Shutdown).unwrap();
    engine.thread.join().unwrap();
}

#[test]
fn a_full_prefix_store_evicts_the_least_recently_used_prefix_that_no_session_reads() {
    let fx = Fixture::new();
    let model = Arc::new(load(&fx, &fx.gguf("tiny"), ""));
    let words = ["alpha", "bravo", "charlie", "delta", "echo"];
    let system = |k: usize| format!("{} ", words[k]).repeat(40);
    let tokens = |text: &str| model.model.tokenizer.encode(text).unwrap();
    assert!(tokens(&system(0)).len() > prefix::MIN_SHARED_TOKENS);
    let (reports, _reports_rx) = tokio::sync::mpsc::unbounded_channel();
    let limit = SharedLimit::new(u64::MAX);
    let handed_back = Arc::clone(&limit.1);
    let engine = Scheduler::start(reports, budget(limit)).unwrap();
    // Session `id` runs system prompt `k` and a question; returns its cached prompt tokens.
    let run = |id: SessionId, k: usize, question: &str| {
        open(&engine, id, &model, exact(&model, 256, KvType::F16));
        let (read, out) = std::io::pipe().unwrap();
        let prompt = format!("{}{question}", system(k));
        send_generate(&engine.tx, id, &prompt, spec(2, Priority::Interactive), out)
            .blocking_recv()
            .unwrap()
            .unwrap();
        done_stats(&read_events(read)).cached_prompt_tokens
    };
    let stored = || -> Vec<Vec<u32>> {
        let store = model.prefixes.lock().unwrap();
        store.iter().map(|p| p.tokens.clone()).collect()
    };
    // Four system prompts, each run by two sessions (the second shares through the store),
    // all left open: the store is full of prefixes that sessions read.
    for k in 0..4 {
        assert_eq!(run(10 + k as SessionId, k, "a"), 0);
        assert!(run(20 + k as SessionId, k, "b") > 0, "prompt {k} shared");
    }
    assert_eq!(stored().len(), prefix::MAX_PREFIXES);
    // A fifth finds no room: every stored prefix is read, none is evicted.
    assert_eq!(run(14, 4, "a"), 0);
    assert_eq!(run(24, 4, "b"), 0, "nothing evicted, nothing shared");
    assert_eq!(handed_back.load(std::sync::atomic::Ordering::SeqCst), 0);
    // Once the sessions of the first prompt are gone, its prefix makes room for the fifth.
    engine.tx.send(Command::Close { id: 10 }).unwrap();
    engine.tx.send(Command::Close { id: 20 }).unwrap();
    assert!(run(34, 4, "c") > 0, "prompt 4 shared after the eviction");
    let now = stored();
    assert_eq!(now.len(), prefix::MAX_PREFIXES);
    let first = tokens(&system(0));
    assert!(
        now.iter().all(|p| !first.starts_with(&p[..8])),
        "the first prompt's prefix is gone"
    );
    assert!(now.iter().any(|p| tokens(&system(4)).starts_with(p)));
    assert!(handed_back.load(std::sync::atomic::Ordering::SeqCst) > 0);
    engine.tx.send(Command::Shutdown).unwrap();
    engine.thread.join().unwrap();
}
