//! Load-test and test support for reviewlane: the simulated provider, a webhook
//! receiver, a whole deployment in-process (`stack`) or as processes (`procs`), the
//! load generator (`load`, `corpus`) and the load scenarios (`scenarios`).

pub mod chaos;
pub mod corpus;
pub mod fakegithub;
pub mod http;
pub mod large;
pub mod load;
pub mod procs;
pub mod replicas;
pub mod scenarios;
pub mod simprovider;
pub mod stack;
pub mod webhook;
