//! The scheduler's tests: generations on small generated models, alone and side by side;
//! requests of a hostile client in [`hostile`]; speculative decoding in [`speculative`].
#![allow(clippy::unwrap_used)]

mod hostile;
mod speculative;

use std::io::Read;
use std::sync::Mutex;
use std::sync::atomic::Ordering;

use leanstream::contract::{StreamEvent, StreamStats};
use leanstream_engine::backend::cpu::Precision;
use leanstream_engine::io::{DirectFile, Fault, FaultKind, FaultyReader, ThreadPoolIo};
use leanstream_engine::kv::KvType;
use leanstream_engine::pipeline::{Executor, Mode, Policy, Selector, SparseModel, StreamingFfn};
use leanstream_engine::sample::SamplerConfig;

use super::*;
use crate::loader::Footprint;
use crate::models::ModelFile;
use crate::testing::Fixture;

const PROMPT: &str = "the cat sat on the";
const TOKENS: usize = 12;
/// The uid that owns the sessions of a test, unless it says otherwise.
const USER: u32 = 1000;

/// A budget factory for [`Scheduler::start`]: each thread gets a clone of `b`.
fn budget<B: SessionBudget + Clone + 'static>(b: B) -> impl Fn() -> Box<dyn SessionBudget> {
    move || Box::new(b.clone())
}

/// A budget that grants every reservation up to a per-session limit the test can change
/// while the scheduler runs, and sums what models hand back.
#[derive(Clone)]
struct SharedLimit(
    Arc<std::sync::atomic::AtomicU64>,
    Arc<std::sync::atomic::AtomicU64>,
);

impl SharedLimit {
    fn new(limit: u64) -> SharedLimit {
        let limit = Arc::new(std::sync::atomic::AtomicU64::new(limit));
        SharedLimit(limit, Arc::default())
    }
}

impl SessionBudget for SharedLimit {
    fn resize(&self, id: SessionId, bytes: u64) -> Result<(), LeanStreamError> {
        let limit = self.0.load(std::sync::atomic::Ordering::SeqCst);
        if bytes <= limit {
            Ok(())
        } else {
            Err(LeanStreamError::OverBudget(format!(
                "session {id} needs {bytes} bytes, over {limit}"
            )))
        }
    }

    fn grow_model(&self, _name: &str, _bytes: u64) -> Result<(), LeanStreamError> {
        Ok(())
    }

    fn shrink_model(&self, _name: &str, bytes: u64) {
        self.1.fetch_add(bytes, std::sync::atomic::Ordering::SeqCst);
    }
}

fn load(fx: &Fixture, file: &ModelFile, toml: &str) -> LoadedModel {
    let params = fx.params(toml);
    let fp = Footprint::of(file, params.model(&file.name)).unwrap();
    LoadedModel::load(file, &params, fp.cache_bytes).unwrap()
}

/// Runs one greedy generation per (model, prompt), all at once on one scheduler, and returns
/// each stream's events.
fn generate(runs: &[(&Arc<LoadedModel>, &str)]) -> Vec<Vec<StreamEvent>> {
    let (events, _events_rx) = tokio::sync::mpsc::unbounded_channel();
    let engine = Scheduler::start(events, budget(SharedLimit::new(u64::MAX))).unwrap();
    let mut readers = Vec::new();
    for (i, (model, prompt)) in runs.iter().enumerate() {
        let id = i as SessionId + 1;
        open(&engine, id, model, exact(model, 64, KvType::F32));
        readers.push(start(&engine, id, prompt));
    }
    let streams = readers.into_iter().map(read_events).collect();
    engine.tx.send(Command::Shutdown).unwrap();
    engine.thread.join().unwrap();
    streams
}

/// [`generate`], with every request queued before the scheduler takes any of them: a session
/// of another kind (a wrapper, which runs alone) holds the worker inside its first pass until
/// all are admitted, so that they all start in the same round whatever the machine's timing.
fn generate_queued(runs: &[(&Arc<LoadedModel>, &str)]) -> Vec<Vec<StreamEvent>> {
    generate_queued_for(runs, TOKENS)
}

