//! Training data: plain-text or JSONL files, streamed line by line,
//! tokenized, packed into fixed-length sequences, split into a held-out
//! eval set and a training stream shuffled through a bounded buffer — all
//! deterministic from a seed, so a resumed run sees the same batches as an
//! uninterrupted one. A JSONL line is a document of `text`, a `prompt` and
//! its `completion`, or a conversation (`messages`, through the model's
//! chat template, [`chat`](super::chat)); in the last two only the
//! completion and the assistant's turns carry loss (the sequences' loss
//! masks). A built-in corpus (arithmetic) lets `strata train` run with no
//! download.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;

use std::ops::Range;

use super::chat::{prompt_completion, ChatTemplate, TrainedText};
use super::network::TokenBatch;
pub use super::tokenizer::Tokenizer;
use crate::EngineError;

/// Where the text comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum Corpus {
    /// Generated arithmetic ("417+96=513"), one problem a document.
    Builtin { documents: usize },
    /// Files: `.jsonl` (one JSON object a line: a `text` field, `prompt`
    /// and `completion`, or `messages`) or anything else as plain text (one
    /// document a file).
    Files(Vec<PathBuf>),
}

/// How the data is cut and ordered.
#[derive(Clone, Debug, PartialEq)]
pub struct DataConfig {
    pub corpus: Corpus,
    /// Tokens a sequence predicts (each sequence holds seq_len + 1).
    pub seq_len: usize,
    /// Sequences a batch.
    pub batch_seqs: usize,
    pub seed: u64,
    /// One sequence in `eval_every` goes to the held-out set (0: none).
    pub eval_every: u64,
    /// Held-out sequences kept for eval, at most.
    pub eval_seqs_max: usize,
    /// Training sequences shuffled at once.
    pub shuffle_buffer: usize,
    /// The template `messages` lines are rendered through (the model's).
    pub chat_template: Option<ChatTemplate>,
    /// Documents packed into one sequence are kept apart: each attends
    /// only to itself, and the first token of one is no target of the
    /// last token of the one before (`TokenBatch::doc_starts`). Without
    /// it, a sequence is one stream, as in pretraining.
    pub documents_apart: bool,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            corpus: Corpus::Builtin { documents: 200_000 },
            seq_len: 64,
            batch_seqs: 16,
            seed: 0,
            eval_every: 50,
            eval_seqs_max: 64,
            shuffle_buffer: 4096,
            chat_template: None,
            documents_apart: false,
        }
    }
}

impl DataConfig {
    /// The most bytes a [`Dataset`] holds in sequences: its shuffle buffer
    /// and held-out set, each sequence seq_len + 1 tokens (u32) with a loss
    /// mask and document starts (a byte a token each, where kept).
    pub fn buffered_bytes(&self) -> u64 {
        let sequences = (self.shuffle_buffer + self.eval_seqs_max) as u64;
        sequences * (self.seq_len as u64 + 1) * (4 + 1 + 1)
    }
}

/// One document: its text, the byte ranges of it that carry loss (`None`:
/// all of it), and whether it ends here (a plain-text file is handed out
/// a line at a time, and ends with the file).
struct Document {
    text: String,
    trained: Option<Vec<Range<usize>>>,
    ends: bool,
}

impl Document {
    fn whole(text: String, ends: bool) -> Self {
        Document {
            text,
            trained: None,
            ends,
        }
    }

