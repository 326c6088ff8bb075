//! ListReviews: a tenant's reviews in its region, newest first, paged (AIP-158),
//! filtered by state, lane, repository and creation time, from the job index — never
//! another tenant's.

use reviewlane_api::proto::{self, JobState, ListReviewsRequest};
use tonic::Code;

use crate::harness::*;

async fn list(
    client: &mut proto::review_service_client::ReviewServiceClient<tonic::transport::Channel>,
    key: &str,
    req: ListReviewsRequest,
) -> Result<proto::ListReviewsResponse, tonic::Status> {
    client.list_reviews(authed(key, req)).await.map(|r| r.into_inner())
}

/// Every page of a listing, in order.
async fn all_pages(
    client: &mut proto::review_service_client::ReviewServiceClient<tonic::transport::Channel>,
    key: &str,
    req: ListReviewsRequest,
) -> (Vec<String>, usize) {
    let mut ids = Vec::new();
    let mut pages = 0;
    let mut token = String::new();
    loop {
        let page = list(client, key, ListReviewsRequest { page_token: token.clone(), ..req.clone() }).await.unwrap();
        pages += 1;
        assert!(page.reviews.iter().all(|r| r.findings.is_empty()), "lists carry no findings");
        ids.extend(page.reviews.into_iter().map(|r| r.job_id));
        if page.next_page_token.is_empty() {
            return (ids, pages);
        }
        token = page.next_page_token;
        assert!(pages < 20, "paging does not end");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_reviews_newest_first_paged_and_filtered() {
    let stack = Stack::start().await;
    let mut client = stack.client().await;
    let mut ids = Vec::new();
    let mut created = Vec::new();
    for i in 0..5 {
        let mut req = submit_req(US_KEY, &format!("list-{i}"), &sample_diff(&format!("l{i}")));
        let r = req.get_mut();
        r.metadata.as_mut().unwrap().repository = if i < 3 { "acme/app".into() } else { "acme/lib".into() };
        if i >= 3 {
            r.lane = proto::Lane::Batch as i32;
        }
        let review = client.submit_review(req).await.unwrap().into_inner().review.unwrap();
        created.push(review.created_at.unwrap());
        ids.push(review.job_id);
    }
    for id in &ids {
        wait_final(&mut client, US_KEY, id).await;
    }
    // Another tenant's review, in the same region: never listed for acme.
    let other = submit(&mut client, US2_KEY, "list-beta", &sample_diff("beta")).await;
    let newest_first: Vec<String> = ids.iter().rev().cloned().collect();

    // Pages of two: 2 + 2 + 1, newest first, the last page without a token.
    let (listed, pages) =
        all_pages(&mut client, US_KEY, ListReviewsRequest { page_size: 2, ..Default::default() }).await;
    assert_eq!(listed, newest_first);
    assert_eq!(pages, 3);
    let (beta, _) = all_pages(&mut client, US2_KEY, ListReviewsRequest::default()).await;
    assert_eq!(beta, vec![other.job_id.clone()]);

    // Filters: lane, repository, creation time, state.
    let batch = ListReviewsRequest { lane: proto::Lane::Batch as i32, ..Default::default() };
    assert_eq!(all_pages(&mut client, US_KEY, batch).await.0, newest_first[..2].to_vec());
    let app = ListReviewsRequest { repository: "acme/app".into(), ..Default::default() };
    assert_eq!(all_pages(&mut client, US_KEY, app).await.0, newest_first[2..].to_vec());
    let recent = ListReviewsRequest { created_after: Some(created[3]), ..Default::default() };
    assert_eq!(all_pages(&mut client, US_KEY, recent).await.0, newest_first[..2].to_vec());
    let earlier = ListReviewsRequest { created_before: Some(created[1]), ..Default::default() };
    assert_eq!(all_pages(&mut client, US_KEY, earlier).await.0, vec![ids[0].clone()]);
    let published = ListReviewsRequest { states: vec![JobState::Published as i32], ..Default::default() };
    assert_eq!(all_pages(&mut client, US_KEY, published).await.0, newest_first);
    let terminal = ListReviewsRequest { states: vec![JobState::Terminal as i32], ..Default::default() };
    assert!(all_pages(&mut client, US_KEY, terminal).await.0.is_empty());

    // A token is good only for the filters it was issued with; a negative size is refused.
    let first = list(&mut client, US_KEY, ListReviewsRequest { page_size: 1, ..Default::default() }).await.unwrap();
    let reused =
        ListReviewsRequest { page_token: first.next_page_token, lane: proto::Lane::Batch as i32, ..Default::default() };
    assert_eq!(list(&mut client, US_KEY, reused).await.unwrap_err().code(), Code::InvalidArgument);
    let negative = ListReviewsRequest { page_size: -1, ..Default::default() };
    assert_eq!(list(&mut client, US_KEY, negative).await.unwrap_err().code(), Code::InvalidArgument);
    let garbage = ListReviewsRequest { page_token: "xyz".into(), ..Default::default() };
    assert_eq!(list(&mut client, US_KEY, garbage).await.unwrap_err().code(), Code::InvalidArgument);
    stack.shutdown().await;
}
