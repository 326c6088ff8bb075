//! `reviewctl`: reviewlane's command line. `main_with` parses, connects and runs one
//! command, and returns the documented exit code (see `exit`).

pub mod cli;
pub mod exit;
pub mod output;
pub mod settings;
pub mod sweep;

use std::ffi::OsString;
use std::io::{IsTerminal, Read};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{CommandFactory, Parser};
use reviewlane_api::proto::review_service_client::ReviewServiceClient;
use reviewlane_api::proto::{
    self, CancelReviewRequest, GetReviewRequest, JobState, SubmitReviewRequest, WatchReviewRequest,
};
use tonic::transport::{Certificate, Channel, ClientTlsConfig};
use tonic_types::StatusExt;

use crate::cli::{Cli, Command, DlqCommand, LaneArg, ListArgs, StateArg, SubmitArgs, WaitArgs};
use crate::settings::Settings;

type Client = ReviewServiceClient<Channel>;

/// Why a command failed.
enum Failure {
    /// The service answered with an error.
    Status(tonic::Status),
    Other(anyhow::Error),
}

impl From<anyhow::Error> for Failure {
    fn from(e: anyhow::Error) -> Self {
        Failure::Other(e)
    }
}

impl From<tonic::Status> for Failure {
    fn from(s: tonic::Status) -> Self {
        Failure::Status(s)
    }
}

/// Runs `reviewctl` with `args` (the program name first).
pub fn main_with<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { exit::USAGE } else { exit::CLEAN });
        }
    };
    if let Command::Completions { shell } = cli.command {
        clap_complete::generate(shell, &mut Cli::command(), "reviewctl", &mut std::io::stdout());
        return ExitCode::SUCCESS;
    }
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    let code = match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(Failure::Status(s)) => {
            eprintln!("reviewctl: {}", describe(&s));
            exit::for_status(&s)
        }
        Err(Failure::Other(e)) if e.is::<exit::NoAnswer>() || e.is::<exit::WaitRanOut>() => {
            eprintln!("reviewctl: {e:#}");
            exit::DEADLINE
        }
        Err(Failure::Other(e)) => {
            eprintln!("reviewctl: {e:#}");
            exit::REQUEST_FAILED
        }
    };
    ExitCode::from(code)
}

/// An error answer in one line: the code, the message, the reason, the retry delay.
fn describe(s: &tonic::Status) -> String {
    let mut text = match s.code() {
        tonic::Code::ResourceExhausted => format!("refused: {}", s.message()),
        // reviewctl cancels nothing itself: the request's own deadline ran out.
        tonic::Code::Cancelled | tonic::Code::DeadlineExceeded => {
            format!("no answer within the request's deadline (--request-timeout): {}", s.message())
        }
        code => format!("{code:?}: {}", s.message()),
    };
    if let Some(info) = s.get_details_error_info() {
        text.push_str(&format!(" [{}]", info.reason));
    }
    if let Some(delay) = s.get_details_retry_info().and_then(|r| r.retry_delay) {
        text.push_str(&format!("; retry in {:.1} s", delay.as_secs_f64()));
    }
    text
}

async fn run(cli: Cli) -> Result<u8, Failure> {
    let home = std::env::var_os("HOME").map(std::path::PathBuf::from);
    let xdg = std::env::var_os("XDG_CONFIG_HOME").map(std::path::PathBuf::from);
    let file = match settings::config_path(&cli.conn, home.as_deref(), xdg.as_deref()) {
        Some(path) => settings::read_config(&path)?,
        None => Default::default(),
    };
    let settings = settings::resolve(&cli.conn, &file)?;
    // A command that waits ends when its wait does, whatever it is doing then.
    let wait = cli.command.wait_timeout();
    let key = &Auth {
        key: settings.api_key.clone(),
        timeout: settings.request_timeout,
        wait: wait.map(|w| (tokio::time::Instant::now() + w, w)),
    };
    let outcome = commands(cli, &settings, key).await;
    match (outcome, key.wait) {
        // A request the wait's end cut short: the wait ran out.
        (Err(Failure::Status(s)), Some((end, w)))
            if matches!(s.code(), tonic::Code::Cancelled | tonic::Code::DeadlineExceeded)
                && tokio::time::Instant::now() >= end =>
        {
            Err(Failure::Other(exit::WaitRanOut(w).into()))
        }
        (Err(Failure::Other(e)), Some((end, w))) if e.is::<exit::NoAnswer>() && tokio::time::Instant::now() >= end => {
            Err(Failure::Other(exit::WaitRanOut(w).into()))
        }
        (outcome, _) => outcome,
    }
}

