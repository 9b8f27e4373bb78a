//! The D-Bus contract of `leanstreamd` (docs/architecture.md §4, docs/clients.md): names, wire
//! types, error names, proxies, and the token-stream protocol. The daemon implements exactly
//! this; apps link it through this crate.
//!
//! Token privacy: `Generate` returns the read end of a pipe (a Unix fd passed in the reply). Only
//! the caller receives the fd, so no other connection — not even a monitor on a session bus — can
//! read the tokens, and a pipe is cheap at high token rates. The stream is UTF-8 JSON, one
//! [`StreamEvent`] per line; it ends with `done` or `error`, then EOF. Closing the read end
//! cancels the generation.

use serde::{Deserialize, Serialize};
use zbus::zvariant::{OwnedFd, OwnedObjectPath, Type};

/// Well-known bus name of the daemon.
pub const BUS_NAME: &str = "io.github.leanstream.LeanStream1";
/// Object path of the manager.
pub const MANAGER_PATH: &str = "/io/github/leanstream/LeanStream1";
/// Sessions live under this path: `{SESSION_PATH_PREFIX}/{n}`.
pub const SESSION_PATH_PREFIX: &str = "/io/github/leanstream/LeanStream1/session";
pub const MANAGER_INTERFACE: &str = "io.github.leanstream.LeanStream1.Manager";
pub const SESSION_INTERFACE: &str = "io.github.leanstream.LeanStream1.Session";
/// Prefix of every error name.
pub const ERROR_PREFIX: &str = "io.github.leanstream.LeanStream1.Error";

/// The daemon's fixed process overhead F: its resident memory (`VmRSS`) stays within
/// `[memory] budget + PROCESS_OVERHEAD_BYTES`. F covers the binary and its libraries, the async
/// runtime and thread stacks, the bus connection, one incoming message of up to 1 MiB (the
/// `max_message_size` of the buses the project's scripts start; a bus that passes larger
/// messages adds their size to F), and what the allocator and the engine hold outside the
/// ledger while models load and unload (parsing buffers, the I/O threads' merge buffers). An
/// idle daemon holds 9.6 MiB; the end-to-end budget test, with models loading and unloading
/// under eight generating clients, measured 38 and 42 MiB over a full ledger, most of it the
/// transient buffers of parsing model files (docs/memory.md).
pub const PROCESS_OVERHEAD_BYTES: u64 = 64 << 20;

/// Errors the daemon returns, named `io.github.leanstream.LeanStream1.Error.<Variant>`, each with
/// a human-readable message.
#[derive(Debug, zbus::DBusError)]
#[zbus(prefix = "io.github.leanstream.LeanStream1.Error")]
pub enum LeanStreamError {
    /// A transport-level failure (not sent by the daemon itself).
    #[zbus(error)]
    ZBus(zbus::Error),
    /// No model of that name in the configured model directory.
    ModelNotFound(String),
    /// An argument is malformed or out of range.
    InvalidArgument(String),
    /// The memory budget cannot fit the request.
    OverBudget(String),
    /// A limit was reached (sessions, a generation already running on the session).
    Busy(String),
    /// The model file, or the daemon's settings for it, cannot be served (not a model, an
    /// unsupported type, a mode the file does not support); the daemon itself is fine.
    InvalidModel(String),
    /// The caller does not own the session.
    AccessDenied(String),
    /// The generation was cancelled.
    Cancelled(String),
    /// A bug or an I/O failure inside the daemon.
    Internal(String),
}

impl LeanStreamError {
    /// What the error means, in plain words, for the CLI.
    pub fn meaning(&self) -> &'static str {
        match self {
            LeanStreamError::ZBus(_) => "could not talk to leanstreamd",
            LeanStreamError::ModelNotFound(_) => "no such model in the daemon's model directory",
            LeanStreamError::InvalidArgument(_) => "the request has an invalid argument",
            LeanStreamError::OverBudget(_) => "the daemon's memory budget cannot fit this",
            LeanStreamError::Busy(_) => "the daemon is busy (a limit was reached)",
            LeanStreamError::InvalidModel(_) => "the model file or its settings cannot be served",
            LeanStreamError::AccessDenied(_) => "this session belongs to another client",
            LeanStreamError::Cancelled(_) => "the generation was cancelled",
            LeanStreamError::Internal(_) => "internal daemon error",
        }
    }
}

