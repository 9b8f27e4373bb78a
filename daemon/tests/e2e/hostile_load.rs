//! A hostile client, one user, floods: cheap calls repeated, calls piled up, requests that fail,
//! prompts that do not fit together. None of it may bloat the daemon, stall or starve the other
//! clients, or make everyone's requests fail; the bounds are wide (behaviour, not benchmarks).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use leanstream::contract::{GenerateParams, StreamEvent};
use leanstream_e2e::*;

use crate::hostile::{Outcome, attempt, start};

/// The longest lifetime a client may ask for: a week, in seconds.
const WEEK: i64 = 604_800;

#[test]
fn asking_again_and_again_to_keep_a_model_loaded_costs_no_memory() -> anyhow::Result<()> {
    runtime().block_on(async {
        let bus = Bus::start()?;
        let daemon = start(&bus, &DaemonConfig::default()).await?;
        let c = Client::new(&bus).await?;
        // The model loads on the first call, then stays loaded and unused: each call asks for
        // a week again. The warm-up lets the allocator settle.
        for _ in 0..1000 {
            c.manager.load_model_for(MODEL, WEEK).await?;
        }
        let before = daemon.rss_bytes()?;
        let started = Instant::now();
        const CALLS: usize = 20_000;
        for _ in 0..CALLS {
            c.manager.load_model_for(MODEL, WEEK).await?;
        }
        let took = started.elapsed();
        let grown = daemon.rss_bytes()?.saturating_sub(before);
        eprintln!(
            "{CALLS} LoadModelFor calls in {took:.1?}: RSS {before} B, grown by {grown} B \
             ({} B a call)",
            grown / CALLS as u64
        );
        // Each call that leaves something behind (a timer waiting out the week, ~1 KiB) adds
        // ~20 MiB here.
        assert!(
            grown < 4 << 20,
            "{CALLS} calls grew the daemon by {grown} B"
        );
        Ok(())
    })
}

/// Time a stalled client waits at most in the flood tests.
const PATIENCE: Duration = Duration::from_secs(5);

#[test]
fn a_flood_of_list_models_calls_stalls_no_other_client() -> anyhow::Result<()> {
    runtime().block_on(async {
        let bus = Bus::start()?;
        let daemon = start(&bus, &DaemonConfig::default()).await?;
        for name in ["copy1", "copy2"] {
            daemon.add_model(name)?;
        }
        let victim = Client::new(&bus).await?;
        let session = victim.open(128).await?;
        read_stream(session.generate(STORY_PROMPT, &greedy(1)).await?).await?;

        // Four connections pile up calls, without waiting for the answers.
        let mut flood = Vec::new();
        for _ in 0..4 {
            let flooder = Client::new(&bus).await?;
            for _ in 0..100 {
                let manager = flooder.manager.clone();
                flood.push(tokio::spawn(async move {
                    error_name(manager.list_models().await.map(|m| m.len()))
                }));
            }
            // The connection lives as long as its calls (the proxies hold it).
        }
        tokio::time::sleep(Duration::from_millis(300)).await;

        let asked = Instant::now();
        let memory = tokio::time::timeout(PATIENCE, victim.manager.memory()).await;
        let memory_took = asked.elapsed();
        let asked = Instant::now();
        let generation = tokio::time::timeout(PATIENCE, async {
            read_stream(session.generate(STORY_PROMPT, &greedy(8)).await?).await
        })
        .await;
        let generation_took = asked.elapsed();
        eprintln!("during the flood: Memory() {memory_took:.2?}, 8 tokens {generation_took:.2?}");
        assert!(
            matches!(memory, Ok(Ok(_))),
            "Memory() during the flood: {memory:?} after {memory_took:.1?}"
        );
        let Ok(generation) = generation else {
            anyhow::bail!("8 tokens not out {PATIENCE:?} into the flood");
        };
        assert_eq!(generation?.ids, STORY_GREEDY[..8]);

        // Every flooding call was answered with the list or refused as Busy.
        let (mut listed, mut busy) = (0, 0);
        for call in flood {
            match call.await?.as_str() {
                "ok: 3" => listed += 1,
                "Busy" => busy += 1,
                other => anyhow::bail!("a flooding ListModels call: {other}"),
            }
        }
        eprintln!("the flood: {listed} lists, {busy} refused as Busy");
        Ok(())
    })
}