/// [`generate_queued`], each generation `max_tokens` long.
fn generate_queued_for(
    runs: &[(&Arc<LoadedModel>, &str)],
    max_tokens: usize,
) -> Vec<Vec<StreamEvent>> {
    let (events, _events_rx) = tokio::sync::mpsc::unbounded_channel();
    let engine = Scheduler::start(events, budget(SharedLimit::new(u64::MAX))).unwrap();
    let (release, gate) = std::sync::mpsc::channel::<()>();
    let gate = Mutex::new(Some(gate));
    let model = runs[0].0;
    let held = Hooked {
        inner: exact(model, 64, KvType::F32),
        before_pass: Box::new(move || {
            if let Some(gate) = gate.lock().unwrap().take() {
                let _ = gate.recv();
            }
        }),
    };
    let gate_id = runs.len() as SessionId + 1;
    open(&engine, gate_id, model, Box::new(held));
    let (_gate_read, out) = std::io::pipe().unwrap();
    let gate_answer = send_generate(&engine, gate_id, PROMPT, spec(1, Priority::default()), out);
    let mut readers = Vec::new();
    let mut answers = Vec::new();
    for (i, (model, prompt)) in runs.iter().enumerate() {
        let id = i as SessionId + 1;
        open(&engine, id, model, exact(model, 64, KvType::F32));
        let (read, out) = std::io::pipe().unwrap();
        answers.push(send_generate(
            &engine,
            id,
            prompt,
            spec(max_tokens, Priority::default()),
            out,
        ));
        readers.push(read);
    }
    handed_on(&engine, model);
    release.send(()).unwrap();
    for a in std::iter::once(gate_answer).chain(answers) {
        a.blocking_recv().unwrap().unwrap();
    }
    let streams = readers.into_iter().map(read_events).collect();
    engine.tx.send(Command::Shutdown).unwrap();
    engine.thread.join().unwrap();
    streams
}

fn ids(events: &[StreamEvent]) -> Vec<u32> {
    events
        .iter()
        .filter_map(|e| match e {
            StreamEvent::Token { id, .. } => Some(*id),
            _ => None,
        })
        .collect()
}

/// Starts a generation of `prompt` on session `id`; returns the read end of its stream.
fn start(engine: &Scheduler, id: SessionId, prompt: &str) -> std::io::PipeReader {
    let (read, out) = std::io::pipe().unwrap();
    start_into(engine, id, prompt, out);
    read
}

/// A greedy generation of `max_tokens` tokens in class `priority`, without deadlines.
fn spec(max_tokens: usize, priority: Priority) -> GenSpec {
    GenSpec {
        max_tokens,
        sampler: SamplerConfig::default(),
        stop: Vec::new(),
        grammar: None,
        priority,
        first_token_within: None,
        within: None,
    }
}

/// Starts a generation of `prompt` on session `id` that writes its stream to `out`.
fn start_into(engine: &Scheduler, id: SessionId, prompt: &str, out: std::io::PipeWriter) {
    let accepted = send_generate(engine, id, prompt, spec(TOKENS, Priority::default()), out);
    accepted.blocking_recv().unwrap().unwrap();
}

/// Sends a `Generate` command without waiting for the scheduler to take it; returns where its
/// answer comes.
fn send_generate(
    engine: &Scheduler,
    id: SessionId,
    prompt: &str,
    spec: GenSpec,
    out: std::io::PipeWriter,
) -> tokio::sync::oneshot::Receiver<Result<(), LeanStreamError>> {
    let (reply, accepted) = tokio::sync::oneshot::channel();
    let input = Input::Text(prompt.to_string());
    let cmd = Command::Generate {
        id,
        input,
        spec,
        out,
        reply,
    };
    engine.tx.send(cmd).unwrap();
    accepted
}

