//! Services log in to a NATS that requires credentials: user and password, token, NKey,
//! mutual TLS — each against a real nats-server configured for it, with the credentials
//! read from files as Kubernetes mounts them. A refused login is a clear start-up error
//! (exit 77) that shows neither the password nor a URL's credentials.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use reviewlane_core::config::Reader;
use reviewlane_shared::Region;
use reviewlane_shared::nats_client::NatsClientConfig;
use reviewlane_shared::startup::StartError;
use reviewlane_shared::testing::NatsServer;

/// The `REVIEWLANE_NATS_*` variables as a service reads them.
fn client_config(env: &[(&str, String)]) -> NatsClientConfig {
    let env: HashMap<String, String> = env.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
    let mut r = Reader::new(&env);
    let c = NatsClientConfig::from_reader(&mut r, &["REVIEWLANE_NATS"]);
    r.finish().expect("valid config");
    c
}

/// Provisions the server (identity and layout) through an authorised connection.
async fn provision(url: &str, options: async_nats::ConnectOptions) {
    let client = options.connect(url).await.expect("authorised connection");
    let js = async_nats::jetstream::new(client);
    reviewlane_shared::layout::provision_identity(&js, Region::Us, url).await.unwrap();
    reviewlane_shared::layout::ensure(&js, Region::Us, &Default::default()).await.unwrap();
}

/// Builds a publisher (it connects, checks the identity and opens the layout).
async fn start_publisher(url: &str, nats: NatsClientConfig) -> Result<(), StartError> {
    let mut pc = reviewlane_publisher::PublisherConfig::new(Region::Us, url, Arc::default());
    pc.admin_addr = "127.0.0.1:0".parse().unwrap();
    pc.nats = nats;
    reviewlane_publisher::build(pc).await.map(|_| ())
}

fn write(dir: &Path, name: &str, content: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, content).unwrap();
    p.display().to_string()
}

