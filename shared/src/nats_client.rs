//! Connecting to a region's NATS: credentials, TLS and the connection name, from the
//! typed config; and URLs redacted wherever they are shown.
//!
//! Credentials come from files (`*_FILE`, as Kubernetes Secrets are mounted) or from
//! environment variables, never from a URL that is logged: a URL with a user or
//! password still works, but every log line, span, metric and error shows it redacted
//! ([`redact`]).
//!
//! | variable | meaning |
//! | --- | --- |
//! | `<P>_USER`, `<P>_PASSWORD_FILE` (or `<P>_PASSWORD`) | user and password |
//! | `<P>_TOKEN_FILE` (or `<P>_TOKEN`) | token |
//! | `<P>_NKEY_SEED_FILE` | NKey seed (`SU…`) |
//! | `<P>_CREDS_FILE` | `.creds` file (decentralised JWT auth) |
//! | `<P>_TLS_CA_FILE` | CA that signed the server's certificate; implies TLS |
//! | `<P>_TLS_CERT_FILE`, `<P>_TLS_KEY_FILE` | client certificate and key (mutual TLS) |
//!
//! `<P>` is `REVIEWLANE_NATS` for the extractor, the publisher and `reviewlane-admin`;
//! the ingress reads `REVIEWLANE_NATS_US` / `REVIEWLANE_NATS_EU` first, then
//! `REVIEWLANE_NATS`. At most one of user/password, token, NKey and creds.

use std::path::PathBuf;

use secrecy::{ExposeSecret, SecretString};

use reviewlane_core::config::Reader;

#[derive(Debug, Clone, Default)]
pub struct NatsClientConfig {
    pub auth: NatsAuth,
    pub tls: NatsTls,
}

#[derive(Debug, Clone, Default)]
pub enum NatsAuth {
    #[default]
    None,
    UserPassword {
        user: String,
        password: SecretString,
    },
    Token(SecretString),
    NKeySeed(SecretString),
    CredsFile(PathBuf),
}

#[derive(Debug, Clone, Default)]
pub struct NatsTls {
    pub ca_file: Option<PathBuf>,
    /// Client certificate and key.
    pub client: Option<(PathBuf, PathBuf)>,
}