    /// The end-of-document token carries loss where the text's end does
    /// (a completion's end: the model learns to stop).
    fn end_trained(&self) -> bool {
        match &self.trained {
            None => true,
            Some(ranges) => ranges.iter().any(|r| r.end == self.text.len()),
        }
    }
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The built-in corpus's document `i`: an addition, a subtraction or a
/// multiplication of small numbers with its answer.
pub fn builtin_document(seed: u64, i: u64) -> String {
    let r = splitmix(seed ^ splitmix(i));
    let a = (r % 1000) as i64;
    let b = ((r >> 16) % 1000) as i64;
    match (r >> 32) % 3 {
        0 => format!("{a}+{b}={}", a + b),
        1 => format!("{a}-{b}={}", a - b),
        _ => {
            let (a, b) = (a % 100, b % 100);
            format!("{a}*{b}={}", a * b)
        }
    }
}

/// Documents, one at a time, from the corpus, in order.
struct DocumentReader {
    corpus: Corpus,
    seed: u64,
    next_builtin: u64,
    file_index: usize,
    lines: Option<(std::io::Lines<BufReader<File>>, bool, PathBuf)>,
    line_no: u64,
    chat_template: Option<ChatTemplate>,
}

impl DocumentReader {
    fn new(
        corpus: Corpus,
        seed: u64,
        chat_template: Option<ChatTemplate>,
    ) -> Result<Self, EngineError> {
        if let Corpus::Files(paths) = &corpus {
            if paths.is_empty() {
                return Err(EngineError::Config("no data files were given".into()));
            }
            for p in paths {
                if p.is_dir() {
                    return Err(EngineError::Config(format!(
                        "data path {} is a directory: give its .txt or .jsonl files \
                         (--data DIR/*.jsonl)",
                        p.display()
                    )));
                }
                if !p.is_file() {
                    return Err(EngineError::Config(format!(
                        "data file {} does not exist (give a .txt or .jsonl file)",
                        p.display()
                    )));
                }
            }
        }
        Ok(Self {
            corpus,
            seed,
            next_builtin: 0,
            file_index: 0,
            lines: None,
            line_no: 0,
            chat_template,
        })
    }

    /// The next document, or `None` at the end of the corpus. A plain-text
    /// file is read line by line and handed out a line at a time with its
    /// newline; the end of the file ends the document.
    fn next(&mut self) -> Result<Option<Document>, EngineError> {
        let paths = match &self.corpus {
            Corpus::Builtin { documents } => {
                if self.next_builtin >= *documents as u64 {
                    return Ok(None);
                }
                self.next_builtin += 1;
                let doc = builtin_document(self.seed, self.next_builtin - 1);
                return Ok(Some(Document::whole(doc, true)));
            }
            Corpus::Files(paths) => paths.clone(),
        };
        loop {
            if self.lines.is_none() {
                let Some(path) = paths.get(self.file_index) else {
                    return Ok(None);
                };
                let file = File::open(path).map_err(|e| {
                    EngineError::Data(format!("cannot open {}: {e}", path.display()))
                })?;
                let jsonl = path.extension().is_some_and(|e| e == "jsonl");
                self.lines = Some((BufReader::new(file).lines(), jsonl, path.clone()));
                self.line_no = 0;
            }
            let (lines, jsonl, path) = self.lines.as_mut().expect("opened");
            let (jsonl, path) = (*jsonl, path.clone());
            match lines.next() {
                None => {
                    self.lines = None;
                    self.file_index += 1;
                    if !jsonl {
                        return Ok(Some(Document::whole(String::new(), true)));
                    }
                }
                Some(Err(e)) => {
                    return Err(EngineError::Data(format!(
                        "{}: read failed: {e}",
                        path.display()
                    )))
                }
                Some(Ok(line)) => {
                    self.line_no += 1;
                    if !jsonl {
                        return Ok(Some(Document::whole(line + "\n", false)));
                    }
                    if line.trim().is_empty() {
                        continue;
                    }
                    let v: serde_json::Value = serde_json::from_str(&line).map_err(|e| {
                        EngineError::Data(format!(
                            "{}:{}: not a JSON object: {e}",
                            path.display(),
                            self.line_no
                        ))
                    })?;
                    let at = |why: String| {
                        EngineError::Data(format!("{}:{}: {why}", path.display(), self.line_no))
                    };
                    let doc = jsonl_document(&v, self.chat_template.as_ref()).map_err(at)?;
                    return Ok(Some(doc));
                }
            }
        }
    }
}

/// One JSONL line's document: `text` (all of it trains), `prompt` and
/// `completion` (the completion trains), or `messages` (through the chat
/// template; the assistant's turns train).
fn jsonl_document(
    v: &serde_json::Value,
    chat_template: Option<&ChatTemplate>,
) -> Result<Document, String> {
    let field = |k: &str| v.get(k).and_then(|t| t.as_str());
    let trained = |t: TrainedText| Document {
        text: t.text,
        trained: Some(t.trained),
        ends: true,
    };
    if let Some(text) = field("text") {
        return Ok(Document::whole(text.to_string(), true));
    }
    if let (Some(prompt), Some(completion)) = (field("prompt"), field("completion")) {
        return Ok(trained(prompt_completion(prompt, completion)));
    }
    if let Some(messages) = v.get("messages") {
        let Some(template) = chat_template else {
            return Err(
                "a \"messages\" line needs the model's chat template, and the \
                        tokenizer's directory has none (chat_template.jinja, or \
                        chat_template in tokenizer_config.json)"
                    .into(),
            );
        };
        return template.render(messages).map(trained);
    }
    Err("no string \"text\" field, no \"prompt\" and \"completion\", no \"messages\"".into())
}

/// Packed sequences of seq_len + 1 tokens in corpus order, end-of-document
/// tokens between documents; a partial last sequence is dropped. Each
/// token carries whether it is a target with loss.
struct SequenceReader {
    docs: DocumentReader,
    pending: Vec<u32>,
    /// Beside `pending`: each token carries loss.
    pending_mask: Vec<bool>,
    /// Beside `pending`: each token begins a document.
    pending_starts: Vec<bool>,
    at: usize,
    seq_len: usize,
    documents_apart: bool,
    /// The last document read ended (the next one begins a document).
    doc_ended: bool,
}

/// One packed sequence and, where some of its targets carry no loss, its
/// loss mask.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Sequence {
    tokens: Vec<u32>,
    mask: Option<Vec<bool>>,
    /// Where documents begin, when documents are kept apart.
    starts: Option<Vec<bool>>,
}

