//! The main job end to end on this machine: two regional nats-servers, each
//! provisioned with its identity, the ingress, an extractor and a publisher per region
//! (the real binaries, built-in analyzer), the sample diffs submitted by one US and one
//! EU tenant over gRPC, the findings printed as a table, the US review again through
//! `reviewctl` as SARIF, the ingress's sources swept through `reviewctl sweep`, then
//! everything stopped with SIGTERM (and killed if it does not stop).
//!
//! Run through `scripts/demo.sh`, which installs nats-server and builds the binaries.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use loadtest::procs::{Service, free_port};
use reviewlane_api::proto::review_service_client::ReviewServiceClient;
use reviewlane_api::proto::{self, SubmitReviewRequest, WatchReviewRequest};
use reviewlane_core::tenants::hash_api_key;
use reviewlane_shared::testing::NatsServer;

struct Submission {
    tenant: &'static str,
    region: &'static str,
    key: String,
    diff_file: &'static str,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let bin_dir: PathBuf = loadtest::procs::bin_dir()?;
    // Kept on failure (logs); removed after a clean run.
    let work = tempfile::Builder::new().prefix("reviewlane-demo-").tempdir()?.keep();
    println!("reviewlane demo — working directory {}", work.as_path().display());

    let us = NatsServer::start();
    let eu = NatsServer::start();
    for (region, server) in [("us", &us), ("eu", &eu)] {
        let out = Command::new(bin_dir.join("reviewlane-admin"))
            .args(["provision", "--region", region, "--nats-url", server.url()])
            .output()
            .context("running reviewlane-admin")?;
        if !out.status.success() {
            bail!("provisioning {region} failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        println!("  nats-server {region}: {} (identity `{region}`)", server.url());
    }

    let submissions = [
        Submission { tenant: "acme", region: "us", key: hex_key(), diff_file: "samples/us-payments.diff" },
        Submission { tenant: "euro", region: "eu", key: hex_key(), diff_file: "samples/eu-analytics.diff" },
    ];
    let mut tenants = String::new();
    for s in &submissions {
        tenants.push_str(&format!(
            "[[tenants]]\nid = \"{}\"\nregion = \"{}\"\napi_key_sha256 = [\"{}\"]\nsink = {{ kind = \"file\", dir = \"{}\" }}\n\n",
            s.tenant,
            s.region,
            hash_api_key(&s.key),
            work.as_path().join(format!("{}-findings", s.tenant)).display()
        ));
    }
    let tenants_file = work.as_path().join("tenants.toml");
    std::fs::write(&tenants_file, tenants)?;

    let port = free_port()?;
    let tf = tenants_file.display().to_string();
    let mut services = vec![Service::start(
        &bin_dir.join("reviewlane-ingress"),
        "ingress",
        &[
            ("REVIEWLANE_GRPC_ADDR", format!("127.0.0.1:{port}")),
            ("REVIEWLANE_ADMIN_ADDR", "127.0.0.1:0".to_string()),
            ("REVIEWLANE_TENANTS_FILE", tf.clone()),
            ("REVIEWLANE_NATS_URL_US", us.url().to_string()),
            ("REVIEWLANE_NATS_URL_EU", eu.url().to_string()),
        ],
        &work.as_path().join("ingress.log"),
    )?];
    for (region, server) in [("us", &us), ("eu", &eu)] {
        let env = [
            // Admin ports on port 0: the demo does not read them.
            ("REVIEWLANE_ADMIN_ADDR", "127.0.0.1:0".to_string()),
            ("REVIEWLANE_REGION", region.to_string()),
            ("REVIEWLANE_NATS_URL", server.url().to_string()),
            ("REVIEWLANE_TENANTS_FILE", tf.clone()),
            ("REVIEWLANE_PROVIDER", "builtin".to_string()),
        ];
        services.push(Service::start(
            &bin_dir.join("reviewlane-extractor"),
            &format!("extractor-{region}"),
            &env,
            &work.as_path().join(format!("extractor-{region}.log")),
        )?);
        services.push(Service::start(
            &bin_dir.join("reviewlane-publisher"),
            &format!("publisher-{region}"),
            &env,
            &work.as_path().join(format!("publisher-{region}.log")),
        )?);
    }
    println!(
        "  services: ingress 127.0.0.1:{port}, extractor-us, extractor-eu, publisher-us, publisher-eu (built-in analyzer)"
    );

    let channel = connect_when_ready(port).await?;
    let mut client = ReviewServiceClient::new(channel);
    let mut rows = Vec::new();
    for s in &submissions {
        let diff =
            std::fs::read_to_string(root.join(s.diff_file)).with_context(|| format!("reading {}", s.diff_file))?;
        let started = Instant::now();
        let mut req = tonic::Request::new(SubmitReviewRequest {
            idempotency_key: format!("demo-{}", s.diff_file),
            lane: proto::Lane::Interactive as i32,
            diff,
            schema_version: "findings.v1".into(),
            metadata: Some(proto::ReviewMetadata { repository: format!("{}/sample", s.tenant), ..Default::default() }),
            ..Default::default()
        });
        req.metadata_mut().insert("authorization", format!("Bearer {}", s.key).parse()?);
        let job = client.submit_review(req).await?.into_inner().review.context("review")?;
        println!("  submitted {} as tenant `{}` -> job {} ({})", s.diff_file, s.tenant, job.job_id, job.region);
        let mut req = tonic::Request::new(WatchReviewRequest { job_id: job.job_id.clone() });
        req.metadata_mut().insert("authorization", format!("Bearer {}", s.key).parse()?);
        let mut stream = client.watch_review(req).await?.into_inner();
        let mut last = None;
        let watch = async {
            while let Some(m) = stream.message().await? {
                last = m.review;
            }
            anyhow::Ok(())
        };
        tokio::time::timeout(Duration::from_secs(30), watch).await.context("job did not finish in 30 s")??;
        let review = last.context("no state")?;
        let state = proto::JobState::try_from(review.state).map(|s| s.as_str_name()).unwrap_or("?");
        println!(
            "    -> {state} in {} ms: {} findings, {} quarantined",
            started.elapsed().as_millis(),
            review.findings.len(),
            review.quarantined_count
        );
        rows.push((s.region, s.tenant, review));
    }

    println!();
    println!("{:<3} {:<6} {:<9} {:<16} {:<45} FINDING", "REG", "TENANT", "SEVERITY", "CATEGORY", "LOCATION");
    println!("{}", "-".repeat(120));
    for (region, tenant, review) in &rows {
        for f in &review.findings {
            println!(
                "{:<3} {:<6} {:<9} {:<16} {:<45} {}",
                region,
                tenant,
                f.severity,
                f.category,
                format!("{}:{}", f.path, f.line),
                f.title
            );
        }
    }
    println!();
    for s in &submissions {
        let path = work.as_path().join(format!("{}-findings", s.tenant));
        let files = std::fs::read_dir(&path).map(|d| d.count()).unwrap_or(0);
        println!("  file sink of `{}`: {} delivery file(s) in {}", s.tenant, files, path.display());
    }

    // The same US review through the command line, as a CI job would run it, written as
    // SARIF for code scanning.
    let sarif = work.as_path().join("acme-review.sarif");
    let out = Command::new(bin_dir.join("reviewctl"))
        .args(["submit", "samples/us-payments.diff", "--repository", "acme/sample", "--wait"])
        .args(["--fail-on", "critical", "--format", "sarif"])
        .current_dir(&root)
        .env("REVIEWLANE_ENDPOINT", format!("http://127.0.0.1:{port}"))
        .env("REVIEWLANE_API_KEY", &submissions[0].key)
        .env_remove("REVIEWLANE_API_KEY_FILE")
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("running reviewctl")?;
    std::fs::write(&sarif, &out.stdout)?;
    let log: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    let results = log["runs"][0]["results"].as_array().map_or(0, Vec::len);
    println!(
        "  reviewctl submit samples/us-payments.diff --wait --fail-on critical --format sarif: exit {}, {results} SARIF results in {}",
        out.status.code().map_or("killed".into(), |c| c.to_string()),
        sarif.display()
    );
    let cli_ok = matches!(out.status.code(), Some(0 | 1)) && results > 0;
    let swept_ok = sweep(&bin_dir, &root, port, &submissions[0].key, work.as_path())?;

    println!();
    let mut clean = true;
    for s in services.iter_mut().rev() {
        let code = s.stop();
        clean &= code == Some(0);
        println!("  stopped {} (exit {})", s.name, code.map(|c| c.to_string()).unwrap_or_else(|| "killed".into()));
    }
    drop(us);
    drop(eu);
    println!("  stopped both nats-servers");
    let published = rows.iter().all(|(_, _, r)| r.state == proto::JobState::Published as i32);
    if !published || !clean || !cli_ok || !swept_ok {
        bail!("demo did not complete cleanly (logs in {})", work.display());
    }
    if std::env::args().any(|a| a == "--keep") {
        println!("  kept {}", work.display());
    } else {
        let _ = std::fs::remove_dir_all(&work);
    }
    Ok(())
}

/// The ingress's own sources at this checkout's `HEAD`, reviewed as one sweep through
/// `reviewctl` (through the lanes here: the built-in analyzer has no batch API), then its
/// progress and reconciliation as `reviewctl sweeps get` and `sweeps items` show them.
/// Skipped outside a git checkout.
fn sweep(bin_dir: &Path, root: &Path, port: u16, key: &str, work: &Path) -> anyhow::Result<bool> {
    let reviewctl = |args: &[&str]| {
        Command::new(bin_dir.join("reviewctl"))
            .args(args)
            .current_dir(root)
            .env("REVIEWLANE_ENDPOINT", format!("http://127.0.0.1:{port}"))
            .env("REVIEWLANE_API_KEY", key)
            .env_remove("REVIEWLANE_API_KEY_FILE")
            .output()
            .context("running reviewctl")
    };
    let in_git = Command::new("git").args(["rev-parse", "HEAD"]).current_dir(root).output();
    if !in_git.is_ok_and(|o| o.status.success()) {
        println!("  not a git checkout: the sweep is skipped");
        return Ok(true);
    }
    println!();
    let args =
        ["sweep", "--git", "HEAD", "--paths", "services/ingress/src/service/*.rs", "--repository", "acme/sample"];
    let out = reviewctl(&[&args[..], &["--wait", "--format", "sarif"]].concat())?;
    let sarif = work.join("acme-sweep.sarif");
    std::fs::write(&sarif, &out.stdout)?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    let log: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    let results = log["runs"][0]["results"].as_array().map_or(0, Vec::len);
    println!(
        "  reviewctl {} --wait --format sarif: exit {}, {results} SARIF results in {}",
        args.join(" "),
        out.status.code().map_or("killed".into(), |c| c.to_string()),
        sarif.display()
    );
    for line in stderr.lines() {
        println!("    {line}");
    }
    let Some(id) = stderr.lines().find_map(|l| l.split_once(':').map(|(id, _)| id.trim().to_string())) else {
        return Ok(false);
    };
    for args in [["sweeps", "get", id.as_str()], ["sweeps", "items", id.as_str()]] {
        let out = reviewctl(&args)?;
        println!("  reviewctl {}:", args.join(" "));
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            println!("    {line}");
        }
    }
    Ok(matches!(out.status.code(), Some(0 | 1)))
}

fn hex_key() -> String {
    format!("rl_{}", (0..4).map(|_| format!("{:016x}", rand::random::<u64>())).collect::<String>())
}

async fn connect_when_ready(port: u16) -> anyhow::Result<tonic::transport::Channel> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(ch) = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))?.connect().await {
            let mut health = tonic_health::pb::health_client::HealthClient::new(ch.clone());
            let req = tonic_health::pb::HealthCheckRequest { service: "reviewlane.v1.ReviewService".into() };
            if health.check(req).await.is_ok_and(|r| r.into_inner().status == 1) {
                return Ok(ch);
            }
        }
        if Instant::now() > deadline {
            bail!("ingress not serving within 20 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