#[test]
fn failing_urgent_requests_do_not_starve_a_background_generation() -> anyhow::Result<()> {
    runtime().block_on(async {
        let bus = Bus::start()?;
        let _daemon = start(&bus, &DaemonConfig::default()).await?;
        let background = Client::new(&bus).await?;
        let session = background.open(128).await?;
        read_stream(session.generate(STORY_PROMPT, &greedy(1)).await?).await?;

        // Interactive requests that the scheduler refuses, one after another: a regex that
        // does not compile, a prompt longer than the session's context.
        let attacker = Client::new(&bus).await?;
        let target = attacker.open(64).await?;
        let stop = Arc::new(AtomicBool::new(false));
        let refused = Arc::new(AtomicUsize::new(0));
        let attack = {
            let (stop, refused) = (Arc::clone(&stop), Arc::clone(&refused));
            tokio::spawn(async move {
                let bad_regex = GenerateParams {
                    grammar_kind: "regex".into(),
                    grammar: "[unclosed".into(),
                    ..greedy(8)
                };
                let too_long = "word ".repeat(100);
                let requests = [("Hi", bad_regex), (too_long.as_str(), greedy(8))];
                while !stop.load(Ordering::Relaxed) {
                    for (prompt, params) in &requests {
                        match attempt(&target, prompt, params).await? {
                            Outcome::Refused(name, _) if name == "InvalidArgument" => {
                                refused.fetch_add(1, Ordering::Relaxed);
                            }
                            other => anyhow::bail!("an attacking request: {other:?}"),
                        }
                    }
                }
                anyhow::Ok(())
            })
        };
        tokio::time::sleep(Duration::from_millis(200)).await;

        let params = GenerateParams {
            priority: "background".into(),
            ..greedy(60)
        };
        let asked = Instant::now();
        let limit = Duration::from_secs(30);
        let out = tokio::time::timeout(limit, async {
            read_stream(session.generate(STORY_PROMPT, &params).await?).await
        })
        .await;
        let took = asked.elapsed();
        stop.store(true, Ordering::Relaxed);
        let refused = refused.load(Ordering::Relaxed);
        eprintln!("60 background tokens in {took:.2?} beside {refused} refused requests");
        let Ok(out) = out else {
            anyhow::bail!("60 background tokens not out within {limit:?} ({refused} refusals)");
        };
        let out = out?;
        assert!(
            matches!(&out.end, Some(StreamEvent::Done { .. })),
            "{:?}",
            out.end
        );
        assert_eq!(out.ids.len(), 60);
        assert_eq!(out.ids[..16], STORY_GREEDY);
        attack.await??;
        assert!(refused > 10, "the attack ran: {refused} refusals");
        Ok(())
    })
}

/// Eight prompts of about 150 tokens (three KV blocks with room for 8 more tokens), each
/// starting with another name so that they share no prefix.
fn long_prompts() -> Vec<String> {
    const BODY: &str = "the robot arm in bay four stopped twice this morning while it moved \
        boxes from the conveyor to the pallet. The first stop came after the gripper lost a box \
        at the turn; the second came when the light curtain saw a person near the pallet. \
        Both times the arm waited for the operator, who checked the area, reset the alarm and \
        started the cycle again. The vision system reported that the boxes were wet and soft, \
        and the vacuum pressure dropped below its limit for a moment before each stop. The \
        maintenance team replaced the suction cups last week and cleaned the filters, but they \
        did not check the hoses. Write a short note for the next shift that says what happened, \
        what to check first and whom to call.";
    [
        "Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi",
    ]
    .iter()
    .map(|name| format!("{name} writes: {BODY}"))
    .collect()
}

