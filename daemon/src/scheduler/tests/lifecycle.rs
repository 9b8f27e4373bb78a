//! One generation from its start to its end: each token is in its pipe before the next forward
//! pass; closing the session ends its stream; a KV budget refuses a prompt up front or ends a
//! generation, and the session goes on.

use super::*;

#[test]
fn each_token_is_in_the_pipe_before_the_next_forward_pass_starts() {
    let fx = Fixture::new();
    let file = fx.gguf("tiny");
    let model = Arc::new(load(&fx, &file, ""));
    let (events, mut events_rx) = tokio::sync::mpsc::unbounded_channel();
    let engine = Scheduler::start(events, budget(SharedLimit::new(u64::MAX))).unwrap();
    let (read, out) = std::io::pipe().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    // At every pass: how many bytes of the token stream are waiting in the pipe (FIONREAD on
    // a duplicate of the read end, which reads nothing).
    let pipe = std::os::fd::OwnedFd::from(read.try_clone().unwrap());
    let noted = Arc::clone(&seen);
    let session = Box::new(Hooked {
        inner: exact(&model, 64, KvType::F32),
        before_pass: Box::new(move || {
            use std::os::fd::AsRawFd;
            let mut waiting: libc::c_int = 0;
            // SAFETY: FIONREAD writes one int through the pointer, which points at `waiting`;
            // the fd is open for the lifetime of `pipe`, which the closure owns.
            let rc = unsafe { libc::ioctl(pipe.as_raw_fd(), libc::FIONREAD, &mut waiting) };
            assert_eq!(rc, 0, "FIONREAD on the stream's pipe");
            noted.lock().unwrap().push(waiting as usize);
        }),
    });
    open(&engine, 1, &model, session);
    start_into(&engine, 1, PROMPT, out);
    // Read nothing until the generation is over (the whole stream fits in the pipe), so
    // what the session saw waiting is everything written so far.
    while !matches!(
        events_rx.blocking_recv(),
        Some(Report::Finished { id: 1, .. }) | None
    ) {}
    let mut text = String::new();
    let mut read = read;
    read.read_to_string(&mut text).unwrap();
    engine.tx.send(Command::Shutdown).unwrap();
    engine.thread.join().unwrap();

    // Bytes of the stream once token k (1-based) was written.
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    let tokens = lines.len() - 1; // the last line is `done`
    assert_eq!(tokens, TOKENS, "{text}");
    let written: Vec<usize> = lines
        .iter()
        .scan(0, |sum, l| {
            *sum += l.len();
            Some(*sum)
        })
        .collect();
    // The last TOKENS - 1 forward passes each follow a token: the one they run on must be
    // in the pipe already.
    let seen = seen.lock().unwrap();
    // The prompt (under MAX_BATCH tokens) went through one batched pass.
    assert_eq!(seen.len(), 1 + (TOKENS - 1), "{seen:?}");
    let decode = &seen[1..];
    assert_eq!(
        decode,
        &written[..TOKENS - 1],
        "bytes waiting at each decode pass"
    );
}

/// The state owner hears that a generation is over before its caller can read the final event:
/// a caller that asks for the session's statistics after `done` finds the generation there.
#[test]
fn the_end_is_reported_before_the_final_event_is_written() {
    use std::io::BufRead;
    let fx = Fixture::new();
    let file = fx.gguf("tiny");
    let model = Arc::new(load(&fx, &file, ""));
    let (events, mut events_rx) = tokio::sync::mpsc::unbounded_channel();
    let engine = Scheduler::start(events, budget(SharedLimit::new(u64::MAX))).unwrap();
    open(&engine, 1, &model, exact(&model, 64, KvType::F32));
    let mut lines = std::io::BufReader::new(start(&engine, 1, PROMPT)).lines();
    let mut tokens = 0u64;
    loop {
        let line = lines.next().expect("a final event").unwrap();
        match serde_json::from_str(&line).unwrap() {
            StreamEvent::Token { .. } => tokens += 1,
            StreamEvent::Done { .. } => break,
            other => panic!("{other:?}"),
        }
    }
    // No waiting: the report is already there.
    match events_rx.try_recv() {
        Ok(Report::Finished {
            id: 1,
            outcome: Some(o),
            ..
        }) => {
            assert_eq!(o.generated, tokens);
            assert_eq!(o.end, "max_tokens");
            assert!(o.first_token_after.is_some());
        }
        other => panic!("not reported before done was read: {other:?}"),
    }
    engine.tx.send(Command::Shutdown).unwrap();
    engine.thread.join().unwrap();
}

