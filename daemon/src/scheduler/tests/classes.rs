//! Classes and deadlines: a more urgent class is served first; a pass gives way to a more urgent
//! request, and its tokens stay the same; a missed deadline is reported in the `done` event.

use super::*;

#[test]
fn a_more_urgent_class_is_served_first_however_long_its_generation() {
    let fx = Fixture::new();
    let file = fx.gguf("tiny");
    let model = Arc::new(load(&fx, &file, ""));
    let (reports, mut reports_rx) = tokio::sync::mpsc::unbounded_channel();
    let engine = Scheduler::start(reports, budget(SharedLimit::new(u64::MAX))).unwrap();
    // Session 9 holds the worker inside its first forward pass until every other request is
    // admitted, so all of them are there when it next chooses.
    let (release, held) = gate(&model);
    open(&engine, 9, &model, Box::new(held));
    for id in 1..=3 {
        open(&engine, id, &model, exact(&model, 64, KvType::F32));
    }
    let mut streams = Vec::new();
    let mut answers = Vec::new();
    let (read, out) = std::io::pipe().unwrap();
    answers.push(send_generate(
        &engine.tx,
        9,
        PROMPT,
        spec(1, Priority::Interactive),
        out,
    ));
    streams.push(read);
    // Background generations shorter than the realtime one: taking turns, they would end first.
    let requests = [
        (1, Priority::Background, 8),
        (2, Priority::Background, 8),
        (3, Priority::Realtime, 30),
    ];
    for (id, priority, tokens) in requests {
        let (read, out) = std::io::pipe().unwrap();
        answers.push(send_generate(
            &engine.tx,
            id,
            PROMPT,
            spec(tokens, priority),
            out,
        ));
        streams.push(read);
    }
    handed_on(&engine, &model);
    release.send(()).unwrap();
    for a in answers {
        a.blocking_recv().unwrap().unwrap();
    }
    let mut order = Vec::new();
    while order.len() < 4 {
        if let Some(Report::Finished { id, .. }) = reports_rx.blocking_recv() {
            order.push(id);
        }
    }
    let events: Vec<Vec<StreamEvent>> = streams.into_iter().map(read_events).collect();
    engine.tx.send(Command::Shutdown).unwrap();
    engine.thread.join().unwrap();
    let pos = |id| order.iter().position(|&x| x == id).unwrap();
    assert!(
        pos(3) < pos(1) && pos(3) < pos(2),
        "the realtime generation ends before the background ones: {order:?}"
    );
    assert_eq!(ids(&events[3]).len(), 30);
    assert_eq!(done_stats(&events[3]).priority, "realtime");
    assert_eq!(done_stats(&events[1]).priority, "background");
}

#[test]
fn a_pass_gives_way_to_a_more_urgent_request_and_its_tokens_stay_the_same() {
    let fx = Fixture::new();
    let file = fx.gguf("tiny");
    let model = Arc::new(load(&fx, &file, ""));
    let expected = ids(&generate(&[(&model, PROMPT)])[0]);
    // Driven by hand, so that the request is sent while a pass is about to run.
    let mut s = ByHand::new(SharedLimit::new(u64::MAX));
    for id in [1, 2] {
        open_as(&s.inbox, id, &model, exact(&model, 64, KvType::F32), USER);
    }
    let background = spec(TOKENS, Priority::Background);
    let (read, _accepted) = request(&s.inbox, 1, PROMPT, background);
    s.admit();
    assert!(!s.worker.take_commands());
    assert_eq!(s.mark(), 0, "taken: no mark left");
    let step = s.worker.wanted(1).expect("a prompt piece");
    // An interactive request is admitted: the background pass gives way and session 1 stays
    // put.
    let interactive = spec(1, Priority::Interactive);
    let (_read_2, _accepted_2) = request(&s.inbox, 2, PROMPT, interactive);
    s.admit();
    let worker = &mut s.worker;
    worker.run_pass(&[step], Priority::Background);
    assert_eq!(
        worker.wanted(1),
        Some(step),
        "the same step is still to run"
    );
    assert!(worker.sessions[&1].seen.is_empty(), "session 1 advanced");
    // A pass of the request's own class does not give way to it.
    worker.run_pass(&[step], Priority::Interactive);
    assert_eq!(worker.sessions[&1].seen.len(), step.tokens, "the pass ran");
    // Once the request is taken, the background generation runs to its end unchanged.
    assert!(!worker.take_commands());
    while worker.sessions.values().any(|s| s.run.is_some()) {
        assert!(!worker.round());
    }
    worker.sessions.clear();
    assert_eq!(ids(&read_events(read)), expected);
}

#[test]
fn a_missed_deadline_is_reported_in_the_done_event_and_a_met_one_is_not() {
    let fx = Fixture::new();
    let file = fx.gguf("tiny");
    let model = Arc::new(load(&fx, &file, ""));
    let (reports, _reports_rx) = tokio::sync::mpsc::unbounded_channel();
    let engine = Scheduler::start(reports, budget(SharedLimit::new(u64::MAX))).unwrap();
    open(&engine, 1, &model, exact(&model, 64, KvType::F32));
    let run = |first: Duration, end: Duration| {
        let (read, out) = std::io::pipe().unwrap();
        let mut spec = spec(4, Priority::Interactive);
        spec.first_token_within = Some(first);
        spec.within = Some(end);
        send_generate(&engine.tx, 1, PROMPT, spec, out)
            .blocking_recv()
            .unwrap()
            .unwrap();
        done_stats(&read_events(read)).missed_deadlines.clone()
    };
    let hour = Duration::from_secs(3600);
    assert_eq!(run(Duration::ZERO, hour), ["first_token"]);
    assert_eq!(run(hour, Duration::ZERO), ["end"]);
    assert!(run(hour, hour).is_empty());
    engine.tx.send(Command::Shutdown).unwrap();
    engine.thread.join().unwrap();
}
