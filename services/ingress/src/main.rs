use reviewlane_core::config::ProcessEnv;
use reviewlane_ingress::{IngressConfig, build};
use reviewlane_shared::startup::run_service;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    run_service(
        "reviewlane-ingress",
        IngressConfig::from_env(&ProcessEnv),
        |c| c.telemetry.clone(),
        build,
        |app, shutdown| app.run_until_stopped(shutdown),
    )
    .await
}
