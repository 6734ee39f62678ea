//! Opens a Hugging Face model directory (Mixtral, Qwen3-MoE, OLMoE or Qwen2-MoE
//! layout), prints the logits of a prompt and its greedy continuation as
//! one JSON object: what `scripts/hf-fixtures/check_export.py` compares
//! with transformers' own.
//!
//!     cargo run --release --example hub_greedy -- MODEL_DIR 16 3 1 4 1 5
//!
//! (the directory, how many tokens to generate, then the prompt's ids).

use strata::engine::EngineConfig;
use strata::lm::{hub, TokenBatch};
use strata_tiers::Dtype;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [dir, new, prompt @ ..] = args.as_slice() else {
        return Err("usage: hub_greedy MODEL_DIR NEW_TOKENS PROMPT_ID...".into());
    };
    let new: usize = new.parse()?;
    let mut tokens: Vec<u32> = prompt.iter().map(|t| t.parse()).collect::<Result<_, _>>()?;
    if tokens.is_empty() {
        return Err("give at least one prompt token id".into());
    }
    let store = tempfile::tempdir()?;
    let config = EngineConfig {
        compute_dtype: Dtype::F32,
        store_path: Some(store.path().join("experts.store")),
        ..EngineConfig::default()
    };
    let (lm, mut engine) = hub::open_engine(std::path::Path::new(dir), config, |_, _| {})?;
    // A forward of n + 1 tokens gives the logits of the first n; the last
    // id is a placeholder target.
    let forward = |engine: &mut strata::engine::Engine, tokens: &[u32]| {
        let mut row = tokens.to_vec();
        row.push(0);
        engine.forward(
            &lm,
            &TokenBatch {
                seq_len: tokens.len(),
                tokens: row,
                loss_mask: None,
                doc_starts: None,
            },
        )
    };
    let logits = forward(&mut engine, &tokens)?.logits;
    let prompt_len = tokens.len();
    for _ in 0..new {
        let out = forward(&mut engine, &tokens)?;
        let last = &out.logits[out.logits.len() - out.width..];
        let next = (0..out.width)
            .max_by(|&a, &b| last[a].total_cmp(&last[b]).then(b.cmp(&a)))
            .expect("a vocabulary");
        tokens.push(next as u32);
    }
    let json = serde_json::json!({
        "logits": logits,
        "vocab": lm.config().vocab,
        "continuation": &tokens[prompt_len..],
    });
    println!("{json}");
    Ok(())
}