/// A model file in the daemon's model directory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct ModelInfo {
    /// File stem: `smollm2` for `smollm2.lsm`.
    pub name: String,
    /// `lsm` or `gguf`.
    pub format: String,
    /// `llama`, `qwen2`, `qwen3`, `gemma3`, … (`unknown` when the header cannot be read).
    pub architecture: String,
    /// llama.cpp's file type when the file names one, then the share of matrix bytes per
    /// stored type: `Q4_K_M (q8_0 53%, q5_0 26%, …)`; for an unreadable header, why.
    pub quantization: String,
    pub file_bytes: u64,
    pub loaded: bool,
}

/// Sampling and length settings of one generation, as Rust callers set them. On the wire they
/// travel as an `a{sv}` dictionary of the keys that differ from these defaults (`options.rs`:
/// the keys and their types). Zero values mean "the daemon's default" for `max_tokens`;
/// `temperature` 0 is greedy; `top_k` 0 and `top_p` 1 disable those cuts.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateParams {
    pub max_tokens: u32,
    pub temperature: f64,
    pub top_k: u32,
    pub top_p: f64,
    pub repetition_penalty: f64,
    pub seed: u64,
    /// Generation stops after any of these strings appears in the output.
    pub stop: Vec<String>,
    /// What `grammar` holds: `""` (no constraint), or one of [`GRAMMAR_KINDS`] (the option's key
    /// on the wire).
    pub grammar_kind: String,
    /// A JSON Schema, a Lark grammar or a regex the whole output must match: generation is
    /// constrained token by token, so the text parses (and validates) when it ends at `eos`.
    pub grammar: String,
    /// The request's class: `""` (the default, `interactive`) or a [`Priority`] name.
    pub priority: String,
    /// Milliseconds from the call by which the first token should be out; 0 = none. A deadline
    /// is a goal that orders the work, not a limit: a miss is reported in the `done` event.
    pub first_token_deadline_ms: u32,
    /// Milliseconds from the call by which the generation should be over; 0 = none.
    pub deadline_ms: u32,
    /// Also mark where sentences and phrases end ([`StreamEvent::Sentence`]), for speech.
    pub sentences: bool,
}

/// How urgent a generation is. The scheduler serves higher classes first and pre-empts lower
/// ones (a lower class's forward pass on the CPU stops at its next layer and runs again later);
/// within a class, sessions take turns (and an earlier deadline goes first). Who may ask for
/// [`Priority::Realtime`] is the daemon's policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Priority {
    /// Background work (summaries, logs): runs when nothing more urgent is waiting.
    Background,
    /// The default: a user or an app waiting for the answer.
    #[default]
    Interactive,
    /// Control loops with a deadline (a planner's next action): served before everything else.
    Realtime,
}

impl Priority {
    /// Every class, most urgent first.
    pub const ALL: [Priority; 3] = [
        Priority::Realtime,
        Priority::Interactive,
        Priority::Background,
    ];

    /// The wire name: `realtime`, `interactive` or `background`.
    pub const fn name(self) -> &'static str {
        match self {
            Priority::Realtime => "realtime",
            Priority::Interactive => "interactive",
            Priority::Background => "background",
        }
    }

    /// The class a [`GenerateParams::priority`] names (`""` is the default); the error names
    /// the accepted values.
    pub fn parse(name: &str) -> Result<Priority, String> {
        match name {
            "" => Ok(Priority::default()),
            _ => Priority::ALL
                .into_iter()
                .find(|p| p.name() == name)
                .ok_or_else(|| {
                    let names: Vec<&str> = Priority::ALL.iter().map(|p| p.name()).collect();
                    format!("priority {name:?} is not one of {}", names.join(", "))
                }),
        }
    }
}

