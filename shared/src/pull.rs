//! Pulling from JetStream: `pull` (one request, with backoff after failures), used by
//! both workers, and `pull_loop`, the publisher's loop.
//!
//! `pull_loop` holds no slot during a long-poll: it waits until a slot is free, asks
//! for at most as many messages as slots are free, and takes a slot per message as it
//! arrives. A message that finds no free slot is handed back at once (nak without
//! delay), so nothing sits leased without a worker.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind, consumer::PullConsumer};
use futures::StreamExt;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

/// How a pulled message is settled, as the workers' pure cores decide it (plain data,
/// comparable in their tests; `kind` is what goes to the server).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ack {
    /// Done with: never again.
    Ack,
    /// Handed back, to come again after the delay (`None`: at once).
    Nak(Option<Duration>),
    /// Unusable: never again, and not as done.
    Term,
}

impl Ack {
    pub fn kind(self) -> AckKind {
        match self {
            Ack::Ack => AckKind::Ack,
            Ack::Nak(d) => AckKind::Nak(d),
            Ack::Term => AckKind::Term,
        }
    }
}

/// Sends `kind` for a pulled message. A failure is only logged: the message comes back
/// after its ack wait, as if it had not been answered.
pub async fn ack(msg: &jetstream::Message, kind: AckKind) {
    if let Err(e) = msg.ack_with(kind).await {
        tracing::warn!(error = %e, "answering a message failed; it returns after its ack wait");
    }
}

/// The ticks that keep a pulled message's lease alive (progress acks), the first one
/// `period` from now. (`tokio::time::interval`'s first tick is due at once, but
/// awaiting it still waits for the timer wheel's next millisecond: on the path of
/// every job, that was a millisecond per wait.)
pub fn heartbeat(period: Duration) -> tokio::time::Interval {
    tokio::time::interval_at(tokio::time::Instant::now() + period, period)
}

/// Longest a pull request waits on the server for a message.
const PULL_EXPIRES: Duration = Duration::from_secs(5);
/// Longest wait for the next message of a pull: its expiry and a margin. A pull request
/// that the server lost (it restarted) never ends by itself; this ends it.
pub const PULL_WAIT: Duration = Duration::from_secs(8);
/// Most messages asked for in one pull.
const MAX_PULL: usize = 64;

/// Asks `consumer` for up to `max` messages (waiting up to the pull expiry). After a
/// failed request it backs off (100 ms doubling to 6.4 s, counted in `failures`).
/// `None` when `stop` fired; `Some(None)` after a failure, to try again.
pub async fn pull(
    consumer: &PullConsumer,
    max: usize,
    failures: &mut u32,
    stop: &CancellationToken,
) -> Option<Option<async_nats::jetstream::consumer::pull::Batch>> {
    let batch = tokio::select! {
        b = consumer.batch().max_messages(max).expires(PULL_EXPIRES).messages() => b,
        _ = stop.cancelled() => return None,
    };
    match batch {
        Ok(b) => {
            *failures = 0;
            Some(Some(b))
        }
        Err(e) => {
            *failures += 1;
            tracing::warn!(error = %e, "pull failed");
            let pause = Duration::from_millis(100 * 2u64.pow((*failures).min(6)));
            tokio::select! { _ = tokio::time::sleep(pause) => Some(None), _ = stop.cancelled() => None }
        }
    }
}

/// Runs until `stop` fires. Each message is handed to `handle`, whose future runs on
/// `tasks` holding one slot of `slots`.
pub async fn pull_loop<F, Fut>(
    consumer: PullConsumer,
    slots: Arc<Semaphore>,
    tasks: TaskTracker,
    stop: CancellationToken,
    handle: F,
) where
    F: Fn(jetstream::Message) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let mut failures = 0u32;
    loop {
        // Wait for a free slot, without keeping it.
        tokio::select! {
            p = slots.clone().acquire_owned() => drop(p.expect("semaphore never closed")),
            _ = stop.cancelled() => return,
        }
        let want = slots.available_permits().clamp(1, MAX_PULL);
        let Some(batch) = pull(&consumer, want, &mut failures, &stop).await else { return };
        let Some(mut batch) = batch else { continue };
        loop {
            let next = tokio::select! {
                m = tokio::time::timeout(PULL_WAIT, batch.next()) => match m {
                    Ok(m) => m,
                    Err(_) => break,
                },
                _ = stop.cancelled() => return,
            };
            let msg = match next {
                None => break,
                Some(Ok(m)) => m,
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "pull message error");
                    break;
                }
            };
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                if let Err(e) = msg.ack_with(AckKind::Nak(None)).await {
                    tracing::warn!(error = %e, "handing back a message failed; it returns after its lease");
                }
                continue;
            };
            let work = handle(msg);
            tasks.spawn(
                async move {
                    let _permit = permit;
                    work.await;
                }
                .in_current_span(),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job's path creates a heartbeat and goes on at once: nothing of it waits for a
    /// tick before the first period is over.
    #[tokio::test(start_paused = true)]
    async fn a_heartbeat_first_ticks_one_period_after_it_starts() {
        let start = tokio::time::Instant::now();
        let mut beat = heartbeat(Duration::from_secs(10));
        assert!(tokio::time::timeout(Duration::from_secs(9), beat.tick()).await.is_err(), "ticked before its period");
        beat.tick().await;
        assert_eq!(start.elapsed(), Duration::from_secs(10));
        beat.tick().await;
        assert_eq!(start.elapsed(), Duration::from_secs(20));
    }
}
