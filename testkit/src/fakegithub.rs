//! A fake GitHub REST API for one pull request, enforcing what the real one does that
//! the review sink relies on: a bearer token; review comments only on lines of the
//! pull request's diff (anything else is 422 for the whole review); the commit the
//! review is for; listing comments and reviews in pages; the primary rate limit
//! (`x-ratelimit-remaining` / `x-ratelimit-reset`: the answer that uses the last
//! request says when it resets, and every request until then is 403) and the
//! secondary ones (429 with `retry-after` on request; a 403 with `retry-after` for a
//! content-creating request less than a second after the previous one, or, when set,
//! beyond N content-creating requests per rolling window — GitHub documents such
//! limits, e.g. 80 a minute and 500 an hour, answered 403 or 429 with a message saying
//! so and possibly `retry-after`).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use serde_json::{Value, json};

use crate::http::HttpResponse;

/// The pull request the fake serves.
#[derive(Debug, Clone)]
pub struct PullRequest {
    /// `owner/repo`.
    pub repository: String,
    pub number: u32,
    /// The head commit a review must name.
    pub head: String,
    /// The pull request's diff (its files' patches are served from it).
    pub diff: String,
    pub token: String,
    /// A GitHub App that may mint `token` as an installation token: its id, its
    /// installation, and its public key (PEM) to verify the App's JWTs with.
    pub app: Option<(String, u64, Vec<u8>)>,
}

/// A review posted to the fake.
#[derive(Debug, Clone)]
pub struct PostedReview {
    pub at: Instant,
    pub body: String,
    pub comments: Vec<Value>,
}

#[derive(Default)]
struct State {
    reviews: Vec<PostedReview>,
    /// Every request: when, method, path, status answered.
    requests: Vec<(Instant, String, String, u16)>,
    /// Answer every review with line comments 422 (a diff GitHub sees differently).
    refuse_comments: bool,
    /// Installation tokens minted.
    minted: usize,
    /// Requests left before the primary limit, and how long until it resets once hit.
    primary: Option<(u32, Duration)>,
    /// The primary limit's reset, once hit.
    limited_until: Option<Instant>,
    /// Answer the next POSTs 429 with these `retry-after` seconds.
    secondary: VecDeque<u64>,
    /// When the last content-creating request (a POST of a review) came.
    last_post: Option<Instant>,
    /// Content-creating requests allowed per rolling window.
    content_limit: Option<(usize, Duration)>,
    /// When the reviews still in that window were created (at most the limit's count).
    created: VecDeque<Instant>,
}

/// GitHub's least time between content-creating requests; a closer one hits the
/// secondary limit.
pub const CONTENT_INTERVAL: Duration = Duration::from_secs(1);

pub struct FakeGitHub {
    addr: SocketAddr,
    pr: Arc<PullRequest>,
    state: Arc<Mutex<State>>,
    _server: crate::http::Server,
}

impl FakeGitHub {
    pub async fn start(pr: PullRequest) -> FakeGitHub {
        let pr = Arc::new(pr);
        let state = Arc::new(Mutex::new(State::default()));
        let (p, st) = (pr.clone(), state.clone());
        let server = crate::http::serve(move |req| handle(p.clone(), st.clone(), req)).await;
        FakeGitHub { addr: server.addr, pr, state, _server: server }
    }

    /// The API's base URL (as `api_url` of a GitHub sink).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn reviews(&self) -> Vec<PostedReview> {
        self.state.lock().expect("fake lock").reviews.clone()
    }

    pub fn requests(&self) -> Vec<(Instant, String, String, u16)> {
        self.state.lock().expect("fake lock").requests.clone()
    }

    /// Installation tokens minted for the App.
    pub fn minted(&self) -> usize {
        self.state.lock().expect("fake lock").minted
    }

    /// From now on, every review with line comments is answered 422.
    pub fn refuse_comments(&self) {
        self.state.lock().expect("fake lock").refuse_comments = true;
    }

    /// After `requests` more requests, the primary limit is hit for `reset`.
    pub fn primary_limit(&self, requests: u32, reset: Duration) {
        self.state.lock().expect("fake lock").primary = Some((requests, reset));
    }

    /// The next POSTs are answered 429 with these `retry-after` seconds.
    pub fn secondary_limit(&self, retry_after_secs: impl IntoIterator<Item = u64>) {
        self.state.lock().expect("fake lock").secondary.extend(retry_after_secs);
    }

    /// At most `requests` content-creating requests (reviews created) per rolling
    /// `window`; one more is answered 403 with `retry-after` (whole seconds until the
    /// window's oldest leaves it) and GitHub's secondary-limit message. Refused requests
    /// do not count.
    pub fn content_limit(&self, requests: usize, window: Duration) {
        self.state.lock().expect("fake lock").content_limit = Some((requests, window));
    }

    pub fn pull_request(&self) -> &PullRequest {
        &self.pr
    }
}

