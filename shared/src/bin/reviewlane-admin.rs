//! `reviewlane-admin provision --region <us|eu> --nats-url <url>`: records the region
//! identity on a NATS server (once, deliberately) and creates its streams and buckets.
//! Refuses a server that already carries another region's identity.

use std::process::ExitCode;

use reviewlane_shared::Region;
use reviewlane_shared::config::{EXIT_CONFIG, EXIT_WIRING};
use reviewlane_shared::layout::{self, LayoutConfig};

const USAGE: &str = "usage: reviewlane-admin provision --region <us|eu> --nats-url <nats://host:port>";

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mut region, mut url) = (None, None);
    let mut it = args.iter();
    if it.next().map(String::as_str) != Some("provision") {
        eprintln!("{USAGE}");
        return ExitCode::from(EXIT_CONFIG as u8);
    }
    while let Some(a) = it.next() {
        match a.as_str() {
            "--region" => region = it.next().and_then(|r| r.parse::<Region>().ok()),
            "--nats-url" => url = it.next().cloned(),
            _ => {}
        }
    }
    let (Some(region), Some(url)) = (region, url) else {
        eprintln!("{USAGE}");
        return ExitCode::from(EXIT_CONFIG as u8);
    };
    let client = match async_nats::connect(&url).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("reviewlane-admin: cannot connect to {url}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let js = async_nats::jetstream::new(client.clone());
    if let Err(e) = layout::provision_identity(&js, region, &url).await {
        eprintln!("reviewlane-admin: {e}");
        return ExitCode::from(EXIT_WIRING as u8);
    }
    if let Err(e) = layout::ensure(&js, region, &LayoutConfig::default()).await {
        eprintln!("reviewlane-admin: cannot create streams and buckets: {e}");
        return ExitCode::FAILURE;
    }
    let _ = client.drain().await;
    println!("provisioned {url} as region `{region}`");
    ExitCode::SUCCESS
}
