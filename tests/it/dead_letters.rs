//! The dead-letter API: a tenant lists and reads its own dead letters, an operator its
//! region's; a replay is a new job linked to the dead one, idempotent; a replay whose
//! content's retention ended is FAILED_PRECONDITION.

use reviewlane_api::proto::{
    self, GetDeadLetterRequest, JobState, ListDeadLettersRequest, ReplayDeadLetterRequest, TerminalReason,
};
use reviewlane_core::region::Region;
use reviewlane_shared::layout;
use reviewlane_testkit::simprovider::Scripted;
use tonic::Code;
use tonic_types::StatusExt;

use crate::harness::*;

type Client = proto::review_service_client::ReviewServiceClient<tonic::transport::Channel>;

async fn list_all(client: &mut Client, key: &str, page_size: i32) -> (Vec<String>, usize) {
    let (mut ids, mut pages, mut token) = (Vec::new(), 0, String::new());
    loop {
        let req = ListDeadLettersRequest { page_size, page_token: token.clone() };
        let page = client.list_dead_letters(authed(key, req)).await.unwrap().into_inner();
        pages += 1;
        ids.extend(page.dead_letters.into_iter().map(|d| d.job_id));
        if page.next_page_token.is_empty() {
            return (ids, pages);
        }
        token = page.next_page_token;
        assert!(pages < 10);
    }
}

async fn get_dead(client: &mut Client, key: &str, id: &str) -> Result<proto::DeadLetter, tonic::Status> {
    let req = GetDeadLetterRequest { job_id: id.into() };
    client.get_dead_letter(authed(key, req)).await.map(|r| r.into_inner().dead_letter.unwrap())
}

async fn replay(client: &mut Client, key: &str, id: &str) -> Result<proto::Review, tonic::Status> {
    let req = ReplayDeadLetterRequest { job_id: id.into() };
    client.replay_dead_letter(authed(key, req)).await.map(|r| r.into_inner().review.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_listed_read_and_replayed_under_the_jobs_access_rules() {
    let stack = Stack::start().await;
    let mut client = stack.client().await;
    // Three reviews the provider rejects: two of acme's, one of beta's.
    let rejected = || Scripted::Status { status: 400, headers: vec![], body: "{}".into() };
    stack.us.provider.script([rejected(), rejected(), rejected()]);
    let mut dead = Vec::new();
    for (key, idem) in [(US_KEY, "dead-1"), (US_KEY, "dead-2"), (US2_KEY, "dead-3")] {
        let job = submit(&mut client, key, idem, &sample_diff(idem)).await;
        let done = wait_final(&mut client, key, &job.job_id).await;
        assert_eq!((done.state, done.terminal_reason.as_str()), (JobState::Terminal as i32, "upstream_rejected"));
        assert_eq!(done.terminal_reason_enum, TerminalReason::UpstreamRejected as i32);
        dead.push(job.job_id);
    }

    // Each tenant sees its own, paged; the operator sees the region's.
    let listed = |ids: Vec<String>| ids.into_iter().collect::<std::collections::BTreeSet<_>>();
    let eventually_listed = async |client: &mut Client, key: &str, want: usize| {
        let listed = poll_until(std::time::Duration::from_secs(5), || {
            let mut c = client.clone();
            async move { Some(list_all(&mut c, key, 1).await).filter(|(ids, _)| ids.len() >= want) }
        });
        listed.await.unwrap_or_else(|| panic!("dead letters of {key} not listed"))
    };
    let (acme, pages) = eventually_listed(&mut client, US_KEY, 2).await;
    assert_eq!(listed(acme), listed(dead[..2].to_vec()));
    assert_eq!(pages, 2);
    let (beta, _) = eventually_listed(&mut client, US2_KEY, 1).await;
    assert_eq!(beta, vec![dead[2].clone()]);
    let (all, _) = eventually_listed(&mut client, OPERATOR_KEY, 3).await;
    assert_eq!(listed(all), listed(dead.clone()));

    // Reading one: the owner and the operator may, another tenant may not.
    let d = get_dead(&mut client, US_KEY, &dead[0]).await.unwrap();
    assert_eq!((d.terminal_reason.as_str(), d.content_available), ("upstream_rejected", true));
    assert_eq!(d.terminal_reason_enum, TerminalReason::UpstreamRejected as i32);
    assert_eq!(get_dead(&mut client, US2_KEY, &dead[0]).await.unwrap_err().code(), Code::NotFound);
    assert_eq!(get_dead(&mut client, OPERATOR_KEY, &dead[2]).await.unwrap().tenant, "beta");

    // A replay: a new job linked to the dead one, published now that the provider
    // answers; the dead job stays as it was; a second replay is the same new job.
    let new = replay(&mut client, US_KEY, &dead[0]).await.unwrap();
    assert_ne!(new.job_id, dead[0]);
    assert_eq!(new.replay_of, dead[0]);
    let done = wait_final(&mut client, US_KEY, &new.job_id).await;
    assert_eq!(done.state, JobState::Published as i32, "{done:?}");
    assert_eq!(stack.webhook.for_job(&new.job_id).len(), 1);
    assert_eq!(get(&mut client, US_KEY, &dead[0]).await.unwrap().state, JobState::Terminal as i32);
    let repeated = replay(&mut client, US_KEY, &dead[0]).await.unwrap();
    assert_eq!(repeated.job_id, new.job_id);
    assert!(!done.findings.is_empty());
    assert_eq!((repeated.state, &repeated.findings), (done.state, &done.findings), "the new job as it is");
    // Another tenant cannot replay it; the operator can replay beta's.
    assert_eq!(replay(&mut client, US2_KEY, &dead[1]).await.unwrap_err().code(), Code::NotFound);
    let beta_replay = replay(&mut client, OPERATOR_KEY, &dead[2]).await.unwrap();
    assert_eq!(wait_final(&mut client, US2_KEY, &beta_replay.job_id).await.state, JobState::Published as i32);

    // The content's retention ended (purged here): the reference stays, a replay is
    // refused with the reason.
    let js = async_nats::jetstream::new(async_nats::connect(stack.us.url()).await.unwrap());
    let content = js.get_stream(layout::deadletter_content_stream(Region::Us)).await.unwrap();
    content.purge().filter(layout::deadletter_content_subject(Region::Us, "acme", &dead[1])).await.unwrap();
    assert!(!get_dead(&mut client, US_KEY, &dead[1]).await.unwrap().content_available);
    let refused = replay(&mut client, US_KEY, &dead[1]).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert_eq!(refused.get_details_error_info().unwrap().reason, "CONTENT_EXPIRED");
    stack.shutdown().await;
}