fn respond(status: StatusCode, headers: &[(&str, String)], body: Value) -> HttpResponse {
    let mut r = Response::builder().status(status).header("content-type", "application/json");
    for (k, v) in headers {
        r = r.header(*k, v);
    }
    r.body(Full::new(Bytes::from(body.to_string()))).expect("response builds")
}

/// The (path, line, side) a review comment may be on: lines of the diff's hunks.
fn commentable(diff: &str) -> Vec<(String, u32, &'static str)> {
    let Ok(d) = reviewlane_core::diff::parse(diff) else { return Vec::new() };
    let mut out = Vec::new();
    for f in &d.files {
        for h in &f.hunks {
            for (l, old, new) in h.numbered() {
                use reviewlane_core::diff::LineKind;
                if let Some(p) = &f.new_path
                    && l.kind != LineKind::Removed
                {
                    out.push((p.clone(), new, "RIGHT"));
                }
                if let Some(p) = f.old_path.as_ref().or(f.new_path.as_ref())
                    && l.kind != LineKind::Added
                {
                    out.push((p.clone(), old, "LEFT"));
                }
            }
        }
    }
    out
}

async fn handle(
    pr: Arc<PullRequest>,
    st: Arc<Mutex<State>>,
    req: Request<Incoming>,
) -> Result<HttpResponse, Infallible> {
    let method = req.method().to_string();
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or_default().to_string();
    let bearer = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("token ")))
        .unwrap_or_default()
        .to_string();
    // An App's installation token, minted on a valid JWT of the App.
    if let Some((app_id, installation, public_pem)) = &pr.app
        && method_is_post(&req)
        && req.uri().path() == format!("/app/installations/{installation}/access_tokens")
    {
        let mut validation = jsonwebtoken::Validation::new(jsonwebtoken::Algorithm::RS256);
        validation.set_issuer(&[app_id]);
        validation.set_required_spec_claims(&["exp", "iat", "iss"]);
        let verified = jsonwebtoken::DecodingKey::from_rsa_pem(public_pem)
            .ok()
            .is_some_and(|key| jsonwebtoken::decode::<Value>(&bearer, &key, &validation).is_ok());
        let mut s = st.lock().expect("fake lock");
        let answer = if verified {
            s.minted += 1;
            respond(StatusCode::CREATED, &[], json!({"token": pr.token, "expires_at": "2099-01-01T00:00:00Z"}))
        } else {
            respond(StatusCode::UNAUTHORIZED, &[], json!({"message": "A JSON web token could not be decoded"}))
        };
        s.requests.push((Instant::now(), "POST".into(), req.uri().path().to_string(), answer.status().as_u16()));
        return Ok(answer);
    }
    let authorized = bearer == pr.token;
    let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let answer = answer(&pr, &st, &method, &path, &query, authorized, &body);
    st.lock().expect("fake lock").requests.push((Instant::now(), method, path, answer.status().as_u16()));
    Ok(answer)
}

fn method_is_post(req: &Request<Incoming>) -> bool {
    req.method() == hyper::Method::POST
}