/// Reads a stream to its end.
fn read_events(mut read: std::io::PipeReader) -> Vec<StreamEvent> {
    let mut text = String::new();
    read.read_to_string(&mut text).unwrap();
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A session id no test opens otherwise: [`handed_on`]'s marker.
const MARKER: SessionId = 999;

/// A session that is never run: it tells the test when the admission stage opens it, by which
/// time every command sent before has been handed on to the worker.
#[derive(Debug)]
struct Marker(Mutex<Option<std::sync::mpsc::Sender<()>>>);

impl Decode for Marker {
    fn forward(&mut self, _: u32) -> leanstream_engine::Result<&mut [f32]> {
        unreachable!("a marker session is never run")
    }
    fn forward_batch(&mut self, _: &[u32]) -> leanstream_engine::Result<&mut [f32]> {
        unreachable!("a marker session is never run")
    }
    fn position(&self) -> usize {
        0
    }
    fn max_context(&self) -> usize {
        if let Some(seen) = self.0.lock().unwrap().take() {
            let _ = seen.send(());
        }
        1
    }
    fn vocab_size(&self) -> usize {
        0
    }
    fn forward_with(
        &mut self,
        _: u32,
        _: &mut dyn leanstream_engine::forward::FfnExecutor,
    ) -> leanstream_engine::Result<&mut [f32]> {
        unreachable!("a marker session is never run")
    }
    fn rewind(&mut self, _: usize) -> leanstream_engine::Result<()> {
        Ok(())
    }
    fn reset(&mut self) {}
    fn bytes(&self) -> u64 {
        0
    }
    fn kv_growth_bytes(&self, _: usize) -> u64 {
        0
    }
    fn grow_kv(&mut self, _: usize) -> leanstream_engine::Result<()> {
        Ok(())
    }
    fn release_kv(&mut self) {}
}

/// Returns once the admission stage has handed on to the worker every command sent to `engine`
/// before (while the worker may be held, by a gate session).
fn handed_on(engine: &Scheduler, model: &Arc<LoadedModel>) {
    let (seen, opened) = std::sync::mpsc::channel();
    let marker = Marker(Mutex::new(Some(seen)));
    open(engine, MARKER, model, Box::new(marker));
    opened.recv().unwrap();
    engine.tx.send(Command::Close { id: MARKER }).unwrap();
}

/// A session that calls `before_pass` at the start of every forward pass.
struct Hooked {
    inner: Box<dyn Decode + Send>,
    before_pass: Box<dyn FnMut() + Send>,
}

impl std::fmt::Debug for Hooked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hooked")
            .field("inner", &self.inner)
            .finish()
    }
}

impl Hooked {
    fn note(&mut self) {
        (self.before_pass)();
    }
}

impl Decode for Hooked {
    fn forward(&mut self, token: u32) -> leanstream_engine::Result<&mut [f32]> {
        self.note();
        self.inner.forward(token)
    }
    fn forward_batch(&mut self, tokens: &[u32]) -> leanstream_engine::Result<&mut [f32]> {
        self.note();
        self.inner.forward_batch(tokens)
    }
    fn position(&self) -> usize {
        self.inner.position()
    }
    fn max_context(&self) -> usize {
        self.inner.max_context()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn forward_with(
        &mut self,
        token: u32,
        exec: &mut dyn leanstream_engine::forward::FfnExecutor,
    ) -> leanstream_engine::Result<&mut [f32]> {
        self.note();
        self.inner.forward_with(token, exec)
    }
    fn forward_rows(
        &mut self,
        tokens: &[u32],
        exec: Option<&mut dyn leanstream_engine::forward::FfnExecutor>,
        out: &mut Vec<f32>,
    ) -> leanstream_engine::Result<()> {
        self.note();
        self.inner.forward_rows(tokens, exec, out)
    }
    fn rewind(&mut self, position: usize) -> leanstream_engine::Result<()> {
        self.inner.rewind(position)
    }
    fn reset(&mut self) {
        self.inner.reset()
    }
    fn bytes(&self) -> u64 {
        self.inner.bytes()
    }
    fn kv_growth_bytes(&self, tokens: usize) -> u64 {
        self.inner.kv_growth_bytes(tokens)
    }
    fn grow_kv(&mut self, tokens: usize) -> leanstream_engine::Result<()> {
        self.inner.grow_kv(tokens)
    }
    fn release_kv(&mut self) {
        self.inner.release_kv()
    }
}

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
    let accepted = send_generate(&engine, 1, PROMPT, spec(200, Priority::default()), out);
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
            &engine,
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
        refusals += matches!(
            ev,
            Report::Finished {
                accepted: false,
                ..
            }
        ) as usize;
        dropped |= matches!(ev, Report::Dropped { id: 1 });
    }
    assert_eq!(refusals, 1, "the refusal is reported to the state owner");
    assert!(dropped, "closing reports that the session's memory is free");
}

