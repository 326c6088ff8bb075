//! The GitHub pull-request review sink: one review per job on the pull request the
//! review's metadata names, with line comments for findings on lines of the pull
//! request's diff (up to `max_comments`) and the rest in the review's summary.
//!
//! - Each finding carries a hidden marker with its fingerprint; the comments and reviews
//!   already on the pull request are listed first, so a re-run posts only what is new
//!   (and nothing when nothing is).
//! - The pull request's files are listed to know which lines GitHub accepts comments
//!   on; should GitHub still answer 422, the review is posted again with every finding
//!   in its summary rather than failing.
//! - GitHub's limits are obeyed like a provider's: a 403/429 with `retry-after`
//!   (secondary limit) or with `x-ratelimit-remaining: 0` (primary limit, until
//!   `x-ratelimit-reset`), and a success that leaves no requests, pause every delivery
//!   to that account until then — in this process, and in the region's other
//!   publishers through `PUBLISHED_<R>` (as the extractors share a provider's pause);
//!   the job's delivery is handed back with that delay. No request is sent while
//!   paused: every request checks the pause first, so a success that used the last
//!   request stops the delivery in progress too.
//! - Content-creating requests (posting a review) are serial and at least
//!   [`CONTENT_INTERVAL`] apart per account, as GitHub asks, across the region's
//!   publishers (a compare-and-set on `PUBLISHED_<R>`, key `github-pace.<digest>`);
//!   a delivery whose turn has not come is handed back until it has, holding nothing.
//! - GitHub asks integrations to slow down after a secondary limit: each one widens the
//!   account's content interval ([`widen`]: doubled, and at least by the wait; up to
//!   [`SLOWDOWN_CAP`]), narrowed back by half per [`SLOWDOWN_QUIET`] without one, for
//!   the region's publishers alike (`PUBLISHED_<R>`, key `github-interval.<digest>`),
//!   so a backlog meets the limit once rather than at every resumption.
//! - Answers that hit a limit are counted by kind (`primary`, `secondary`) in
//!   `reviewlane_github_rate_limited_total`; the widest interval in force is
//!   `reviewlane_github_content_interval_seconds`.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use reviewlane_core::findings::{Finding, Side};
use reviewlane_core::messages::Delivery;
use serde_json::{Value, json};

use crate::outcome::SinkOutcome;

/// The hidden marker a finding's comment or summary line carries.
pub fn marker(fingerprint: &str) -> String {
    format!("<!-- reviewlane:fingerprint={fingerprint} -->")
}

/// Fingerprints of the markers in `text`.
pub fn markers(text: &str) -> impl Iterator<Item = &str> {
    text.split("<!-- reviewlane:fingerprint=").skip(1).filter_map(|rest| rest.split_once(" -->").map(|(fp, _)| fp))
}

fn fingerprint(f: &Finding) -> String {
    f.fingerprint.clone().unwrap_or_else(|| reviewlane_core::findings::fingerprint(f))
}

/// GitHub's side of a finding.
fn side(f: &Finding) -> &'static str {
    match f.side() {
        Side::New => "RIGHT",
        Side::Old => "LEFT",
    }
}

/// A line comment's body: what, why, what to do, a suggestion when there is a
/// replacement, and the marker.
pub fn comment_body(f: &Finding) -> String {
    let mut text = format!("**{}** · {} · {}\n\n{}", f.severity, f.category, f.title, f.message);
    if let Some(action) = &f.suggested_action {
        text.push_str(&format!("\n\n**Suggested action:** {action}"));
    }
    if let Some(replacement) = f.suggested_replacement.as_ref().filter(|_| f.side() == Side::New) {
        text.push_str(&format!("\n\n```suggestion\n{}\n```", replacement.trim_end_matches('\n')));
    }
    text.push_str(&format!("\n\n{}", marker(&fingerprint(f))));
    text
}

/// The review to post: its summary and its line comments. `None`: nothing new.
#[derive(Debug, Clone, PartialEq)]
pub struct ComposedReview {
    pub body: String,
    pub comments: Vec<Value>,
    /// Findings in the summary only.
    pub summarised: usize,
}