impl SequenceReader {
    fn next(&mut self, tok: &Tokenizer) -> Result<Option<Sequence>, EngineError> {
        let need = self.seq_len + 1;
        while self.pending.len() - self.at < need {
            self.pending.drain(..self.at);
            self.pending_mask.drain(..self.at);
            self.pending_starts.drain(..self.at);
            self.at = 0;
            let Some(doc) = self.docs.next()? else {
                return Ok(None);
            };
            let first = self.pending.len();
            match &doc.trained {
                None => {
                    let before = self.pending.len();
                    tok.encode(&doc.text, &mut self.pending)?;
                    let added = self.pending.len() - before;
                    self.pending_mask.extend(std::iter::repeat_n(true, added));
                }
                Some(ranges) => {
                    tok.encode_masked(&doc.text, ranges, &mut self.pending, &mut self.pending_mask)?
                }
            }
            if let Some(eos) = tok.eos().filter(|_| doc.ends) {
                self.pending.push(eos);
                self.pending_mask.push(doc.end_trained());
            }
            let added = self.pending.len() - first;
            self.pending_starts
                .extend(std::iter::repeat_n(false, added));
            if self.documents_apart && self.doc_ended && added > 0 {
                // Its first token is no target of the document before.
                self.pending_starts[first] = true;
                self.pending_mask[first] = false;
            }
            if added > 0 {
                self.doc_ended = doc.ends;
            }
        }
        let range = self.at..self.at + need;
        let mask = &self.pending_mask[range.clone()];
        let seq = Sequence {
            tokens: self.pending[range.clone()].to_vec(),
            mask: mask[1..].contains(&false).then(|| mask.to_vec()),
            starts: self
                .documents_apart
                .then(|| self.pending_starts[range].to_vec()),
        };
        self.at += need;
        Ok(Some(seq))
    }
}

/// The training stream and the held-out set.
pub struct Dataset {
    config: DataConfig,
    tokenizer: Tokenizer,
    reader: SequenceReader,
    /// Sequence index in corpus order of the reader's next one.
    index: u64,
    epoch: u64,
    buffer: Vec<Sequence>,
    rng: u64,
    eval: Vec<Sequence>,
    batches: u64,
}

