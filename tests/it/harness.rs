//! The test harness is `reviewlane_testkit::stack`, shared with the load scenarios.
pub use reviewlane_testkit::stack::*;
