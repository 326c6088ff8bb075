//! Sweeps through the lanes: a manifest created, filled page by page (a page added twice
//! adds nothing twice), sealed; each item an ordinary review linked to its sweep,
//! published once; the sweep's progress counted from its items; a cancelled sweep's
//! items that have not run end at once; another tenant sees none of it.

use std::time::Duration;

use reviewlane_api::proto::{
    self, AddSweepItemsRequest, CancelSweepRequest, CreateSweepRequest, GetSweepRequest, ListSweepItemsRequest,
    ListSweepsRequest, SealSweepRequest, SweepItem, SweepItemState, SweepMode, SweepState, WatchSweepRequest,
};
use tonic::Code;

use crate::harness::*;

fn item(i: usize) -> SweepItem {
    SweepItem {
        item_key: format!("src/file_{i}.rs"),
        diff: format!(
            "diff --git a/src/file_{i}.rs b/src/file_{i}.rs\nnew file mode 100644\n--- /dev/null\n+++ b/src/file_{i}.rs\n@@ -0,0 +1,2 @@\n+fn f_{i}() {{}}\n+// TODO: finish {i}\n"
        ),
        ..Default::default()
    }
}

fn count(sweep: &proto::Sweep, state: SweepItemState) -> u64 {
    sweep.items.iter().find(|c| c.state == state as i32).map_or(0, |c| c.count)
}

async fn sweep_of(client: &mut Client, key: &str, id: &str) -> proto::Sweep {
    client.get_sweep(authed(key, GetSweepRequest { sweep_id: id.into() })).await.unwrap().into_inner().sweep.unwrap()
}

