use reviewlane_shared::proto::{CancelReviewRequest, GetReviewRequest, SubmitReviewRequest};
use tonic::Code;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_and_cross_tenant_access_are_refused() {
    let stack = Stack::start().await;
    let mut client = stack.client().await;

    let no_key = tonic::Request::new(SubmitReviewRequest { diff: sample_diff("a"), ..Default::default() });
    assert_eq!(client.submit_review(no_key).await.unwrap_err().code(), Code::Unauthenticated);
    let unknown = submit_req("not-a-key", "k", &sample_diff("a"));
    assert_eq!(client.submit_review(unknown).await.unwrap_err().code(), Code::Unauthenticated);
    let mut malformed = tonic::Request::new(SubmitReviewRequest::default());
    malformed.metadata_mut().insert("authorization", "Basic abc".parse().unwrap());
    assert_eq!(client.submit_review(malformed).await.unwrap_err().code(), Code::Unauthenticated);

    let job = submit(&mut client, US_KEY, "mine", &sample_diff("a")).await;
    // Tenant B, same region, and a tenant of another region: not found, never forbidden.
    for key in [US2_KEY, EU_KEY] {
        assert_eq!(get(&mut client, key, &job.job_id).await.unwrap_err().code(), Code::NotFound);
        let cancel = client.cancel_review(authed(key, CancelReviewRequest { job_id: job.job_id.clone() })).await;
        assert_eq!(cancel.unwrap_err().code(), Code::NotFound);
    }
    let unauth_get = tonic::Request::new(GetReviewRequest { job_id: job.job_id.clone() });
    assert_eq!(client.get_review(unauth_get).await.unwrap_err().code(), Code::Unauthenticated);
    // The owner still sees it.
    assert!(get(&mut client, US_KEY, &job.job_id).await.is_ok());
    // A malformed id is an argument error.
    assert_eq!(get(&mut client, US_KEY, "nope").await.unwrap_err().code(), Code::InvalidArgument);

    // Health is served without a key.
    let mut health = tonic_health_client(&stack).await;
    let resp = health.check(tonic_health_req()).await.unwrap().into_inner();
    assert_eq!(resp.status, 1, "SERVING");
    stack.shutdown().await;
}

async fn tonic_health_client(
    stack: &Stack,
) -> tonic_health::pb::health_client::HealthClient<tonic::transport::Channel> {
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{}", stack.ingress)).unwrap().connect().await.unwrap();
    tonic_health::pb::health_client::HealthClient::new(channel)
}

fn tonic_health_req() -> tonic_health::pb::HealthCheckRequest {
    tonic_health::pb::HealthCheckRequest { service: "reviewlane.v1.ReviewService".into() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_lists_the_review_service() {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

    let stack = Stack::start().await;
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{}", stack.ingress)).unwrap().connect().await.unwrap();
    let mut client = ServerReflectionClient::new(channel);
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut resp = client.server_reflection_info(futures::stream::iter([req])).await.unwrap().into_inner();
    let msg = resp.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = msg.message_response else {
        panic!("unexpected reflection answer")
    };
    let names: Vec<_> = list.service.into_iter().map(|s| s.name).collect();
    assert!(names.contains(&"reviewlane.v1.ReviewService".to_string()), "{names:?}");
    assert!(names.contains(&"grpc.health.v1.Health".to_string()), "{names:?}");
    stack.shutdown().await;
}
