//! The real service binaries as child processes: for the demo, and for the load
//! scenarios, which report each service's resident memory (from `/proc`).
//!
//! A `Service` is stopped with SIGTERM (then SIGKILL after 10 s) by `stop`, and killed
//! when dropped. `ProcStack` is the process twin of the in-process `stack::Stack`: two
//! provisioned nats-servers, a simulated provider per region, a webhook receiver (both
//! in this process), and the ingress, an extractor and a publisher per region as
//! processes.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use reviewlane_core::region::Region;
use reviewlane_shared::testing::NatsServer;

use crate::simprovider::SimProvider;
use crate::stack::{RegionStack, StackOptions, all_tenants_toml};
use crate::webhook::WebhookReceiver;

/// A child process stopped (SIGTERM, then SIGKILL after 10 s) by `stop`, killed on drop.
pub struct Service {
    pub name: String,
    child: Child,
    /// How it was started, to start it again after a kill.
    bin: PathBuf,
    env: Vec<(String, String)>,
    log: PathBuf,
}

impl Service {
    pub fn start(bin: &Path, label: &str, env: &[(&str, String)], log: &Path) -> anyhow::Result<Service> {
        let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        let child = spawn(bin, &env, std::fs::File::create(log)?)?;
        Ok(Service { name: label.to_string(), child, bin: bin.to_path_buf(), env, log: log.to_path_buf() })
    }

    /// `kill -9`, then the same process started again (its log continues).
    pub fn kill_and_restart(&mut self) -> anyhow::Result<()> {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let log = std::fs::OpenOptions::new().append(true).open(&self.log)?;
        self.child = spawn(&self.bin, &self.env, log)?;
        Ok(())
    }

    /// SIGTERM, then wait up to 10 s; returns the exit code (`None`: killed).
    pub fn stop(&mut self) -> Option<i32> {
        let _ = Command::new("kill").arg("-TERM").arg(self.child.id().to_string()).status();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.code();
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal by name (`STOP`, `CONT`, `KILL`, ...).
    pub fn signal(&self, name: &str) -> anyhow::Result<()> {
        let status = Command::new("kill").arg(format!("-{name}")).arg(self.child.id().to_string()).status()?;
        if !status.success() {
            bail!("kill -{name} {} failed", self.child.id());
        }
        Ok(())
    }

    /// Resident memory now and at its peak (`VmRSS`, `VmHWM`), in MiB (Linux).
    pub fn rss_mib(&self) -> Option<(f64, f64)> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        let field = |name: &str| {
            status
                .lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<f64>().ok())
                .map(|kib| kib / 1024.0)
        };
        Some((field("VmRSS:")?, field("VmHWM:")?))
    }
}

/// CPU time (user + system, every thread) a process has used so far, in seconds, from
/// `/proc/<pid>/stat` (Linux; clock ticks of 1/100 s).
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces): state is field 3, utime 14,
    // stime 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some((utime + stime) as f64 / 100.0)
}