async fn commands(cli: Cli, settings: &Settings, key: &Auth) -> Result<u8, Failure> {
    let mut client = connect(settings, key).await?;
    match cli.command {
        Command::Submit(args) => submit(&mut client, key, args).await,
        Command::Get { job_id, format } => {
            let r = get(&mut client, key, &job_id).await?;
            eprintln!("{}", output::status_line(&r));
            output::write(&r, format).context("writing the findings")?;
            Ok(exit::CLEAN)
        }
        Command::Watch { job_id, wait } => wait_and_report(&mut client, key, &job_id, &wait).await,
        Command::Cancel { job_id } => {
            let r = client
                .cancel_review(authed(key, CancelReviewRequest { job_id }))
                .await?
                .into_inner()
                .review
                .context("the service answered without the review")?;
            eprintln!("{}", output::status_line(&r));
            Ok(exit::CLEAN)
        }
        Command::List(args) => list(&mut client, key, args).await,
        Command::Dlq(cmd) => dlq(&mut client, key, cmd).await,
        Command::Lanes { json } => {
            let lanes = client.list_lanes(authed(key, proto::ListLanesRequest {})).await?.into_inner().lanes;
            if !json {
                println!("{}", output::LANE_HEADER);
            }
            for l in &lanes {
                println!("{}", if json { output::lane_json(l).to_string() } else { output::lane_line(l) });
            }
            Ok(exit::CLEAN)
        }
        Command::Pool { json } => {
            let pool =
                client.list_deployments(authed(key, proto::ListDeploymentsRequest {})).await?.into_inner().deployments;
            let now = std::time::SystemTime::now();
            if !json {
                println!("{}", output::DEPLOYMENT_HEADER);
            }
            for d in &pool {
                println!(
                    "{}",
                    if json { output::deployment_json(d).to_string() } else { output::deployment_line(d, now) }
                );
            }
            Ok(exit::CLEAN)
        }
        Command::Sweep(args) => sweep::sweep(&mut client, key, args).await,
        Command::Sweeps(cmd) => sweep::sweeps(&mut client, key, cmd).await,
        Command::Completions { .. } => unreachable!("handled before connecting"),
    }
}

async fn connect(s: &Settings, auth: &Auth) -> anyhow::Result<Client> {
    let mut endpoint = Channel::from_shared(s.endpoint.clone()).context("the endpoint is not a URI")?;
    if s.endpoint.starts_with("https://") {
        let mut tls = ClientTlsConfig::new().with_webpki_roots();
        if let Some(ca) = &s.tls_ca_file {
            let pem = std::fs::read(ca).with_context(|| format!("reading {}", ca.display()))?;
            tls = tls.ca_certificate(Certificate::from_pem(pem));
        }
        endpoint = endpoint.tls_config(tls)?;
    }
    // The connection's handshake is bounded too: an endpoint that takes the TCP
    // connection and never answers ends the command.
    let limit = auth.request_timeout();
    let endpoint = endpoint.connect_timeout(limit.min(Duration::from_secs(10)));
    let channel = tokio::time::timeout(limit, endpoint.connect())
        .await
        .map_err(|_| exit::NoAnswer(s.request_timeout))?
        .with_context(|| format!("connecting to {s}"))?;
    Ok(ReviewServiceClient::new(channel).max_decoding_message_size(64 * 1024 * 1024))
}

