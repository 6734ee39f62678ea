//! Instruction data as people fine-tune on it: conversations (`messages`
//! with `role` and `content`) rendered through the checkpoint's own chat
//! template, and `prompt` / `completion` pairs. Each becomes one document
//! whose text carries the byte ranges that train (the assistant's turns,
//! the completion); the rest (system and user turns, the prompt, the
//! template's markup around them) carries no loss.
//!
//! The template is the Jinja one transformers applies
//! (`tokenizer_config.json`'s `chat_template`, or `chat_template.jinja`),
//! run by minijinja with Python's string methods. To find what the
//! assistant said in the rendered text, each assistant message's content
//! (inside its surrounding white space) is wrapped in two private-use
//! markers before rendering; the markers are taken out afterwards, and the
//! text between them, with the end of turn that follows it where it is the
//! tokenizer's end token, trains. A `<think>…</think>` reasoning block at
//! the start of the content is marked apart, so that a template that moves
//! it out of the content (Qwen3's) or drops it (for earlier turns) keeps
//! the markers balanced; reasoning that stays in the text trains with its
//! answer. A template that cuts into the content itself (not only its
//! white space) is refused, naming the template.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use minijinja::{context, Environment, Error, ErrorKind};
use serde_json::Value;

use crate::EngineError;

const OPEN: char = '\u{F8F0}';
const CLOSE: char = '\u{F8F1}';
/// Around a turn's reasoning (`<think>…</think>`), which a template may
/// move out of the content or drop.
const OPEN_REASONING: char = '\u{F8F2}';
const CLOSE_REASONING: char = '\u{F8F3}';
const MARKERS: [char; 4] = [OPEN, CLOSE, OPEN_REASONING, CLOSE_REASONING];

/// A chat template with the special tokens it refers to, compiled once.
#[derive(Clone)]
pub struct ChatTemplate {
    compiled: Arc<Environment<'static>>,
    source: String,
    bos_token: String,
    eos_token: String,
    /// Where it came from, for messages.
    origin: String,
}

/// One document of text and the byte ranges of it that carry loss.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TrainedText {
    pub text: String,
    pub trained: Vec<Range<usize>>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

/// The same template and tokens (the compiled form follows from them).
impl PartialEq for ChatTemplate {
    fn eq(&self, other: &Self) -> bool {
        (&self.source, &self.bos_token, &self.eos_token)
            == (&other.source, &other.bos_token, &other.eos_token)
    }
}