fn answer(
    pr: &PullRequest,
    st: &Mutex<State>,
    method: &str,
    path: &str,
    query: &str,
    authorized: bool,
    body: &[u8],
) -> HttpResponse {
    let mut s = st.lock().expect("fake lock");
    let now = Instant::now();
    let unix = |at: Instant| {
        let from_now = at.saturating_duration_since(now);
        (std::time::SystemTime::now() + from_now).duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs()
            + 1
    };
    if !authorized {
        return respond(StatusCode::UNAUTHORIZED, &[], json!({"message": "Bad credentials"}));
    }
    // Primary limit: 403 with remaining 0 until the reset.
    if let Some(until) = s.limited_until {
        if now < until {
            let h = [("x-ratelimit-remaining", "0".to_string()), ("x-ratelimit-reset", unix(until).to_string())];
            return respond(StatusCode::FORBIDDEN, &h, json!({"message": "API rate limit exceeded"}));
        }
        s.limited_until = None;
    }
    let mut remaining = 5000u32;
    let mut reset_at = now + Duration::from_secs(3600);
    if let Some((left, reset)) = s.primary {
        remaining = left.saturating_sub(1);
        if left == 0 {
            s.primary = None;
            let until = now + reset;
            s.limited_until = Some(until);
            let h = [("x-ratelimit-remaining", "0".to_string()), ("x-ratelimit-reset", unix(until).to_string())];
            return respond(StatusCode::FORBIDDEN, &h, json!({"message": "API rate limit exceeded"}));
        }
        s.primary = Some((remaining, reset));
        if remaining == 0 {
            // This answer uses the last request: every one until the reset is refused.
            s.primary = None;
            reset_at = now + reset;
            s.limited_until = Some(reset_at);
        }
    }
    let limit_headers =
        [("x-ratelimit-remaining", remaining.to_string()), ("x-ratelimit-reset", unix(reset_at).to_string())];
    let base = format!("/repos/{}/pulls/{}", pr.repository, pr.number);
    let page: usize =
        query.split('&').find_map(|kv| kv.strip_prefix("page=")).and_then(|p| p.parse().ok()).unwrap_or(1);
    let per_page: usize = query
        .split('&')
        .find_map(|kv| kv.strip_prefix("per_page="))
        .and_then(|p| p.parse().ok())
        .unwrap_or(30)
        .clamp(1, 100);
    let paged = |items: Vec<Value>| -> Value {
        Value::Array(items.into_iter().skip((page - 1) * per_page).take(per_page).collect())
    };
    match (method, path.strip_prefix(&base)) {
        ("GET", Some("/comments")) => {
            let comments: Vec<Value> = s.reviews.iter().flat_map(|r| r.comments.clone()).collect();
            respond(StatusCode::OK, &limit_headers, paged(comments))
        }
        ("GET", Some("/reviews")) => {
            let reviews: Vec<Value> = s.reviews.iter().map(|r| json!({"body": r.body})).collect();
            respond(StatusCode::OK, &limit_headers, paged(reviews))
        }
        ("GET", Some("/files")) => {
            let files: Vec<Value> = reviewlane_core::diff::parse(&pr.diff)
                .map(|d| {
                    d.files
                        .iter()
                        .map(|f| {
                            let patch: String =
                                f.hunks.iter().map(|h| reviewlane_core::diff::render_run(&h.numbered())).collect();
                            json!({"filename": f.new_path.clone().or(f.old_path.clone()), "patch": patch})
                        })
                        .collect()
                })
                .unwrap_or_default();
            respond(StatusCode::OK, &limit_headers, paged(files))
        }
        ("POST", Some("/reviews")) => {
            let too_soon = s.last_post.is_some_and(|at| now.duration_since(at) < CONTENT_INTERVAL);
            s.last_post = Some(now);
            if too_soon {
                return respond(
                    StatusCode::FORBIDDEN,
                    &[("retry-after", "1".to_string())],
                    json!({"message": "You have exceeded a secondary rate limit. Please wait a few minutes before you try again."}),
                );
            }
            if let Some((limit, window)) = s.content_limit {
                s.created.retain(|at| now.duration_since(*at) < window);
                if let Some(oldest) = s.created.front().filter(|_| s.created.len() >= limit) {
                    let frees_in = window.saturating_sub(now.duration_since(*oldest));
                    let secs = frees_in.as_millis().div_ceil(1000).max(1);
                    let mut h = limit_headers.to_vec();
                    h.push(("retry-after", secs.to_string()));
                    return respond(
                        StatusCode::FORBIDDEN,
                        &h,
                        json!({
                            "message": "You have exceeded a secondary rate limit and have been temporarily blocked from content creation. Please retry your request again later.",
                            "documentation_url": "https://docs.github.com/rest/overview/rate-limits-for-the-rest-api#about-secondary-rate-limits",
                        }),
                    );
                }
            }
            if let Some(secs) = s.secondary.pop_front() {
                let h = [("retry-after", secs.to_string())];
                return respond(
                    StatusCode::TOO_MANY_REQUESTS,
                    &h,
                    json!({"message": "You have exceeded a secondary rate limit."}),
                );
            }
            let Ok(review) = serde_json::from_slice::<Value>(body) else {
                return respond(StatusCode::BAD_REQUEST, &[], json!({"message": "Problems parsing JSON"}));
            };
            if review["commit_id"] != pr.head {
                return respond(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    &[],
                    json!({"message": "commit_id is not part of the pull request"}),
                );
            }
            let allowed = commentable(&pr.diff);
            let comments: Vec<Value> = review["comments"].as_array().cloned().unwrap_or_default();
            if s.refuse_comments && !comments.is_empty() {
                return respond(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    &[],
                    json!({"message": "Unprocessable Entity", "errors": ["Line could not be resolved"]}),
                );
            }
            for c in &comments {
                let side = c["side"].as_str().unwrap_or("RIGHT");
                let ok = c["path"].as_str().zip(c["line"].as_u64()).is_some_and(|(p, l)| {
                    allowed.iter().any(|(ap, al, asd)| ap == p && u64::from(*al) == l && *asd == side)
                });
                if !ok {
                    return respond(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        &[],
                        json!({"message": "Unprocessable Entity", "errors": ["Line could not be resolved"]}),
                    );
                }
            }
            let body_text = review["body"].as_str().unwrap_or_default().to_string();
            s.reviews.push(PostedReview { at: now, body: body_text, comments });
            if s.content_limit.is_some() {
                s.created.push_back(now);
            }
            respond(StatusCode::OK, &limit_headers, json!({"id": s.reviews.len()}))
        }
        _ => respond(StatusCode::NOT_FOUND, &[], json!({"message": "Not Found"})),
    }
}