/// Composes the review of `findings` (sorted, most severe first) given the fingerprints
/// already on the pull request and the lines GitHub takes comments on: new findings on
/// commentable lines become line comments, up to `max_comments`; the rest are listed in
/// the summary. `all_in_summary`: no line comments at all (after a 422).
pub fn compose(
    findings: &[Finding],
    existing: &HashSet<String>,
    commentable: &HashSet<(String, u32, &'static str)>,
    max_comments: usize,
    all_in_summary: bool,
) -> Option<ComposedReview> {
    let new: Vec<&Finding> = findings.iter().filter(|f| !existing.contains(&fingerprint(f))).collect();
    if new.is_empty() {
        return None;
    }
    let mut comments = Vec::new();
    let mut summary = Vec::new();
    for f in new {
        let lines = f.lines();
        // GitHub names a file by its text: one whose name is not UTF-8 takes no comment.
        let name = reviewlane_core::diff::path::utf8(&f.path).map(|n| n.into_owned());
        let fits = !all_in_summary
            && comments.len() < max_comments
            && name.as_ref().is_some_and(|n| lines.clone().all(|l| commentable.contains(&(n.clone(), l, side(f)))));
        if fits {
            let mut c = json!({"path": name, "line": lines.end(), "side": side(f), "body": comment_body(f)});
            if lines.start() < lines.end() {
                c["start_line"] = json!(lines.start());
                c["start_side"] = json!(side(f));
            }
            comments.push(c);
        } else {
            summary.push(f);
        }
    }
    let mut body = format!(
        "reviewlane found {} new finding{}.",
        comments.len() + summary.len(),
        if comments.len() + summary.len() == 1 { "" } else { "s" }
    );
    if !summary.is_empty() {
        body.push_str("\n\nNot on a line of this diff, or over the comment limit:\n");
        for f in &summary {
            body.push_str(&format!(
                "\n- `{}:{}` **{}** {}: {} {}",
                f.path,
                f.line,
                f.severity,
                f.category,
                f.title,
                marker(&fingerprint(f))
            ));
        }
    }
    Some(ComposedReview { body, summarised: summary.len(), comments })
}

/// How long GitHub asks us to wait, from an answer: `retry-after` on a 403/429
/// (secondary limit), or the reset of an exhausted primary limit (on a 403/429, or on a
/// success that used the last request). `None`: no wait.
pub fn limit_delay(status: u16, headers: &reqwest::header::HeaderMap, now_unix: u64) -> Option<Duration> {
    let header =
        |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<u64>().ok());
    let limited = matches!(status, 403 | 429);
    if limited && let Some(secs) = header("retry-after") {
        return Some(Duration::from_secs(secs.max(1)));
    }
    if header("x-ratelimit-remaining") == Some(0) {
        let reset = header("x-ratelimit-reset").unwrap_or(now_unix + 60);
        return Some(Duration::from_secs(reset.saturating_sub(now_unix).max(1)));
    }
    // A secondary limit without a hint: GitHub says wait at least a minute. (A 403
    // without either header is a permission problem, not a limit.)
    (status == 429).then_some(Duration::from_secs(60))
}

/// The commentable lines of a pull request's files (from their patches).
fn commentable_lines(files: &[Value]) -> HashSet<(String, u32, &'static str)> {
    use reviewlane_core::diff::{LineKind, parse};
    let mut out = HashSet::new();
    for file in files {
        let (Some(name), Some(patch)) = (file["filename"].as_str(), file["patch"].as_str()) else { continue };
        let Ok(d) = parse(&format!("--- a/{name}\n+++ b/{name}\n{patch}\n")) else { continue };
        for h in d.files.iter().flat_map(|f| &f.hunks) {
            for (l, old, new) in h.numbered() {
                if l.kind != LineKind::Removed {
                    out.insert((name.to_string(), new, "RIGHT"));
                }
                if l.kind != LineKind::Added {
                    out.insert((name.to_string(), old, "LEFT"));
                }
            }
        }
    }
    out
}

/// Pages of a list endpoint read at most (100 items each).
const MAX_PAGES: usize = 10;

/// The least time between two content-creating requests to one account: GitHub asks
/// for a second; a tenth more covers the time a request takes to get there.
pub const CONTENT_INTERVAL: Duration = Duration::from_millis(1100);

/// The widest a content interval gets after secondary limits.
pub const SLOWDOWN_CAP: Duration = Duration::from_secs(60);

/// How long an account goes without a secondary limit before its widened interval is
/// halved (back toward [`CONTENT_INTERVAL`]): from the cap back down takes six of
/// them, an hour, the span of GitHub's hourly content-creation limit.
pub const SLOWDOWN_QUIET: Duration = Duration::from_secs(10 * 60);

/// An account's content interval as widened by secondary limits, shared by the region's
/// publishers (`PUBLISHED_<R>`, key `github-interval.<digest>`, JSON).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Slowdown {
    /// The interval as last widened.
    pub interval_ms: u64,
    /// When the last secondary limit's wait ends (Unix ms): the quiet periods count from
    /// here, and a limit answered before it belongs to the same episode.
    pub quiet_from_ms: u64,
}

/// The content interval in force at `now_ms`: the widened one halved once per full
/// [`SLOWDOWN_QUIET`] since its limit lifted, never below [`CONTENT_INTERVAL`].
pub fn content_interval(slowdown: Option<&Slowdown>, now_ms: u64) -> Duration {
    let base = CONTENT_INTERVAL.as_millis() as u64;
    let Some(s) = slowdown else { return CONTENT_INTERVAL };
    let quiet = now_ms.saturating_sub(s.quiet_from_ms) / SLOWDOWN_QUIET.as_millis() as u64;
    let narrowed = s.interval_ms.checked_shr(quiet.min(63) as u32).unwrap_or(0);
    Duration::from_millis(narrowed.max(base))
}

/// The slowdown after a secondary limit answered at `now_ms` with `retry_after`: the
/// interval in force doubled, and at least widened by the wait — a backlog posting at
/// the old pace filled a window that frees its first slot only `retry_after` later, so
/// a pace `retry_after` slower per request fits it whatever its size (up to
/// [`SLOWDOWN_CAP`]). An answer before the last limit's wait ended is the same
/// episode (requests already in flight, another publisher's): it widens nothing again.
pub fn widen(prev: Option<Slowdown>, now_ms: u64, retry_after: Duration) -> Slowdown {
    let wait = retry_after.as_millis() as u64;
    let lifts = now_ms + wait;
    if let Some(p) = prev.filter(|p| now_ms < p.quiet_from_ms) {
        return Slowdown { interval_ms: p.interval_ms, quiet_from_ms: p.quiet_from_ms.max(lifts) };
    }
    let now = content_interval(prev.as_ref(), now_ms).as_millis() as u64;
    let wider = (now * 2).max(now + wait).min(SLOWDOWN_CAP.as_millis() as u64);
    Slowdown { interval_ms: wider.max(CONTENT_INTERVAL.as_millis() as u64), quiet_from_ms: lifts }
}

