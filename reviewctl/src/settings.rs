//! Where to connect and as whom: flags, then the environment (both through clap), then
//! the config file, then defaults. Pure except for reading the files named.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde::Deserialize;

use crate::cli::ConnArgs;

pub const DEFAULT_ENDPOINT: &str = "http://127.0.0.1:50051";

/// The config file's keys.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    pub endpoint: Option<String>,
    pub api_key_file: Option<PathBuf>,
    pub tls_ca_file: Option<PathBuf>,
    pub request_timeout_secs: Option<f64>,
}

/// How long one request may wait for its answer unless set.
pub const DEFAULT_REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub endpoint: String,
    pub api_key: String,
    pub tls_ca_file: Option<PathBuf>,
    /// The deadline of every request (and of connecting).
    pub request_timeout: std::time::Duration,
}

impl std::fmt::Display for Settings {
    /// Never the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "endpoint {}", self.endpoint)
    }
}

/// The config file to read: the one named, else the default one when it exists.
pub fn config_path(args: &ConnArgs, home: Option<&Path>, xdg: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = &args.config {
        return Some(p.clone());
    }
    let dir = xdg.map(Path::to_path_buf).or_else(|| home.map(|h| h.join(".config")))?;
    Some(dir.join("reviewlane/reviewctl.toml")).filter(|p| p.exists())
}

pub fn read_config(path: &Path) -> anyhow::Result<ConfigFile> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("{} is not a reviewctl config file", path.display()))
}

/// Flags and environment first, then the file.
pub fn resolve(args: &ConnArgs, file: &ConfigFile) -> anyhow::Result<Settings> {
    let endpoint = args.endpoint.clone().or_else(|| file.endpoint.clone()).unwrap_or_else(|| DEFAULT_ENDPOINT.into());
    if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
        bail!("the endpoint must start with http:// or https://");
    }
    let api_key = match (&args.api_key, args.api_key_file.as_ref().or(file.api_key_file.as_ref())) {
        (Some(k), _) => k.clone(),
        (None, Some(path)) => std::fs::read_to_string(path)
            .with_context(|| format!("reading the API key file {}", path.display()))?
            .trim()
            .to_string(),
        (None, None) => bail!("no API key: set REVIEWLANE_API_KEY or REVIEWLANE_API_KEY_FILE, or --api-key-file"),
    };
    if api_key.is_empty() {
        bail!("the API key is empty");
    }
    let tls_ca_file = args.tls_ca_file.clone().or_else(|| file.tls_ca_file.clone());
    let request_timeout = match args.request_timeout.or(file.request_timeout_secs) {
        None => DEFAULT_REQUEST_TIMEOUT,
        Some(secs) if secs.is_finite() && secs > 0.0 && secs <= 86_400.0 => std::time::Duration::from_secs_f64(secs),
        Some(_) => bail!("the request timeout must be a number of seconds above 0 and at most 86400"),
    };
    Ok(Settings { endpoint, api_key, tls_ca_file, request_timeout })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_and_environment_come_before_the_file_and_the_file_before_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let key_file = dir.path().join("key");
        std::fs::write(&key_file, "sk-from-file\n").unwrap();
        let file = ConfigFile {
            endpoint: Some("https://reviews.example:443".into()),
            api_key_file: Some(key_file.clone()),
            tls_ca_file: Some("/etc/ca.pem".into()),
            request_timeout_secs: Some(5.0),
        };
        let s = resolve(&ConnArgs::default(), &file).unwrap();
        assert_eq!(s.request_timeout, std::time::Duration::from_secs(5));
        assert_eq!(s.endpoint, "https://reviews.example:443");
        assert_eq!(s.api_key, "sk-from-file");
        assert!(!s.to_string().contains("sk-"));
        let args = ConnArgs {
            endpoint: Some("http://127.0.0.1:9".into()),
            api_key: Some("sk-from-env".into()),
            ..Default::default()
        };
        let s = resolve(&ConnArgs { request_timeout: Some(0.5), ..args.clone() }, &file).unwrap();
        assert_eq!(s.request_timeout, std::time::Duration::from_millis(500));
        let s = resolve(&args, &file).unwrap();
        assert_eq!((s.endpoint.as_str(), s.api_key.as_str()), ("http://127.0.0.1:9", "sk-from-env"));
        assert_eq!(s.tls_ca_file, Some("/etc/ca.pem".into()));
        let only_key = ConnArgs { api_key: Some("k".into()), ..Default::default() };
        let defaults = resolve(&only_key, &ConfigFile::default()).unwrap();
        assert_eq!((defaults.endpoint.as_str(), defaults.request_timeout), (DEFAULT_ENDPOINT, DEFAULT_REQUEST_TIMEOUT));
        let zero = ConnArgs { request_timeout: Some(0.0), ..only_key.clone() };
        assert!(resolve(&zero, &ConfigFile::default()).is_err());
        assert!(resolve(&ConnArgs::default(), &ConfigFile::default()).is_err());
        let bad = ConnArgs { endpoint: Some("127.0.0.1:50051".into()), ..only_key };
        assert!(resolve(&bad, &ConfigFile::default()).is_err());
    }

    #[test]
    fn the_default_config_file_is_used_only_when_it_exists() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(config_path(&ConnArgs::default(), Some(dir.path()), None), None);
        let path = dir.path().join(".config/reviewlane/reviewctl.toml");
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, "endpoint = \"http://127.0.0.1:1\"\n").unwrap();
        assert_eq!(config_path(&ConnArgs::default(), Some(dir.path()), None), Some(path.clone()));
        assert_eq!(read_config(&path).unwrap().endpoint.as_deref(), Some("http://127.0.0.1:1"));
        std::fs::write(&path, "endpoit = \"x\"\n").unwrap();
        assert!(read_config(&path).is_err());
    }
}