fn spawn(bin: &Path, env: &[(String, String)], log: std::fs::File) -> anyhow::Result<Child> {
    Command::new(bin)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Where the service binaries are: next to the running binary (same profile), or one
/// level up for a test binary (`target/<profile>/deps`).
pub fn bin_dir() -> anyhow::Result<PathBuf> {
    let dir = std::env::current_exe()?.parent().context("binary dir")?.to_path_buf();
    if dir.file_name().is_some_and(|n| n == "deps") {
        return Ok(dir.parent().context("profile dir")?.to_path_buf());
    }
    Ok(dir)
}

/// Installs nats-server 2.12+ into the checkout's `.tools/` when the machine has none
/// (`scripts/install-deps.sh`; skipped when `NATS_SERVER_BIN` names one).
pub fn ensure_nats_server() -> anyhow::Result<()> {
    if std::env::var_os("NATS_SERVER_BIN").is_some() {
        return Ok(());
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new("bash")
        .arg(root.join("scripts/install-deps.sh"))
        .stderr(Stdio::inherit())
        .output()
        .context("running scripts/install-deps.sh")?;
    if !out.status.success() {
        bail!("scripts/install-deps.sh failed: no nats-server");
    }
    Ok(())
}

/// Builds the service binaries in the running binary's profile (a no-op when they are
/// up to date), so `cargo run --release -p loadtest -- <scenario>` is one command.
pub fn ensure_built() -> anyhow::Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut cmd = Command::new(cargo);
    cmd.current_dir(&root).args(["build", "--quiet", "--bins"]);
    // `cargo run` put this package's variables into our environment; build scripts that
    // watch them (ring: `CARGO_MANIFEST_DIR`) would rebuild on every run.
    for (k, _) in std::env::vars() {
        let set_by_cargo_run = k.starts_with("CARGO_PKG_")
            || matches!(
                k.as_str(),
                "CARGO_MANIFEST_DIR"
                    | "CARGO_MANIFEST_PATH"
                    | "CARGO_CRATE_NAME"
                    | "CARGO_BIN_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
            );
        if set_by_cargo_run {
            cmd.env_remove(k);
        }
    }
    // `loadtest` too: with it in the same build the shared crates get the features
    // `cargo run -p loadtest` gives them, so neither build invalidates the other's.
    for p in ["reviewlane-ingress", "reviewlane-extractor", "reviewlane-publisher", "reviewlane-shared", "loadtest"] {
        cmd.args(["-p", p]);
    }
    if !cfg!(debug_assertions) {
        cmd.arg("--release");
    }
    let status = cmd.status().context("running cargo build for the service binaries")?;
    if !status.success() {
        bail!("building the service binaries failed");
    }
    Ok(())
}

pub struct ProcStack {
    pub us: RegionStack,
    pub eu: RegionStack,
    pub webhook: WebhookReceiver,
    pub ingress: SocketAddr,
    /// Ingress, then extractor and publisher of each region.
    pub services: Vec<Service>,
    /// Each service's admin address (`/metrics`, `/healthz`, `/readyz`).
    pub admin: Vec<(String, SocketAddr)>,
    work: tempfile::TempDir,
    /// How an extractor of each region is started (all but its admin port and key), and
    /// how many have been.
    extractor_env: BTreeMap<Region, Vec<(String, String)>>,
    extractors_started: BTreeMap<Region, usize>,
    bins: PathBuf,
}

/// A free loopback port (for a child process to bind).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl ProcStack {
    pub async fn start(opts: StackOptions) -> anyhow::Result<ProcStack> {
        let bins = bin_dir()?;
        let work = tempfile::Builder::new().prefix("reviewlane-load-").tempdir()?;
        let webhook = WebhookReceiver::start().await;
        // Provisioning owns the layout, as `reviewlane-admin provision` does in a deployment.
        let mut layout = opts.layout.clone();
        if let Some(max) = opts.lane_max_messages {
            layout.lane_max_messages = max;
        }
        let us = RegionStack::single(
            NatsServer::start_laid_out(Region::Us, &layout).await,
            SimProvider::start_with(opts.us_provider.clone(), opts.canaries.clone()).await,
        );
        let eu = RegionStack::single(
            NatsServer::start_laid_out(Region::Eu, &layout).await,
            SimProvider::start_with(opts.eu_provider.clone(), opts.canaries.clone()).await,
        );
        let tenants_file = work.path().join("tenants.toml");
        std::fs::write(&tenants_file, all_tenants_toml(&webhook.url(), &opts))?;
        let tf = tenants_file.display().to_string();
        let port = free_port()?;
        let log = |name: &str| work.path().join(format!("{name}.log"));
        let mut admin = Vec::new();
        let mut admin_addr = |name: &str| -> anyhow::Result<String> {
            let addr: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
            admin.push((name.to_string(), addr));
            Ok(addr.to_string())
        };
        let mut services = vec![Service::start(
            &bins.join("reviewlane-ingress"),
            "ingress",
            &[
                ("REVIEWLANE_GRPC_ADDR", format!("127.0.0.1:{port}")),
                ("REVIEWLANE_ADMIN_ADDR", admin_addr("ingress")?),
                ("REVIEWLANE_TENANTS_FILE", tf.clone()),
                ("REVIEWLANE_NATS_URL_US", us.nats.url().into()),
                ("REVIEWLANE_NATS_URL_EU", eu.nats.url().into()),
                ("REVIEWLANE_MAX_DIFF_BYTES", opts.max_diff_bytes.to_string()),
            ],
            &log("ingress"),
        )?];
        let mut extractor_env = BTreeMap::new();
        for (region, rs) in [(Region::Us, &us), (Region::Eu, &eu)] {
            let r = region.as_str();
            let common = [
                ("REVIEWLANE_REGION", r.to_string()),
                ("REVIEWLANE_NATS_URL", rs.nats.url().into()),
                ("REVIEWLANE_TENANTS_FILE", tf.clone()),
            ];
            let mut env: Vec<(String, String)> = common.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
            let provider = if opts.anthropic {
                [
                    ("REVIEWLANE_PROVIDER", "anthropic".to_string()),
                    ("REVIEWLANE_ANTHROPIC_BASE_URL", format!("http://{}", rs.provider.addr())),
                    ("REVIEWLANE_ANTHROPIC_MODEL", "sim".into()),
                ]
            } else {
                [
                    ("REVIEWLANE_PROVIDER", "openai".to_string()),
                    ("REVIEWLANE_OPENAI_BASE_URL", rs.provider.base_url()),
                    ("REVIEWLANE_OPENAI_MODEL", "sim".into()),
                ]
            };
            env.extend(provider.map(|(k, v)| (k.to_string(), v)));
            env.extend(
                [
                    ("REVIEWLANE_PROVIDER_REGION", r.into()),
                    ("REVIEWLANE_CONCURRENCY", opts.extractor_concurrency.to_string()),
                    ("REVIEWLANE_KEY_LIMIT", opts.key_limit.to_string()),
                    ("REVIEWLANE_LEASE_SECS", opts.lease.as_secs().max(1).to_string()),
                    ("REVIEWLANE_CONTEXT_TOKENS", opts.context_tokens.unwrap_or(100_000).to_string()),
                    ("REVIEWLANE_PROVIDER_BATCH", opts.provider_batch.clone()),
                    ("REVIEWLANE_HEARTBEAT_MS", opts.heartbeat.as_millis().to_string()),
                    ("REVIEWLANE_BACKOFF_BASE_MS", "200".into()),
                    ("REVIEWLANE_BACKOFF_CAP_SECS", "2".into()),
                    ("REVIEWLANE_SHUTDOWN_GRACE_SECS", opts.shutdown_grace.as_secs().max(1).to_string()),
                ]
                .map(|(k, v): (&str, String)| (k.to_string(), v)),
            );
            if !opts.model_prices.is_empty() {
                let prices: Vec<String> = opts
                    .model_prices
                    .iter()
                    .map(|(model, p)| format!("{model}={}/{}", p.input_per_mtok, p.output_per_mtok))
                    .collect();
                env.push(("REVIEWLANE_MODEL_PRICES".into(), prices.join(",")));
            }
            if !opts.key_budgets.is_empty() {
                let budgets: Vec<String> = opts.key_budgets.iter().map(|(d, l)| format!("{}={l}", d.short())).collect();
                env.push(("REVIEWLANE_KEY_BUDGETS".into(), budgets.join(",")));
            }
            extractor_env.insert(region, env);
            let mut env = common.to_vec();
            env.push(("REVIEWLANE_DELIVERY_BACKOFF_CAP_SECS", "1".into()));
            env.push(("REVIEWLANE_PUBLISH_LEASE_SECS", opts.publish_lease.as_secs().max(2).to_string()));
            env.push(("REVIEWLANE_SINK_TIMEOUT_SECS", (opts.publish_lease.as_secs().max(2) - 1).min(10).to_string()));
            env.push(("REVIEWLANE_ADMIN_ADDR", admin_addr(&format!("publisher-{r}"))?));
            services.push(Service::start(
                &bins.join("reviewlane-publisher"),
                &format!("publisher-{r}"),
                &env,
                &log(&format!("publisher-{r}")),
            )?);
        }
        let mut stack = ProcStack {
            us,
            eu,
            webhook,
            ingress: format!("127.0.0.1:{port}").parse()?,
            services,
            admin,
            work,
            extractor_env,
            extractors_started: BTreeMap::new(),
            bins,
        };
        for region in Region::ALL {
            for _ in 0..opts.extractors {
                stack.spawn_extractor(region)?;
            }
        }
        stack.wait_serving().await?;
        Ok(stack)
    }

    /// Starts one more extractor of `region` (named `extractor-<r>`, then
    /// `extractor-<r>-<n>`; it calls the provider with key `sk-load-<n>`, so the provider
    /// can tell the replicas apart); its name.
    pub fn spawn_extractor(&mut self, region: Region) -> anyhow::Result<String> {
        self.spawn_extractor_with(region, |_| Vec::new())
    }

    /// `spawn_extractor`, its environment extended with `more(n)` for the `n`-th extractor
    /// of the region (its own deployments file, say).
    pub fn spawn_extractor_with(
        &mut self,
        region: Region,
        more: impl FnOnce(usize) -> Vec<(&'static str, String)>,
    ) -> anyhow::Result<String> {
        let r = region.as_str();
        let n = *self.extractors_started.entry(region).and_modify(|n| *n += 1).or_insert(0);
        let name = format!("extractor-{r}{}", if n == 0 { String::new() } else { format!("-{n}") });
        let admin: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
        self.admin.push((name.clone(), admin));
        let mut env: Vec<(&str, String)> =
            self.extractor_env[&region].iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        env.push(("REVIEWLANE_ADMIN_ADDR", admin.to_string()));
        env.push(("REVIEWLANE_OPENAI_API_KEY", format!("sk-load-{n}")));
        env.extend(more(n));
        let log = self.work.path().join(format!("extractor-{r}-{n}.log"));
        self.services.push(Service::start(&self.bins.join("reviewlane-extractor"), &name, &env, &log)?);
        Ok(name)
    }

    /// Waits until the extractor `name` is ready (warmed up), at most 30 s.
    pub async fn wait_ready(&self, name: &str) -> anyhow::Result<()> {
        let addr = self.admin_of(name).context("no such service")?;
        let ready = crate::stack::poll_until(Duration::from_secs(30), || async move {
            crate::stack::http_status_ok(addr, "/readyz").await.then_some(())
        });
        ready.await.with_context(|| format!("{name} not ready in 30 s"))
    }

    /// Waits until the ingress answers gRPC (health) and the extractors' consumers exist.
    async fn wait_serving(&self) -> anyhow::Result<()> {
        let serving = crate::stack::poll_until(Duration::from_secs(30), || async {
            let up = async {
                let ch = tonic::transport::Channel::from_shared(format!("http://{}", self.ingress))?.connect().await?;
                let mut health = tonic_health::pb::health_client::HealthClient::new(ch);
                health.check(tonic_health::pb::HealthCheckRequest { service: String::new() }).await?;
                anyhow::Ok(())
            };
            (up.await.is_ok() && self.extractors_ready().await).then_some(())
        });
        serving
            .await
            .with_context(|| format!("services did not come up in 30 s; logs in {}", self.work.path().display()))
    }

    async fn extractors_ready(&self) -> bool {
        for (region, rs) in [(Region::Us, &self.us), (Region::Eu, &self.eu)] {
            // None started yet (`extractors: 0`): the caller starts its own.
            if !self.extractors_started.contains_key(&region) {
                continue;
            }
            let Ok(client) = async_nats::connect(rs.nats.url()).await else { return false };
            let js = async_nats::jetstream::new(client);
            let lane = reviewlane_shared::layout::lane_stream(region, reviewlane_shared::Lane::Interactive);
            let Ok(mut stream) = js.get_stream(lane).await else { return false };
            match stream.info().await {
                Ok(info) if info.state.consumer_count > 0 => {}
                _ => return false,
            }
        }
        // Each extractor is ready once it has warmed up (the others have seen it).
        for (name, addr) in &self.admin {
            if name.starts_with("extractor") && !crate::stack::http_status_ok(*addr, "/readyz").await {
                return false;
            }
        }
        true
    }

    /// The service named `name` (`ingress`, `extractor-us`, `extractor-us-1`, ...).
    pub fn service(&self, name: &str) -> Option<&Service> {
        self.services.iter().find(|s| s.name == name)
    }

    pub fn service_mut(&mut self, name: &str) -> Option<&mut Service> {
        self.services.iter_mut().find(|s| s.name == name)
    }

    /// Where the services' logs are.
    pub fn log_dir(&self) -> &Path {
        self.work.path()
    }

    /// Leaves the logs (and the tenants file) in place after the stack is gone.
    pub fn keep_logs(&mut self) {
        self.work.disable_cleanup(true);
    }

    /// Its admin address.
    pub fn admin_of(&self, name: &str) -> Option<SocketAddr> {
        self.admin.iter().find(|(n, _)| n == name).map(|(_, a)| *a)
    }

    /// CPU seconds each service and each region's nats-server has used so far.
    pub fn cpu(&self) -> Vec<(String, f64)> {
        let mut out: Vec<(String, f64)> =
            self.services.iter().filter_map(|s| Some((s.name.clone(), cpu_seconds(s.child.id())?))).collect();
        for (name, region) in [("nats-us", &self.us), ("nats-eu", &self.eu)] {
            if let Some(secs) = cpu_seconds(region.nats.pid()) {
                out.push((name.to_string(), secs));
            }
        }
        // This process: the client, the simulated providers and the webhook receiver.
        if let Some(secs) = cpu_seconds(std::process::id()) {
            out.push(("loadtest".to_string(), secs));
        }
        out
    }

    /// Resident memory of each service: (name, now MiB, peak MiB).
    pub fn rss(&self) -> Vec<(String, f64, f64)> {
        self.services.iter().filter_map(|s| s.rss_mib().map(|(now, peak)| (s.name.clone(), now, peak))).collect()
    }

    /// SIGTERM to every service (publishers and extractors first); their exit codes.
    pub fn shutdown(mut self) -> BTreeMap<String, Option<i32>> {
        let mut codes = BTreeMap::new();
        for s in self.services.iter_mut().rev() {
            codes.insert(s.name.clone(), s.stop());
        }
        codes
    }
}
