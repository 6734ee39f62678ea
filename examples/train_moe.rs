//! Trains a small MoE stack with its experts in an SSD store, a quarter of
//! them in host memory and two on the device, on a synthetic task whose
//! answer is learnable from the inputs, and prints the loss falling and
//! where each step's time went.
//!
//!     cargo run --release --example train_moe

use strata::engine::{Engine, EngineConfig};
use strata::model::{fill_uniform, Batch, ModelConfig};
use strata_optim::AdamWHyper;
use strata_tiers::Dtype;

/// Inputs uniform(±1); the class is the bucket of the sum of the first
/// eight inputs, so a model that learns that sum can predict it.
fn batch(model: &ModelConfig, tokens: usize, seed: u64) -> Batch {
    let mut inputs = vec![0.0f32; tokens * model.d_model];
    fill_uniform(&mut inputs, seed, 9, 1.0);
    let targets = (0..tokens)
        .map(|t| {
            let s: f32 = inputs[t * model.d_model..t * model.d_model + 8]
                .iter()
                .sum();
            let bucket = ((s + 4.0) / 8.0 * model.classes as f32) as i64;
            bucket.clamp(0, model.classes as i64 - 1) as u32
        })
        .collect();
    Batch { inputs, targets }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = ModelConfig {
        layers: 4,
        d_model: 128,
        d_ff: 256,
        experts: 8,
        top_k: 2,
        classes: 16,
        ..ModelConfig::default()
    };
    let dir = std::env::temp_dir().join(format!("strata-train-moe-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let expert_bytes = (model.expert_params() * 2) as u64; // bf16 compute params
    let record_bytes = expert_bytes + 12 * model.expert_params() as u64 + 8192;
    let experts = (model.layers * model.experts) as u64;
    let config = EngineConfig {
        store_path: Some(dir.join("experts.strata")),
        device_budget_bytes: 2 * expert_bytes,
        host_budget_bytes: experts / 4 * record_bytes,
        compute_dtype: Dtype::Bf16,
        hyper: AdamWHyper {
            lr: 3e-3,
            ..AdamWHyper::default()
        },
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(model.clone(), config)?;
    println!(
        "{} layers × {} experts ({} params each) in {}; {} on the device, {} in host memory",
        model.layers,
        model.experts,
        model.expert_params(),
        dir.join("experts.strata").display(),
        engine.device_slots(),
        engine.host_slots()
    );
    let steps = 40;
    for step in 0..steps {
        let m = engine.step(&batch(&model, 512, step))?;
        if step % 5 == 0 || step + 1 == steps {
            println!(
                "step {:>3}  loss {:.4}  {:>6.0} tokens/s  stalls: ssd {:.3}s upload {:.3}s optimizer {:.3}s  host hit rate {:.2}",
                m.step,
                m.loss,
                m.tokens as f64 / m.wall_s,
                m.stall_ssd_s,
                m.stall_upload_s,
                m.stall_optimizer_s,
                m.host_hit_rate
            );
        }
    }
    engine.checkpoint_experts()?;
    drop(engine);
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
