use std::time::Duration;

use async_nats::jetstream;
use reviewlane_api::proto::JobState;
use reviewlane_core::region::Region;
use reviewlane_shared::layout;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_findings_message_twice_is_delivered_once() {
    let stack = Stack::start().await;
    let mut client = stack.client().await;
    let job = submit(&mut client, US_KEY, "once-1", &sample_diff("once")).await;
    assert_eq!(wait_final(&mut client, US_KEY, &job.job_id).await.state, JobState::Published as i32);
    assert!(eventually(Duration::from_secs(5), || stack.webhook.for_job(&job.job_id).len() == 1).await);

    // Publish the very same FINDINGS message again, past JetStream's own dedup (no
    // Nats-Msg-Id): the publisher must deliver nothing new.
    let js = jetstream::new(async_nats::connect(stack.us.nats.url()).await.unwrap());
    let stream = js.get_stream(layout::findings_stream(Region::Us)).await.unwrap();
    let subject = layout::findings_subject(Region::Us, "acme", &job.job_id, 1);
    let original = stream.get_last_raw_message_by_subject(&subject).await.unwrap();
    js.publish(subject.clone(), original.payload.clone()).await.unwrap().await.unwrap();

    // Wait until the publisher has settled the copy.
    let consumer: jetstream::consumer::PullConsumer =
        stream.get_consumer(reviewlane_publisher::startup::CONSUMER_NAME).await.unwrap();
    let settled = poll_until(Duration::from_secs(10), || {
        let mut c = consumer.clone();
        async move {
            let info = c.info().await.ok()?;
            (info.num_pending == 0 && info.num_ack_pending == 0 && info.delivered.stream_sequence >= 2).then_some(())
        }
    });
    assert!(settled.await.is_some(), "publisher settles the copy");
    assert_eq!(stack.webhook.for_job(&job.job_id).len(), 1, "the copy was delivered again");
    assert_eq!(get(&mut client, US_KEY, &job.job_id).await.unwrap().state, JobState::Published as i32);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_webhook_is_retried_then_delivered_once() {
    let stack = Stack::start().await;
    stack.webhook.answer_with([503, 503]);
    let mut client = stack.client().await;
    let job = submit(&mut client, EU_KEY, "retry-hook", &sample_diff("hook")).await;
    assert_eq!(wait_final(&mut client, EU_KEY, &job.job_id).await.state, JobState::Published as i32);
    assert_eq!(stack.webhook.for_job(&job.job_id).len(), 1);
    stack.shutdown().await;
}
