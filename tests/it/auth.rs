use std::time::Duration;

use reviewlane_api::proto::{CancelReviewRequest, GetReviewRequest, SubmitReviewRequest};
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

    // The older protocol version, as older grpcurl and the Python client speak it.
    {
        use tonic_reflection::pb::v1alpha::ServerReflectionRequest;
        use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse;
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", stack.ingress))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let req = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut resp = ServerReflectionClient::new(channel)
            .server_reflection_info(futures::stream::iter([req]))
            .await
            .unwrap()
            .into_inner();
        let Some(MessageResponse::ListServicesResponse(list)) = resp.message().await.unwrap().unwrap().message_response
        else {
            panic!("unexpected v1alpha reflection answer")
        };
        assert!(list.service.iter().any(|s| s.name == "reviewlane.v1.ReviewService"), "{list:?}");
    }
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_readiness_follow_the_nats_connection() {
    let mut stack = Stack::start().await;
    let mut health = tonic_health_client(&stack).await;
    let status = |h: &mut tonic_health::pb::health_client::HealthClient<tonic::transport::Channel>| {
        let mut h = h.clone();
        async move { h.check(tonic_health_req()).await.unwrap().into_inner().status }
    };
    assert_eq!(status(&mut health).await, 1, "SERVING");
    let ready = |addr| async move { http_status_ok(addr, "/readyz").await };
    assert!(ready(stack.ingress_admin).await);

    // The US nats-server dies: NOT_SERVING (2) and not ready, within a bounded wait.
    stack.us.nats.kill();
    let down = poll_until(Duration::from_secs(10), || {
        let mut h = health.clone();
        async move { (status(&mut h).await == 2).then_some(()) }
    });
    assert!(down.await.is_some(), "still SERVING with the US NATS down");
    assert!(!ready(stack.ingress_admin).await);
    let connected = |page: String| metric_sum(&page, "reviewlane_nats_connected{region=\"us\"}");
    assert_eq!(connected(http_get(stack.ingress_admin, "/metrics").await), 0.0);
    assert_eq!(
        metric_sum(&http_get(stack.ingress_admin, "/metrics").await, "reviewlane_nats_connected{region=\"eu\"}"),
        1.0
    );

    // Back on the same port: the ingress reconnects by itself and serves again.
    stack.us.nats.restart();
    let back = poll_until(Duration::from_secs(20), || {
        let mut h = health.clone();
        async move { (status(&mut h).await == 1 && ready(stack.ingress_admin).await).then_some(()) }
    });
    assert!(back.await.is_some(), "not SERVING again after the US NATS came back");
    assert_eq!(connected(http_get(stack.ingress_admin, "/metrics").await), 1.0);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watches_are_kept_alive_and_limited_per_tenant() {
    use reviewlane_api::proto::WatchReviewRequest;
    let limits = reviewlane_ingress::config::ServerLimits {
        watch_keepalive: Duration::from_millis(300),
        max_watches_per_tenant: 2,
        ..Default::default()
    };
    // No extractor: the job stays waiting, so only keepalives move the stream.
    let stack = Stack::start_with(StackOptions { extractors: 0, ingress_limits: limits, ..Default::default() }).await;
    let mut client = stack.client().await;
    let job = submit(&mut client, US_KEY, "watched", &sample_diff("watched")).await;
    let watch = |client: &mut reviewlane_api::proto::review_service_client::ReviewServiceClient<_>| {
        let req = authed(US_KEY, WatchReviewRequest { job_id: job.job_id.clone() });
        let mut c = client.clone();
        async move { c.watch_review(req).await }
    };
    let mut first = watch(&mut client).await.expect("first watch").into_inner();
    // The review as it stands, then again every keepalive period although nothing changed.
    let three = async {
        for _ in 0..3 {
            assert!(first.message().await.unwrap().is_some());
        }
    };
    tokio::time::timeout(Duration::from_secs(5), three).await.expect("keepalive messages arrive");
    let second = watch(&mut client).await.expect("second watch");
    let third = watch(&mut client).await.expect_err("over the tenant's open watches");
    assert_eq!(third.code(), tonic::Code::ResourceExhausted, "{third:?}");
    // Another tenant is not limited by this one's watches.
    let other = submit(&mut client, US2_KEY, "other-watch", &sample_diff("other")).await;
    let req = authed(US2_KEY, WatchReviewRequest { job_id: other.job_id.clone() });
    client.watch_review(req).await.expect("another tenant watches");
    // A closed watch frees its place.
    drop(first);
    drop(second);
    let freed = poll_until(Duration::from_secs(5), || {
        let mut c = client.clone();
        async move { watch(&mut c).await.ok().map(|_| ()) }
    });
    assert!(freed.await.is_some(), "closed watches never freed their places");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_sees_every_revision_of_the_review_in_order() {
    use reviewlane_api::proto::{JobState, WatchReviewRequest};
    use reviewlane_core::clock;
    use reviewlane_core::job::{Budget, Event};

    // No extractor: the revisions below are the only ones. They are written back to back,
    // faster than any polling interval; the watch follows the record itself, so it shows
    // each of them, in order, and no revision twice.
    let stack = Stack::start_with(StackOptions { extractors: 0, ..Default::default() }).await;
    let mut client = stack.client().await;
    let job = submit(&mut client, US_KEY, "every-revision", &sample_diff("rev")).await;
    let mut stream = client
        .watch_review(authed(US_KEY, WatchReviewRequest { job_id: job.job_id.clone() }))
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap().review.unwrap();
    assert_eq!(first.state, JobState::Waiting as i32);

    let s = crate::manual::stores(stack.us.nats.url(), reviewlane_shared::Region::Us, clock::system()).await;
    let now = clock::system().now_ms();
    let lease = || Event::Leased { owner: "test".into(), lease_expires_at_ms: now + 60_000 };
    for generation in 1..=3 {
        s.jobs.apply(&job.job_id, &lease()).await.unwrap();
        let retry = Event::RetryScheduled {
            generation,
            budget: Budget::Congestion,
            next_eligible_at_ms: now,
            upstream_status: Some("429".into()),
            invalid_output: None,
        };
        s.jobs.apply(&job.job_id, &retry).await.unwrap();
    }
    s.jobs.apply(&job.job_id, &Event::Cancel).await.unwrap();

    let mut seen = Vec::new();
    let read = async {
        while let Some(m) = stream.message().await.unwrap() {
            let r = m.review.unwrap();
            seen.push((r.state, r.attempts.map(|a| a.congestion).unwrap_or_default()));
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read).await.expect("the watch ends at the final state");
    let (run, wait) = (JobState::Running as i32, JobState::RetryScheduled as i32);
    let expected = vec![(run, 0), (wait, 1), (run, 1), (wait, 2), (run, 2), (wait, 3), (JobState::Terminal as i32, 3)];
    assert_eq!(seen, expected);
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grpc_listener_serves_tls_and_can_require_client_certificates() {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
    let dir = tempfile::tempdir().unwrap();
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_pem = ca_params.self_signed(&ca_key).unwrap().pem();
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf = |names: Vec<String>| {
        let key = KeyPair::generate().unwrap();
        (CertificateParams::new(names).unwrap().signed_by(&key, &issuer).unwrap().pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf(vec!["localhost".into()]);
    let (client_cert, client_key) = leaf(vec!["ci-client".into()]);
    let file = |name: &str, content: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, content).unwrap();
        p
    };
    let tls = reviewlane_ingress::config::GrpcTls {
        cert_file: file("server.pem", &server_cert),
        key_file: file("server-key.pem", &server_key),
        client_ca_file: Some(file("ca.pem", &ca_pem)),
    };
    let stack = Stack::start_with(StackOptions { grpc_tls: Some(tls), ..Default::default() }).await;
    let endpoint =
        || Endpoint::from_shared(format!("https://{}", stack.ingress)).unwrap().connect_timeout(Duration::from_secs(5));
    let base = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&ca_pem)).domain_name("localhost");

    // With a client certificate: served over TLS.
    let with_cert = base.clone().identity(Identity::from_pem(&client_cert, &client_key));
    let channel = endpoint().tls_config(with_cert).unwrap().connect().await.expect("TLS connection");
    let mut client = reviewlane_api::proto::review_service_client::ReviewServiceClient::new(channel);
    let job = client.submit_review(submit_req(US_KEY, "over-tls", &sample_diff("tls"))).await.expect("submit over TLS");
    assert!(!job.into_inner().review.unwrap().job_id.is_empty());

    // Without one, or in plaintext: no service.
    let refused = match endpoint().tls_config(base).unwrap().connect().await {
        Err(_) => true,
        Ok(channel) => reviewlane_api::proto::review_service_client::ReviewServiceClient::new(channel)
            .submit_review(submit_req(US_KEY, "no-cert", &sample_diff("x")))
            .await
            .is_err(),
    };
    assert!(refused, "served a client without a certificate");
    let plain =
        reviewlane_api::proto::review_service_client::ReviewServiceClient::connect(format!("http://{}", stack.ingress))
            .await;
    let plain_refused = match plain {
        Err(_) => true,
        Ok(mut c) => c.submit_review(submit_req(US_KEY, "plain", &sample_diff("p"))).await.is_err(),
    };
    assert!(plain_refused, "served plaintext on a TLS listener");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_development_certificate_serves_tls() {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
    // What compose mounts (deploy/tls/): a caller trusting dev.crt reaches the ingress.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/tls");
    let tls = reviewlane_ingress::config::GrpcTls {
        cert_file: dir.join("dev.crt"),
        key_file: dir.join("dev.key"),
        client_ca_file: None,
    };
    let stack = Stack::start_with(StackOptions { grpc_tls: Some(tls), extractors: 0, ..Default::default() }).await;
    let ca = std::fs::read_to_string(dir.join("dev.crt")).unwrap();
    let config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)).domain_name("localhost");
    let channel = Endpoint::from_shared(format!("https://{}", stack.ingress))
        .unwrap()
        .tls_config(config)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = reviewlane_api::proto::review_service_client::ReviewServiceClient::new(channel);
    let review =
        client.submit_review(submit_req(US_KEY, "dev-cert", &sample_diff("d"))).await.expect("served over TLS");
    assert!(!review.into_inner().review.unwrap().job_id.is_empty());
    stack.shutdown().await;
}
