//! Chat templates rendered with minijinja. STUB: being written.

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// A ChatML template for models that ship none (TEMP, replaced on merge).
pub const CHATML_TEMPLATE: &str = "";

/// One chat turn.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    source: String,
}

impl ChatTemplate {
    /// Compiles `source` (Jinja, as in Hugging Face `chat_template`).
    pub fn new(source: &str, _bos_token: &str, _eos_token: &str) -> Result<ChatTemplate> {
        Ok(ChatTemplate {
            source: source.to_string(),
        })
    }

    /// Renders the conversation into prompt text.
    pub fn render(
        &self,
        _messages: &[ChatMessage],
        _add_generation_prompt: bool,
    ) -> Result<String> {
        Err(Error::ChatTemplate(format!(
            "not yet built ({} bytes)",
            self.source.len()
        )))
    }
}
