//! The language model people train and fine-tune: a decoder-only MoE
//! transformer with the Mixtral architecture ([`MixtralLm`]), its
//! configuration ([`LmConfig`], presets and Hugging Face `config.json`)
//! and its data ([`data`]). Its attention math is in
//! [`math::attention`](crate::math::attention), with the other plain ops.

pub mod config;
pub mod data;
pub mod network;
pub mod safetensors_io;

pub use config::{AuxLoss, LmConfig, PRESETS};
pub use network::{DenseTensor, MixtralLm, TokenBatch};
