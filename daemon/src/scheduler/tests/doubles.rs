//! Engine sessions that stand in for real ones: a marker that tells a test when the admission
//! stage has handed on everything sent before it, and a session that runs a hook before each
//! forward pass of the real session it wraps (to watch the pipe, to slow passes down, or to hold
//! the worker at a gate).

use super::*;

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
pub(super) fn handed_on(engine: &Scheduler, model: &Arc<LoadedModel>) {
    let (seen, opened) = std::sync::mpsc::channel();
    let marker = Marker(Mutex::new(Some(seen)));
    open(engine, MARKER, model, Box::new(marker));
    opened.recv().unwrap();
    engine.tx.send(Command::Close { id: MARKER }).unwrap();
}

/// A session that calls `before_pass` at the start of every forward pass.
pub(super) struct Hooked {
    pub inner: Box<dyn Decode + Send>,
    pub before_pass: Box<dyn FnMut() + Send>,
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

/// A session of `model` that holds the worker inside its first forward pass until the sender
/// returned is sent to: requests sent meanwhile are all there when the worker next chooses.
pub(super) fn gate(model: &LoadedModel) -> (std::sync::mpsc::Sender<()>, Hooked) {
    let (release, gate) = std::sync::mpsc::channel::<()>();
    let gate = Mutex::new(Some(gate));
    let held = Hooked {
        inner: exact(model, 64, KvType::F32),
        before_pass: Box::new(move || {
            if let Some(gate) = gate.lock().unwrap().take() {
                let _ = gate.recv();
            }
        }),
    };
    (release, held)
}
