use reviewlane_core::config::ProcessEnv;
use reviewlane_extractor::{ExtractorConfig, build};
use reviewlane_shared::startup::run_service;

/// mimalloc: malloc and free were a tenth of the services' CPU under load with
/// glibc's allocator (BENCHMARKS.md, "Overhead beside BullMQ").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    run_service(
        "reviewlane-extractor",
        ExtractorConfig::from_env(&ProcessEnv),
        |c| c.telemetry.clone(),
        build,
        |app, shutdown| app.run_until_stopped(shutdown),
    )
    .await
}