impl NatsClientConfig {
    /// Reads the first of `prefixes` that sets anything (see the module docs). Files are
    /// read here, so a missing one is a config error at start, naming the variable.
    pub fn from_reader(r: &mut Reader<'_>, prefixes: &[&str]) -> NatsClientConfig {
        let keys = reviewlane_core::env::NATS_CREDENTIALS;
        let Some(p) = prefixes.iter().find(|p| keys.iter().any(|k| r.raw(&format!("{p}{k}")).is_some())) else {
            return NatsClientConfig::default();
        };
        let var = |k: &str| format!("{p}{k}");
        let secret = |r: &mut Reader<'_>, value: &str, file: &str| -> Option<SecretString> {
            if let Some(path) = r.raw(&var(file)) {
                match std::fs::read_to_string(&path) {
                    Ok(s) => return Some(SecretString::from(s.trim().to_string())),
                    Err(_) => {
                        r.error(format!("{} names a file that cannot be read", var(file)));
                        return None;
                    }
                }
            }
            r.raw(&var(value)).map(SecretString::from)
        };
        let path = |r: &mut Reader<'_>, k: &str| -> Option<PathBuf> {
            let v = r.raw(&var(k))?;
            let p = PathBuf::from(v);
            if !p.is_file() {
                r.error(format!("{} names a file that does not exist", var(k)));
            }
            Some(p)
        };
        let user = r.raw(&var("_USER"));
        let password = secret(r, "_PASSWORD", "_PASSWORD_FILE");
        let token = secret(r, "_TOKEN", "_TOKEN_FILE");
        let seed = path(r, "_NKEY_SEED_FILE").and_then(|f| std::fs::read_to_string(f).ok());
        let creds = path(r, "_CREDS_FILE");
        let methods = [user.is_some() || password.is_some(), token.is_some(), seed.is_some(), creds.is_some()];
        if methods.iter().filter(|m| **m).count() > 1 {
            r.error(format!("set at most one of {p}_USER/_PASSWORD, {p}_TOKEN, {p}_NKEY_SEED_FILE and {p}_CREDS_FILE"));
        }
        let auth = match (user, password, token, seed, creds) {
            (Some(user), Some(password), ..) => NatsAuth::UserPassword { user, password },
            (Some(_), None, ..) | (None, Some(_), ..) => {
                r.error(format!("{p}_USER and a password ({p}_PASSWORD_FILE or {p}_PASSWORD) go together"));
                NatsAuth::None
            }
            (_, _, Some(t), ..) => NatsAuth::Token(t),
            (_, _, _, Some(seed), _) => NatsAuth::NKeySeed(SecretString::from(seed.trim().to_string())),
            (_, _, _, _, Some(creds)) => NatsAuth::CredsFile(creds),
            _ => NatsAuth::None,
        };
        let ca_file = path(r, "_TLS_CA_FILE");
        let client = match (path(r, "_TLS_CERT_FILE"), path(r, "_TLS_KEY_FILE")) {
            (Some(c), Some(k)) => Some((c, k)),
            (None, None) => None,
            _ => {
                r.error(format!("{p}_TLS_CERT_FILE and {p}_TLS_KEY_FILE go together"));
                None
            }
        };
        NatsClientConfig { auth, tls: NatsTls { ca_file, client } }
    }

    /// Connection options with these credentials and TLS settings, named `name` (the
    /// service, shown in the server's connection list).
    pub async fn options(&self, name: &str) -> std::io::Result<async_nats::ConnectOptions> {
        let mut o = async_nats::ConnectOptions::new().name(name).max_reconnects(None);
        o = match &self.auth {
            NatsAuth::None => o,
            NatsAuth::UserPassword { user, password } => {
                o.user_and_password(user.clone(), password.expose_secret().to_string())
            }
            NatsAuth::Token(t) => o.token(t.expose_secret().to_string()),
            NatsAuth::NKeySeed(seed) => o.nkey(seed.expose_secret().to_string()),
            NatsAuth::CredsFile(path) => o.credentials_file(path).await?,
        };
        if let Some(ca) = &self.tls.ca_file {
            o = o.add_root_certificates(ca.clone()).require_tls(true);
        }
        if let Some((cert, key)) = &self.tls.client {
            o = o.add_client_certificate(cert.clone(), key.clone()).require_tls(true);
        }
        Ok(o)
    }
}

/// The servers of `url`: one URL, or several comma-separated (a cluster's nodes; the
/// client reconnects to another when one goes away).
pub fn server_addrs(url: &str) -> std::io::Result<Vec<async_nats::ServerAddr>> {
    url.split(',').map(|u| u.trim().parse::<async_nats::ServerAddr>()).collect()
}

/// Whether any of the URLs (comma-separated) carries a user, password or token.
/// A required NATS URL (one or several, comma-separated) without credentials in it:
/// those go in `REVIEWLANE_NATS_*` files or variables, since URLs get logged.
pub fn read_url(r: &mut Reader<'_>, key: &str) -> Option<String> {
    let url: String = r.required(key, "nats://host:port or tls://host:port, comma-separated for a cluster")?;
    check_url(r, key, &url);
    Some(url)
}

/// Refuses a NATS URL that carries credentials.
pub fn check_url(r: &mut Reader<'_>, key: &str, url: &str) {
    if has_credentials(url) {
        r.error(format!(
            "{key} carries credentials; set them with REVIEWLANE_NATS_USER and REVIEWLANE_NATS_PASSWORD_FILE (or _TOKEN_FILE, _NKEY_SEED_FILE, _CREDS_FILE) instead"
        ));
    }
}

