//! Chat templates (Hugging Face `chat_template` Jinja) rendered with minijinja.
//!
//! The environment mirrors what `transformers` gives a template: `trim_blocks` and
//! `lstrip_blocks` on, Python string/dict methods (`.strip()`, `.startswith()`, `.items()`, …)
//! through `minijinja_contrib::pycompat`, a `raise_exception(message)` function, a `tojson`
//! filter, and the variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`.
//! Models without a template get a fallback chosen by their vocabulary
//! ([`ChatTemplate::for_model`]): [`GEMMA_TEMPLATE`] when it has Gemma's turn markers,
//! [`CHATML_TEMPLATE`] otherwise.

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind, context};
use serde::{Deserialize, Serialize};

use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

mod literal;

/// The fallback template for models that ship none: ChatML, as `transformers` defines it
/// (`<|im_start|>{role}\n{content}<|im_end|>\n` per message, then `<|im_start|>assistant\n` when
/// a generation prompt is asked for). It adds no system message and no bos token.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// The fallback for Gemma vocabularies (GGUF files of Gemma often ship no template): turns
/// `<start_of_turn>{role}\n{content}<end_of_turn>\n` with the assistant's role called `model`,
/// a system message folded into the first user turn (Gemma has no system role), and
/// `<start_of_turn>model\n` as the generation prompt. No bos token: the tokenizer adds it.
pub const GEMMA_TEMPLATE: &str = "\
{% if messages and messages[0]['role'] == 'system' %}\
{% set system = messages[0]['content'] | trim + '\n\n' %}{% set turns = messages[1:] %}\
{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}\
{% for message in turns %}\
{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}\
{% if loop.first %}{{ system }}{% endif %}\
{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}";

/// Name of the one template in a [`ChatTemplate`]'s environment (shows in error messages).
const NAME: &str = "chat_template";

/// One chat turn.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant` (templates may accept others, e.g. `tool`).
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template: parsed once by [`ChatTemplate::new`], rendered many times.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles `source` (Jinja, as in Hugging Face `chat_template`). `bos_token` and
    /// `eos_token` are the token texts the template sees (e.g. `<|im_start|>`, `<|im_end|>`).
    /// A syntax error is an [`Error::ChatTemplate`] with minijinja's message and line.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_string())
            .map_err(template_error)?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// The template a model should use: its own `source` when it has one, else the fallback
    /// its vocabulary calls for (see the module docs), with the tokenizer's bos and eos texts.
    pub fn for_model(source: Option<&str>, tok: &Tokenizer) -> Result<ChatTemplate> {
        let source = source.unwrap_or_else(|| {
            if tok.token_to_id("<start_of_turn>").is_some() {
                GEMMA_TEMPLATE
            } else {
                CHATML_TEMPLATE
            }
        });
        let text = |id: Option<u32>| id.and_then(|i| tok.decode(&[i]).ok()).unwrap_or_default();
        let specials = tok.specials();
        ChatTemplate::new(
            source,
            &text(specials.bos),
            &text(specials.eos.first().copied()),
        )
    }

    /// The ChatML fallback ([`CHATML_TEMPLATE`]).
    pub fn chatml(bos_token: &str, eos_token: &str) -> Result<ChatTemplate> {
        ChatTemplate::new(CHATML_TEMPLATE, bos_token, eos_token)
    }

    /// Renders the conversation into prompt text. With `add_generation_prompt` the text ends
    /// where the assistant's reply begins. Errors (including `raise_exception` calls from the
    /// template, e.g. "roles must alternate") are [`Error::ChatTemplate`]. To tokenise a
    /// prompt whose messages come from a client, use [`ChatTemplate::render_ids`]: encoding
    /// this text would turn a control token spelled in a message into the control token.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self.env.get_template(NAME).map_err(template_error)?;
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(template_error)
    }

    /// The template's Jinja source.
    fn source(&self) -> Result<String> {
        let tmpl = self.env.get_template(NAME).map_err(template_error)?;
        Ok(tmpl.source().to_string())
    }
}

/// minijinja's message, with the cause chain (a `raise_exception` message sits in the detail).
fn template_error(e: minijinja::Error) -> Error {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    Error::ChatTemplate(msg)
}

