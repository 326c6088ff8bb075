//! Reading configuration: one pass over the environment (or a map, in tests) that
//! collects every bad value before the service gives up, so an operator fixes them
//! all at once. Messages name variables, never their values (which may be secrets).

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

/// Where configuration comes from.
pub trait Env {
    fn get(&self, key: &str) -> Option<String>;
}

/// The process environment.
pub struct ProcessEnv;

impl Env for ProcessEnv {
    fn get(&self, key: &str) -> Option<String> {
        std::env::var(key).ok()
    }
}

impl Env for HashMap<String, String> {
    fn get(&self, key: &str) -> Option<String> {
        HashMap::get(self, key).cloned()
    }
}

impl Env for HashMap<&str, String> {
    fn get(&self, key: &str) -> Option<String> {
        HashMap::get(self, key).cloned()
    }
}

/// Every problem found in one configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<String>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "invalid configuration:")?;
        for e in &self.0 {
            writeln!(f, "  - {e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// Exit code for a bad configuration (sysexits EX_USAGE), used before binding anything.
pub const EXIT_CONFIG: i32 = 64;
/// Exit code for a wiring failure (sysexits EX_CONFIG): wrong region, unprovisioned NATS.
pub const EXIT_WIRING: i32 = 78;
/// Exit code of `reviewlane-admin provision` when a stream or bucket differs from the
/// config in a way it could not correct (sysexits EX_DATAERR).
pub const EXIT_DRIFT: i32 = 65;
/// Exit code when NATS refuses the configured credentials or TLS (sysexits EX_NOPERM).
pub const EXIT_NATS_AUTH: i32 = 77;

pub struct Reader<'a> {
    env: &'a dyn Env,
    errors: Vec<String>,
}

impl<'a> Reader<'a> {
    /// One notice for each retired name set in the environment (the layout's and the
    /// service's own `retired`), naming it and where it went, never its value: a service
    /// logs them at start, so a setting that no longer has an effect does not go unseen.
    pub fn retired_notices(&self, retired: crate::env::Retired) -> Vec<String> {
        let layout = crate::env::LAYOUT.iter().map(|n| (*n, "the layout belongs to `reviewlane-admin provision`"));
        layout
            .chain(crate::env::EVERY_SERVICE_RETIRED.iter().copied())
            .chain(retired.iter().copied())
            .filter(|(name, _)| self.raw(name).is_some())
            .map(|(name, went)| format!("{name} is set but no longer read by this service: {went}"))
            .collect()
    }

    pub fn new(env: &'a dyn Env) -> Self {
        Reader { env, errors: Vec::new() }
    }

    pub fn raw(&self, key: &str) -> Option<String> {
        self.env.get(key).filter(|v| !v.trim().is_empty())
    }

    pub fn required<T: FromStr>(&mut self, key: &str, expected: &str) -> Option<T> {
        match self.raw(key) {
            None => {
                self.errors.push(format!("{key} is required ({expected})"));
                None
            }
            Some(v) => self.parse(key, &v, expected),
        }
    }

    pub fn optional<T: FromStr>(&mut self, key: &str, expected: &str) -> Option<T> {
        let v = self.raw(key)?;
        self.parse(key, &v, expected)
    }

    pub fn or<T: FromStr>(&mut self, key: &str, default: T, expected: &str) -> T {
        match self.raw(key) {
            None => default,
            Some(v) => self.parse(key, &v, expected).unwrap_or(default),
        }
    }

    fn parse<T: FromStr>(&mut self, key: &str, v: &str, expected: &str) -> Option<T> {
        match v.trim().parse() {
            Ok(t) => Some(t),
            Err(_) => {
                self.errors.push(format!("{key} has an invalid value ({expected})"));
                None
            }
        }
    }

    /// Loads and validates the tenants file named by `key`, recording its problems.
    pub fn tenants(&mut self, key: &str) -> Option<crate::tenants::Tenants> {
        let path: std::path::PathBuf = self.required(key, "path to the tenants TOML file")?;
        match crate::tenants::Tenants::load(&path) {
            Ok(t) => Some(t),
            Err(errs) => {
                self.errors.extend(errs);
                None
            }
        }
    }

    /// Each lane's service window (its SLO for submit-to-published):
    /// `REVIEWLANE_INTERACTIVE_WINDOW_SECS` (60) and `REVIEWLANE_BATCH_WINDOW_SECS`
    /// (3600), indexed like `Lane::ALL`. Admission, the latency buckets and the
    /// queue-age alerts all use these.
    pub fn lane_windows(&mut self) -> [std::time::Duration; 2] {
        let i: u64 = self.or(crate::env::INTERACTIVE_WINDOW_SECS, 60, "whole seconds");
        let b: u64 = self.or(crate::env::BATCH_WINDOW_SECS, 3600, "whole seconds");
        if i == 0 || b == 0 {
            self.error("lane windows (REVIEWLANE_*_WINDOW_SECS) must be positive");
        }
        [std::time::Duration::from_secs(i), std::time::Duration::from_secs(b)]
    }

    /// Records a problem found by a cross-field check.
    pub fn error(&mut self, msg: impl Into<String>) {
        self.errors.push(msg.into());
    }

    pub fn finish(self) -> Result<(), ConfigErrors> {
        if self.errors.is_empty() { Ok(()) } else { Err(ConfigErrors(self.errors)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collects_every_error_and_never_echoes_values() {
        let env: HashMap<&str, String> =
            [("A", "notanumber-secret".to_string()), ("C", "7".to_string())].into_iter().collect();
        let mut r = Reader::new(&env);
        let a: Option<u32> = r.required("A", "a number");
        let b: Option<u32> = r.required("B", "a number");
        let c: u32 = r.or("C", 1, "a number");
        let d: u32 = r.or("D", 5, "a number");
        assert_eq!((a, b, c, d), (None, None, 7, 5));
        let errs = r.finish().unwrap_err();
        assert_eq!(errs.0.len(), 2);
        assert!(!errs.to_string().contains("secret"));
    }
}