/// Which of GitHub's limits an answer hit: the primary one (no requests left until the
/// reset), or a secondary one (`retry-after`, or a 403/429 without a count).
pub fn limit_kind(status: u16, headers: &reqwest::header::HeaderMap) -> Option<&'static str> {
    let remaining = headers.get("x-ratelimit-remaining").and_then(|v| v.to_str().ok()).map(str::trim);
    match status {
        403 | 429 if headers.contains_key("retry-after") => Some("secondary"),
        403 | 429 if remaining == Some("0") => Some("primary"),
        429 => Some("secondary"),
        _ => None,
    }
}

/// `reviewlane_github_rate_limited_total{region, kind}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct LimitLabels {
    pub region: String,
    /// `primary`, `secondary`.
    pub kind: String,
}

pub type LimitCounter =
    prometheus_client::metrics::family::Family<LimitLabels, prometheus_client::metrics::counter::Counter>;

/// `reviewlane_github_content_interval_seconds{region}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct RegionLabel {
    pub region: String,
}

pub type IntervalGauge = prometheus_client::metrics::family::Family<
    RegionLabel,
    prometheus_client::metrics::gauge::Gauge<f64, std::sync::atomic::AtomicU64>,
>;

/// The sink's metric families, with the region's label.
#[derive(Clone, Default)]
pub struct GitHubMetrics {
    pub region: String,
    /// Limit answers by kind.
    pub limited: LimitCounter,
    /// The widest content interval in force among the accounts this process posts to.
    pub interval: IntervalGauge,
}

pub struct GitHub {
    /// Accounts (API URL and token) paused until a limit resets.
    paused: Mutex<HashMap<String, Instant>>,
    /// Installation tokens minted for Apps, by (API URL, App, installation), until a
    /// few minutes before they expire.
    installation_tokens: Mutex<HashMap<String, (String, Instant)>>,
    /// Where pauses are shared with the region's other publishers (`PUBLISHED_<R>`, key
    /// `github-pause.<digest of the account>`, value: until when, Unix milliseconds),
    /// the next content-creating request's turn (`github-pace.<digest>`, the same) and
    /// the content interval as widened (`github-interval.<digest>`, a [`Slowdown`]).
    shared: Option<async_nats::jetstream::kv::Store>,
    /// When this process may next post to an account (the shared turn is the fleet's).
    next_post: Mutex<HashMap<String, Instant>>,
    /// Accounts' widened content intervals as last seen (the shared ones are the
    /// fleet's); an account back at [`CONTENT_INTERVAL`] is dropped.
    slowdowns: Mutex<HashMap<String, Slowdown>>,
    metrics: Option<GitHubMetrics>,
    /// Jobs whose line comments GitHub refused (422): posted with every finding in the
    /// summary next time.
    comments_refused: Mutex<HashSet<String>>,
}

/// Jobs remembered in `comments_refused` at most.
const REFUSED_KEPT: usize = 1024;

fn now_unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// The KV key of an account's shared pause (no token in it: a digest).
fn pause_key(account: &str) -> String {
    account_key("github-pause", account)
}

fn account_key(kind: &str, account: &str) -> String {
    let mut d = reviewlane_core::job_id::sha256_hex(&[account.as_bytes()]);
    d.truncate(32);
    format!("{kind}.{d}")
}

/// Whose turn it is to post: the next turn's start (Unix ms) as stored, and now. `Ok`:
/// take the turn and store `now + interval` as the next; `Err`: wait this long.
pub fn turn(next_ms: Option<u64>, now_ms: u64, interval: Duration) -> Result<u64, Duration> {
    match next_ms {
        Some(next) if next > now_ms => Err(Duration::from_millis(next - now_ms)),
        _ => Ok(now_ms + interval.as_millis() as u64),
    }
}