impl std::fmt::Display for Priority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The values of [`GenerateParams::grammar_kind`] that constrain a generation: a JSON Schema
/// (the JSON text), a grammar in llguidance's Lark dialect, or a regex in Rust `regex` syntax.
pub const GRAMMAR_KINDS: [&str; 3] = ["json_schema", "lark", "regex"];

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams {
            max_tokens: 0,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            seed: 0,
            stop: Vec::new(),
            grammar_kind: String::new(),
            grammar: String::new(),
            priority: String::new(),
            first_token_deadline_ms: 0,
            deadline_ms: 0,
            sentences: false,
        }
    }
}

#[cfg(feature = "engine")]
impl GenerateParams {
    /// The engine's sampler settings for these parameters, as the f32 values it samples with.
    /// Their ranges are checked in one place, `SamplerConfig::validate`, which the daemon and the
    /// CLI both call on this (a `top_p` of 5e-324 is positive here and 0 there: refused).
    pub fn sampler_config(&self) -> leanstream_engine::sample::SamplerConfig {
        leanstream_engine::sample::SamplerConfig {
            temperature: self.temperature as f32,
            top_k: self.top_k as usize,
            top_p: self.top_p as f32,
            repetition_penalty: self.repetition_penalty as f32,
            seed: self.seed,
            ..Default::default()
        }
    }

    /// The constraint these parameters ask for, with the engine's name for its kind; `None`
    /// when `grammar_kind` is empty. Errors name the accepted kinds, or say that a kind came
    /// without a grammar.
    pub fn grammar(
        &self,
    ) -> Result<Option<(leanstream_engine::constrain::GrammarKind, &str)>, String> {
        use leanstream_engine::constrain::GrammarKind;
        let kind = match self.grammar_kind.as_str() {
            "" if self.grammar.is_empty() => return Ok(None),
            "" => return Err("grammar is set but grammar_kind is empty".into()),
            "json_schema" => GrammarKind::JsonSchema,
            "lark" => GrammarKind::Lark,
            "regex" => GrammarKind::Regex,
            other => {
                return Err(format!(
                    "grammar_kind {other:?} is not one of {}",
                    GRAMMAR_KINDS.join(", ")
                ));
            }
        };
        if self.grammar.is_empty() {
            return Err(format!(
                "grammar_kind is {:?} but grammar is empty",
                self.grammar_kind
            ));
        }
        Ok(Some((kind, self.grammar.as_str())))
    }
}

/// One chat turn: role (`system`, `user`, `assistant`) and content.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct ChatTurn {
    pub role: String,
    pub content: String,
}

/// What a loaded model holds, by part, and where its weights are placed (all 0 while it loads or
/// unloads).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct ModelParts {
    /// Weight bytes read into memory (the file image; a streaming model's streamed FFN section
    /// and a planned model's streamed layers are not in it).
    pub weights: u64,
    /// The tokenizer's heap.
    pub tokenizer: u64,
    /// The f32 tables built at load (norms, biases) and the layer table.
    pub tables: u64,
    /// The memory planner's weight-stream ring (0 when every dense weight is resident).
    pub ring: u64,
    /// Weight bytes the memory planner streams whole through the ring every token (the dense
    /// pieces it does not keep resident); 0 when the model has no plan or keeps them all.
    pub streamed_whole: u64,
    /// Weight bytes of the FFN layers the memory planner streams by neuron through the neuron
    /// cache (only the chunks the predictor selects are read); 0 when none is.
    pub streamed_sparse: u64,
}

