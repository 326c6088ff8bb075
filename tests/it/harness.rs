//! The test harness is `loadtest::stack`, shared with the load scenarios.
pub use loadtest::stack::*;
