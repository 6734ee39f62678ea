//! The language model people train and fine-tune: a decoder-only MoE
//! transformer with the Mixtral architecture ([`MixtralLm`]), its
//! configuration ([`LmConfig`], presets and Hugging Face `config.json`),
//! its attention math, and its data ([`data`]).

pub mod attention;
pub mod config;
pub mod data;
pub mod network;

pub use config::{LmConfig, PRESETS};
pub use network::{DenseTensor, MixtralLm, TokenBatch};