#[test]
fn prompts_that_do_not_fit_together_are_refused_up_front_and_the_rest_complete()
-> anyhow::Result<()> {
    runtime().block_on(async {
        let prompts = long_prompts();
        let cfg = DaemonConfig {
            budget: "1GiB".into(),
            extra: "max_sessions_per_client = 8\n".into(),
            ..DaemonConfig::default()
        };
        // What eight open sessions hold, and what one prompt's keys and values add.
        let (open, per_prompt) = {
            let bus = Bus::start()?;
            let _daemon = start(&bus, &cfg).await?;
            let c = Client::new(&bus).await?;
            let mut sessions = Vec::new();
            for _ in 0..8 {
                sessions.push(c.open(256).await?);
            }
            let open = c.manager.memory().await?.used_bytes;
            let out = read_stream(sessions[0].generate(&prompts[0], &greedy(8)).await?).await?;
            let Some(StreamEvent::Done { stats, .. }) = &out.end else {
                anyhow::bail!("measuring one prompt: {:?}", out.end);
            };
            let per_prompt = c.manager.memory().await?.used_bytes - open;
            eprintln!(
                "8 open sessions: {open} B; a prompt of {} tokens adds {per_prompt} B",
                stats.prompt_tokens
            );
            (open, per_prompt)
        };

        // A budget with room for three and a half prompts, eight prompts at once.
        let bus = Bus::start()?;
        let cfg = DaemonConfig {
            budget: format!("{}", open + per_prompt * 7 / 2),
            ..cfg
        };
        let _daemon = start(&bus, &cfg).await?;
        let mut sessions = Vec::new();
        for _ in 0..8 {
            let c = Client::new(&bus).await?;
            let s = c.open(256).await?;
            sessions.push((c, s));
        }
        let mut runs = Vec::new();
        for ((_, s), prompt) in sessions.iter().zip(&prompts) {
            let (s, prompt) = (s.clone(), prompt.clone());
            runs.push(tokio::spawn(async move {
                attempt(&s, &prompt, &greedy(8)).await
            }));
        }
        let mut tally: BTreeMap<&str, usize> = BTreeMap::new();
        for (i, run) in runs.into_iter().enumerate() {
            let outcome = run.await??;
            let how = match &outcome {
                Outcome::Streamed(Stream {
                    ids,
                    end: Some(StreamEvent::Done { .. }),
                    ..
                }) if ids.len() == 8 => "completed",
                Outcome::Refused(name, _) if name == "OverBudget" => "refused at the call",
                Outcome::Streamed(Stream {
                    ids,
                    end: Some(StreamEvent::Error { name, .. }),
                    ..
                }) if ids.is_empty() && name == "OverBudget" => "refused before any token",
                _ => anyhow::bail!("prompt {i} neither completed nor was refused: {outcome:?}"),
            };
            *tally.entry(how).or_default() += 1;
        }
        eprintln!("eight prompts with room for three and a half: {tally:?}");
        // Rounding may leave room for one prompt less than three.
        assert!(
            tally.get("completed").is_some_and(|&n| n >= 2),
            "room for three and a half prompts: {tally:?}"
        );
        Ok(())
    })
}

#[test]
fn opening_and_closing_sessions_does_not_flood_the_log() -> anyhow::Result<()> {
    runtime().block_on(async {
        let bus = Bus::start()?;
        let cfg = DaemonConfig {
            capture_log: true,
            ..DaemonConfig::default()
        };
        let daemon = start(&bus, &cfg).await?;
        let c = Client::new(&bus).await?;
        // Pinned, the model stays loaded between the sessions.
        c.manager.load_model(MODEL).await?;
        c.open(64).await?.close().await?;
        let log = daemon.log()?;
        assert!(
            log.contains("serving"),
            "the daemon's log was not captured: {log:?}"
        );
        let before = log.lines().count();
        const CYCLES: usize = 200;
        for _ in 0..CYCLES {
            c.open(64).await?.close().await?;
        }
        let log = daemon.log()?;
        let added: Vec<&str> = log.lines().skip(before).collect();
        assert!(
            added.len() < 10,
            "{CYCLES} sessions opened and closed added {} lines to the log, such as {:#?}",
            added.len(),
            &added[..added.len().min(4)]
        );
        Ok(())
    })
}
