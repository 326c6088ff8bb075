//! `reviewctl`: see `reviewctl --help`.

fn main() -> std::process::ExitCode {
    reviewctl::main_with(std::env::args_os())
}
