//! What reviewlane's integration tests and load scenarios run against: a whole
//! deployment in-process (`stack`) or as processes (`procs`), the simulated provider
//! (`simprovider`, with the providers' batch APIs in `simbatch` and their metering in
//! `simmeter`), a gateway with fixed windows in front of it (`simgateway`), a simulated
//! Azure OpenAI resource with its deployments, filters and Global Batch (`simazure`), a webhook
//! receiver (`webhook`), a fake GitHub API (`fakegithub`), and the small HTTP server
//! they share (`http`). The nats-servers themselves come
//! from `reviewlane_shared::testing`.

pub mod diffs;
pub mod fakegithub;
pub mod http;
pub mod procs;
pub mod simazure;
pub mod simbatch;
pub mod simgateway;
pub mod simmeter;
pub mod simprovider;
pub mod stack;
pub mod webhook;
