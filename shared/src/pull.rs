//! Pulling from JetStream: `Puller` (one loop's requests, on one inbox, with backoff
//! after failures), used by both workers, and `pull_loop`, the publisher's loop.
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
/// Longest a pull is read: its expiry and a margin. A pull request that the server lost
/// (it restarted) never ends by itself; this ends it.
const PULL_WAIT: Duration = Duration::from_secs(8);
/// Most messages asked for in one pull.
const MAX_PULL: usize = 64;

/// One loop's pull requests, answered on one inbox that stays subscribed for the loop's
/// life. (A fresh inbox per request, as `PullConsumer::batch` makes one, cost a
/// subscribe and an unsubscribe for every pull: two more messages a job.) One request
/// is open at a time: `ask` opens it, `next` reads it until it is answered in full,
/// expires, or the server ends it.
///
/// A request given up on without its end (no answer by its deadline: a server that
/// restarted, or requests queued while the connection was down and sent on reconnect)
/// may still be waiting on the server: a later message or status of it would be read
/// as the next request's, and each such request would hold one message more, unseen
/// and without progress acks. So the inbox is then replaced: the old one is
/// unsubscribed (the server drops requests nobody listens to), and what had already
/// come to it goes back at once.
pub struct Puller {
    consumer: PullConsumer,
    /// What the messages are acknowledged through.
    context: jetstream::Context,
    inbox: async_nats::Subject,
    replies: async_nats::Subscriber,
    /// Messages the open request may still bring.
    pending: usize,
    /// When the open request is given up on.
    deadline: tokio::time::Instant,
    failures: u32,
}

impl Puller {
    pub async fn new(consumer: PullConsumer, client: async_nats::Client) -> Result<Puller, async_nats::SubscribeError> {
        let inbox = async_nats::Subject::from(client.new_inbox());
        let replies = client.subscribe(inbox.clone()).await?;
        let context = jetstream::new(client);
        let deadline = tokio::time::Instant::now();
        Ok(Puller { consumer, context, inbox, replies, pending: 0, deadline, failures: 0 })
    }

    /// Asks for up to `max` messages (the server keeps the request up to the pull
    /// expiry). After a failed request it backs off (100 ms doubling to 6.4 s). `false`
    /// when `stop` fired.
    pub async fn ask(&mut self, max: usize, stop: &CancellationToken) -> bool {
        let request =
            jetstream::consumer::pull::BatchConfig { batch: max, expires: Some(PULL_EXPIRES), ..Default::default() };
        let sent = tokio::select! {
            biased;
            _ = stop.cancelled() => return false,
            r = self.consumer.request_batch(request, self.inbox.clone()) => r,
        };
        match sent {
            Ok(()) => {
                self.failures = 0;
                self.pending = max;
                self.deadline = tokio::time::Instant::now() + PULL_WAIT;
                true
            }
            Err(e) => {
                self.failures += 1;
                self.pending = 0;
                tracing::warn!(error = %e, "pull failed");
                let pause = Duration::from_millis(100 * 2u64.pow(self.failures.min(6)));
                tokio::select! { _ = tokio::time::sleep(pause) => true, _ = stop.cancelled() => false }
            }
        }
    }

    /// The next message of the open request; `None` once the request is over (answered
    /// in full, expired, ended by the server, or lost with a restarting server: no
    /// answer within its expiry and a margin: then the inbox is replaced).
    pub async fn next(&mut self) -> Option<jetstream::Message> {
        while self.pending > 0 {
            let reply = match tokio::time::timeout_at(self.deadline, self.replies.next()).await {
                Ok(Some(reply)) => reply,
                Ok(None) | Err(_) => {
                    self.renew().await;
                    break;
                }
            };
            match reply.status {
                None | Some(async_nats::StatusCode::OK) => {
                    self.pending -= 1;
                    return Some(jetstream::Message { message: reply, context: self.context.clone() });
                }
                Some(async_nats::StatusCode::IDLE_HEARTBEAT) => {}
                // Expired, or nothing to deliver: the request is over.
                Some(async_nats::StatusCode::TIMEOUT | async_nats::StatusCode::NOT_FOUND) => break,
                Some(status) => {
                    tracing::warn!(status = status.as_u16(), reason = ?reply.description, "pull ended by the server");
                    break;
                }
            }
        }
        self.pending = 0;
        None
    }

    /// A fresh inbox in place of one a request may still be waiting on; what had come
    /// to the old one is handed back at once.
    async fn renew(&mut self) {
        let client = self.context.client();
        let inbox = async_nats::Subject::from(client.new_inbox());
        let replies = match client.subscribe(inbox.clone()).await {
            Ok(replies) => replies,
            Err(e) => {
                tracing::warn!(error = %e, "renewing the pull inbox failed; keeping the old one");
                return;
            }
        };
        let mut old = std::mem::replace(&mut self.replies, replies);
        self.inbox = inbox;
        // Already closed, or the connection is gone: either way nothing more comes to it.
        let _ = old.unsubscribe().await;
        while let Some(Some(reply)) = futures::FutureExt::now_or_never(old.next()) {
            if matches!(reply.status, None | Some(async_nats::StatusCode::OK)) && reply.reply.is_some() {
                ack(&jetstream::Message { message: reply, context: self.context.clone() }, AckKind::Nak(None)).await;
            }
        }
    }
}