/// Who calls, how long one answer may take, and when a waiting command's wait ends
/// (and how long it was).
struct Auth {
    key: String,
    timeout: Duration,
    wait: Option<(tokio::time::Instant, Duration)>,
}

impl Auth {
    /// How long the next request may take: its own timeout, or what is left of the
    /// command's wait when that is less.
    fn request_timeout(&self) -> Duration {
        bounded(self.timeout, self.wait.map(|(end, _)| end), tokio::time::Instant::now())
    }

    /// When a wait that lasts `secs` from `now` ends: the command's end when it comes
    /// first.
    fn wait_end(&self, secs: u64) -> tokio::time::Instant {
        let own = tokio::time::Instant::now() + Duration::from_secs(secs);
        self.wait.map_or(own, |(end, _)| end.min(own))
    }
}

/// A request's timeout: `request`, or the time left until `end` when that is less (at
/// least a millisecond, so that a request made at the end fails at once, not never).
fn bounded(request: Duration, end: Option<tokio::time::Instant>, now: tokio::time::Instant) -> Duration {
    let left = end.map_or(request, |end| end.saturating_duration_since(now));
    request.min(left).max(Duration::from_millis(1))
}

/// A unary request: with the key, and a deadline the client keeps and the service is
/// told of (`grpc-timeout`), so no call waits for ever on a service that never answers.
fn authed<T>(auth: &Auth, msg: T) -> tonic::Request<T> {
    let mut req = watching(auth, msg);
    req.set_timeout(auth.request_timeout());
    req
}

/// A streaming request: with the key; `--wait-timeout` bounds it.
fn watching<T>(auth: &Auth, msg: T) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    if let Ok(v) = format!("Bearer {}", auth.key).parse() {
        req.metadata_mut().insert("authorization", v);
    }
    req
}

async fn get(client: &mut Client, key: &Auth, job_id: &str) -> Result<proto::Review, Failure> {
    let r = client.get_review(authed(key, GetReviewRequest { job_id: job_id.to_string() })).await?;
    Ok(r.into_inner().review.context("the service answered without the review")?)
}

/// What makes `git diff` print the canonical form whatever the user's settings:
/// paths from the top of the repository (not `diff.relative` from a subdirectory),
/// `a/` and `b/` prefixes (not `diff.noprefix`, `diff.mnemonicPrefix` or custom
/// ones), no colour, no external diff program, no textconv filter.
pub const CANONICAL_DIFF: [&str; 6] =
    ["--no-relative", "--src-prefix=a/", "--dst-prefix=b/", "--no-color", "--no-ext-diff", "--no-textconv"];