impl ChatTemplate {
    /// A template given as its Jinja source, with the special tokens'
    /// texts (`bos_token`, `eos_token`) it may refer to.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, EngineError> {
        Self::compile(
            source.to_string(),
            bos_token.to_string(),
            eos_token.to_string(),
            "the chat template".into(),
        )
    }

    /// The template of a model (or tokenizer) directory:
    /// `chat_template.jinja` (transformers ≥ 4.43 writes it), else the
    /// `chat_template` of `tokenizer_config.json` (a string, or a list of
    /// named templates of which "default" is taken). `None` where the
    /// directory has neither.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>, EngineError> {
        let config_path = dir.join("tokenizer_config.json");
        let config: Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| {
                EngineError::Config(format!("{}: not valid JSON: {e}", config_path.display()))
            })?,
            Err(_) => Value::Null,
        };
        let token = |key: &str| -> String {
            match config.get(key) {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Object(o)) => o
                    .get("content")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
                _ => String::new(),
            }
        };
        let jinja = dir.join("chat_template.jinja");
        let (source, origin) = if let Ok(text) = std::fs::read_to_string(&jinja) {
            (text, jinja.display().to_string())
        } else {
            let origin = format!("{}'s chat_template", config_path.display());
            match config.get("chat_template") {
                Some(Value::String(s)) => (s.clone(), origin),
                Some(Value::Array(named)) => {
                    let default = named.iter().find(|t| t["name"] == "default");
                    match default.and_then(|t| t["template"].as_str()) {
                        Some(s) => (s.to_string(), origin),
                        None => {
                            return Err(EngineError::Config(format!(
                                "{origin} has no template named \"default\""
                            )))
                        }
                    }
                }
                _ => return Ok(None),
            }
        };
        let (bos, eos) = (token("bos_token"), token("eos_token"));
        Self::compile(source, bos, eos, origin).map(Some)
    }

    fn compile(
        source: String,
        bos_token: String,
        eos_token: String,
        origin: String,
    ) -> Result<Self, EngineError> {
        // As transformers renders: blocks trimmed, Python's methods.
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned("chat", source.clone())
            .map_err(|e| EngineError::Config(format!("{origin}: not a usable template: {e}")))?;
        Ok(ChatTemplate {
            compiled: Arc::new(env),
            source,
            bos_token,
            eos_token,
            origin,
        })
    }

    /// Renders one conversation (`messages`: an array of objects with
    /// `role` and `content`) and marks what the assistant said.
    pub fn render(&self, messages: &Value) -> Result<TrainedText, String> {
        let list = messages
            .as_array()
            .ok_or("\"messages\" is not an array of {role, content} objects")?;
        let mut marked = Vec::with_capacity(list.len());
        for m in list {
            let role = m.get("role").and_then(Value::as_str);
            let content = m.get("content").and_then(Value::as_str);
            let (Some(role), Some(content)) = (role, content) else {
                return Err("a message without a string \"role\" and \"content\"".into());
            };
            if content.contains(MARKERS) {
                return Err(
                    "a message holds one of U+F8F0 to U+F8F3, which strata reserves".into(),
                );
            }
            let mut m = m.clone();
            if role == "assistant" {
                m["content"] = Value::String(mark_assistant(content));
            }
            marked.push(m);
        }
        let rendered = self
            .compiled
            .get_template("chat")
            .and_then(|t| {
                t.render(context! {
                    messages => marked,
                    add_generation_prompt => false,
                    bos_token => self.bos_token,
                    eos_token => self.eos_token,
                })
            })
            .map_err(|e| format!("{}: {e}", self.origin))?;
        self.unmark(&rendered)
    }

    /// Takes the markers out; each marked span, with the tokenizer's end
    /// token where it follows (after white space), trains.
    fn unmark(&self, rendered: &str) -> Result<TrainedText, String> {
        let mut text = String::with_capacity(rendered.len());
        let mut trained = Vec::new();
        let mut open: Option<usize> = None;
        let mut rest = rendered;
        // Where the reasoning kept in the text began, if it still waits
        // for its turn's answer: the two train as one span, the markup
        // between them (`</think>`) included.
        let mut reasoning: Option<usize> = None;
        let mut reasoning_open: Option<usize> = None;
        while let Some(i) = rest.find(MARKERS) {
            text.push_str(&rest[..i]);
            let c = rest[i..].chars().next().expect("found");
            rest = &rest[i + c.len_utf8()..];
            match (c, open, reasoning_open) {
                (OPEN_REASONING, None, None) => reasoning_open = Some(text.len()),
                (CLOSE_REASONING, None, Some(start)) => {
                    reasoning = Some(start);
                    reasoning_open = None;
                }
                (OPEN, None, None) => open = Some(reasoning.take().unwrap_or(text.len())),
                (CLOSE, Some(start), None) => {
                    let mut end = text.len();
                    let eos = self.eos_token.as_str();
                    let gap = rest.len() - rest.trim_start().len();
                    if !eos.is_empty() && rest[gap..].starts_with(eos) {
                        text.push_str(&rest[..gap + eos.len()]);
                        rest = &rest[gap + eos.len()..];
                        end = text.len();
                    }
                    trained.push(start..end);
                    open = None;
                }
                _ => {
                    return Err(format!(
                        "{}: the template moved or repeated an assistant message's content",
                        self.origin
                    ))
                }
            }
        }
        if open.is_some() || reasoning_open.is_some() || reasoning.is_some() {
            return Err(format!(
                "{}: the template cut an assistant message's content",
                self.origin
            ));
        }
        text.push_str(rest);
        Ok(TrainedText { text, trained })
    }
}

/// An assistant's content with its markers, inside the surrounding white
/// space (so that a template's strip() still sees it): the answer between
/// `OPEN` and `CLOSE`; a `<think>…</think>` reasoning block before it
/// between the reasoning markers, inside its tags, so that a template that
/// splits the reasoning out of the content (Qwen3's) carries the markers
/// along, or drops them with it.
fn mark_assistant(content: &str) -> String {
    let wrap = |text: &str, open: char, close: char| {
        let core = text.trim();
        let lead = &text[..text.len() - text.trim_start().len()];
        let trail = &text[text.trim_end().len()..];
        format!("{lead}{open}{core}{close}{trail}")
    };
    let split = content
        .split_once("</think>")
        .and_then(|(head, answer)| Some((head.split_once("<think>")?, answer)));
    match split {
        Some(((before, thought), answer)) if before.trim().is_empty() => format!(
            "{before}<think>{}</think>{}",
            wrap(thought, OPEN_REASONING, CLOSE_REASONING),
            wrap(answer, OPEN, CLOSE)
        ),
        _ => wrap(content, OPEN, CLOSE),
    }
}

