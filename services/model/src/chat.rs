//! Chat templates: the Jinja template shipped in the GGUF, rendered with minijinja the way
//! Hugging Face's `apply_chat_template` does (trim/lstrip blocks, Python string methods,
//! `raise_exception`).

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Serde;
use minijinja::{Environment, Error as JinjaError, ErrorKind, Value, context};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// One chat turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

fn raise_exception(msg: String) -> std::result::Result<String, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
}

/// Instructions one rendering may run: a chat template spends tens per message, so this is
/// thousands of messages' worth, and a runaway loop stops within tens of milliseconds.
pub const TEMPLATE_FUEL: u64 = 2_000_000;

impl ChatTemplate {
    /// Compiles `source`; `bos`/`eos` are the texts of those tokens (templates may print them).
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<Self> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| Error::Template(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        // Templates come with the model file and loop over the caller's messages: a bounded
        // number of steps, so no template and no conversation can hold a thread forever.
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| Error::Template(format!("does not compile: {e}")))?;
        Ok(Self { env, bos: bos.to_string(), eos: eos.to_string() })
    }

    /// Renders a conversation; with `add_generation_prompt` the text ends where the assistant's
    /// reply begins.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self.env.get_template("chat").map_err(|e| Error::Template(e.to_string()))?;
        tmpl.render(context! {
            messages => Value::from(Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos.as_str(),
            eos_token => self.eos.as_str(),
        })
        .map_err(|e| Error::Template(format!("rendering failed: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    /// A template whose loops would run 10^10 times: it is stopped by fuel, with an error,
    /// instead of holding its thread.
    #[test]
    fn a_runaway_template_runs_out_of_fuel() {
        let src =
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        let start = std::time::Instant::now();
        let err = t.render(&[], true).unwrap_err().to_string();
        assert!(err.contains("fuel"), "{err}");
        assert!(start.elapsed() < std::time::Duration::from_secs(10));
        // An ordinary conversation of a few hundred messages renders within it.
        let t = ChatTemplate::new(SMOLLM2, "", "").unwrap();
        let msgs: Vec<Message> = (0..400)
            .map(|i| Message {
                role: if i % 2 == 0 { "user" } else { "assistant" }.into(),
                content: format!("m{i}"),
            })
            .collect();
        assert!(t.render(&msgs, true).is_ok());
    }

    #[test]
    fn renders_chatml_with_default_system_prompt() {
        let t = ChatTemplate::new(SMOLLM2, "<|im_start|>", "<|im_end|>").unwrap();
        let s = t.render(&[Message::new("user", "Hi")], true).unwrap();
        assert_eq!(
            s,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let s = t
            .render(&[Message::new("system", "Be brief."), Message::new("user", "Hi")], false)
            .unwrap();
        assert_eq!(s, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
    }

    #[test]
    fn python_methods_and_raise_exception() {
        let t = ChatTemplate::new(
            "{% if messages[0]['role'] == 'bad' %}{{ raise_exception('roles must alternate') }}{% endif %}{{ messages[0]['content'].strip() }}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(t.render(&[Message::new("user", "  x  ")], false).unwrap(), "x");
        let e = t.render(&[Message::new("bad", "x")], false).unwrap_err().to_string();
        assert!(e.contains("roles must alternate"), "{e}");
    }

    #[test]
    fn broken_template_is_an_error() {
        assert!(ChatTemplate::new("{% for %}", "", "").is_err());
    }
}
