//! Test support: a real `nats-server` with JetStream on a free loopback port and a
//! temporary store, stopped (kill + wait) and removed when the handle drops.
//!
//! The binary comes from `NATS_SERVER_BIN`, else the project's `.tools/` (see
//! `scripts/install-deps.sh`), else `PATH`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use reviewlane_core::region::Region;

pub struct NatsServer {
    child: Child,
    url: String,
    store: tempfile::TempDir,
    /// Configuration added to the defaults (auth, TLS, cluster).
    extra: String,
}

pub fn nats_server_bin() -> PathBuf {
    if let Ok(p) = std::env::var("NATS_SERVER_BIN") {
        return PathBuf::from(p);
    }
    let local = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.tools/usr/sbin/nats-server");
    if local.exists() {
        return local;
    }
    PathBuf::from("nats-server")
}

impl NatsServer {
    /// Starts a server; panics (it is a test helper) if it does not come up in 10 s.
    pub fn start() -> NatsServer {
        NatsServer::start_with("")
    }

    /// Starts a server with `extra` added to its configuration file (an
    /// `authorization { … }` or `tls { … }` block, say).
    pub fn start_with(extra: &str) -> NatsServer {
        let store = tempfile::tempdir().expect("temp dir");
        let (child, url) = launch(store.path(), "-1", extra);
        NatsServer { child, url, store, extra: extra.to_string() }
    }

    /// Kills the server (SIGKILL) and starts it again on the same port with the same
    /// store, as a crashed server comes back; clients reconnect by themselves.
    pub fn restart(&mut self) {
        self.kill();
        let port = self.url.rsplit(':').next().expect("url has a port").to_string();
        let (child, url) = launch(self.store.path(), &port, &self.extra);
        self.child = child;
        self.url = url;
    }
}

fn launch(dir: &Path, port: &str, extra: &str) -> (Child, String) {
    let conf = dir.join("nats.conf");
    // max_payload: a 1 MiB diff plus its JSON envelope exceeds the 1 MiB default.
    // max_file_store: the streams' byte limits are reserved up front against it, and
    // its default (75 % of the disk's free space) would make the tests depend on how
    // full the disk is; tests write little.
    std::fs::write(
        &conf,
        format!(
            "listen: 127.0.0.1:{port}\nmax_payload: 8MB\nports_file_dir: \"{dir}\"\njetstream {{ store_dir: \"{dir}/js\", max_file_store: 1TB }}\n{extra}\n",
            dir = dir.display()
        ),
    )
    .expect("write nats.conf");
    // The Go runtime's settings (`GOGC`, `GOMEMLIMIT`) come from the environment, as the
    // comparisons in docs/operations.md ("NATS memory") set them.
    let mut child = Command::new(nats_server_bin())
        .arg("-c")
        .arg(&conf)
        .stdout(Stdio::null())
        .stderr(if std::env::var_os("TEST_LOG").is_some() { Stdio::inherit() } else { Stdio::null() })
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot start nats-server ({}): {e}; run scripts/install-deps.sh", nats_server_bin().display())
        });
    let deadline = Instant::now() + Duration::from_secs(10);
    let url = loop {
        if let Some(url) = reported_url(dir, child.id()) {
            break url;
        }
        if Instant::now() >= deadline {
            // Not left running behind the panic.
            let _ = child.kill();
            let _ = child.wait();
            panic!("nats-server did not report its port in 10 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (child, url)
}

/// The client URL a server wrote to `<dir>/<its program's name>_<pid>.ports`.
fn reported_url(dir: &Path, pid: u32) -> Option<String> {
    let suffix = format!("_{pid}.ports");
    let ports = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.ends_with(&suffix)))?;
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(ports).ok()?).ok()?;
    v["nats"][0].as_str().map(str::to_string)
}

impl NatsServer {
    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn store_dir(&self) -> &Path {
        self.store.path()
    }

    /// Starts a server provisioned for `region` as `reviewlane-admin provision` does
    /// it: the region identity, then every stream and bucket with the default layout.
    pub async fn start_provisioned(region: Region) -> NatsServer {
        NatsServer::start_laid_out(region, &crate::layout::LayoutConfig::default()).await
    }

    /// Starts a server provisioned for `region` with the given layout.
    pub async fn start_laid_out(region: Region, layout: &crate::layout::LayoutConfig) -> NatsServer {
        let s = NatsServer::start();
        provision(s.url(), region, layout).await;
        s
    }

    /// Starts a server that carries `region`'s identity and nothing else: provisioning
    /// stopped half way.
    pub async fn start_with_identity(region: Region) -> NatsServer {
        let s = NatsServer::start();
        let client = async_nats::connect(s.url()).await.expect("connect to test nats-server");
        let js = async_nats::jetstream::new(client);
        crate::layout::provision_identity(&js, region, s.url()).await.expect("provision the identity");
        s
    }