/// The diff to review, as bytes, and the revisions it was taken between (for `--git`).
fn read_diff(args: &SubmitArgs) -> anyhow::Result<(Vec<u8>, Option<String>, Option<String>)> {
    if let Some(range) = &args.git {
        let out = std::process::Command::new("git")
            .args(["diff"])
            .args(CANONICAL_DIFF)
            .arg(range)
            .output()
            .context("running git diff")?;
        if !out.status.success() {
            bail!("git diff {range} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        let (base, head) = revisions(range);
        return Ok((out.stdout, base, head));
    }
    let mut bytes = Vec::new();
    match args.file.as_deref() {
        None if std::io::stdin().is_terminal() => bail!("no diff: give a file, pipe one in, or use --git <range>"),
        None => std::io::stdin().read_to_end(&mut bytes).map(|_| ()).context("reading stdin")?,
        Some(p) if p.as_os_str() == "-" => {
            std::io::stdin().read_to_end(&mut bytes).map(|_| ()).context("reading stdin")?
        }
        Some(p) => bytes = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?,
    }
    Ok((bytes, None, None))
}

/// The commits a `git diff` range compares: `A..B` (A and B), `A...B` (their merge base
/// and B), `A` (A and the working tree: no head).
fn revisions(range: &str) -> (Option<String>, Option<String>) {
    let rev = |r: &str| {
        let r = if r.is_empty() { "HEAD" } else { r };
        std::process::Command::new("git")
            .args(["rev-parse", "--verify", "--quiet", &format!("{r}^{{commit}}")])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    if let Some((a, b)) = range.split_once("...") {
        let head = rev(b);
        let base = std::process::Command::new("git")
            .args(["merge-base", if a.is_empty() { "HEAD" } else { a }, if b.is_empty() { "HEAD" } else { b }])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
        (base, head)
    } else if let Some((a, b)) = range.split_once("..") {
        (rev(a), rev(b))
    } else {
        (rev(range), None)
    }
}

/// The idempotency key of a submit: the same diff with the same options is the same
/// review, so re-running a CI step does not pay twice.
pub fn derived_key(diff: &[u8], lane: &str, schema: &str, meta: &proto::ReviewMetadata) -> String {
    let digest = reviewlane_core::job_id::sha256_hex(&[
        b"reviewctl.v1",
        diff,
        lane.as_bytes(),
        schema.as_bytes(),
        meta.repository.as_bytes(),
        &meta.pull_request.to_be_bytes(),
        meta.base_revision.as_bytes(),
        meta.head_revision.as_bytes(),
    ]);
    format!("reviewctl-{}", &digest[..40])
}

async fn submit(client: &mut Client, key: &Auth, args: SubmitArgs) -> Result<u8, Failure> {
    let (bytes, base, head) = read_diff(&args)?;
    let metadata = proto::ReviewMetadata {
        repository: args.repository.clone().unwrap_or_default(),
        base_revision: args.base.clone().or(base).unwrap_or_default(),
        head_revision: args.head.clone().or(head).unwrap_or_default(),
        pull_request: args.pr.unwrap_or(0),
    };
    let lane = match args.lane {
        LaneArg::Interactive => proto::Lane::Interactive,
        LaneArg::Batch => proto::Lane::Batch,
    };
    let idempotency_key = args
        .idempotency_key
        .clone()
        .unwrap_or_else(|| derived_key(&bytes, lane.as_str_name(), &args.schema, &metadata));
    let (diff, diff_bytes) = match String::from_utf8(bytes) {
        Ok(text) => (text, Vec::new()),
        Err(e) => (String::new(), e.into_bytes()),
    };
    let req = SubmitReviewRequest {
        idempotency_key,
        lane: lane as i32,
        diff,
        diff_bytes,
        schema_version: args.schema.clone(),
        metadata: Some(metadata),
        timeout: args.timeout_secs.map(|s| prost_types::Duration { seconds: s as i64, nanos: 0 }),
        ..Default::default()
    };
    let review = client.submit_review(authed(key, req)).await?.into_inner().review.context("no review")?;
    if !args.wait {
        eprintln!("{}", output::status_line(&review));
        println!("{}", review.job_id);
        return Ok(exit::CLEAN);
    }
    wait_and_report(client, key, &review.job_id, &args.waiting).await
}

async fn list(client: &mut Client, key: &Auth, args: ListArgs) -> Result<u8, Failure> {
    let states = args
        .states
        .iter()
        .map(|s| match s {
            StateArg::Waiting => JobState::Waiting,
            StateArg::Running => JobState::Running,
            StateArg::RetryScheduled => JobState::RetryScheduled,
            StateArg::Validated => JobState::Validated,
            StateArg::Published => JobState::Published,
            StateArg::Terminal => JobState::Terminal,
        } as i32)
        .collect();
    let lane = match args.lane {
        None => proto::Lane::Unspecified,
        Some(LaneArg::Interactive) => proto::Lane::Interactive,
        Some(LaneArg::Batch) => proto::Lane::Batch,
    };
    let created_after = args.since_secs.map(|s| {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        prost_types::Timestamp { seconds: now.as_secs().saturating_sub(s) as i64, nanos: 0 }
    });
    let mut req = proto::ListReviewsRequest {
        page_size: args.page_size,
        page_token: args.page_token.clone().unwrap_or_default(),
        states,
        lane: lane as i32,
        repository: args.repository.clone().unwrap_or_default(),
        created_after,
        created_before: None,
    };
    let mut out = anstream::stdout();
    loop {
        let page = client.list_reviews(authed(key, req.clone())).await?.into_inner();
        for r in &page.reviews {
            let line = if args.json { output::review_json(r).to_string() } else { output::list_line(r) };
            std::io::Write::write_all(&mut out, format!("{line}\n").as_bytes()).context("writing the list")?;
        }
        if page.next_page_token.is_empty() {
            return Ok(exit::CLEAN);
        }
        if !args.all {
            eprintln!("more: reviewctl list --page-token {} (same filters)", page.next_page_token);
            return Ok(exit::CLEAN);
        }
        req.page_token = page.next_page_token;
    }
}

async fn dlq(client: &mut Client, key: &Auth, cmd: DlqCommand) -> Result<u8, Failure> {
    match cmd {
        DlqCommand::List { all, json } => {
            let mut req = proto::ListDeadLettersRequest { page_size: 100, page_token: String::new() };
            loop {
                let page = client.list_dead_letters(authed(key, req.clone())).await?.into_inner();
                for d in &page.dead_letters {
                    println!(
                        "{}",
                        if json { output::dead_letter_json(d).to_string() } else { output::dead_letter_line(d) }
                    );
                }
                if page.next_page_token.is_empty() {
                    return Ok(exit::CLEAN);
                }
                if !all {
                    eprintln!("more: reviewctl dlq list --all");
                    return Ok(exit::CLEAN);
                }
                req.page_token = page.next_page_token;
            }
        }
        DlqCommand::Show { job_id } => {
            let req = proto::GetDeadLetterRequest { job_id };
            let d =
                client.get_dead_letter(authed(key, req)).await?.into_inner().dead_letter.context("no dead letter")?;
            println!("{:#}", output::dead_letter_json(&d));
            Ok(exit::CLEAN)
        }
        DlqCommand::Replay { job_id, wait, waiting } => {
            let req = proto::ReplayDeadLetterRequest { job_id };
            let r = client.replay_dead_letter(authed(key, req)).await?.into_inner().review.context("no review")?;
            if !wait {
                eprintln!("{}", output::status_line(&r));
                println!("{}", r.job_id);
                return Ok(exit::CLEAN);
            }
            wait_and_report(client, key, &r.job_id, &waiting).await
        }
    }
}

fn is_final(r: &proto::Review) -> bool {
    matches!(JobState::try_from(r.state), Ok(JobState::Published | JobState::Terminal))
}

/// Follows the review until it is final (or the wait runs out), showing progress on
/// stderr — a spinner on a terminal, a line per change otherwise — then writes its
/// findings and returns the exit code.
async fn wait_and_report(client: &mut Client, key: &Auth, job_id: &str, wait: &WaitArgs) -> Result<u8, Failure> {
    let progress = std::io::stderr().is_terminal().then(|| {
        let bar = indicatif::ProgressBar::new_spinner();
        bar.enable_steady_tick(Duration::from_millis(120));
        bar
    });
    let mut last_line = String::new();
    let mut show = |r: &proto::Review| {
        let line = output::status_line(r);
        match &progress {
            Some(bar) => bar.set_message(line.clone()),
            None if line != last_line => eprintln!("{line}"),
            None => {}
        }
        last_line = line;
    };
    let deadline = key.wait_end(wait.wait_timeout);
    let mut last = get(client, key, job_id).await?;
    show(&last);
    let open = |mut c: Client| -> Opening<proto::WatchReviewResponse> {
        let req = watching(key, WatchReviewRequest { job_id: job_id.to_string() });
        Box::pin(async move { c.watch_review(req).await })
    };
    follow_stream(client, deadline, &mut last, open, |m| m.review, &mut show, is_final).await?;
    let final_line = output::status_line(&last);
    match &progress {
        Some(bar) => {
            bar.finish_and_clear();
            eprintln!("{final_line}");
        }
        // Already printed as the last change.
        None if final_line == last_line => {}
        None => eprintln!("{final_line}"),
    }
    if is_final(&last) && last.state == JobState::Published as i32 {
        output::write(&last, wait.format).context("writing the findings")?;
    }
    if !is_final(&last) {
        eprintln!("reviewctl: still not final after {} s", wait.wait_timeout);
    }
    Ok(exit::for_review(&last, wait.fail_on.map(|s| s.as_str())))
}

/// A server stream being opened (on its own handle of the client).
type Opening<M> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<tonic::Response<tonic::Streaming<M>>, tonic::Status>> + Send>,
>;

/// Follows a server stream until `done` holds for the last state or `deadline` passes:
/// each state is shown and kept in `last`. A stream the server ends (a restart, a lost
/// store connection) is opened again, after its retry delay when it was unavailable.
async fn follow_stream<M, T>(
    client: &mut Client,
    deadline: tokio::time::Instant,
    last: &mut T,
    open: impl Fn(Client) -> Opening<M>,
    state: impl Fn(M) -> Option<T>,
    show: &mut impl FnMut(&T),
    done: impl Fn(&T) -> bool,
) -> Result<(), Failure> {
    while !done(last) && tokio::time::Instant::now() < deadline {
        let followed = tokio::time::timeout_at(deadline, async {
            let mut stream = open(client.clone()).await?.into_inner();
            while let Some(msg) = stream.message().await? {
                if let Some(s) = state(msg) {
                    show(&s);
                    *last = s;
                }
            }
            Ok::<(), tonic::Status>(())
        })
        .await;
        match followed {
            Err(_) => break,
            Ok(Ok(())) => {}
            Ok(Err(s)) if s.code() == tonic::Code::Unavailable => {
                let delay = s.get_details_retry_info().and_then(|r| r.retry_delay).unwrap_or(Duration::from_secs(1));
                tokio::time::sleep_until((tokio::time::Instant::now() + delay).min(deadline)).await;
            }
            Ok(Err(s)) => return Err(Failure::Status(s)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_under_a_wait_gets_the_smaller_of_its_timeout_and_what_is_left() {
        let now = tokio::time::Instant::now();
        let s = Duration::from_secs;
        assert_eq!(bounded(s(30), None, now), s(30), "no wait: the request's own");
        assert_eq!(bounded(s(30), Some(now + s(5)), now), s(5), "5 s left of the wait");
        assert_eq!(bounded(s(2), Some(now + s(5)), now), s(2), "the request's own is less");
        assert_eq!(bounded(s(30), Some(now), now + s(1)), Duration::from_millis(1), "the wait is over");
    }

    #[test]
    fn the_derived_key_follows_the_diff_and_the_options() {
        let meta = proto::ReviewMetadata::default();
        let a = derived_key(b"diff", "LANE_INTERACTIVE", "findings.v2", &meta);
        assert_eq!(a, derived_key(b"diff", "LANE_INTERACTIVE", "findings.v2", &meta));
        assert_ne!(a, derived_key(b"diff2", "LANE_INTERACTIVE", "findings.v2", &meta));
        assert_ne!(a, derived_key(b"diff", "LANE_BATCH", "findings.v2", &meta));
        let pr = proto::ReviewMetadata { pull_request: 7, ..Default::default() };
        assert_ne!(a, derived_key(b"diff", "LANE_INTERACTIVE", "findings.v2", &pr));
        assert!(a.starts_with("reviewctl-") && a.len() == 50);
    }

    #[test]
    fn usage_errors_exit_64_and_help_exits_0() {
        assert_eq!(main_with(["reviewctl", "submit", "--no-such-flag"]), ExitCode::from(exit::USAGE));
        assert_eq!(main_with(["reviewctl", "--help"]), ExitCode::from(exit::CLEAN));
    }
}
