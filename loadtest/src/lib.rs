//! Load-test and test support for reviewlane: the simulated provider, and (in later
//! issues) the load generator and scenarios.

pub mod http;
pub mod simprovider;
pub mod webhook;