#[test]
fn streaming_modes_with_sparsity_off_generate_the_dense_tokens() {
    let fx = Fixture::new();
    let file = fx.lsm("tiny", None);
    let dense = Arc::new(load(&fx, &file, ""));
    let prompt_tokens = dense.model.tokenizer.encode(PROMPT).unwrap().len();
    let expected = generate(&[(&dense, PROMPT)]).remove(0);
    assert!(
        matches!(expected.last(), Some(StreamEvent::Done { .. })),
        "{expected:?}"
    );
    let expected = ids(&expected);
    assert!(!expected.is_empty());
    for mode in [Mode::Mmap, Mode::OnDemand, Mode::Prefetch, Mode::LeanStream] {
        // Half the chunks: one layer, so every token evicts and reads again.
        let share = if mode.uses_cache() {
            "cache_share = 0.5\n"
        } else {
            ""
        };
        // Without speculation, so that the pipeline counts one token a decode pass.
        let toml =
            format!("[models.tiny]\nmode = \"{mode}\"\nsparsity = 0\nspeculate = \"off\"\n{share}");
        let sparse = Arc::new(load(&fx, &file, &toml));
        // Alongside a dense generation, as the scheduler interleaves them.
        let out = generate(&[(&sparse, PROMPT), (&dense, PROMPT)]);
        assert_eq!(ids(&out[0]), expected, "{mode}");
        assert_eq!(ids(&out[1]), expected, "{mode}: the dense run beside it");
        // Every forward pass went through the model's pipeline: the prompt, then each
        // generated token but the last.
        let stats = sparse.ffn.as_ref().unwrap().lock().unwrap().stats();
        let passes = prompt_tokens + expected.len() - 1;
        assert_eq!(stats.tokens as usize, passes, "{mode}");
        if mode.uses_cache() {
            assert!(
                stats.misses > 0 && stats.bytes_read > 0,
                "{mode}: {stats:?}"
            );
        }
    }
}

/// The stats of a stream's `done` event.
fn done_stats(events: &[StreamEvent]) -> &StreamStats {
    match events.last() {
        Some(StreamEvent::Done { stats, .. }) => stats,
        other => panic!("the stream did not end with done: {other:?}"),
    }
}

