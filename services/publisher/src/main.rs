use std::process::ExitCode;

use reviewlane_publisher::{PublisherConfig, build};
use reviewlane_shared::config::{EXIT_CONFIG, ProcessEnv};
use reviewlane_shared::startup::shutdown_signal;
use reviewlane_shared::telemetry;

#[tokio::main]
async fn main() -> ExitCode {
    let config = match PublisherConfig::from_env(&ProcessEnv) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("reviewlane-publisher: {e}");
            return ExitCode::from(EXIT_CONFIG as u8);
        }
    };
    telemetry::init(config.log_json);
    let app = match build(config).await {
        Ok(app) => app,
        Err(e) => {
            tracing::error!(error = %e, "cannot start");
            eprintln!("reviewlane-publisher: {e}");
            return ExitCode::from(e.exit_code() as u8);
        }
    };
    match app.run_until_stopped(shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "stopped with an error");
            ExitCode::FAILURE
        }
    }
}