/// Runs until `stop` fires. Each message is handed to `handle`, whose future runs on
/// `tasks` holding one slot of `slots`.
pub async fn pull_loop<F, Fut>(
    mut puller: Puller,
    slots: Arc<Semaphore>,
    tasks: TaskTracker,
    stop: CancellationToken,
    handle: F,
) where
    F: Fn(jetstream::Message) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    loop {
        // Wait for a free slot, without keeping it.
        tokio::select! {
            p = slots.clone().acquire_owned() => drop(p.expect("semaphore never closed")),
            _ = stop.cancelled() => return,
        }
        let want = slots.available_permits().clamp(1, MAX_PULL);
        if !puller.ask(want, &stop).await {
            return;
        }
        loop {
            let next = tokio::select! {
                m = puller.next() => m,
                _ = stop.cancelled() => return,
            };
            let Some(msg) = next else { break };
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

    /// Stream `T` on `t.>` and its durable pull consumer `c`.
    async fn stream_and_consumer(js: &jetstream::Context) -> PullConsumer {
        let config = jetstream::stream::Config { name: "T".into(), subjects: vec!["t.>".into()], ..Default::default() };
        let stream = js.create_stream(config).await.unwrap();
        let config = jetstream::consumer::pull::Config { durable_name: Some("c".into()), ..Default::default() };
        stream.create_consumer(config).await.unwrap()
    }

    /// One inbox serves every request of a loop: each request brings what it asked for,
    /// in order, and is over once answered in full (no wait for its expiry); messages
    /// acknowledged through it are gone from the consumer.
    #[tokio::test]
    async fn a_puller_brings_each_request_in_full_on_one_inbox() {
        let server = reviewlane_shared::testing::NatsServer::start();
        let client = async_nats::connect(server.url()).await.unwrap();
        let js = jetstream::new(client.clone());
        let consumer = stream_and_consumer(&js).await;
        for i in 0..5 {
            js.publish(format!("t.{i}"), format!("{i}").into()).await.unwrap().await.unwrap();
        }
        let mut puller = Puller::new(consumer.clone(), client).await.unwrap();
        let stop = CancellationToken::new();
        let mut got = Vec::new();
        for want in [2, 2, 1] {
            assert!(puller.ask(want, &stop).await);
            let started = std::time::Instant::now();
            while let Some(m) = puller.next().await {
                got.push(String::from_utf8(m.payload.to_vec()).unwrap());
                m.double_ack().await.unwrap();
            }
            assert!(started.elapsed() < PULL_EXPIRES, "a request answered in full waited for its expiry");
        }
        assert_eq!(got, ["0", "1", "2", "3", "4"]);
        let mut consumer = consumer;
        let info = consumer.info().await.unwrap();
        assert_eq!((info.num_pending, info.num_ack_pending), (0, 0));
        stop.cancel();
        assert!(!puller.ask(1, &stop).await, "a stopped loop asks for nothing");
    }

    /// A request sent while the server was down, given up on, then sent on reconnect,
    /// waits on the server for nobody: it takes no message that the loop never reads.
    #[tokio::test]
    async fn a_request_given_up_on_holds_no_message_after_the_server_comes_back() {
        let mut server = reviewlane_shared::testing::NatsServer::start();
        let client = async_nats::connect(server.url()).await.unwrap();
        let js = jetstream::new(client.clone());
        let mut consumer = stream_and_consumer(&js).await;
        let mut puller = Puller::new(consumer.clone(), client.clone()).await.unwrap();
        let stop = CancellationToken::new();
        server.kill();
        let down = tokio::time::Instant::now() + Duration::from_secs(5);
        while client.connection_state() == async_nats::connection::State::Connected {
            assert!(tokio::time::Instant::now() < down, "the client never saw the server go");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Sent when the connection is back; given up on by its deadline before that.
        assert!(puller.ask(1, &stop).await);
        assert!(puller.next().await.is_none());
        server.restart();
        let up = tokio::time::Instant::now() + Duration::from_secs(10);
        while client.connection_state() != async_nats::connection::State::Connected {
            assert!(tokio::time::Instant::now() < up, "the client did not reconnect");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        client.flush().await.unwrap();
        for i in 0..2 {
            js.publish(format!("t.{i}"), format!("{i}").into()).await.unwrap().await.unwrap();
        }
        assert!(puller.ask(1, &stop).await);
        let m = puller.next().await.expect("the message asked for");
        assert_eq!(&m.payload[..], b"0");
        m.double_ack().await.unwrap();
        let info = consumer.info().await.unwrap();
        assert_eq!(
            (info.num_pending, info.num_ack_pending),
            (1, 0),
            "a message went to a request the loop no longer reads"
        );
    }
}