    /// Kills the server at once (SIGKILL), keeping the store.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Provisions `url` for `region` as `reviewlane-admin provision` does: the identity,
/// then every stream and bucket of `layout` (the services only open them).
pub async fn provision(url: &str, region: Region, layout: &crate::layout::LayoutConfig) {
    let addrs = crate::nats_client::server_addrs(url).expect("test NATS URLs");
    let client = async_nats::connect(addrs).await.expect("connect to test nats-server");
    let js = async_nats::jetstream::new(client);
    crate::layout::provision_identity(&js, region, url).await.expect("provision the identity");
    crate::layout::ensure(&js, region, layout).await.expect("provision the layout");
}

/// Three nats-servers on loopback forming one JetStream cluster (`server_name` n0..n2,
/// routes between them), each with its own store; stopped when dropped.
pub struct NatsCluster {
    pub nodes: Vec<NatsServer>,
}

impl NatsCluster {
    /// Starts three nodes and waits (at most 30 s) until JetStream answers on the
    /// cluster, i.e. a meta leader is elected.
    pub async fn start() -> NatsCluster {
        let route_ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let routes =
            route_ports.iter().map(|p| format!("\"nats-route://127.0.0.1:{p}\"")).collect::<Vec<_>>().join(", ");
        let nodes = (0..3)
            .map(|i| {
                NatsServer::start_with(&format!(
                    "server_name: n{i}\ncluster {{ name: reviewlane, listen: 127.0.0.1:{}, routes: [{routes}] }}",
                    route_ports[i]
                ))
            })
            .collect();
        let cluster = NatsCluster { nodes };
        let addrs = crate::nats_client::server_addrs(&cluster.url()).expect("cluster URLs");
        let client = async_nats::connect(addrs).await.expect("connect to the cluster");
        let js = async_nats::jetstream::new(client);
        // Bounded generously: on two busy cores (the suite runs tests in parallel) the
        // cluster once took over 30 s to place its first stream.
        let deadline = Instant::now() + Duration::from_secs(60);
        while js.query_account().await.is_err() {
            assert!(Instant::now() < deadline, "the JetStream cluster elected no meta leader in 60 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // A meta leader may not know its peers yet ("no suitable peers for placement"):
        // ready once a stream on all three nodes can be placed.
        let probe = async_nats::jetstream::stream::Config {
            name: "READY_PROBE".into(),
            subjects: vec!["ready.probe".into()],
            num_replicas: 3,
            storage: async_nats::jetstream::stream::StorageType::Memory,
            ..Default::default()
        };
        loop {
            match js.create_stream(probe.clone()).await {
                Ok(_) => {
                    js.delete_stream("READY_PROBE").await.expect("delete the readiness probe");
                    break;
                }
                Err(e) => {
                    assert!(Instant::now() < deadline, "no stream on three nodes could be placed in 60 s: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        cluster
    }

    /// Every node's URL, comma-separated, as services take a cluster.
    pub fn url(&self) -> String {
        self.nodes.iter().map(|n| n.url()).collect::<Vec<_>>().join(",")
    }
}

/// A port free on 127.0.0.1 right now (for a route port, which must be known before
/// the servers that name it start).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// Everything the process's telemetry emitted: JSON log lines and finished spans. One
/// per test process (the subscriber is global); tests filter by job id.
pub struct Captured {
    logs: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    pub spans: opentelemetry_sdk::trace::InMemorySpanExporter,
}

impl Captured {
    /// The JSON log lines written so far.
    pub fn log_text(&self) -> String {
        String::from_utf8_lossy(&self.logs.lock().expect("log buffer")).into_owned()
    }
}

#[derive(Clone)]
struct CaptureWriter(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for CaptureWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log buffer").extend_from_slice(b);
        if std::env::var_os("TEST_LOG").is_some() {
            let _ = std::io::stderr().write_all(b);
        }
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Installs (once) the services' subscriber with JSON logs into memory at debug level
/// and spans into an in-memory exporter. Mirrored to stderr when `TEST_LOG` is set.
pub fn capture() -> &'static Captured {
    static CAPTURED: std::sync::OnceLock<Captured> = std::sync::OnceLock::new();
    CAPTURED.get_or_init(|| {
        let spans = opentelemetry_sdk::trace::InMemorySpanExporter::default();
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().with_simple_exporter(spans.clone()).build();
        let logs = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let writer = CaptureWriter(logs.clone());
        let filter = tracing_subscriber::EnvFilter::new(
            "info,reviewlane_shared=debug,reviewlane_ingress=debug,reviewlane_extractor=debug,reviewlane_publisher=debug",
        );
        let sub = crate::telemetry::subscriber(filter, crate::telemetry::LogFormat::Json, move || writer.clone(), &provider);
        let _ = tracing::subscriber::set_global_default(sub);
        // The provider lives as long as the process: spans end into `spans`.
        std::mem::forget(provider);
        Captured { logs, spans }
    })
}

#[cfg(test)]
mod tests {
    use super::reported_url;

    /// A server names its ports file after its program, which need not be called
    /// `nats-server`: it is found by its process id alone.
    #[test]
    fn a_server_is_found_by_its_pid_whatever_its_program_is_called() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("nats-2.10.27_41.ports"), r#"{"nats":["nats://127.0.0.1:5000"]}"#).unwrap();
        std::fs::write(dir.path().join("nats-server_7.ports"), r#"{"nats":["nats://127.0.0.1:6000"]}"#).unwrap();
        assert_eq!(reported_url(dir.path(), 41).as_deref(), Some("nats://127.0.0.1:5000"));
        assert_eq!(reported_url(dir.path(), 7).as_deref(), Some("nats://127.0.0.1:6000"));
        assert_eq!(reported_url(dir.path(), 1), None, "pid 1 is not pid 41");
        std::fs::write(dir.path().join("nats-server_8.ports"), "{").unwrap();
        assert_eq!(reported_url(dir.path(), 8), None, "a file still being written");
    }
}
