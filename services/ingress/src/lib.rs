//! reviewlane ingress: authenticates callers, picks the tenant's region, validates the
//! diff and enqueues the review durably on that region's lane. It never calls a
//! provider and never waits on one.

pub mod admission;
pub mod auth;
pub mod config;
pub mod env;
pub mod error;
pub mod request_limit;
pub mod rpc;
pub mod service;
pub mod startup;

pub use config::IngressConfig;
pub use startup::{App, build, build_with_clock};
