//! The simulated provider as a service (the compose stack runs one per region): an
//! OpenAI-compatible chat-completions endpoint answering with one finding per changed
//! file, no key, no network. `GET /stats` shows what it was asked.
//!
//! | variable | default | meaning |
//! | --- | --- | --- |
//! | `REVIEWLANE_SIM_ADDR` | `127.0.0.1:8080` | listen address |
//! | `REVIEWLANE_SIM_LATENCY_MS` | `200` | time to answer each call |
//!
//! `--check-config` checks the variables and exits 0, or 64 naming what is wrong.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use loadtest::simprovider::{SimConfig, SimProvider};
use reviewlane_core::config::{EXIT_CONFIG, ProcessEnv, Reader};

#[tokio::main]
async fn main() -> ExitCode {
    let mut r = Reader::new(&ProcessEnv);
    let addr: SocketAddr = r.or("REVIEWLANE_SIM_ADDR", SocketAddr::from(([127, 0, 0, 1], 8080)), "host:port");
    let latency_ms: u64 = r.or("REVIEWLANE_SIM_LATENCY_MS", 200, "milliseconds");
    if let Err(e) = r.finish() {
        eprintln!("reviewlane-sim: {e}");
        return ExitCode::from(EXIT_CONFIG as u8);
    }
    if std::env::args().any(|a| a == "--check-config") {
        println!("reviewlane-sim: configuration is valid");
        return ExitCode::SUCCESS;
    }
    let config = SimConfig { latency: Duration::from_millis(latency_ms), ..Default::default() };
    let sim = match SimProvider::start_on(addr, config, Vec::new()).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("reviewlane-sim: cannot listen on {addr}: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("reviewlane-sim: serving {}", sim.base_url());
    reviewlane_shared::startup::shutdown_signal().await;
    ExitCode::SUCCESS
}
