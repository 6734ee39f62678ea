use super::*;

fn builtin(seq_len: usize) -> DataConfig {
    DataConfig {
        corpus: Corpus::Builtin { documents: 2000 },
        seq_len,
        batch_seqs: 4,
        shuffle_buffer: 64,
        ..DataConfig::default()
    }
}

#[test]
fn batches_are_deterministic_and_packed() {
    let mut a = Dataset::open(builtin(32), Tokenizer::Bytes).unwrap();
    let mut b = Dataset::open(builtin(32), Tokenizer::Bytes).unwrap();
    for _ in 0..50 {
        let (x, y) = (a.next_batch().unwrap(), b.next_batch().unwrap());
        assert_eq!(x, y);
        assert_eq!(x.tokens.len(), 4 * 33);
        assert!(x.tokens.iter().all(|&t| t < 257));
    }
    assert!(!a.eval_batches().is_empty());
    let batch = a.next_batch().unwrap();
    let text = a.tokenizer().decode(&batch.tokens);
    assert!(text.contains('='), "{text}");
}

/// A model of 256 tokens reads bytes with no end-of-document token;
/// otherwise documents end with token 256.
#[test]
fn bytes_have_an_end_token_only_where_the_vocabulary_has_room() {
    assert_eq!(Tokenizer::bytes_for(256).vocab_size(), 256);
    assert_eq!(Tokenizer::bytes_for(32_000).vocab_size(), 257);
    for (vocab, end_seen) in [(256, false), (300, true)] {
        let mut ds = Dataset::open(builtin(32), Tokenizer::bytes_for(vocab)).unwrap();
        let mut ends = false;
        for _ in 0..20 {
            let batch = ds.next_batch().unwrap();
            assert!(batch.tokens.iter().all(|&t| (t as usize) < vocab.min(257)));
            ends |= batch.tokens.contains(&256);
        }
        assert_eq!(ends, end_seen, "vocab {vocab}");
    }
}

#[test]
fn skipping_resumes_the_same_stream() {
    let mut a = Dataset::open(builtin(16), Tokenizer::Bytes).unwrap();
    for _ in 0..700 {
        a.next_batch().unwrap(); // past the end of an epoch
    }
    assert!(a.epoch() >= 1);
    let mut b = Dataset::open(builtin(16), Tokenizer::Bytes).unwrap();
    b.skip_batches(700).unwrap();
    assert_eq!(a.next_batch().unwrap(), b.next_batch().unwrap());
}

#[test]
fn held_out_and_training_partition_the_corpus() {
    let config = DataConfig {
        eval_every: 10,
        eval_seqs_max: usize::MAX,
        ..builtin(8)
    };
    let mut all = Dataset::reader(&config).unwrap();
    let mut total = 0u64;
    while all.next(&Tokenizer::Bytes).unwrap().is_some() {
        total += 1;
    }
    let mut ds = Dataset::open(config, Tokenizer::Bytes).unwrap();
    let mut trained = 0u64;
    while ds.epoch() == 0 {
        ds.next_sequence().unwrap();
        trained += 1;
    }
    trained -= 1; // the draw that started epoch 1
    let held = ds.eval.len() as u64;
    assert_eq!(trained + held, total);
    assert!(held > total / 20 && held < total / 5, "{held} of {total}");
}

#[test]
fn files_text_and_jsonl() {
    let dir = tempfile::tempdir().unwrap();
    let txt = dir.path().join("a.txt");
    std::fs::write(&txt, "hello world\n".repeat(20)).unwrap();
    let jsonl = dir.path().join("b.jsonl");
    std::fs::write(
        &jsonl,
        "{\"text\": \"abc def\"}\n\n{\"text\": \"ghi\"}\n".repeat(10),
    )
    .unwrap();
    let config = DataConfig {
        corpus: Corpus::Files(vec![txt, jsonl.clone()]),
        seq_len: 8,
        batch_seqs: 2,
        eval_every: 0,
        ..DataConfig::default()
    };
    let mut ds = Dataset::open(config, Tokenizer::Bytes).unwrap();
    let b = ds.next_batch().unwrap();
    assert_eq!(b.tokens.len(), 18);
    // bad JSONL names the line
    std::fs::write(&jsonl, "{\"text\": \"ok\"}\n{\"body\": 1}\n").unwrap();
    let config = DataConfig {
        corpus: Corpus::Files(vec![jsonl]),
        seq_len: 2,
        batch_seqs: 1,
        ..DataConfig::default()
    };
    let err = Dataset::open(config, Tokenizer::Bytes).err().unwrap();
    assert!(err.to_string().contains("b.jsonl:2"), "{err}");
    // A data error is not a configuration error.
    assert!(!err.to_string().contains("invalid configuration"), "{err}");
}

#[test]
fn a_tokenizer_json_is_used_with_its_end_token() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer.json");
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "unk_token": "[UNK]",
                  "vocab": {"a": 0, "b": 1, "</s>": 2, "[UNK]": 3}}
    });
    std::fs::write(&path, json.to_string()).unwrap();
    let tok = Tokenizer::from_file(&path).unwrap();
    assert_eq!((tok.vocab_size(), tok.eos()), (4, Some(2)));
    let mut ids = Vec::new();
    tok.encode("a b zz a", &mut ids).unwrap();
    assert_eq!(ids, [0, 1, 3, 0]);
    std::fs::write(&path, "{}").unwrap();
    let err = Tokenizer::from_file(&path).err().unwrap();
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
}