/// How a sink authenticates.
pub enum Auth<'a> {
    /// A token read from this file.
    TokenFile(&'a Path),
    /// Installation tokens of this App.
    App(&'a reviewlane_core::tenants::GitHubApp),
}

/// The claims of a GitHub App's JWT: issued a minute ago (clock drift), valid nine
/// minutes (GitHub allows ten).
#[derive(serde::Serialize)]
struct AppClaims {
    iat: u64,
    exp: u64,
    iss: String,
}

/// A GitHub App's JWT, RS256 over the App's private key.
pub fn app_jwt(app_id: &str, private_key_pem: &[u8], now_unix: u64) -> Result<String, jsonwebtoken::errors::Error> {
    let key = jsonwebtoken::EncodingKey::from_rsa_pem(private_key_pem)?;
    let claims = AppClaims { iat: now_unix.saturating_sub(60), exp: now_unix + 540, iss: app_id.to_string() };
    jsonwebtoken::encode(&jsonwebtoken::Header::new(jsonwebtoken::Algorithm::RS256), &claims, &key)
}

impl GitHub {
    pub fn new() -> Self {
        GitHub {
            paused: Mutex::new(HashMap::new()),
            installation_tokens: Mutex::new(HashMap::new()),
            shared: None,
            next_post: Mutex::new(HashMap::new()),
            slowdowns: Mutex::new(HashMap::new()),
            metrics: None,
            comments_refused: Mutex::new(HashSet::new()),
        }
    }

    /// Limit answers and the content interval are reported in `metrics`.
    pub fn with_metrics(mut self, metrics: GitHubMetrics) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Takes the account's turn for a content-creating request, or says how long until
    /// it comes: this process's own turn first, then the fleet's (a compare-and-set;
    /// a store that cannot answer leaves the local pacing alone in force). Turns are
    /// the account's content interval apart, as widened by secondary limits.
    async fn take_turn(&self, account: &str) -> Result<(), SinkOutcome> {
        {
            let interval = content_interval(self.slowdowns.lock().expect("slowdown lock").get(account), now_unix_ms());
            let mut next = self.next_post.lock().expect("pace lock");
            let now = Instant::now();
            if let Some(at) = next.get(account).filter(|at| **at > now) {
                return Err(SinkOutcome::Deferred(*at - now));
            }
            next.insert(account.to_string(), now + interval);
        }
        let interval = self.refresh_slowdown(account).await;
        let Some(kv) = &self.shared else { return Ok(()) };
        let key = account_key("github-pace", account);
        let stored = match kv.entry(&key).await {
            Ok(e) => e.filter(|e| e.operation == async_nats::jetstream::kv::Operation::Put),
            Err(e) => {
                tracing::warn!(error = %e, "reading the shared GitHub pacing failed; pacing locally");
                return Ok(());
            }
        };
        let next_ms = stored.as_ref().and_then(|e| std::str::from_utf8(&e.value).ok()?.parse().ok());
        let mine = match turn(next_ms, now_unix_ms(), interval) {
            Ok(mine) => mine,
            Err(wait) => {
                // Not ours after all: give the local turn back.
                self.next_post.lock().expect("pace lock").remove(account);
                return Err(SinkOutcome::Deferred(wait));
            }
        };
        let written = match &stored {
            Some(e) => {
                kv.update(&key, mine.to_string().into(), e.revision).await.map(|_| ()).map_err(|e| e.to_string())
            }
            None => kv.create(&key, mine.to_string().into()).await.map(|_| ()).map_err(|e| e.to_string()),
        };
        if written.is_err() {
            // Another publisher took this turn first.
            self.next_post.lock().expect("pace lock").remove(account);
            return Err(SinkOutcome::Deferred(interval));
        }
        // The fleet's interval may be wider than the one this process knew.
        self.next_post.lock().expect("pace lock").insert(account.to_string(), Instant::now() + interval);
        Ok(())
    }

    /// The account's shared slowdown, read into this process's (the later limit wins: a
    /// widening this process could not share stays in force here), and the content
    /// interval in force now.
    async fn refresh_slowdown(&self, account: &str) -> Duration {
        let stored = match &self.shared {
            Some(kv) => match kv.get(account_key("github-interval", account)).await {
                Ok(v) => v.and_then(|v| serde_json::from_slice::<Slowdown>(&v).ok()),
                Err(e) => {
                    tracing::warn!(error = %e, "reading the shared GitHub content interval failed");
                    None
                }
            },
            None => None,
        };
        let now = now_unix_ms();
        let interval = {
            let mut local = self.slowdowns.lock().expect("slowdown lock");
            let known = local.get(account).copied().into_iter().chain(stored).max_by_key(|s| s.quiet_from_ms);
            if let Some(s) = known {
                local.insert(account.to_string(), s);
            }
            content_interval(known.as_ref(), now)
        };
        self.report_interval(now);
        interval
    }

    /// After a secondary limit answered with `wait`: widens the account's content
    /// interval, for the whole fleet (a compare-and-set, a few tries; this process keeps
    /// its own when the store cannot take it).
    async fn slow_down(&self, account: &str, wait: Duration) {
        let now = now_unix_ms();
        let local = self.slowdowns.lock().expect("slowdown lock").get(account).copied();
        let mut widened = widen(local, now, wait);
        if let Some(kv) = &self.shared {
            let key = account_key("github-interval", account);
            for _ in 0..3 {
                let entry = match kv.entry(&key).await {
                    Ok(e) => e.filter(|e| e.operation == async_nats::jetstream::kv::Operation::Put),
                    Err(e) => {
                        tracing::warn!(error = %e, "reading the shared GitHub content interval failed");
                        break;
                    }
                };
                let stored = entry.as_ref().and_then(|e| serde_json::from_slice::<Slowdown>(&e.value).ok());
                let known = local.into_iter().chain(stored).max_by_key(|s| s.quiet_from_ms);
                let next = widen(known, now, wait);
                let value: bytes::Bytes = serde_json::to_vec(&next).expect("a slowdown serialises").into();
                let written = match &entry {
                    Some(e) => kv.update(&key, value, e.revision).await.map(|_| ()).map_err(|e| e.to_string()),
                    None => kv.create(&key, value).await.map(|_| ()).map_err(|e| e.to_string()),
                };
                if written.is_ok() {
                    widened = next;
                    break;
                }
            }
        }
        self.slowdowns.lock().expect("slowdown lock").insert(account.to_string(), widened);
        tracing::warn!(
            interval_ms = content_interval(Some(&widened), now).as_millis() as u64,
            "GitHub secondary limit; content-creating requests slowed down"
        );
        self.report_interval(now);
    }

    /// Sets the interval gauge to the widest interval in force; accounts back at the
    /// configured interval are forgotten.
    fn report_interval(&self, now_ms: u64) {
        let widest = {
            let mut local = self.slowdowns.lock().expect("slowdown lock");
            local.retain(|_, s| now_ms < s.quiet_from_ms || content_interval(Some(s), now_ms) > CONTENT_INTERVAL);
            local.values().map(|s| content_interval(Some(s), now_ms)).max().unwrap_or(CONTENT_INTERVAL)
        };
        if let Some(m) = &self.metrics {
            m.interval.get_or_create(&RegionLabel { region: m.region.clone() }).set(widest.as_secs_f64());
        }
    }

    /// Pauses are shared with every publisher of the region through `kv`.
    pub fn with_shared_pauses(mut self, kv: async_nats::jetstream::kv::Store) -> Self {
        self.shared = Some(kv);
        self
    }

    /// Records a pause for the whole fleet (best effort: this process keeps its own).
    async fn share_pause(&self, account: &str, d: Duration) {
        let Some(kv) = &self.shared else { return };
        let until = now_unix_ms() + d.as_millis() as u64;
        if let Err(e) = kv.put(pause_key(account), until.to_string().into()).await {
            tracing::warn!(error = %e, "sharing a GitHub pause failed");
        }
    }

    /// The pause of an account, this process's or another publisher's.
    async fn pause_of(&self, account: &str) -> Option<Duration> {
        if let Some(d) = self.paused_for(account) {
            return Some(d);
        }
        let kv = self.shared.as_ref()?;
        let until: u64 = match kv.get(pause_key(account)).await {
            Ok(Some(v)) => std::str::from_utf8(&v).ok()?.parse().ok()?,
            _ => return None,
        };
        let left = Duration::from_millis(until.saturating_sub(now_unix_ms()));
        (!left.is_zero()).then(|| {
            self.pause(account, left);
            left
        })
    }

    /// The token to call with: read from its file, or an installation token of the
    /// App (minted when there is none still valid for five minutes).
    async fn token(&self, http: &reqwest::Client, api_url: &str, auth: &Auth<'_>) -> Result<String, SinkOutcome> {
        let app = match auth {
            Auth::TokenFile(path) => {
                return std::fs::read_to_string(path)
                    .map(|t| t.trim().to_string())
                    .map_err(|_| SinkOutcome::Transient("token_unreadable"));
            }
            Auth::App(app) => app,
        };
        let cache_key = format!("{api_url}#{}#{}", app.app_id, app.installation_id);
        if let Some((token, until)) = self.installation_tokens.lock().expect("token lock").get(&cache_key)
            && Instant::now() < *until
        {
            return Ok(token.clone());
        }
        let pem = std::fs::read(&app.private_key_file).map_err(|_| SinkOutcome::Transient("app_key_unreadable"))?;
        let now_unix = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let jwt = app_jwt(&app.app_id, &pem, now_unix).map_err(|_| SinkOutcome::Refused("app_key_invalid"))?;
        let url = format!("{}/app/installations/{}/access_tokens", api_url.trim_end_matches('/'), app.installation_id);
        let rb = authed(http.post(url), &jwt);
        let account = format!("{api_url}#app#{}", app.app_id);
        let (_, body) = self.send(&account, rb).await?;
        let token = body["token"].as_str().ok_or(SinkOutcome::Transient("no_token"))?.to_string();
        // Installation tokens live an hour; use one for 50 minutes at most.
        let until = Instant::now() + Duration::from_secs(50 * 60);
        self.installation_tokens.lock().expect("token lock").insert(cache_key, (token.clone(), until));
        tracing::info!("GitHub App installation token minted");
        Ok(token)
    }

    fn pause(&self, account: &str, d: Duration) {
        let until = Instant::now() + d;
        let mut p = self.paused.lock().expect("pause lock");
        let e = p.entry(account.to_string()).or_insert(until);
        *e = (*e).max(until);
    }

    fn paused_for(&self, account: &str) -> Option<Duration> {
        let p = self.paused.lock().expect("pause lock");
        p.get(account).map(|until| until.saturating_duration_since(Instant::now())).filter(|d| !d.is_zero())
    }

    /// One request, unless the account is paused, with the limit rules applied to its
    /// answer.
    async fn send(&self, account: &str, rb: reqwest::RequestBuilder) -> Result<(u16, Value), SinkOutcome> {
        if let Some(wait) = self.pause_of(account).await {
            return Err(SinkOutcome::Deferred(wait));
        }
        let resp = match rb.send().await {
            Ok(r) => r,
            Err(e) if e.is_timeout() => return Err(SinkOutcome::Transient("timeout")),
            Err(_) => return Err(SinkOutcome::Transient("connect")),
        };
        let status = resp.status().as_u16();
        let now_unix = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let wait = limit_delay(status, resp.headers(), now_unix);
        let kind = limit_kind(status, resp.headers());
        if let (Some(kind), Some(m)) = (kind, &self.metrics) {
            m.limited.get_or_create(&LimitLabels { region: m.region.clone(), kind: kind.into() }).inc();
        }
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        if let Some(d) = wait {
            self.pause(account, d);
            self.share_pause(account, d).await;
            if kind == Some("secondary") {
                self.slow_down(account, d).await;
            }
            if matches!(status, 403 | 429) {
                tracing::warn!(
                    status,
                    wait_ms = d.as_millis() as u64,
                    "GitHub rate limit; deliveries to the account paused"
                );
                return Err(SinkOutcome::RetryAfter(d));
            }
        }
        match status {
            200..=299 | 422 => Ok((status, body)),
            401 | 403 | 404 => {
                // A rejected installation token may be a revoked one: mint anew next time.
                self.installation_tokens.lock().expect("token lock").clear();
                Err(SinkOutcome::Permanent(status))
            }
            408 | 429 | 500..=599 => Err(SinkOutcome::Transient("5xx")),
            s => Err(SinkOutcome::Permanent(s)),
        }
    }

    /// Every page of a list endpoint (bounded).
    async fn list(
        &self,
        account: &str,
        http: &reqwest::Client,
        token: &str,
        url: &str,
    ) -> Result<Vec<Value>, SinkOutcome> {
        let mut out = Vec::new();
        for page in 1..=MAX_PAGES {
            let rb = authed(http.get(format!("{url}?per_page=100&page={page}")), token);
            let (_, body) = self.send(account, rb).await?;
            let items = body.as_array().cloned().unwrap_or_default();
            let last = items.len() < 100;
            out.extend(items);
            if last {
                break;
            }
        }
        Ok(out)
    }

    pub async fn deliver(
        &self,
        http: &reqwest::Client,
        api_url: &str,
        auth: Auth<'_>,
        max_comments: usize,
        d: &Delivery,
    ) -> SinkOutcome {
        match self.try_deliver(http, api_url, auth, max_comments, d).await {
            Ok(o) | Err(o) => o,
        }
    }

    async fn try_deliver(
        &self,
        http: &reqwest::Client,
        api_url: &str,
        auth: Auth<'_>,
        max_comments: usize,
        d: &Delivery,
    ) -> Result<SinkOutcome, SinkOutcome> {
        let repo = &d.metadata.repository;
        let valid_repo = repo.split_once('/').is_some_and(|(o, r)| {
            let ok = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
            ok(o) && ok(r)
        });
        if !valid_repo || d.metadata.pull_request == 0 || d.metadata.head_revision.is_empty() {
            return Ok(SinkOutcome::Refused("not_a_pull_request"));
        }
        let token = self.token(http, api_url, &auth).await?;
        let account = format!("{api_url}#{}", reviewlane_core::job_id::sha256_hex(&[token.as_bytes()]));
        let base = format!("{}/repos/{repo}/pulls/{}", api_url.trim_end_matches('/'), d.metadata.pull_request);
        let mut existing = HashSet::new();
        for c in self.list(&account, http, &token, &format!("{base}/comments")).await? {
            existing.extend(markers(c["body"].as_str().unwrap_or_default()).map(String::from));
        }
        for r in self.list(&account, http, &token, &format!("{base}/reviews")).await? {
            existing.extend(markers(r["body"].as_str().unwrap_or_default()).map(String::from));
        }
        let files = self.list(&account, http, &token, &format!("{base}/files")).await?;
        let commentable = commentable_lines(&files);
        // Line comments GitHub refused before (422) for this job: the summary at once, so
        // a delivery handed back between the two posts does not repeat the refused one.
        let refused_before = self.comments_refused.lock().expect("refused lock").contains(&d.job_id);
        for all_in_summary in [refused_before, true] {
            let Some(review) = compose(&d.findings, &existing, &commentable, max_comments, all_in_summary) else {
                tracing::info!("every finding is already on the pull request; nothing posted");
                return Ok(SinkOutcome::Delivered);
            };
            let payload = json!({
                "commit_id": d.metadata.head_revision,
                "event": "COMMENT",
                "body": review.body,
                "comments": review.comments,
            });
            let rb = authed(http.post(format!("{base}/reviews")), &token).json(&payload);
            self.take_turn(&account).await?;
            match self.send(&account, rb).await? {
                (422, _) if !review.comments.is_empty() => {
                    tracing::warn!(
                        comments = review.comments.len(),
                        "GitHub refused a line comment; posting them in the summary"
                    );
                    let mut refused = self.comments_refused.lock().expect("refused lock");
                    // Bounded: a job forgotten posts its comments once more, then falls back.
                    if refused.len() >= REFUSED_KEPT {
                        refused.clear();
                    }
                    refused.insert(d.job_id.clone());
                }
                (422, _) => return Ok(SinkOutcome::Permanent(422)),
                _ => {
                    self.comments_refused.lock().expect("refused lock").remove(&d.job_id);
                    tracing::info!(
                        comments = review.comments.len(),
                        summarised = review.summarised,
                        "pull request review posted"
                    );
                    return Ok(SinkOutcome::Delivered);
                }
            }
        }
        Ok(SinkOutcome::Permanent(422))
    }
}

impl Default for GitHub {
    fn default() -> Self {
        Self::new()
    }
}

fn authed(rb: reqwest::RequestBuilder, token: &str) -> reqwest::RequestBuilder {
    rb.header("authorization", format!("Bearer {token}"))
        .header("accept", "application/vnd.github+json")
        .header("x-github-api-version", "2022-11-28")
        .header("user-agent", "reviewlane")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn finding(path: &str, line: u32, severity: &str) -> Finding {
        let mut f = Finding {
            path: path.into(),
            line,
            severity: severity.into(),
            category: "security".into(),
            title: "t".into(),
            message: "m".into(),
            evidence: format!("e{line}"),
            ..Default::default()
        };
        f.fingerprint = Some(reviewlane_core::findings::fingerprint(&f));
        f
    }

    #[test]
    fn new_findings_on_diff_lines_become_comments_the_rest_the_summary() {
        let on = finding("a.rs", 2, "high");
        let off = finding("a.rs", 90, "medium");
        let seen = finding("b.rs", 3, "low");
        let mut ranged = finding("a.rs", 3, "low");
        ranged.end_line = Some(4);
        ranged.suggested_replacement = Some("fixed();".into());
        let commentable: HashSet<_> = (1..=5).map(|l| ("a.rs".to_string(), l, "RIGHT")).collect();
        let existing: HashSet<String> = [seen.fingerprint.clone().unwrap()].into();
        let p = compose(&[on.clone(), off.clone(), seen.clone(), ranged.clone()], &existing, &commentable, 20, false)
            .unwrap();
        assert_eq!(p.comments.len(), 2);
        assert_eq!((p.comments[0]["line"].as_u64(), p.comments[0]["side"].as_str()), (Some(2), Some("RIGHT")));
        assert_eq!((p.comments[1]["start_line"].as_u64(), p.comments[1]["line"].as_u64()), (Some(3), Some(4)));
        assert!(p.comments[1]["body"].as_str().unwrap().contains("```suggestion\nfixed();\n```"));
        assert_eq!(p.summarised, 1);
        assert!(p.body.contains(&marker(off.fingerprint.as_deref().unwrap())));
        assert!(!p.body.contains(&marker(seen.fingerprint.as_deref().unwrap())));
        // Every marker can be read back.
        let all: HashSet<&str> =
            p.comments.iter().flat_map(|c| markers(c["body"].as_str().unwrap())).chain(markers(&p.body)).collect();
        assert_eq!(all.len(), 3);
        // The limit, and the fallback with everything in the summary.
        assert_eq!(compose(&[on.clone(), ranged.clone()], &existing, &commentable, 1, false).unwrap().summarised, 1);
        let fallback = compose(std::slice::from_ref(&on), &existing, &commentable, 20, true).unwrap();
        assert!(fallback.comments.is_empty() && fallback.summarised == 1);
        // Nothing new: nothing to post.
        assert_eq!(compose(&[seen], &existing, &commentable, 20, false), None);
    }

    #[test]
    fn a_name_that_is_not_utf8_is_listed_in_its_quoted_form() {
        // GitHub lists the files by text: the Latin-1 name as it decodes them, and a
        // name that begins with a quote as it is.
        let commentable: HashSet<_> =
            [("l\u{fffd}gacy.txt".to_string(), 1, "RIGHT"), ("\"x.rs".to_string(), 1, "RIGHT")].into();
        let legacy = finding("\"l\\351gacy.txt\"", 1, "high");
        let quoted = finding("\"\\\"x.rs\"", 1, "high");
        let p = compose(&[legacy, quoted], &HashSet::new(), &commentable, 20, false).unwrap();
        assert_eq!(p.comments.len(), 1);
        assert_eq!(p.comments[0]["path"], "\"x.rs");
        assert_eq!(p.summarised, 1);
        assert!(p.body.contains("`\"l\\351gacy.txt\":1`"), "{}", p.body);
    }

    fn headers(pairs: &[(&'static str, &str)]) -> reqwest::header::HeaderMap {
        let mut m = reqwest::header::HeaderMap::new();
        for (k, v) in pairs {
            m.insert(*k, v.parse().unwrap());
        }
        m
    }

    #[test]
    fn content_requests_take_turns_an_interval_apart() {
        let s = Duration::from_secs(1);
        assert_eq!(turn(None, 10_000, s), Ok(11_000), "no turn taken yet");
        assert_eq!(turn(Some(9_000), 10_000, s), Ok(11_000), "the last turn is over");
        assert_eq!(turn(Some(10_000), 10_000, s), Ok(11_000));
        assert_eq!(turn(Some(10_700), 10_000, s), Err(Duration::from_millis(700)), "wait for the next turn");
    }

    #[test]
    fn a_secondary_limit_widens_the_content_interval_up_to_the_cap() {
        let s = |ms: u64| Duration::from_millis(ms);
        // Doubled when the wait is short, widened by the wait when it is longer.
        assert_eq!(widen(None, 10_000, s(1_000)), Slowdown { interval_ms: 2_200, quiet_from_ms: 11_000 });
        assert_eq!(widen(None, 10_000, s(8_000)), Slowdown { interval_ms: 9_100, quiet_from_ms: 18_000 });
        // Again after the wait: from the interval in force.
        let first = widen(None, 10_000, s(1_000));
        assert_eq!(widen(Some(first), 20_000, s(1_000)).interval_ms, 4_400);
        // Never past the cap (GitHub's usual minute, or a long one).
        assert_eq!(widen(None, 10_000, s(60_000)).interval_ms, SLOWDOWN_CAP.as_millis() as u64);
        let wide = Slowdown { interval_ms: 40_000, quiet_from_ms: 0 };
        assert_eq!(widen(Some(wide), 10_000, s(1_000)).interval_ms, SLOWDOWN_CAP.as_millis() as u64);
    }

    #[test]
    fn a_limit_answered_during_the_last_ones_wait_widens_nothing_again() {
        let first = widen(None, 10_000, Duration::from_secs(5));
        // A request already in flight, or another publisher's, answered at 12 s.
        let same = widen(Some(first), 12_000, Duration::from_secs(5));
        assert_eq!(same, Slowdown { interval_ms: first.interval_ms, quiet_from_ms: 17_000 });
    }

    #[test]
    fn the_interval_narrows_by_half_per_quiet_period_after_the_wait() {
        let quiet = SLOWDOWN_QUIET.as_millis() as u64;
        let s = Slowdown { interval_ms: 8_800, quiet_from_ms: 100_000 };
        assert_eq!(content_interval(None, 5), CONTENT_INTERVAL);
        // In force from the limit on, through the wait and the first quiet period.
        assert_eq!(content_interval(Some(&s), 50_000), Duration::from_millis(8_800));
        assert_eq!(content_interval(Some(&s), 100_000 + quiet - 1), Duration::from_millis(8_800));
        assert_eq!(content_interval(Some(&s), 100_000 + quiet), Duration::from_millis(4_400));
        assert_eq!(content_interval(Some(&s), 100_000 + 2 * quiet), Duration::from_millis(2_200));
        // Back at the configured interval, never below it.
        assert_eq!(content_interval(Some(&s), 100_000 + 3 * quiet), CONTENT_INTERVAL);
        assert_eq!(content_interval(Some(&s), u64::MAX), CONTENT_INTERVAL);
    }

    /// Limit answers while a backlog of `backlog` posts is paced against `n` posts per
    /// rolling `window_ms` (accepted ones; `retry-after`: until the window's oldest
    /// leaves it, in whole seconds, or `fixed_retry`), widening the interval after each
    /// one, or (`slow_down: false`) keeping the configured one.
    fn limit_answers(backlog: usize, n: usize, window_ms: u64, fixed_retry: Option<u64>, slow_down: bool) -> usize {
        let (mut now, mut slowdown, mut hits) = (0u64, None, 0);
        let mut accepted: Vec<u64> = Vec::new();
        while accepted.len() < backlog && hits < 100 {
            let in_window: Vec<u64> = accepted.iter().copied().filter(|at| now - at < window_ms).collect();
            if in_window.len() >= n {
                hits += 1;
                let wait = fixed_retry.unwrap_or((in_window[0] + window_ms - now).div_ceil(1000)).max(1) * 1000;
                if slow_down {
                    slowdown = Some(widen(slowdown, now, Duration::from_millis(wait)));
                }
                now += wait;
                continue;
            }
            accepted.push(now);
            now += content_interval(slowdown.as_ref(), now).as_millis() as u64;
        }
        hits
    }

    #[test]
    fn a_backlog_meets_a_content_limit_once() {
        // The case in point: 2 posts per rolling 10 s, six reviews.
        assert_eq!(limit_answers(6, 2, 10_000, None, true), 1);
        assert!(limit_answers(6, 2, 10_000, None, false) > 1, "the configured pace alone meets it again");
        // Other windows and sizes, and GitHub's usual minute's wait.
        assert_eq!(limit_answers(20, 2, 4_000, None, true), 1);
        assert_eq!(limit_answers(30, 5, 60_000, None, true), 1);
        assert_eq!(limit_answers(6, 2, 10_000, Some(60), true), 1);
        // A limit the configured pace keeps under is never met.
        assert_eq!(limit_answers(200, 80, 60_000, None, true), 0);
    }

    #[test]
    fn limit_answers_are_told_apart() {
        let h = headers;
        assert_eq!(limit_kind(403, &h(&[("retry-after", "60")])), Some("secondary"));
        assert_eq!(limit_kind(429, &h(&[])), Some("secondary"));
        assert_eq!(limit_kind(403, &h(&[("x-ratelimit-remaining", "0")])), Some("primary"));
        assert_eq!(limit_kind(403, &h(&[("x-ratelimit-remaining", "10")])), None, "forbidden, not limited");
        assert_eq!(limit_kind(200, &h(&[("x-ratelimit-remaining", "0")])), None, "a success is no limit answer");
    }

    #[test]
    fn limits_are_read_from_githubs_headers() {
        let h = headers;
        assert_eq!(limit_delay(429, &h(&[("retry-after", "7")]), 1000), Some(Duration::from_secs(7)));
        assert_eq!(limit_delay(403, &h(&[("retry-after", "2")]), 1000), Some(Duration::from_secs(2)));
        let primary = h(&[("x-ratelimit-remaining", "0"), ("x-ratelimit-reset", "1030")]);
        assert_eq!(limit_delay(403, &primary, 1000), Some(Duration::from_secs(30)));
        // A success that used the last request: wait for the reset before the next.
        assert_eq!(limit_delay(200, &primary, 1000), Some(Duration::from_secs(30)));
        assert_eq!(limit_delay(200, &h(&[("x-ratelimit-remaining", "12")]), 1000), None);
        assert_eq!(limit_delay(429, &h(&[]), 1000), Some(Duration::from_secs(60)));
        assert_eq!(limit_delay(404, &h(&[]), 1000), None);
        assert_eq!(limit_delay(403, &h(&[("x-ratelimit-remaining", "40")]), 1000), None, "forbidden, not limited");
    }
}