/// `raise_exception(message)`, as `transformers` provides it: fails the render with `message`.
fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// `value | tojson` / `tojson(indent=n)`: JSON text as Python's `json.dumps(ensure_ascii=False)`
/// writes it (minijinja's own needs its `json` feature, which this crate does not enable).
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let text = match indent {
        None => serde_json::to_string(&value),
        Some(n) => {
            let pad = vec![b' '; n];
            let fmt = serde_json::ser::PrettyFormatter::with_indent(&pad);
            let mut out = Vec::new();
            let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
            value
                .serialize(&mut ser)
                .map(|()| String::from_utf8_lossy(&out).into_owned())
        }
    }
    .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(Value::from_safe_string(text))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M-Instruct's template, as stored in its GGUF file.
    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn render(src: &str, msgs: &[ChatMessage], gen_prompt: bool) -> Result<String> {
        ChatTemplate::new(src, "<|im_start|>", "<|im_end|>")?.render(msgs, gen_prompt)
    }

    fn ok(r: Result<String>) -> String {
        r.unwrap_or_else(|e| panic!("render failed: {e}"))
    }

    #[test]
    fn smollm2_adds_its_default_system_prompt() {
        let msgs = [ChatMessage::new("user", "What is the capital of France?")];
        assert_eq!(
            ok(render(SMOLLM2, &msgs, true)),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nWhat is the capital of France?<|im_end|>\n\
             <|im_start|>assistant\n"
        );
    }

    #[test]
    fn smollm2_keeps_a_given_system_prompt() {
        let msgs = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Hi"),
            ChatMessage::new("assistant", "Hello!"),
        ];
        assert_eq!(
            ok(render(SMOLLM2, &msgs, false)),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello!<|im_end|>\n"
        );
    }

    #[test]
    fn chatml_fallback() {
        let msgs = [ChatMessage::new("user", "Hi")];
        let t = ChatTemplate::chatml("", "<|im_end|>").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            t.render(&msgs, true).ok().as_deref(),
            Some("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
        );
        assert_eq!(
            t.render(&msgs, false).ok().as_deref(),
            Some("<|im_start|>user\nHi<|im_end|>\n")
        );
    }

    #[test]
    fn gemma_fallback_folds_the_system_message_into_the_first_user_turn() {
        let msgs = [
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", " Hi "),
            ChatMessage::new("assistant", "Hello!"),
            ChatMessage::new("user", "Bye"),
        ];
        assert_eq!(
            ok(render(GEMMA_TEMPLATE, &msgs, true)),
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n\
             <start_of_turn>model\nHello!<end_of_turn>\n\
             <start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(
            ok(render(GEMMA_TEMPLATE, &msgs[1..2], false)),
            "<start_of_turn>user\nHi<end_of_turn>\n"
        );
    }

    #[test]
    fn python_methods_tokens_and_block_trimming() {
        // A Llama-2-style template: .strip(), bos/eos, trim_blocks/lstrip_blocks.
        let src = "{{ bos_token }}\n{% for m in messages %}\n    {% if m['role'] == 'user' %}\n[INST] {{ m['content'].strip() }} [/INST]\n    {% else %}\n{{ m['content'].strip() + eos_token }}\n    {% endif %}\n{% endfor %}";
        let msgs = [
            ChatMessage::new("user", "  hi  "),
            ChatMessage::new("assistant", " yo "),
        ];
        assert_eq!(
            ok(render(src, &msgs, false)),
            "<|im_start|>\n[INST] hi [/INST]\nyo<|im_end|>\n"
        );
    }

    #[test]
    fn raise_exception_is_a_chat_template_error() {
        let src = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation roles must alternate') }}{% endif %}ok";
        let err = render(src, &[ChatMessage::new("assistant", "x")], true);
        match err {
            Err(Error::ChatTemplate(m)) => assert!(m.contains("roles must alternate"), "{m}"),
            other => panic!("expected a chat template error, got {other:?}"),
        }
        assert_eq!(
            render(src, &[ChatMessage::new("user", "x")], true)
                .ok()
                .as_deref(),
            Some("ok")
        );
    }

    #[test]
    fn syntax_errors_are_reported_at_compile_time() {
        match ChatTemplate::new("{% for m in messages %}{{ m", "", "") {
            Err(Error::ChatTemplate(m)) => assert!(m.contains("syntax error"), "{m}"),
            other => panic!("expected a syntax error, got {other:?}"),
        }
    }

    #[test]
    fn tojson_filter() {
        let src = "{{ messages[0] | tojson }}|{{ messages[0]['content'] | tojson(indent=2) }}";
        let msgs = [ChatMessage::new("user", "é \"q\"")];
        assert_eq!(
            ok(render(src, &msgs, false)),
            r#"{"role":"user","content":"é \"q\""}|"é \"q\"""#
        );
    }
}