/// A `prompt` / `completion` pair: the completion trains.
pub fn prompt_completion(prompt: &str, completion: &str) -> TrainedText {
    let completion_bytes = prompt.len()..prompt.len() + completion.len();
    TrainedText {
        text: format!("{prompt}{completion}"),
        trained: std::iter::once(completion_bytes).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Qwen's ChatML, as in Qwen2/Qwen3 tokenizer configs (shortened).
    const CHATML: &str = "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content.strip() + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

    /// Mistral's instruct template (shortened), with bos/eos and a check.
    const MISTRAL: &str = "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}";

    fn spans(t: &TrainedText) -> Vec<&str> {
        t.trained.iter().map(|r| &t.text[r.clone()]).collect()
    }

    #[test]
    fn chatml_trains_the_assistant_turns_and_their_end() {
        let template = ChatTemplate::new(CHATML, "", "<|im_end|>").unwrap();
        let messages = json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": " 4 "},
            {"role": "user", "content": "and 3+3?"},
            {"role": "assistant", "content": "6"},
        ]);
        let t = template.render(&messages).unwrap();
        assert_eq!(
            t.text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n\
             <|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\nand 3+3?<|im_end|>\n\
             <|im_start|>assistant\n6<|im_end|>\n"
        );
        // .strip() ran on the marked content: Python's string methods work.
        assert_eq!(spans(&t), ["4<|im_end|>", "6<|im_end|>"]);
    }

    #[test]
    fn mistral_uses_bos_and_eos_and_its_exceptions_are_errors() {
        let template = ChatTemplate::new(MISTRAL, "<s>", "</s>").unwrap();
        let t = template
            .render(&json!([
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
            ]))
            .unwrap();
        assert_eq!(t.text, "<s>[INST] Hi [/INST]Hello!</s>");
        assert_eq!(spans(&t), ["Hello!</s>"]);
        let err = template
            .render(&json!([{"role": "assistant", "content": "first"}]))
            .unwrap_err();
        assert!(err.contains("roles must alternate"), "{err}");
    }

    #[test]
    fn bad_messages_and_templates_are_named() {
        let template = ChatTemplate::new(CHATML, "", "<|im_end|>").unwrap();
        for (bad, why) in [
            (json!({"role": "user"}), "not an array"),
            (json!([{"role": "user"}]), "\"content\""),
            (json!([{"role": "user", "content": "\u{F8F0}"}]), "reserves"),
        ] {
            let err = template.render(&bad).unwrap_err();
            assert!(err.contains(why), "{err}");
        }
        let err = ChatTemplate::new("{% for %}", "", "")
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a usable template"), "{err}");
        // A template that drops the assistant's words.
        let dropping = ChatTemplate::new(
            "{% for m in messages %}{{ m.content[:2] }}{% endfor %}",
            "",
            "",
        )
        .unwrap();
        let err = dropping
            .render(&json!([{"role": "assistant", "content": "long answer"}]))
            .unwrap_err();
        assert!(err.contains("cut an assistant message"), "{err}");
    }

    /// A template that moves a turn's `<think>` reasoning out of its
    /// content, keeps it for the last turn and drops it for earlier ones
    /// (as Qwen3's does): the kept reasoning trains with its answer, the
    /// `</think>` between them included.
    #[test]
    fn reasoning_a_template_keeps_trains_with_its_answer() {
        let template = "{% for m in messages %}{% if m.role == 'assistant' %}\
            {% set c = m.content %}{% set r = '' %}\
            {% if '</think>' in c %}{% set r = c.split('</think>')[0].split('<think>')[-1].strip('\\n') %}\
            {% set c = c.split('</think>')[-1].lstrip('\\n') %}{% endif %}\
            {% if loop.last %}{{ '<a><think>' + r + '</think>' + c + '</s>' }}\
            {% else %}{{ '<a>' + c + '</s>' }}{% endif %}\
            {% else %}{{ '<u>' + m.content }}{% endif %}{% endfor %}";
        let template = ChatTemplate::new(template, "", "</s>").unwrap();
        let t = template
            .render(&json!([
                {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "<think>\nr1\n</think>\n\nans1"},
                {"role": "user", "content": "q2"},
                {"role": "assistant", "content": "<think>\nr2\n</think>\n\nans2"},
            ]))
            .unwrap();
        assert_eq!(t.text, "<u>q1<a>ans1</s><u>q2<a><think>r2</think>ans2</s>");
        assert_eq!(spans(&t), ["ans1</s>", "r2</think>ans2</s>"]);
    }

    #[test]
    fn a_prompt_completion_pair_trains_the_completion() {
        let t = prompt_completion("Q: 2+2=", " 4");
        assert_eq!(spans(&t), [" 4"]);
    }
}