type Client = reviewlane_api::proto::review_service_client::ReviewServiceClient<tonic::transport::Channel>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_through_the_lanes_publishes_each_item_once_and_counts_its_progress() {
    let stack = Stack::start().await;
    let mut client = stack.client().await;
    let create = |key: &str| CreateSweepRequest {
        idempotency_key: key.into(),
        mode: SweepMode::Lanes as i32,
        ..Default::default()
    };
    let sweep = client.create_sweep(authed(US_KEY, create("nightly"))).await.unwrap().into_inner().sweep.unwrap();
    assert_eq!((sweep.state, sweep.runs_on), (SweepState::Open as i32, SweepMode::Lanes as i32));
    // Idempotent per key; another mode under the same key is another request.
    let again = client.create_sweep(authed(US_KEY, create("nightly"))).await.unwrap().into_inner().sweep.unwrap();
    assert_eq!(again.sweep_id, sweep.sweep_id);
    let other = CreateSweepRequest { mode: SweepMode::Auto as i32, ..create("nightly") };
    assert_eq!(client.create_sweep(authed(US_KEY, other)).await.unwrap_err().code(), Code::AlreadyExists);

    // Two pages; the first sent twice adds nothing twice.
    let id = sweep.sweep_id.clone();
    let page =
        |range: std::ops::Range<usize>| AddSweepItemsRequest { sweep_id: id.clone(), items: range.map(item).collect() };
    let first = client.add_sweep_items(authed(US_KEY, page(0..4))).await.unwrap().into_inner();
    assert_eq!((first.added, first.already_present), (4, 0));
    let repeat = client.add_sweep_items(authed(US_KEY, page(0..4))).await.unwrap().into_inner();
    assert_eq!((repeat.added, repeat.already_present), (0, 4));
    let second = client.add_sweep_items(authed(US_KEY, page(3..6))).await.unwrap().into_inner();
    assert_eq!((second.added, second.already_present), (2, 1));
    // Another item under a key the sweep has is another request.
    let mut changed = item(0);
    changed.diff = item(1).diff;
    let clash = AddSweepItemsRequest { sweep_id: id.clone(), items: vec![changed] };
    assert_eq!(client.add_sweep_items(authed(US_KEY, clash)).await.unwrap_err().code(), Code::AlreadyExists);
    // Nothing runs before the seal.
    let open = sweep_of(&mut client, US_KEY, &id).await;
    assert_eq!((open.items_total, count(&open, SweepItemState::Queued)), (6, 6));
    assert!(stack.us.provider.stats().total_calls == 0);
    // Another tenant sees no sweep.
    let foreign = client.get_sweep(authed(US2_KEY, GetSweepRequest { sweep_id: id.clone() })).await.unwrap_err();
    assert_eq!(foreign.code(), Code::NotFound);

    // A watch opened before the seal follows the sweep to its end.
    let watch = client.watch_sweep(authed(US_KEY, WatchSweepRequest { sweep_id: id.clone() })).await.unwrap();
    let mut watch = watch.into_inner();
    let sealed = client.seal_sweep(authed(US_KEY, SealSweepRequest { sweep_id: id.clone() })).await.unwrap();
    assert_eq!(sealed.into_inner().sweep.unwrap().state, SweepState::Sealed as i32);
    let events = tokio::time::timeout(Duration::from_secs(30), async {
        let mut events = Vec::new();
        while let Some(m) = watch.message().await.unwrap() {
            events.push(m.sweep.unwrap());
        }
        events
    })
    .await
    .expect("the watch ends within 30 s");
    let published: Vec<u64> = events.iter().map(|e| count(e, SweepItemState::Published)).collect();
    assert!(published.windows(2).all(|w| w[0] <= w[1]), "{published:?}");
    assert_eq!(events.first().map(|e| e.state), Some(SweepState::Open as i32));
    let last = events.last().unwrap();
    assert_eq!(
        (last.state, count(last, SweepItemState::Published), last.percent_done),
        (SweepState::Sealed as i32, 6, 100.0)
    );
    assert!(events.len() >= 2 && events.len() <= 10, "one event per change, at most one a second: {}", events.len());
    let after_seal = AddSweepItemsRequest { sweep_id: id.clone(), items: vec![item(9)] };
    assert_eq!(client.add_sweep_items(authed(US_KEY, after_seal)).await.unwrap_err().code(), Code::FailedPrecondition);
    // A page it has (a retry after the seal) is answered as it stands.
    let retried = client.add_sweep_items(authed(US_KEY, page(0..2))).await.unwrap().into_inner();
    assert_eq!((retried.added, retried.already_present), (0, 2));

    let done = poll_until(Duration::from_secs(30), || {
        let mut client = client.clone();
        let id = id.clone();
        async move {
            let s = sweep_of(&mut client, US_KEY, &id).await;
            (count(&s, SweepItemState::Published) == 6).then_some(s)
        }
    })
    .await
    .expect("every item published within 30 s");
    assert_eq!((done.items_total, done.percent_done), (6, 100.0));
    assert!(done.estimated_completion.is_none(), "nothing left to estimate");
    let tokens = done.tokens.unwrap();
    assert_eq!((tokens.input, tokens.output), (600, 300), "the items' paid calls (100 in, 50 out each)");

    // Each item is an ordinary review linked to its sweep, delivered once.
    let listed = client
        .list_sweep_items(authed(
            US_KEY,
            ListSweepItemsRequest { sweep_id: id.clone(), page_size: 4, ..Default::default() },
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.items.len(), 4);
    assert!(!listed.next_page_token.is_empty());
    let rest = client
        .list_sweep_items(authed(
            US_KEY,
            ListSweepItemsRequest {
                sweep_id: id.clone(),
                page_size: 4,
                page_token: listed.next_page_token.clone(),
                ..Default::default()
            },
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(rest.items.len(), 2);
    assert!(rest.next_page_token.is_empty());
    let all: Vec<_> = listed.items.iter().chain(&rest.items).collect();
    let mut keys: Vec<&str> = all.iter().map(|i| i.item_key.as_str()).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        (0..6).map(|i| format!("src/file_{i}.rs")).collect::<Vec<_>>().iter().map(String::as_str).collect::<Vec<_>>()
    );
    for i in &all {
        assert_eq!(i.state, SweepItemState::Published as i32);
        let review = get(&mut client, US_KEY, &i.job_id).await.unwrap();
        assert_eq!((review.sweep_id.as_str(), review.lane), (id.as_str(), proto::Lane::Batch as i32));
        assert!(eventually(Duration::from_secs(10), || stack.webhook.for_job(&i.job_id).len() == 1).await);
    }
    assert_eq!(stack.us.provider.stats().paid_calls.len(), 6, "each item paid once");
    // The tenant's sweeps, newest first; another tenant has none.
    let mine = client.list_sweeps(authed(US_KEY, ListSweepsRequest::default())).await.unwrap().into_inner();
    assert_eq!(mine.sweeps.iter().map(|s| s.sweep_id.as_str()).collect::<Vec<_>>(), [id.as_str()]);
    assert_eq!(count(&mine.sweeps[0], SweepItemState::Published), 6);
    let theirs = client.list_sweeps(authed(US2_KEY, ListSweepsRequest::default())).await.unwrap().into_inner();
    assert!(theirs.sweeps.is_empty());
    // Filtered by state: none failed.
    let failed = ListSweepItemsRequest {
        sweep_id: id.clone(),
        states: vec![SweepItemState::Failed as i32],
        ..Default::default()
    };
    assert!(client.list_sweep_items(authed(US_KEY, failed)).await.unwrap().into_inner().items.is_empty());
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_sweep_runs_nothing_more_and_counts_its_items_cancelled() {
    let stack = Stack::start().await;
    let mut client = stack.client().await;
    let create =
        CreateSweepRequest { idempotency_key: "to-cancel".into(), mode: SweepMode::Lanes as i32, ..Default::default() };
    let id = client.create_sweep(authed(US_KEY, create)).await.unwrap().into_inner().sweep.unwrap().sweep_id;
    let page = AddSweepItemsRequest { sweep_id: id.clone(), items: (0..3).map(item).collect() };
    client.add_sweep_items(authed(US_KEY, page)).await.unwrap();
    let cancelled = client.cancel_sweep(authed(US_KEY, CancelSweepRequest { sweep_id: id.clone() })).await.unwrap();
    let cancelled = cancelled.into_inner().sweep.unwrap();
    assert_eq!(cancelled.state, SweepState::Cancelled as i32);
    assert_eq!((count(&cancelled, SweepItemState::Cancelled), cancelled.percent_done), (3, 100.0));
    // A cancelled sweep is not sealed, and takes no more items.
    let seal = client.seal_sweep(authed(US_KEY, SealSweepRequest { sweep_id: id.clone() })).await.unwrap_err();
    assert_eq!(seal.code(), Code::FailedPrecondition);
    let more = AddSweepItemsRequest { sweep_id: id.clone(), items: vec![item(7)] };
    assert_eq!(client.add_sweep_items(authed(US_KEY, more)).await.unwrap_err().code(), Code::FailedPrecondition);
    assert_eq!(stack.us.provider.stats().total_calls, 0, "nothing of it ran");
    stack.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_called_when_its_sweep_is_cancelled_is_not_called_again_after_its_call_fails() {
    use reviewlane_testkit::simprovider::{Scripted, SimConfig};
    let provider = SimConfig { latency: Duration::from_millis(800), ..Default::default() };
    let stack = Stack::start_with(StackOptions { us_provider: provider, ..Default::default() }).await;
    let mut client = stack.client().await;
    // Its one call fails with a transient error: without the cancel it would be retried.
    stack.us.provider.script([Scripted::Status { status: 503, headers: Vec::new(), body: "{}".into() }]);
    let create = CreateSweepRequest {
        idempotency_key: "cancel-mid-call".into(),
        mode: SweepMode::Lanes as i32,
        ..Default::default()
    };
    let id = client.create_sweep(authed(US_KEY, create)).await.unwrap().into_inner().sweep.unwrap().sweep_id;
    let page = AddSweepItemsRequest { sweep_id: id.clone(), items: vec![item(0)] };
    client.add_sweep_items(authed(US_KEY, page)).await.unwrap();
    client.seal_sweep(authed(US_KEY, SealSweepRequest { sweep_id: id.clone() })).await.unwrap();
    let provider = &stack.us.provider;
    let calling =
        poll_until(Duration::from_secs(10), || async move { (provider.in_flight() == 1).then_some(()) }).await;
    assert!(calling.is_some(), "the item's call started");
    client.cancel_sweep(authed(US_KEY, CancelSweepRequest { sweep_id: id.clone() })).await.unwrap();

    let req = ListSweepItemsRequest { sweep_id: id.clone(), ..Default::default() };
    let job = client.list_sweep_items(authed(US_KEY, req)).await.unwrap().into_inner().items[0].job_id.clone();
    let done = wait_final(&mut client, US_KEY, &job).await;
    assert_eq!(
        (done.state, done.terminal_reason.as_str()),
        (proto::JobState::Terminal as i32, "cancelled"),
        "{done:?}"
    );
    let stats = stack.us.provider.stats();
    assert_eq!(stats.calls_by_job.get(&job), Some(&1), "called once, not again after the cancel");
    assert!(!stats.paid_by_job.contains_key(&job), "nothing paid");
    let swept = sweep_of(&mut client, US_KEY, &id).await;
    assert_eq!((count(&swept, SweepItemState::Cancelled), swept.percent_done), (1, 100.0));
    stack.shutdown().await;
}

/// A sweep's manifest listed while its items' entries are being rewritten (each item's
/// review stripped once it is handed over, as the extractor does): every listing holds
/// every item once. Progress, cancellation and a coordinator's round read these; a
/// listing one item short ended a sweep at 100 % with that item still running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_listed_while_its_items_are_rewritten_holds_every_item_once() {
    use reviewlane_core::region::Region;
    use reviewlane_core::sweep::ItemEntry;
    use reviewlane_shared::layout::{self, LayoutConfig};
    use reviewlane_shared::sweeps::Sweeps;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let nats = reviewlane_shared::testing::NatsServer::start();
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let layout = layout::ensure(&js, Region::Us, &LayoutConfig::default()).await.unwrap();
    let store = Sweeps::new(js.clone(), layout.sweeps.clone());
    // Five pages of ten, in the order added; their job ids (digests, in production)
    // sort the other way.
    let n = 50;
    let items: Vec<ItemEntry> = (0..n)
        .map(|i| ItemEntry {
            job_id: format!("us_job{:04}", n - i),
            item_key: format!("k{i}"),
            request_digest: "d".into(),
            added_at_ms: 1_000 + (i / 10) as u64,
            position: (i % 10) as u32,
            review: None,
        })
        .collect();
    for item in &items {
        store.add_item("s1", item).await.unwrap();
    }
    let (stop, rewrites) = (std::sync::Arc::new(AtomicBool::new(false)), std::sync::Arc::new(AtomicUsize::new(0)));
    let writer = {
        let (store, items) = (Sweeps::new(js.clone(), layout.sweeps.clone()), items.clone());
        let (stop, rewrites) = (stop.clone(), rewrites.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let i = rewrites.fetch_add(1, Ordering::Relaxed);
                store.strip_item("s1", &items[i % items.len()]).await.unwrap();
            }
        })
    };
    let want: Vec<String> = items.iter().map(|i| i.job_id.clone()).collect();
    let mut sorted = want.clone();
    sorted.sort();
    for round in 0..200 {
        let mut ids = store.item_ids("s1").await.unwrap();
        ids.sort();
        assert_eq!(ids, sorted, "ids, listing {round}");
        let listed: Vec<String> = store.items("s1").await.unwrap().into_iter().map(|i| i.job_id).collect();
        assert_eq!(listed, want, "entries in the order added, listing {round}");
    }
    stop.store(true, Ordering::Relaxed);
    writer.await.unwrap();
    assert!(rewrites.load(Ordering::Relaxed) > 200, "the entries were rewritten throughout");
    // An entry deleted by hand (an operator's `nats kv del`) is no item.
    layout.sweeps.delete(format!("item.s1.{}", want[0])).await.unwrap();
    let listed: Vec<String> = store.items("s1").await.unwrap().into_iter().map(|i| i.job_id).collect();
    assert_eq!(listed, want[1..], "a deleted entry is left out");
}