#[test]
fn closing_a_session_mid_generation_ends_its_stream_with_cancelled() {
    let fx = Fixture::new();
    let file = fx.gguf("tiny");
    let model = Arc::new(load(&fx, &file, ""));
    let (events, _events_rx) = tokio::sync::mpsc::unbounded_channel();
    let engine = Scheduler::start(events, budget(SharedLimit::new(u64::MAX))).unwrap();
    // Slow passes, so that the close arrives while the generation runs.
    let session = Box::new(Hooked {
        inner: exact(&model, 256, KvType::F32),
        before_pass: Box::new(|| std::thread::sleep(std::time::Duration::from_millis(20))),
    });
    open(&engine, 1, &model, session);
    let (read, out) = std::io::pipe().unwrap();
    let accepted = send_generate(&engine.tx, 1, PROMPT, spec(200, Priority::default()), out);
    accepted.blocking_recv().unwrap().unwrap();
    engine.tx.send(Command::Close { id: 1 }).unwrap();
    let events = read_events(read);
    engine.tx.send(Command::Shutdown).unwrap();
    engine.thread.join().unwrap();
    assert!(
        ids(&events).len() < 200,
        "the close came too late: {events:?}"
    );
    assert!(
        matches!(events.last(), Some(StreamEvent::Error { name, .. }) if name == "Cancelled"),
        "{events:?}"
    );
}

#[test]
fn kv_over_budget_refuses_a_prompt_up_front_or_ends_a_generation_and_the_session_stays_usable() {
    let fx = Fixture::new();
    let file = fx.gguf("tiny");
    let model = Arc::new(load(&fx, &file, ""));
    let session = model
        .open_session(256, Precision::Exact, KvType::F16)
        .unwrap();
    let open_bytes = session.bytes();
    let block = session.kv_growth_bytes(1);
    assert!(block > 0, "a new session holds no KV block");
    let limit = SharedLimit::new(open_bytes);
    let (events, mut events_rx) = tokio::sync::mpsc::unbounded_channel();
    let engine = Scheduler::start(events, budget(limit.clone())).unwrap();
    let id = 1;
    open(&engine, id, &model, session);
    let request = |max_tokens: usize| {
        let (read, out) = std::io::pipe().unwrap();
        let answer = send_generate(
            &engine.tx,
            id,
            PROMPT,
            spec(max_tokens, Priority::Interactive),
            out,
        );
        (answer.blocking_recv().unwrap(), read_events(read))
    };
    // No room for the prompt's block: refused before it runs, naming the budget; no stream.
    let (answer, refused) = request(TOKENS);
    assert!(
        matches!(answer, Err(LeanStreamError::OverBudget(_))),
        "{answer:?}"
    );
    assert!(refused.is_empty(), "{refused:?}");
    // Room for the prompt's block only: the generation runs until its tokens need the next
    // block, then ends naming the budget.
    limit
        .0
        .store(open_bytes + block, std::sync::atomic::Ordering::SeqCst);
    let (answer, ended) = request(200);
    answer.unwrap();
    assert!(
        matches!(ended.last(), Some(StreamEvent::Error { name, .. }) if name == "OverBudget"),
        "{ended:?}"
    );
    let prompt_tokens = model.model.tokenizer.encode(PROMPT).unwrap().len();
    let block_tokens = leanstream_engine::kv::KV_BLOCK_TOKENS;
    assert_eq!(
        ids(&ended).len(),
        block_tokens + 1 - prompt_tokens,
        "up to the block's end"
    );
    // The same session generates as usual in the block it kept.
    let (answer, served) = request(TOKENS);
    answer.unwrap();
    assert!(
        matches!(served.last(), Some(StreamEvent::Done { .. })),
        "{served:?}"
    );
    assert_eq!(ids(&served).len(), TOKENS);
    engine.tx.send(Command::Close { id }).unwrap();
    engine.tx.send(Command::Shutdown).unwrap();
    engine.thread.join().unwrap();
    let (mut refusals, mut dropped) = (0, false);
    while let Ok(ev) = events_rx.try_recv() {
        refusals += matches!(ev, Report::Finished { outcome: None, .. }) as usize;
        dropped |= matches!(ev, Report::Dropped { id: 1 });
    }
    assert_eq!(refusals, 1, "the refusal is reported to the state owner");
    assert!(dropped, "closing reports that the session's memory is free");
}
