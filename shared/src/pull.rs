//! The pull loop both workers share: take a free slot, then pull at most as many
//! messages as there are free slots, so no message sits leased without a worker.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer};
use futures::StreamExt;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

/// Longest a pull request waits on the server for a message.
const PULL_EXPIRES: Duration = Duration::from_secs(5);
/// Most messages asked for in one pull.
const MAX_PULL: usize = 64;

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
        // Take a free slot before pulling: never hold a lease without a slot to use it.
        let first = tokio::select! {
            p = slots.clone().acquire_owned() => p.expect("semaphore never closed"),
            _ = stop.cancelled() => return,
        };
        let mut permits = vec![first];
        while permits.len() < MAX_PULL {
            match slots.clone().try_acquire_owned() {
                Ok(p) => permits.push(p),
                Err(_) => break,
            }
        }
        let batch = tokio::select! {
            b = consumer.batch().max_messages(permits.len()).expires(PULL_EXPIRES).messages() => b,
            _ = stop.cancelled() => return,
        };
        let mut batch = match batch {
            Ok(b) => b,
            Err(e) => {
                failures += 1;
                tracing::warn!(error = %e, "pull failed");
                let pause = Duration::from_millis(100 * 2u64.pow(failures.min(6)));
                tokio::select! { _ = tokio::time::sleep(pause) => continue, _ = stop.cancelled() => return }
            }
        };
        failures = 0;
        loop {
            let next = tokio::select! {
                m = batch.next() => m,
                _ = stop.cancelled() => return,
            };
            let Some(msg) = next else { break };
            let msg = match msg {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(error = %e, "pull message error");
                    break;
                }
            };
            let Some(permit) = permits.pop() else { break };
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