#[test]
fn sessions_running_together_share_passes_and_keep_their_tokens() {
    let fx = Fixture::new();
    let dense = Arc::new(load(&fx, &fx.gguf("tiny"), ""));
    // Half the chunks cached: the pipeline reads while the pass runs.
    let toml = "[models.tiny]\nmode = \"leanstream\"\nsparsity = 0\ncache_share = 0.5\n";
    let streaming = Arc::new(load(&fx, &fx.lsm("tiny", None), toml));
    for model in [&dense, &streaming] {
        let mode = if model.ffn.is_some() {
            "leanstream"
        } else {
            "dense"
        };
        let prompts = [PROMPT, "a bird sang", "one two three four five six"];
        let alone: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| ids(&generate(&[(model, p)])[0]))
            .collect();
        let runs: Vec<(&Arc<LoadedModel>, &str)> = prompts.iter().map(|p| (model, *p)).collect();
        let together = generate_queued(&runs);
        let (mut shared, mut shared_prompts) = (0, 0);
        for (i, events) in together.iter().enumerate() {
            assert_eq!(
                ids(events),
                alone[i],
                "{mode}: session {i}'s tokens beside the others"
            );
            shared += done_stats(events).shared_decode_passes;
            shared_prompts += done_stats(events).shared_prompt_passes;
        }
        for events in generate(&runs[..1]) {
            let stats = done_stats(&events);
            assert_eq!(
                (stats.shared_decode_passes, stats.shared_prompt_passes),
                (0, 0),
                "{mode}: alone"
            );
        }
        // All three start in the same round: most of their passes are shared, their prompts'
        // included.
        assert!(shared >= TOKENS, "{mode}: shared passes: {shared}");
        assert!(
            shared_prompts >= 2,
            "{mode}: shared prompt passes: {shared_prompts}"
        );
    }
}

#[test]
fn a_read_error_ends_only_its_generation() {
    let fx = Fixture::new();
    let file = fx.lsm("tiny", None);
    let toml = "[models.tiny]\nmode = \"leanstream\"\nsparsity = 0\ncache_share = 1.0\n";
    let healthy = Arc::new(load(&fx, &file, toml));
    // The same model, but the first chunk of layer 0 sits on a bad sector.
    let mut faulty = load(&fx, &file, toml);
    let sm = SparseModel::open(&file.path, false).unwrap();
    let at = sm.layout.file_offset(sm.layout.id(0, 0));
    let fault = Fault::on_range(at..at + 1, FaultKind::Error(std::io::ErrorKind::Other));
    let reader = FaultyReader::new(Arc::new(DirectFile::open(&file.path).unwrap()), vec![fault]);
    let io = ThreadPoolIo::new(Arc::new(reader), 1, Default::default()).unwrap();
    let ffn = StreamingFfn::new(
        Arc::clone(&sm),
        Selector::new(sm.scorer(None).unwrap(), sm.layout.n_ff),
        Policy::for_mode(Mode::LeanStream).unwrap(),
        sm.layout.streamed_bytes(),
        Box::new(io),
        Precision::Exact,
    )
    .unwrap();
    faulty.ffn = Some(Mutex::new(Executor::Streaming(Box::new(ffn))));
    let faulty = Arc::new(faulty);

    let expected = ids(&generate(&[(&healthy, PROMPT)])[0]);
    let out = generate(&[
        (&faulty, PROMPT),
        (&healthy, PROMPT),
        (&faulty, "a bird sang"),
    ]);
    for failed in [&out[0], &out[2]] {
        match failed.as_slice() {
            [StreamEvent::Error { name, message }] => {
                assert_eq!(name, "Internal");
                assert!(message.contains("chunk 0"), "{message}");
            }
            other => panic!("expected one error event, got {other:?}"),
        }
    }
    assert_eq!(ids(&out[1]), expected, "the other generation goes on");
    assert!(matches!(out[1].last(), Some(StreamEvent::Done { .. })));
}

/// A session of `model` in exact precision, for `context` tokens stored as `kv`.
fn exact(model: &LoadedModel, context: usize, kv: KvType) -> Box<dyn Decode + Send> {
    model.open_session(context, Precision::Exact, kv).unwrap()
}

/// Opens `session` on `model` as session `id` of the scheduler, owned by [`USER`].
fn open(
    engine: &Scheduler,
    id: SessionId,
    model: &Arc<LoadedModel>,
    session: Box<dyn Decode + Send>,
) {
    open_as(&engine.tx, id, model, session, USER);
}