#[test]
fn empty_and_missing_data_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let txt = dir.path().join("short.txt");
    std::fs::write(&txt, "hi").unwrap();
    let config = DataConfig {
        corpus: Corpus::Files(vec![txt]),
        seq_len: 64,
        ..DataConfig::default()
    };
    let err = Dataset::open(config, Tokenizer::Bytes).err().unwrap();
    assert!(err.to_string().contains("dataset is empty"), "{err}");
    let config = DataConfig {
        corpus: Corpus::Files(vec![dir.path().join("nope.txt")]),
        ..DataConfig::default()
    };
    let err = Dataset::open(config, Tokenizer::Bytes).err().unwrap();
    assert!(err.to_string().contains("does not exist"), "{err}");
    // A directory is not a missing file: the message says what to give.
    let config = DataConfig {
        corpus: Corpus::Files(vec![dir.path().to_path_buf()]),
        ..DataConfig::default()
    };
    let err = Dataset::open(config, Tokenizer::Bytes).err().unwrap();
    assert!(err.to_string().contains("is a directory"), "{err}");
}

/// Instruction data: a prompt/completion pair trains its completion and
/// its end token; a conversation, its assistant turns; plain text, all.
#[test]
fn instruction_lines_carry_loss_on_the_answers_only() {
    let dir = tempfile::tempdir().unwrap();
    let jsonl = dir.path().join("sft.jsonl");
    let lines = [
        r#"{"prompt": "Q:2+2=", "completion": "4"}"#,
        r#"{"messages": [{"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]}"#,
        r#"{"text": "xy"}"#,
    ];
    std::fs::write(&jsonl, lines.join("\n")).unwrap();
    let template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}";
    let config = DataConfig {
        corpus: Corpus::Files(vec![jsonl.clone()]),
        seq_len: 41,
        batch_seqs: 1,
        eval_every: 0,
        shuffle_buffer: 1,
        chat_template: Some(ChatTemplate::new(template, "", "</s>").unwrap()),
        ..DataConfig::default()
    };
    let mut ds = Dataset::open(config.clone(), Tokenizer::Bytes).unwrap();
    let b = ds.next_batch().unwrap();
    let mask = b.loss_mask.as_ref().expect("a loss mask");
    let trained: String = b
        .tokens
        .iter()
        .zip(mask)
        .filter(|(_, &m)| m)
        .map(|(&t, _)| if t < 256 { t as u8 as char } else { '#' })
        .collect();
    // The completion and its end token (#); the assistant's turn with
    // the template's end of turn (the tokenizer's end token), and the
    // document's end token, since the turn ends the text; all of the
    // plain text and its end token. Prompts, user turns and markup:
    // nothing.
    assert_eq!(trained, "4#6</s>#xy#");
    assert_eq!(b.loss_tokens(), trained.len());
    // Without a template, a conversation is refused, naming the line.
    let no_template = DataConfig {
        chat_template: None,
        ..config
    };
    let err = Dataset::open(no_template, Tokenizer::Bytes).err().unwrap();
    assert!(
        err.to_string()
            .contains("sft.jsonl:2: a \"messages\" line needs"),
        "{err}"
    );
    // Plain text alone has no mask at all.
    std::fs::write(&jsonl, r#"{"text": "hello world, hello"}"#).unwrap();
    let plain = DataConfig {
        corpus: Corpus::Files(vec![jsonl]),
        seq_len: 8,
        batch_seqs: 1,
        eval_every: 0,
        ..DataConfig::default()
    };
    let b = Dataset::open(plain, Tokenizer::Bytes)
        .unwrap()
        .next_batch()
        .unwrap();
    assert_eq!(b.loss_mask, None);
}

/// Documents kept apart: each begins where `doc_starts` says, and its
/// first token is no target of the document before it.
#[test]
fn documents_kept_apart_are_marked_where_they_begin() {
    let dir = tempfile::tempdir().unwrap();
    let jsonl = dir.path().join("docs.jsonl");
    std::fs::write(&jsonl, "{\"text\": \"abc\"}\n{\"text\": \"de\"}\n").unwrap();
    let config = DataConfig {
        corpus: Corpus::Files(vec![jsonl]),
        seq_len: 6,
        batch_seqs: 1,
        eval_every: 0,
        documents_apart: true,
        ..DataConfig::default()
    };
    let b = Dataset::open(config, Tokenizer::Bytes)
        .unwrap()
        .next_batch()
        .unwrap();
    // a b c ⏎ d e ⏎: the second document begins at 4.
    assert_eq!(b.tokens, [97, 98, 99, 256, 100, 101, 256]);
    let starts = b.doc_starts.expect("documents apart");
    assert_eq!(starts, [true, false, false, false, true, false, false]);
    let mask = b.loss_mask.expect("the second document's first token");
    assert_eq!(mask, [false, true, true, true, false, true, true]);
}