pub fn has_credentials(url: &str) -> bool {
    url.split(',').any(|u| u.split_once("://").map_or(u, |(_, r)| r).contains('@'))
}

/// `url` (one or several, comma-separated) as it may be shown: any user or password
/// replaced by `***`.
pub fn redact(url: &str) -> String {
    url.split(',')
        .map(|u| {
            let u = u.trim();
            let (scheme, rest) = match u.split_once("://") {
                Some((s, r)) => (Some(s), r),
                None => (None, u),
            };
            let rest = match rest.rsplit_once('@') {
                Some((_, host)) => format!("***@{host}"),
                None => rest.to_string(),
            };
            match scheme {
                Some(s) => format!("{s}://{rest}"),
                None => rest,
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn urls_are_shown_without_credentials() {
        assert_eq!(redact("nats://app:hunter2@nats-us:4222"), "nats://***@nats-us:4222");
        assert_eq!(redact("tls://tok@a:1, nats://b:2"), "tls://***@a:1,nats://b:2");
        assert_eq!(redact("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
        assert_eq!(redact("u:p@host:4222"), "***@host:4222");
    }

    fn read(env: &[(&str, &str)], prefixes: &[&str]) -> (NatsClientConfig, Vec<String>) {
        let env: HashMap<String, String> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let mut r = Reader::new(&env);
        let c = NatsClientConfig::from_reader(&mut r, prefixes);
        let errors = match r.finish() {
            Ok(()) => Vec::new(),
            Err(e) => e.to_string().lines().skip(1).map(String::from).collect(),
        };
        (c, errors)
    }

    #[test]
    fn credentials_come_from_files_or_variables_and_never_reach_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let pw = dir.path().join("password");
        std::fs::write(&pw, "s3cret-pw\n").unwrap();
        let (c, errors) = read(
            &[("REVIEWLANE_NATS_USER", "app"), ("REVIEWLANE_NATS_PASSWORD_FILE", pw.to_str().unwrap())],
            &["REVIEWLANE_NATS"],
        );
        assert!(errors.is_empty(), "{errors:?}");
        assert!(
            matches!(&c.auth, NatsAuth::UserPassword { user, password } if user == "app" && password.expose_secret() == "s3cret-pw")
        );
        assert!(!format!("{c:?}").contains("s3cret-pw"), "Debug shows the secret");

        // The ingress: a region's own prefix first.
        let (c, _) = read(
            &[("REVIEWLANE_NATS_EU_TOKEN", "t-eu"), ("REVIEWLANE_NATS_TOKEN", "t")],
            &["REVIEWLANE_NATS_EU", "REVIEWLANE_NATS"],
        );
        assert!(matches!(&c.auth, NatsAuth::Token(t) if t.expose_secret() == "t-eu"));

        let (_, errors) = read(
            &[
                ("REVIEWLANE_NATS_TOKEN", "t"),
                ("REVIEWLANE_NATS_USER", "u"),
                ("REVIEWLANE_NATS_PASSWORD", "secret-value"),
            ],
            &["REVIEWLANE_NATS"],
        );
        assert!(errors.iter().any(|e| e.contains("at most one")), "{errors:?}");
        assert!(errors.iter().all(|e| !e.contains("secret-value")));
        let (_, errors) = read(&[("REVIEWLANE_NATS_CREDS_FILE", "/nonexistent/app.creds")], &["REVIEWLANE_NATS"]);
        assert!(
            errors.iter().any(|e| e.contains("REVIEWLANE_NATS_CREDS_FILE names a file that does not exist")),
            "{errors:?}"
        );
        let (_, errors) = read(&[("REVIEWLANE_NATS_TLS_CERT_FILE", pw.to_str().unwrap())], &["REVIEWLANE_NATS"]);
        assert!(errors.iter().any(|e| e.contains("go together")), "{errors:?}");
        let (c, errors) = read(&[], &["REVIEWLANE_NATS"]);
        assert!(errors.is_empty() && matches!(c.auth, NatsAuth::None));
    }
}