/// Memory held by one model (shared by all its sessions).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct ModelMemory {
    pub name: String,
    /// Weights and tables kept for the model's lifetime (in a streaming mode: the file less its
    /// streamed FFN section).
    pub resident_bytes: u64,
    /// The neuron cache the FFN weights stream through now (0 in `dense` and `mmap` mode).
    /// It shrinks toward its floor to make room for sessions and other models, and grows back
    /// toward its wanted size when memory frees.
    pub cache_bytes: u64,
    /// The smallest cache the model can run with (one layer's chunks).
    pub cache_floor_bytes: u64,
    /// The cache the configuration asks for (`cache_share` of the streamed FFN bytes).
    pub cache_wanted_bytes: u64,
    /// How the model runs: `dense`, `mmap`, `on-demand`, `prefetch` or `leanstream`; or
    /// `dense+neuron`: a model under `max_bytes` whose plan streams FFN layers by neuron.
    pub mode: String,
    /// Bytes of weights the memory planner reads from storage for every token (a `dense` model
    /// loaded under `max_bytes` that does not fit it whole): dense pieces, plus the expected
    /// misses of FFN layers streamed by neuron; 0 when every weight is resident.
    pub streamed_bytes_per_token: u64,
    /// Seconds since its last session closed, for a model kept loaded without sessions by its
    /// `keep_alive`; 0 while it has sessions, or is pinned.
    pub idle_seconds: u64,
    /// Seconds until it unloads on its own (its `keep_alive` running out); -1 when it will
    /// not: it has sessions, is pinned (`LoadModel`, `preload`), or has `keep_alive = -1`.
    pub unload_in_seconds: i64,
    /// The loaded model's bytes by part (the floor the memory planner counts besides weights),
    /// and the weight bytes its plan streams whole and by neuron.
    pub parts: ModelParts,
}

/// Memory held by one session (its KV cache and working buffers).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct SessionMemory {
    pub path: OwnedObjectPath,
    pub model: String,
    /// Unique bus name of the owner, e.g. `:1.42`.
    pub client: String,
    pub bytes: u64,
}

/// Memory attributed to one client (the sum of its sessions).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct ClientMemory {
    pub client: String,
    pub sessions: u32,
    pub bytes: u64,
}

/// The arbiter's figures. Invariant: `used_bytes <= budget_bytes`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Type)]
pub struct MemoryReport {
    pub budget_bytes: u64,
    /// What the models, caches and sessions hold, as the engine reports it; `<= budget_bytes`.
    pub used_bytes: u64,
    /// The daemon process's resident memory (VmRSS) when the report was made; it stays within
    /// the budget plus the documented fixed overhead.
    pub rss_bytes: u64,
    pub models: Vec<ModelMemory>,
    pub sessions: Vec<SessionMemory>,
    pub clients: Vec<ClientMemory>,
}

/// Counters of one session.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Type)]
pub struct SessionStats {
    pub model: String,
    pub context_tokens: u32,
    pub position: u32,
    pub generations: u32,
    pub generated_tokens: u64,
    /// Forward passes of the session's decode phases (each emits at least one token; with
    /// speculative decoding, one plus the drafts it accepted): `generated_tokens` ÷ this is
    /// the tokens per pass.
    pub decode_passes: u64,
    /// Draft tokens speculative decoding verified, and how many of them it accepted.
    pub draft_tokens: u64,
    pub accepted_draft_tokens: u64,
}

/// Statistics sent at the end of a stream.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StreamStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub time_to_first_token_s: f64,
    pub prefill_tokens_per_s: f64,
    pub decode_tokens_per_s: f64,
    /// Decode passes this generation shared with other sessions on the same model (one pass over
    /// the weights advancing several conversations); 0 when it ran alone.
    #[serde(default)]
    pub shared_decode_passes: usize,
    /// Pieces of this generation's prompt that ran in one pass with other sessions' steps
    /// (their prompts or decode steps); 0 when its prompt ran alone.
    #[serde(default)]
    pub shared_prompt_passes: usize,
    /// Prompt tokens whose keys and values were already in memory (the session's previous turn,
    /// or a prompt prefix shared with another session on the model) and were not computed.
    #[serde(default)]
    pub cached_prompt_tokens: usize,
    /// The request's class.
    #[serde(default)]
    pub priority: String,
    /// The deadlines the request set and missed (`first_token`, `end`); empty when none was
    /// set or all were met.
    #[serde(default)]
    pub missed_deadlines: Vec<String>,
    /// Tokens sampled per decode pass: above 1 when speculative decoding verified drafts in
    /// its passes; 0 when the generation did not speculate (`speculate = "off"`).
    #[serde(default)]
    pub speculation_tokens_per_pass: f64,
    /// Draft tokens accepted ÷ drafted, over every kind of draft; 0 when none was drafted.
    #[serde(default)]
    pub draft_acceptance: f64,
}

