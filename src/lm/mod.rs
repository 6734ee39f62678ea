//! The language model people train and fine-tune: a decoder-only MoE
//! transformer of the Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE or GLM-4.5 family
//! ([`MoeLm`]), its configuration ([`LmConfig`], presets and Hugging Face
//! `config.json`), a Hub model directory read in ([`hub`]) and its data
//! ([`data`]). Its attention math is in
//! [`math::attention`](crate::math::attention), with the other plain ops.

mod attention_half;
pub mod chat;
pub mod config;
pub mod data;
mod ffn;
pub mod groups;
mod hf_config;
pub mod hub;
mod mlp;
pub mod network;
mod qkv;
pub mod safetensors_io;
mod token_batch;
mod tokenizer;

pub use config::{AuxLoss, Family, LmConfig, QkNorm, PRESETS};
pub use groups::TensorGroup;
pub use network::{DenseTensor, MoeLm, TokenBatch};
