//! Forward passes shared between sessions and run through a model's pipeline: sessions that run
//! together keep the tokens they get alone; the streaming modes give the dense tokens; a read
//! error ends only the generations of its pass.

use leanstream_engine::io::{DirectFile, Fault, FaultKind, FaultyReader, ThreadPoolIo};
use leanstream_engine::pipeline::{Executor, Mode, Policy, Selector, SparseModel, StreamingFfn};

use super::*;

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
