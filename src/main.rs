use clap::Parser;

fn main() -> std::process::ExitCode {
    strata::cli::run(strata::cli::Cli::parse())
}