fn assert_refused(res: Result<(), StartError>, secrets: &[&str]) {
    let err = res.expect_err("the login is refused");
    assert!(matches!(err, StartError::Auth { .. }), "{err}");
    assert_eq!(err.exit_code(), 77);
    let msg = err.to_string();
    for s in secrets {
        assert!(!msg.contains(s), "the error shows a secret: {msg}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_and_password_from_a_file_and_a_wrong_one_refused_without_leaking_it() {
    let nats = NatsServer::start_with("authorization { user: app, password: \"pw-correct-7f3\" }");
    let url = nats.url().to_string();
    provision(&url, async_nats::ConnectOptions::with_user_and_password("app".into(), "pw-correct-7f3".into())).await;
    let dir = tempfile::tempdir().unwrap();

    let good = write(dir.path(), "password", "pw-correct-7f3\n");
    let cfg = client_config(&[("REVIEWLANE_NATS_USER", "app".into()), ("REVIEWLANE_NATS_PASSWORD_FILE", good)]);
    start_publisher(&url, cfg).await.expect("logs in");

    let bad = write(dir.path(), "wrong", "pw-wrong-91c");
    let cfg = client_config(&[("REVIEWLANE_NATS_USER", "app".into()), ("REVIEWLANE_NATS_PASSWORD_FILE", bad)]);
    assert_refused(start_publisher(&url, cfg).await, &["pw-wrong-91c", "pw-correct-7f3"]);

    // Credentials in a URL (which gets logged) are refused at start, without echoing it.
    let host = url.trim_start_matches("nats://");
    let env: HashMap<&str, String> = [
        ("REVIEWLANE_REGION", "us".to_string()),
        ("REVIEWLANE_NATS_URL", format!("nats://app:pw-in-url-55d@{host}")),
        ("REVIEWLANE_TENANTS_FILE", write(dir.path(), "tenants.toml", "")),
    ]
    .into();
    let err = reviewlane_publisher::PublisherConfig::from_env(&env).expect_err("refused").to_string();
    assert!(err.contains("REVIEWLANE_NATS_URL carries credentials"), "{err}");
    assert!(!err.contains("pw-in-url-55d"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_and_nkey_logins() {
    let nats = NatsServer::start_with("authorization { token: \"tok-a81\" }");
    let url = nats.url().to_string();
    provision(&url, async_nats::ConnectOptions::with_token("tok-a81".into())).await;
    let dir = tempfile::tempdir().unwrap();
    let token = write(dir.path(), "token", "tok-a81");
    start_publisher(&url, client_config(&[("REVIEWLANE_NATS_TOKEN_FILE", token)])).await.expect("token login");
    let wrong = write(dir.path(), "wrong-token", "tok-zzz");
    assert_refused(start_publisher(&url, client_config(&[("REVIEWLANE_NATS_TOKEN_FILE", wrong)])).await, &["tok-zzz"]);

    let user = nkeys::KeyPair::new_user();
    let nats = NatsServer::start_with(&format!("authorization {{ users: [ {{ nkey: {} }} ] }}", user.public_key()));
    let url = nats.url().to_string();
    let seed = user.seed().unwrap();
    provision(&url, async_nats::ConnectOptions::with_nkey(seed.clone())).await;
    let seed_file = write(dir.path(), "user.nk", &seed);
    start_publisher(&url, client_config(&[("REVIEWLANE_NATS_NKEY_SEED_FILE", seed_file)])).await.expect("nkey login");
    let other = nkeys::KeyPair::new_user().seed().unwrap();
    let other_file = write(dir.path(), "other.nk", &other);
    assert_refused(
        start_publisher(&url, client_config(&[("REVIEWLANE_NATS_NKEY_SEED_FILE", other_file)])).await,
        &[&other],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_with_a_ca_file_and_a_client_certificate() {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let dir = tempfile::tempdir().unwrap();
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf = |names: Vec<String>| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(names).unwrap().signed_by(&key, &issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf(vec!["127.0.0.1".into(), "localhost".into()]);
    let (client_cert, client_key) = leaf(vec!["reviewlane-publisher".into()]);
    let ca = write(dir.path(), "ca.pem", &ca_cert.pem());
    let sc = write(dir.path(), "server.pem", &server_cert);
    let sk = write(dir.path(), "server-key.pem", &server_key);
    let cc = write(dir.path(), "client.pem", &client_cert);
    let ck = write(dir.path(), "client-key.pem", &client_key);
    let nats = NatsServer::start_with(&format!(
        "tls {{ cert_file: \"{sc}\", key_file: \"{sk}\", ca_file: \"{ca}\", verify: true }}"
    ));
    let url = nats.url().replace("nats://", "tls://");
    let with_cert = client_config(&[
        ("REVIEWLANE_NATS_TLS_CA_FILE", ca.clone()),
        ("REVIEWLANE_NATS_TLS_CERT_FILE", cc),
        ("REVIEWLANE_NATS_TLS_KEY_FILE", ck),
    ]);
    provision(&url, with_cert.options("provision").await.unwrap()).await;
    start_publisher(&url, with_cert).await.expect("mutual TLS login");
    // Without a client certificate the server refuses the handshake.
    let res = start_publisher(&url, client_config(&[("REVIEWLANE_NATS_TLS_CA_FILE", ca)])).await;
    let err = res.expect_err("refused without a client certificate");
    assert!(matches!(err, StartError::Auth { .. } | StartError::Connect { .. }), "{err}");
}

/// Decentralised JWT auth: an operator, an account with JetStream, a user, signed with
/// NKeys the way `nsc` does it; the server trusts the operator and knows the account.
mod jwt {
    use base64::Engine as _;
    use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
    use serde_json::json;

    fn encode(claims: serde_json::Value, issuer: &nkeys::KeyPair) -> String {
        let header = B64.encode(json!({"typ": "JWT", "alg": "ed25519-nkey"}).to_string());
        let body = B64.encode(claims.to_string());
        let signing_input = format!("{header}.{body}");
        let sig = B64.encode(issuer.sign(signing_input.as_bytes()).unwrap());
        format!("{signing_input}.{sig}")
    }

    fn claims(iss: &nkeys::KeyPair, sub: &str, name: &str, nats: serde_json::Value) -> serde_json::Value {
        let iat = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        json!({"jti": format!("{name}{iat}").to_uppercase(), "iat": iat, "iss": iss.public_key(), "name": name, "sub": sub, "nats": nats})
    }

    /// (server configuration, .creds file content, the user's seed).
    pub fn setup() -> (String, String, String) {
        let operator = nkeys::KeyPair::new_operator();
        let account = nkeys::KeyPair::new_account();
        let system = nkeys::KeyPair::new_account();
        let user = nkeys::KeyPair::new_user();
        let op_jwt = encode(
            claims(&operator, &operator.public_key(), "op", json!({"type": "operator", "version": 2})),
            &operator,
        );
        let limits = json!({"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": true,
            "conn": -1, "leaf": -1, "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1});
        let acc_jwt = encode(
            claims(&operator, &account.public_key(), "app", json!({"limits": limits, "type": "account", "version": 2})),
            &operator,
        );
        let sys_jwt = encode(
            claims(
                &operator,
                &system.public_key(),
                "sys",
                json!({"limits": {"subs": -1, "data": -1, "payload": -1, "conn": -1}, "type": "account", "version": 2}),
            ),
            &operator,
        );
        let user_jwt = encode(
            claims(
                &account,
                &user.public_key(),
                "svc",
                json!({"pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1, "type": "user", "version": 2}),
            ),
            &account,
        );
        let conf = format!(
            "operator: {op_jwt}\nsystem_account: {sys}\nresolver: MEMORY\nresolver_preload: {{\n  {acc}: {acc_jwt}\n  {sys}: {sys_jwt}\n}}\n",
            sys = system.public_key(),
            acc = account.public_key(),
        );
        let seed = user.seed().unwrap();
        let creds = format!(
            "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
        );
        (conf, creds, seed)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_creds_file_logs_in_to_an_operator_mode_server() {
    let (conf, creds, _) = jwt::setup();
    let nats = NatsServer::start_with(&conf);
    let url = nats.url().to_string();
    let dir = tempfile::tempdir().unwrap();
    let creds_file = write(dir.path(), "svc.creds", &creds);
    let cfg = client_config(&[("REVIEWLANE_NATS_CREDS_FILE", creds_file)]);
    provision(&url, cfg.options("provision").await.unwrap()).await;
    start_publisher(&url, cfg).await.expect("creds login");
    // Another operator's user is refused.
    let (_, other, other_seed) = jwt::setup();
    let other_file = write(dir.path(), "other.creds", &other);
    assert_refused(
        start_publisher(&url, client_config(&[("REVIEWLANE_NATS_CREDS_FILE", other_file)])).await,
        &[&other_seed],
    );
}
