//! Text to token ids: bytes (with or without an end-of-document token),
//! or a Hugging Face `tokenizer.json`.

use std::ops::Range;
use std::path::Path;

use crate::EngineError;

/// Turns text into token ids.
pub enum Tokenizer {
    /// One token per UTF-8 byte, plus an end-of-document token (256).
    Bytes,
    /// One token per UTF-8 byte and no end-of-document token, for a model
    /// whose vocabulary is the 256 bytes alone: documents follow one
    /// another unmarked.
    BytesOnly,
    /// A Hugging Face `tokenizer.json`.
    Hf(Box<tokenizers::Tokenizer>, u32),
}

impl Tokenizer {
    /// Loads `tokenizer.json` (its end-of-document token is the first of
    /// `</s>`, `<|endoftext|>`, `<|end_of_text|>`, `<eos>` it knows).
    pub fn from_file(path: &Path) -> Result<Self, EngineError> {
        let tok = tokenizers::Tokenizer::from_file(path).map_err(|e| {
            EngineError::Config(format!(
                "{}: not a usable tokenizer.json: {e}",
                path.display()
            ))
        })?;
        let eos = ["</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>"]
            .iter()
            .find_map(|t| tok.token_to_id(t))
            .ok_or_else(|| {
                EngineError::Config(format!(
                    "{}: no end-of-document token (</s>, <|endoftext|>, <eos>) in the vocabulary",
                    path.display()
                ))
            })?;
        Ok(Tokenizer::Hf(Box::new(tok), eos))
    }

    /// Bytes for a model of `vocab` tokens with no tokenizer of its own:
    /// with an end-of-document token where the vocabulary has room for it.
    pub fn bytes_for(vocab: usize) -> Tokenizer {
        match vocab {
            256 => Tokenizer::BytesOnly,
            _ => Tokenizer::Bytes,
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Bytes => 257,
            Tokenizer::BytesOnly => 256,
            Tokenizer::Hf(t, _) => t.get_vocab_size(true),
        }
    }

    /// The token that ends a document, if the tokenizer has one.
    pub fn eos(&self) -> Option<u32> {
        match self {
            Tokenizer::Bytes => Some(256),
            Tokenizer::BytesOnly => None,
            Tokenizer::Hf(_, eos) => Some(*eos),
        }
    }

    pub fn encode(&self, text: &str, out: &mut Vec<u32>) -> Result<(), EngineError> {
        match self {
            Tokenizer::Bytes | Tokenizer::BytesOnly => out.extend(text.bytes().map(u32::from)),
            Tokenizer::Hf(t, _) => {
                let enc = t
                    .encode(text, false)
                    .map_err(|e| EngineError::Config(format!("tokenizing failed: {e}")))?;
                out.extend_from_slice(enc.get_ids());
            }
        }
        Ok(())
    }

    /// Encodes `text`, and for each token whether it starts inside one of
    /// the `trained` byte ranges.
    pub(super) fn encode_masked(
        &self,
        text: &str,
        trained: &[Range<usize>],
        ids: &mut Vec<u32>,
        mask: &mut Vec<bool>,
    ) -> Result<(), EngineError> {
        let inside = |at: usize| trained.iter().any(|r| r.contains(&at));
        match self {
            Tokenizer::Bytes | Tokenizer::BytesOnly => {
                ids.extend(text.bytes().map(u32::from));
                mask.extend((0..text.len()).map(inside));
            }
            Tokenizer::Hf(t, _) => {
                let enc = t
                    .encode(text, false)
                    .map_err(|e| EngineError::Config(format!("tokenizing failed: {e}")))?;
                ids.extend_from_slice(enc.get_ids());
                mask.extend(enc.get_offsets().iter().map(|&(start, _)| inside(start)));
            }
        }
        Ok(())
    }

    /// Text for display (the byte tokenizer shows its end token as ⏎).
    pub fn decode(&self, ids: &[u32]) -> String {
        match self {
            Tokenizer::Bytes | Tokenizer::BytesOnly => {
                let bytes: Vec<u8> = ids
                    .iter()
                    .map(|&i| if i < 256 { i as u8 } else { b'|' })
                    .collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
            Tokenizer::Hf(t, _) => t.decode(ids, false).unwrap_or_default(),
        }
    }
}
