//! `reviewlane-admin provision --region <us|eu> --nats-url <url>`: records the region
//! identity on a NATS server (once, deliberately), then reconciles its streams and
//! buckets with the layout config (`REVIEWLANE_STREAM_REPLICAS`, the `*_MAX_AGE_SECS`
//! retentions and the limits in `docs/retention.md`): creates what is missing, updates
//! what NATS can change in place, and reports the rest.
//!
//! Credentials and TLS: `REVIEWLANE_NATS_*` as for the services.
//!
//! `--check-config` checks the arguments and variables and stops (0, or 64) without
//! connecting. `reviewlane-admin probe <host:port> [path]` is the containers' health
//! check (exit 0 when the admin port answers 200).
//!
//! Exit codes: 0 provisioned and in line with the config; 64 bad arguments or config;
//! 77 the server refused the credentials; 78 the server carries another region's
//! identity; 65 a stream or bucket differs from
//! the config in a way that could not be corrected (each difference is printed); 1 the
//! server could not be reached.

use std::process::ExitCode;

use reviewlane_core::config::{EXIT_CONFIG, EXIT_DRIFT, EXIT_NATS_AUTH, EXIT_WIRING, ProcessEnv, Reader};
use reviewlane_shared::Region;
use reviewlane_shared::layout::{self, LayoutConfig};
use reviewlane_shared::nats_client::{NatsClientConfig, redact};

const USAGE: &str = "usage: reviewlane-admin provision --region <us|eu> --nats-url <nats://host:port> [--check-config]
       reviewlane-admin probe <host:port> [path]   (exit 0 when GET path answers 200; default /readyz)";

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mut region, mut url) = (None, None);
    let mut it = args.iter();
    match it.next().map(String::as_str) {
        Some("provision") => {}
        Some("probe") => return probe(it.next(), it.next()).await,
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(EXIT_CONFIG as u8);
        }
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
    let mut reader = Reader::new(&ProcessEnv);
    let cfg = LayoutConfig::from_reader(&mut reader);
    let nats = NatsClientConfig::from_reader(&mut reader, &["REVIEWLANE_NATS"]);
    if let Err(e) = reader.finish() {
        eprintln!("reviewlane-admin: {e}");
        return ExitCode::from(EXIT_CONFIG as u8);
    }
    if args.iter().any(|a| a == "--check-config") {
        println!("reviewlane-admin: configuration is valid");
        return ExitCode::SUCCESS;
    }
    let options = match nats.options("reviewlane-admin").await {
        Ok(o) => o,
        Err(e) => {
            eprintln!("reviewlane-admin: NATS credentials: {e}");
            return ExitCode::from(EXIT_CONFIG as u8);
        }
    };
    let addrs = match reviewlane_shared::nats_client::server_addrs(&url) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("reviewlane-admin: the NATS URL does not parse: {e}");
            return ExitCode::from(EXIT_CONFIG as u8);
        }
    };
    let client = match options.connect(addrs).await {
        Ok(c) => c,
        Err(e) if e.kind() == async_nats::ConnectErrorKind::AuthorizationViolation => {
            eprintln!("reviewlane-admin: the NATS server at {} refused the credentials: {e}", redact(&url));
            return ExitCode::from(EXIT_NATS_AUTH as u8);
        }
        Err(e) => {
            eprintln!("reviewlane-admin: cannot connect to the NATS server at {}: {e}", redact(&url));
            return ExitCode::FAILURE;
        }
    };
    let js = async_nats::jetstream::new(client.clone());
    if let Err(e) = layout::provision_identity(&js, region, &redact(&url)).await {
        eprintln!("reviewlane-admin: {e}");
        return ExitCode::from(EXIT_WIRING as u8);
    }
    let report = match layout::reconcile(&js, region, &cfg).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("reviewlane-admin: cannot create or check streams and buckets: {e}");
            return ExitCode::FAILURE;
        }
    };
    let _ = client.drain().await;
    for name in &report.created {
        println!("created {name}");
    }
    for d in &report.drift {
        match &d.unfixed {
            None => println!("updated {} {}: {} -> {}", d.stream, d.field, d.have, d.want),
            Some(why) => eprintln!("drift {} {}: is {}, config wants {}; {why}", d.stream, d.field, d.have, d.want),
        }
    }
    if report.unfixed().next().is_some() {
        eprintln!("reviewlane-admin: region `{region}` provisioned with drift left (above)");
        return ExitCode::from(EXIT_DRIFT as u8);
    }
    println!("provisioned region `{region}`; every stream and bucket matches the config");
    ExitCode::SUCCESS
}

/// A container health check without curl in the image: `GET path` on `addr` (an admin
/// port), exit 0 on 200, 1 otherwise, within 3 s.
async fn probe(addr: Option<&String>, path: Option<&String>) -> ExitCode {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Some(addr) = addr else {
        eprintln!("{USAGE}");
        return ExitCode::from(EXIT_CONFIG as u8);
    };
    let path = path.map(String::as_str).unwrap_or("/readyz");
    let check = async {
        let mut s = tokio::net::TcpStream::connect(addr.as_str()).await.ok()?;
        let req = format!("GET {path} HTTP/1.1\r\nhost: probe\r\nconnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut head = [0u8; 12];
        s.read_exact(&mut head).await.ok()?;
        Some(head.starts_with(b"HTTP/1.1 200"))
    };
    match tokio::time::timeout(std::time::Duration::from_secs(3), check).await {
        Ok(Some(true)) => ExitCode::SUCCESS,
        _ => ExitCode::FAILURE,
    }
}
