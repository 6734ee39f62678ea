use clap::Parser;

fn main() -> std::process::ExitCode {
    strata_cli::sys::keep_freed_memory_in_the_heap();
    strata_cli::cli::run(strata_cli::cli::Cli::parse())
}
