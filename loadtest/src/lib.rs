//! Load-test and test support for reviewlane: the simulated provider, a webhook
//! receiver, a whole in-process deployment (`stack`), and the load scenarios.

pub mod http;
pub mod simprovider;
pub mod stack;
pub mod webhook;