/// Opens `session` on `model` as session `id`, owned by `user`, through `inbox`.
fn open_as(
    inbox: &Commands,
    id: SessionId,
    model: &Arc<LoadedModel>,
    session: Box<dyn Decode + Send>,
    user: u32,
) {
    let model = Arc::clone(model);
    let cmd = Command::Open {
        id,
        model,
        session,
        user,
    };
    inbox.send(cmd).unwrap();
}

#[test]
fn a_more_urgent_class_is_served_first_however_long_its_generation() {
    let fx = Fixture::new();
    let file = fx.gguf("tiny");
    let model = Arc::new(load(&fx, &file, ""));
    let (reports, mut reports_rx) = tokio::sync::mpsc::unbounded_channel();
    let engine = Scheduler::start(reports, budget(SharedLimit::new(u64::MAX))).unwrap();
    // Session 9 holds the worker inside its first forward pass until every other request is
    // admitted, so all of them are there when it next chooses.
    let (release, gate) = std::sync::mpsc::channel::<()>();
    let gate = Mutex::new(Some(gate));
    let held = Hooked {
        inner: exact(&model, 64, KvType::F32),
        before_pass: Box::new(move || {
            if let Some(gate) = gate.lock().unwrap().take() {
                let _ = gate.recv();
            }
        }),
    };
    open(&engine, 9, &model, Box::new(held));
    for id in 1..=3 {
        open(&engine, id, &model, exact(&model, 64, KvType::F32));
    }
    let mut streams = Vec::new();
    let mut answers = Vec::new();
    let (read, out) = std::io::pipe().unwrap();
    answers.push(send_generate(
        &engine,
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
            &engine,
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
        send_generate(&engine, 1, PROMPT, spec, out)
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
        send_generate(&engine, id, prompt, spec, out)
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
        send_generate(&engine, id, &prompt, spec(2, Priority::Interactive), out)
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

/// The scheduler's two stages without their threads, driven by hand: the inbox the state owner
/// sends to, the admission stage and the worker (each handles only what a test hands it), and
/// the state owner's end of the reports.
struct ByHand {
    inbox: Commands,
    admission: Admission,
    worker: Worker,
    reports: tokio::sync::mpsc::UnboundedReceiver<Report>,
}

impl ByHand {
    fn new<B: SessionBudget + Clone + 'static>(budget: B) -> ByHand {
        let (tx, rx) = std::sync::mpsc::channel();
        let (work, work_rx, waiting) = WorkQueue::new();
        let (reports, reports_rx) = tokio::sync::mpsc::unbounded_channel();
        let admission = Admission::new(rx, work, reports.clone(), Box::new(budget.clone()));
        let worker = Worker {
            rx: work_rx,
            waiting,
            reports,
            budget: Box::new(budget),
            sessions: BTreeMap::new(),
        };
        ByHand {
            inbox: Commands { tx },
            admission,
            worker,
            reports: reports_rx,
        }
    }

    /// Puts every command sent so far through the admission stage (not the worker).
    fn admit(&mut self) {
        while let Ok(cmd) = self.admission.rx.try_recv() {
            assert!(!self.admission.handle(cmd), "the worker's queue is open");
        }
    }

    /// The urgency mark as the worker sees it.
    fn mark(&self) -> u8 {
        self.worker.waiting.load(Ordering::Acquire)
    }
}

/// Sends a `Generate` of `prompt` in class `priority` to `inbox`; returns the read end of its
/// stream and where its answer comes.
fn request(
    inbox: &Commands,
    id: SessionId,
    prompt: &str,
    spec: GenSpec,
) -> (
    std::io::PipeReader,
    tokio::sync::oneshot::Receiver<Result<(), LeanStreamError>>,
) {
    let (read, out) = std::io::pipe().unwrap();
    let (reply, answer) = tokio::sync::oneshot::channel();
    let input = Input::Text(prompt.into());
    let cmd = Command::Generate {
        id,
        input,
        spec,
        out,
        reply,
    };
    inbox.send(cmd).unwrap();
    (read, answer)
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