impl Dataset {
    /// Opens the corpus and reads the held-out set. An empty corpus (not
    /// one whole training sequence) is an error.
    pub fn open(config: DataConfig, tokenizer: Tokenizer) -> Result<Self, EngineError> {
        if config.seq_len == 0 || config.batch_seqs == 0 || config.shuffle_buffer == 0 {
            return Err(EngineError::Config(
                "seq_len, batch size and shuffle buffer must be at least 1".into(),
            ));
        }
        let reader = Self::reader(&config)?;
        let mut ds = Self {
            rng: splitmix(config.seed ^ 0x5eed),
            tokenizer,
            reader,
            index: 0,
            epoch: 0,
            buffer: Vec::new(),
            eval: Vec::new(),
            batches: 0,
            config,
        };
        ds.fill()?;
        if ds.buffer.is_empty() {
            let what = match &ds.config.corpus {
                Corpus::Builtin { .. } => "the built-in corpus".to_string(),
                Corpus::Files(p) => p
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            };
            return Err(EngineError::Config(format!(
                "the dataset is empty: {what} holds no training sequence of seq_len + 1 = {} \
                 tokens (give more text or a smaller --seq-len)",
                ds.config.seq_len + 1
            )));
        }
        Ok(ds)
    }

    fn reader(config: &DataConfig) -> Result<SequenceReader, EngineError> {
        Ok(SequenceReader {
            docs: DocumentReader::new(
                config.corpus.clone(),
                config.seed,
                config.chat_template.clone(),
            )?,
            pending: Vec::new(),
            pending_mask: Vec::new(),
            pending_starts: Vec::new(),
            at: 0,
            seq_len: config.seq_len,
            documents_apart: config.documents_apart,
            doc_ended: true,
        })
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Tops the shuffle buffer up from the stream; held-out sequences are
    /// set aside as they pass.
    fn fill(&mut self) -> Result<(), EngineError> {
        while self.buffer.len() < self.config.shuffle_buffer {
            let Some(seq) = self.reader.next(&self.tokenizer)? else {
                return Ok(());
            };
            let i = self.index;
            self.index += 1;
            let every = self.config.eval_every;
            if every > 0 && splitmix(self.config.seed ^ splitmix(i)).is_multiple_of(every) {
                if self.epoch == 0 && self.eval.len() < self.config.eval_seqs_max {
                    self.eval.push(seq);
                }
                continue;
            }
            self.buffer.push(seq);
        }
        Ok(())
    }

    fn next_sequence(&mut self) -> Result<Sequence, EngineError> {
        if self.buffer.is_empty() {
            // A new epoch: the stream starts over.
            self.epoch += 1;
            self.reader = Self::reader(&self.config)?;
            self.index = 0;
            self.fill()?;
        }
        self.rng = splitmix(self.rng);
        let pick = (self.rng % self.buffer.len() as u64) as usize;
        let seq = self.buffer.swap_remove(pick);
        self.fill()?;
        Ok(seq)
    }

    /// The next training batch.
    pub fn next_batch(&mut self) -> Result<TokenBatch, EngineError> {
        let seqs: Vec<Sequence> = (0..self.config.batch_seqs)
            .map(|_| self.next_sequence())
            .collect::<Result<_, _>>()?;
        self.batches += 1;
        Ok(batch_of(self.config.seq_len, &seqs))
    }

    /// Batches handed out so far.
    pub fn batches(&self) -> u64 {
        self.batches
    }

    /// Moves past `n` batches (a resumed run continues where it stopped).
    pub fn skip_batches(&mut self, n: u64) -> Result<(), EngineError> {
        for _ in 0..n {
            self.next_batch()?;
        }
        Ok(())
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The held-out set as batches of at most `batch_seqs` sequences.
    pub fn eval_batches(&self) -> Vec<TokenBatch> {
        self.eval
            .chunks(self.config.batch_seqs)
            .map(|c| batch_of(self.config.seq_len, c))
            .collect()
    }
}

/// Sequences as one batch, with a loss mask where any of them has one.
fn batch_of(seq_len: usize, seqs: &[Sequence]) -> TokenBatch {
    let tokens = seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
    let masked = seqs.iter().any(|s| s.mask.is_some());
    let loss_mask = masked.then(|| {
        seqs.iter()
            .flat_map(|s| match &s.mask {
                Some(m) => m.clone(),
                None => vec![true; s.tokens.len()],
            })
            .collect()
    });
    let apart = seqs.iter().all(|s| s.starts.is_some());
    let doc_starts = apart.then(|| {
        seqs.iter()
            .flat_map(|s| s.starts.clone().unwrap_or_default())
            .collect()
    });
    TokenBatch {
        seq_len,
        tokens,
        loss_mask,
        doc_starts,
    }
}

#[cfg(test)]
mod tests;