/// One line of the token stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamEvent {
    /// A generated token and the text it completed (may be empty while a UTF-8 character is split).
    Token { id: u32, text: String },
    /// With the `sentences` option: the text since the previous mark, sent right after the token
    /// that ends a sentence or a phrase (`.`, `!`, `?`, `;`, `:` or `…` followed by whitespace,
    /// or a newline), and with the rest before `done`.
    Sentence { text: String },
    /// The generation ended normally; `reason` is `eos`, `max_tokens`, `stop_string` or `context_full`.
    Done { reason: String, stats: StreamStats },
    /// The generation failed or was cancelled; `name` is the error name without the prefix.
    Error { name: String, message: String },
}

#[zbus::proxy(
    interface = "io.github.leanstream.LeanStream1.Manager",
    default_service = "io.github.leanstream.LeanStream1",
    default_path = "/io/github/leanstream/LeanStream1"
)]
pub trait Manager {
    /// Models in the model directory.
    fn list_models(&self) -> zbus::Result<Vec<ModelInfo>>;
    /// Loads a model by name and pins it until `UnloadModel` (idempotent).
    fn load_model(&self, name: &str) -> zbus::Result<()>;
    /// Loads a model by name without pinning it: it stays loaded `keep_alive_seconds`
    /// (1..=604800) after its last session closes, or after this call when it has none, unless
    /// its configuration keeps it longer; `-1` pins it like `load_model`.
    fn load_model_for(&self, name: &str, keep_alive_seconds: i64) -> zbus::Result<()>;
    /// Unloads a model; fails with `Busy` while it has sessions.
    fn unload_model(&self, name: &str) -> zbus::Result<()>;
    /// Opens a session on a model (loading it if needed) with room for `context_tokens` tokens
    /// (0 = the daemon's default). Only the calling connection may use the returned object.
    fn open_session(&self, model: &str, context_tokens: u32) -> zbus::Result<OwnedObjectPath>;
    /// The memory budget and how it is used.
    fn memory(&self) -> zbus::Result<MemoryReport>;
    /// Counters for operators since the daemon started, by name (`requests.Generate`,
    /// `refusals.Busy`, `tokens.generated`, `ttft_us.interactive.sum`, `model_load_ms.NAME`, …).
    fn counters(&self) -> zbus::Result<std::collections::HashMap<String, u64>>;
    #[zbus(property)]
    fn version(&self) -> zbus::Result<String>;
    /// `cpu` or `cuda`.
    #[zbus(property)]
    fn backend(&self) -> zbus::Result<String>;
}

#[zbus::proxy(
    interface = "io.github.leanstream.LeanStream1.Session",
    default_service = "io.github.leanstream.LeanStream1"
)]
pub trait Session {
    /// Starts generating from `prompt` (special tokens written in it are recognised); returns the
    /// read end of the token stream.
    fn generate(&self, prompt: &str, params: &GenerateParams) -> zbus::Result<OwnedFd>;
    /// Continues the conversation with `messages`, rendered by the model's chat template.
    fn generate_chat(
        &self,
        messages: &[ChatTurn],
        params: &GenerateParams,
    ) -> zbus::Result<OwnedFd>;
    /// Cancels the running generation, if any (its stream ends with `Cancelled`).
    fn cancel(&self) -> zbus::Result<()>;
    /// Closes the session and releases its memory.
    fn close(&self) -> zbus::Result<()>;
    fn stats(&self) -> zbus::Result<SessionStats>;
    /// The token ids `text` encodes to on the session's model, as `generate` would encode it.
    fn tokenize(&self, text: &str) -> zbus::Result<Vec<u32>>;
    /// The prompt text `generate_chat` would run for `messages` (the chat template applied).
    fn apply_template(&self, messages: &[ChatTurn]) -> zbus::Result<String>;
}
