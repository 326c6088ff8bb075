//! Wall-clock time in milliseconds, behind a trait so lease, quota and reconciler logic
//! can be driven by a test clock instead of sleeps.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub trait Clock: Send + Sync + 'static {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;
}

/// The system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        now_ms()
    }
}

/// A clock that moves only when told to.
#[derive(Debug, Default)]
pub struct ManualClock(AtomicU64);

impl ManualClock {
    pub fn at(ms: u64) -> Arc<Self> {
        Arc::new(ManualClock(AtomicU64::new(ms)))
    }

    pub fn advance(&self, by: std::time::Duration) {
        self.0.fetch_add(by.as_millis() as u64, Ordering::SeqCst);
    }

    pub fn set(&self, ms: u64) {
        self.0.store(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// The shared handle services pass around.
/// Milliseconds since the Unix epoch by the system's clock (0 before the epoch).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

pub type SharedClock = Arc<dyn Clock>;

pub fn system() -> SharedClock {
    Arc::new(SystemClock)
}
