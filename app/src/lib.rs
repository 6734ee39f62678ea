//! The `strata` command, as a library its tests and embedders can call:
//! the trainer ([`trainer`]: train, fine-tune, resume, export, with its
//! run directories and memory plan), the command line ([`cli`]), `strata
//! launch` ([`launch`]) and the benchmarks behind `strata bench`
//! ([`mod@bench`]). The engine itself is the `strata` crate, which knows
//! nothing of any of them.

pub mod bench;
pub mod cli;
pub mod launch;
pub mod plot;
pub mod sys;
pub mod trainer;
