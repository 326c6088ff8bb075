//! `reviewctl sweep` and `reviewctl sweeps`: a repository reviewed as one sweep. The
//! manifest is built from a revision: each text file under the size bound is one item
//! whose diff adds the whole file — what `git diff <empty tree> <rev> -- <path>` prints
//! — so findings validate against the file's real lines. Pages go up (a page sent
//! again adds nothing twice), the sweep is sealed, its progress followed, and its
//! findings written as one report (one SARIF run for the whole sweep).

use std::io::IsTerminal;

use anyhow::{Context, bail};
use reviewlane_api::proto::{self, SweepItemState};

use crate::cli::{SweepArgs, SweepsCommand};
use crate::{Auth, CANONICAL_DIFF, Client, Failure, authed, exit, output};

/// Diff bytes of one `AddSweepItems` page at most (an item larger goes alone), well
/// under the ingress's decoding limit.
const PAGE_BYTES: usize = 256 * 1024;
/// Items of one page at most (the ingress takes 1,000).
const PAGE_ITEMS: usize = 500;
/// Paths given to one `git diff`.
const DIFF_PATHS: usize = 200;

/// One item of the manifest: its path (the item's key) and its diff.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestItem {
    pub path: String,
    pub diff: Vec<u8>,
}

/// Runs git in the current directory; its stdout.
fn git(args: &[&str]) -> anyhow::Result<Vec<u8>> {
    let out = std::process::Command::new("git").args(args).output().context("running git")?;
    if !out.status.success() {
        bail!(
            "git {} failed: {}",
            args.first().copied().unwrap_or_default(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out.stdout)
}

/// The regular files of `rev` matching the globs (every one when none), with their
/// sizes: `git ls-tree -r -l -z` for the files, and `git diff --name-only` from the
/// empty tree for the globs (ls-tree takes no pathspec magic). Symlinks and submodules
/// are left out.
fn files_at(rev: &str, empty: &str, globs: &[String]) -> anyhow::Result<Vec<(String, u64)>> {
    let files = parse_ls_tree(&git(&["ls-tree", "-r", "-l", "-z", "--full-tree", rev])?);
    if globs.is_empty() {
        return Ok(files);
    }
    let mut args = vec!["diff", "--name-only", "-z", "--no-renames", empty, rev, "--"];
    let specs: Vec<String> = globs.iter().map(|g| format!(":(glob){g}")).collect();
    args.extend(specs.iter().map(String::as_str));
    let matched = git(&args)?;
    let matched: std::collections::HashSet<&[u8]> = matched.split(|b| *b == 0).filter(|p| !p.is_empty()).collect();
    Ok(files.into_iter().filter(|(path, _)| matched.contains(path.as_bytes())).collect())
}

/// `<mode> SP <type> SP <object> SP+ <size> TAB <path> NUL` entries: regular files
/// (mode 100644 or 100755) with their sizes.
pub fn parse_ls_tree(out: &[u8]) -> Vec<(String, u64)> {
    out.split(|b| *b == 0)
        .filter_map(|entry| {
            let entry = std::str::from_utf8(entry).ok()?;
            let (meta, path) = entry.split_once('\t')?;
            let mut fields = meta.split_whitespace();
            let (mode, kind, _, size) = (fields.next()?, fields.next()?, fields.next()?, fields.next()?);
            (kind == "blob" && (mode == "100644" || mode == "100755"))
                .then(|| Some((path.to_string(), size.parse().ok()?)))?
        })
        .collect()
}

/// Splits `git diff` output into one section per file, each a diff of its own, keyed by
/// its new path (C-quoted paths unquoted by the diff parser). Binary files and files
/// without a line (empty ones) have nothing to review and are left out.
pub fn split_sections(out: &[u8]) -> Vec<ManifestItem> {
    let mut starts: Vec<usize> = Vec::new();
    let mut at = 0;
    for line in out.split_inclusive(|b| *b == b'\n') {
        if line.starts_with(b"diff --git ") {
            starts.push(at);
        }
        at += line.len();
    }
    starts.push(out.len());
    starts
        .windows(2)
        .filter_map(|w| {
            let section = &out[w[0]..w[1]];
            let parsed = reviewlane_core::diff::parse_bytes(section).ok()?;
            let file = parsed.files.into_iter().next()?;
            if file.binary || file.hunks.is_empty() {
                return None;
            }
            Some(ManifestItem { path: file.new_path?, diff: section.to_vec() })
        })
        .collect()
}

/// The manifest of `rev`: each text file under `max_bytes` as one item.
fn manifest(rev: &str, globs: &[String], max_bytes: u64) -> anyhow::Result<(String, Vec<ManifestItem>)> {
    let commit =
        String::from_utf8_lossy(&git(&["rev-parse", "--verify", &format!("{rev}^{{commit}}")])?).trim().to_string();
    let empty = String::from_utf8_lossy(&git(&["hash-object", "-t", "tree", "/dev/null"])?).trim().to_string();
    let paths: Vec<String> = files_at(&commit, &empty, globs)?
        .into_iter()
        .filter(|(_, size)| *size > 0 && *size <= max_bytes)
        .map(|(p, _)| p)
        .collect();
    let mut items = Vec::new();
    for chunk in paths.chunks(DIFF_PATHS) {
        let mut args: Vec<&str> = vec!["--literal-pathspecs", "diff"];
        args.extend(CANONICAL_DIFF);
        args.extend([empty.as_str(), commit.as_str(), "--"]);
        args.extend(chunk.iter().map(String::as_str));
        items.extend(split_sections(&git(&args)?));
    }
    Ok((commit, items))
}

/// Consecutive pages of items within `PAGE_ITEMS` and `PAGE_BYTES` (an item larger than
/// a page alone), cut as provider batches are.
pub fn pages(sizes: &[usize]) -> Vec<std::ops::Range<usize>> {
    let limits = reviewlane_core::batch::BatchLimits { max_requests: PAGE_ITEMS, max_bytes: PAGE_BYTES };
    reviewlane_core::batch::chunks(sizes, limits)
}

fn count(s: &proto::Sweep, state: SweepItemState) -> u64 {
    s.items.iter().find(|c| c.state == state as i32).map_or(0, |c| c.count)
}

/// One line of a sweep's progress.
pub fn progress_line(s: &proto::Sweep) -> String {
    let mut line = format!(
        "{} {}: {}/{} done ({:.0} %), {} published, {} failed, {} running, {} waiting",
        s.sweep_id,
        proto::SweepState::try_from(s.state)
            .map_or("unknown", |st| st.as_str_name())
            .trim_start_matches("SWEEP_STATE_")
            .to_lowercase(),
        count(s, SweepItemState::Published) + count(s, SweepItemState::Failed) + count(s, SweepItemState::Cancelled),
        s.items_total,
        s.percent_done,
        count(s, SweepItemState::Published),
        count(s, SweepItemState::Failed),
        count(s, SweepItemState::Running),
        count(s, SweepItemState::Submitted) + count(s, SweepItemState::Queued),
    );
    if let Some(b) = s.provider_batches.filter(|b| b.batches_running > 0) {
        line.push_str(&format!(
            "; provider batches: {} running, {}/{} lines done ({} failed)",
            b.batches_running,
            b.lines_succeeded + b.lines_failed,
            b.lines,
            b.lines_failed
        ));
    }
    if let Some(eta) = &s.estimated_completion {
        let now =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs() as i64;
        line.push_str(&format!(", about {} s left", (eta.seconds - now).max(0)));
    }
    line
}

async fn get_sweep(client: &mut Client, key: &Auth, id: &str) -> Result<proto::Sweep, Failure> {
    let req = proto::GetSweepRequest { sweep_id: id.to_string() };
    Ok(client.get_sweep(authed(key, req)).await?.into_inner().sweep.context("no sweep")?)
}

/// `reviewctl sweep`.
pub(crate) async fn sweep(client: &mut Client, key: &Auth, args: SweepArgs) -> Result<u8, Failure> {
    let (commit, items) = manifest(&args.git, &args.paths, args.max_file_bytes)?;
    if items.is_empty() {
        return Err(anyhow::anyhow!("no text file of {} under {} bytes matches", args.git, args.max_file_bytes).into());
    }
    let idempotency_key = args.idempotency_key.clone().unwrap_or_else(|| {
        let digest = reviewlane_core::job_id::sha256_hex(&[
            b"reviewctl.sweep.v1",
            commit.as_bytes(),
            args.paths.join("\0").as_bytes(),
            &args.max_file_bytes.to_be_bytes(),
            args.schema.as_bytes(),
            args.repository.as_deref().unwrap_or_default().as_bytes(),
        ]);
        format!("reviewctl-sweep-{}", &digest[..40])
    });
    let mode = match args.mode {
        crate::cli::SweepModeArg::Auto => proto::SweepMode::Auto,
        crate::cli::SweepModeArg::Lanes => proto::SweepMode::Lanes,
        crate::cli::SweepModeArg::ProviderBatch => proto::SweepMode::ProviderBatch,
    };
    let create = proto::CreateSweepRequest { idempotency_key, mode: mode as i32, completion_window: None };
    let sweep = client.create_sweep(authed(key, create)).await?.into_inner().sweep.context("no sweep")?;
    let id = sweep.sweep_id.clone();
    let metadata = proto::ReviewMetadata {
        repository: args.repository.clone().unwrap_or_default(),
        head_revision: commit.clone(),
        ..Default::default()
    };
    let (mut added, mut present) = (0, 0);
    let sizes: Vec<usize> = items.iter().map(|i| i.diff.len()).collect();
    for page in pages(&sizes) {
        let page_items = items[page]
            .iter()
            .map(|i| {
                let (diff, diff_bytes) = match String::from_utf8(i.diff.clone()) {
                    Ok(text) => (text, Vec::new()),
                    Err(e) => (String::new(), e.into_bytes()),
                };
                proto::SweepItem {
                    item_key: i.path.clone(),
                    diff,
                    diff_bytes,
                    metadata: Some(metadata.clone()),
                    schema_version: args.schema.clone(),
                }
            })
            .collect();
        let req = proto::AddSweepItemsRequest { sweep_id: id.clone(), items: page_items };
        let answer = client.add_sweep_items(authed(key, req)).await?.into_inner();
        (added, present) = (added + answer.added, present + answer.already_present);
    }
    eprintln!("{id}: {} items ({added} new, {present} already in the sweep) from {commit}", items.len());
    let sealed = client.seal_sweep(authed(key, proto::SealSweepRequest { sweep_id: id.clone() })).await?;
    let sealed = sealed.into_inner().sweep.context("no sweep")?;
    if !args.wait {
        eprintln!("{}", progress_line(&sealed));
        println!("{id}");
        return Ok(exit::CLEAN);
    }
    let last = follow(client, key, &id, args.waiting.wait_timeout).await?;
    report(client, key, &last, &args.schema, &args.waiting).await
}

/// Follows a sweep until every item is final or `wait_timeout` runs out (`WatchSweep`,
/// opened again when the server ends it), showing its progress on stderr: a bar on a
/// terminal, a line per change otherwise.
async fn follow(client: &mut Client, key: &Auth, id: &str, wait_timeout: u64) -> Result<proto::Sweep, Failure> {
    let deadline = key.wait_end(wait_timeout);
    let mut last = get_sweep(client, key, id).await?;
    let bar = std::io::stderr().is_terminal().then(|| {
        let bar = indicatif::ProgressBar::new(last.items_total);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar
    });
    let mut shown = String::new();
    let mut show = |s: &proto::Sweep| {
        let line = progress_line(s);
        match &bar {
            Some(b) => {
                b.set_length(s.items_total);
                b.set_position(s.items_total.min((s.percent_done / 100.0 * s.items_total as f64).round() as u64));
                b.set_message(line.clone());
            }
            None if line != shown => eprintln!("{line}"),
            None => {}
        }
        shown = line;
    };
    show(&last);
    let open = |mut c: Client| -> crate::Opening<proto::WatchSweepResponse> {
        let req = crate::watching(key, proto::WatchSweepRequest { sweep_id: id.to_string() });
        Box::pin(async move { c.watch_sweep(req).await })
    };
    let done = |s: &proto::Sweep| s.percent_done >= 100.0;
    crate::follow_stream(client, deadline, &mut last, open, |m| m.sweep, &mut show, done).await?;
    if let Some(b) = bar {
        b.finish_and_clear();
        eprintln!("{shown}");
    }
    Ok(last)
}

/// The sweep's items, every page, in the order they were added.
async fn all_items(
    client: &mut Client,
    key: &Auth,
    id: &str,
    states: Vec<i32>,
) -> Result<Vec<proto::SweepItemStatus>, Failure> {
    let mut req =
        proto::ListSweepItemsRequest { sweep_id: id.to_string(), page_size: 1000, states, ..Default::default() };
    let mut out = Vec::new();
    loop {
        let page = client.list_sweep_items(authed(key, req.clone())).await?.into_inner();
        out.extend(page.items);
        if page.next_page_token.is_empty() {
            return Ok(out);
        }
        req.page_token = page.next_page_token;
    }
}

/// Writes every published item's findings as one report and returns the exit code: as
/// `submit --wait` for the findings, 2 when an item ended without findings, 4 when the
/// wait ran out first.
async fn report(
    client: &mut Client,
    key: &Auth,
    sweep: &proto::Sweep,
    schema: &str,
    wait: &crate::cli::WaitArgs,
) -> Result<u8, Failure> {
    let published = all_items(client, key, &sweep.sweep_id, vec![SweepItemState::Published as i32]).await?;
    let mut findings = Vec::new();
    for item in &published {
        findings.extend(crate::get(client, key, &item.job_id).await?.findings);
    }
    let whole = proto::Review {
        job_id: sweep.sweep_id.clone(),
        state: proto::JobState::Published as i32,
        schema_version: schema.to_string(),
        findings,
        ..Default::default()
    };
    output::write(&whole, wait.format).context("writing the findings")?;
    if sweep.percent_done < 100.0 {
        eprintln!("reviewctl: the sweep is not done after {} s", wait.wait_timeout);
        return Ok(exit::DEADLINE);
    }
    for r in &sweep.failed {
        let reason = proto::TerminalReason::try_from(r.reason).map_or("unknown", |r| r.as_str_name());
        eprintln!("  {} failed: {}", r.count, reason.trim_start_matches("TERMINAL_REASON_").to_lowercase());
    }
    let code = exit::for_review(&whole, wait.fail_on.map(|s| s.as_str()));
    if code == exit::CLEAN && count(sweep, SweepItemState::Failed) + count(sweep, SweepItemState::Cancelled) > 0 {
        return Ok(exit::FAILED);
    }
    Ok(code)
}

/// `reviewctl sweeps …`.
pub(crate) async fn sweeps(client: &mut Client, key: &Auth, cmd: SweepsCommand) -> Result<u8, Failure> {
    match cmd {
        SweepsCommand::Get { sweep_id } => {
            let s = get_sweep(client, key, &sweep_id).await?;
            eprintln!("{}", progress_line(&s));
            println!("{:#}", sweep_json(&s));
            Ok(exit::CLEAN)
        }
        SweepsCommand::Items { sweep_id, states } => {
            let states = states.iter().map(|s| s.to_proto() as i32).collect();
            for i in all_items(client, key, &sweep_id, states).await? {
                let state = SweepItemState::try_from(i.state).map_or("unknown", |s| s.as_str_name());
                println!(
                    "{}\t{}\t{}",
                    i.job_id,
                    state.trim_start_matches("SWEEP_ITEM_STATE_").to_lowercase(),
                    i.item_key
                );
            }
            Ok(exit::CLEAN)
        }
        SweepsCommand::Watch { sweep_id, wait_timeout } => {
            let s = follow(client, key, &sweep_id, wait_timeout).await?;
            Ok(if s.percent_done < 100.0 {
                exit::DEADLINE
            } else if count(&s, SweepItemState::Failed) + count(&s, SweepItemState::Cancelled) > 0 {
                exit::FAILED
            } else {
                exit::CLEAN
            })
        }
        SweepsCommand::List { all } => {
            let mut req = proto::ListSweepsRequest { page_size: 20, page_token: String::new() };
            loop {
                let page = client.list_sweeps(authed(key, req.clone())).await?.into_inner();
                for s in &page.sweeps {
                    println!("{}", progress_line(s));
                }
                if page.next_page_token.is_empty() {
                    return Ok(exit::CLEAN);
                }
                if !all {
                    eprintln!("more: reviewctl batch list --all");
                    return Ok(exit::CLEAN);
                }
                req.page_token = page.next_page_token;
            }
        }
        SweepsCommand::Cancel { sweep_id } => {
            let req = proto::CancelSweepRequest { sweep_id };
            let s = client.cancel_sweep(authed(key, req)).await?.into_inner().sweep.context("no sweep")?;
            eprintln!("{}", progress_line(&s));
            Ok(exit::CLEAN)
        }
    }
}

/// A sweep as JSON: its state, its counts by item state and failed reason.
fn sweep_json(s: &proto::Sweep) -> serde_json::Value {
    let name = |n: &str, prefix: &str| n.trim_start_matches(prefix).to_lowercase();
    let items: serde_json::Map<String, serde_json::Value> = s
        .items
        .iter()
        .map(|c| {
            let state = SweepItemState::try_from(c.state).map_or("unknown", |s| s.as_str_name());
            (name(state, "SWEEP_ITEM_STATE_"), c.count.into())
        })
        .collect();
    let failed: serde_json::Map<String, serde_json::Value> = s
        .failed
        .iter()
        .map(|r| {
            let reason = proto::TerminalReason::try_from(r.reason).map_or("unknown", |r| r.as_str_name());
            (name(reason, "TERMINAL_REASON_"), r.count.into())
        })
        .collect();
    let tokens = s.tokens.unwrap_or_default();
    serde_json::json!({
        "sweep_id": s.sweep_id,
        "state": name(proto::SweepState::try_from(s.state).map_or("unknown", |st| st.as_str_name()), "SWEEP_STATE_"),
        "runs_on": name(proto::SweepMode::try_from(s.runs_on).map_or("unknown", |m| m.as_str_name()), "SWEEP_MODE_"),
        "items_total": s.items_total,
        "items": items,
        "failed": failed,
        "percent_done": s.percent_done,
        "tokens": {"input": tokens.input, "output": tokens.output},
        "estimated_cost_usd": s.estimated_cost_usd,
        "estimated_completion": s.estimated_completion.map(|t| t.seconds),
        "provider_batches": s.provider_batches.map(|b| serde_json::json!({
            "batches_running": b.batches_running,
            "lines": b.lines,
            "lines_succeeded": b.lines_succeeded,
            "lines_failed": b.lines_failed,
        })),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ls_tree_entries_are_regular_files_with_sizes() {
        let out = b"100644 blob aaaa      12\tsrc/a.rs\x00100755 blob bbbb     300\tbin/run.sh\x00120000 blob cccc       5\tlink\x00160000 commit dddd       -\tvendor/sub\x00100644 blob eeee       7\tsp ace\tname.txt\x00";
        assert_eq!(
            parse_ls_tree(out),
            vec![("src/a.rs".into(), 12), ("bin/run.sh".into(), 300), ("sp ace\tname.txt".into(), 7)]
        );
    }

    #[test]
    fn git_diff_output_splits_into_one_reviewable_item_per_text_file() {
        let out = concat!(
            "diff --git a/a.rs b/a.rs\nnew file mode 100644\nindex 0000000..1111111\n--- /dev/null\n+++ b/a.rs\n@@ -0,0 +1,2 @@\n+fn a() {}\n+// diff --git inside a line\n",
            "diff --git a/img.png b/img.png\nnew file mode 100644\nindex 0000000..2222222\nBinary files /dev/null and b/img.png differ\n",
            "diff --git \"a/we\\tird.rs\" \"b/we\\tird.rs\"\nnew file mode 100644\n--- /dev/null\n+++ \"b/we\\tird.rs\"\n@@ -0,0 +1 @@\n+x\n",
        );
        let items = split_sections(out.as_bytes());
        let paths: Vec<&str> = items.iter().map(|i| i.path.as_str()).collect();
        assert_eq!(paths, ["a.rs", "we\tird.rs"]);
        // Each item is a diff of its own, exactly the file's section.
        assert!(items[0].diff.starts_with(b"diff --git a/a.rs") && items[0].diff.ends_with(b"inside a line\n"));
        assert!(reviewlane_core::diff::parse(std::str::from_utf8(&items[1].diff).unwrap()).is_ok());
    }

    #[test]
    fn pages_stay_within_their_item_and_byte_bounds() {
        assert_eq!(pages(&[100; 1200]), vec![0..500, 500..1000, 1000..1200]);
        assert_eq!(pages(&[200 * 1024, 100 * 1024, 10]), vec![0..1, 1..3]);
        assert_eq!(pages(&[1024 * 1024, 10]), vec![0..1, 1..2], "a large item goes alone");
        assert!(pages(&[]).is_empty());
    }

    #[test]
    fn the_progress_line_shows_the_providers_live_lines_while_batches_run() {
        let mut s = proto::Sweep {
            sweep_id: "us_1".into(),
            state: proto::SweepState::Sealed as i32,
            items_total: 120,
            items: vec![proto::SweepItemCount { state: SweepItemState::Submitted as i32, count: 120 }],
            ..Default::default()
        };
        assert!(!progress_line(&s).contains("provider batches"), "a sweep on the lanes");
        s.provider_batches =
            Some(proto::ProviderBatchProgress { batches_running: 1, lines: 120, lines_succeeded: 35, lines_failed: 2 });
        let line = progress_line(&s);
        assert!(line.starts_with("us_1 sealed: 0/120 done (0 %)"), "{line}");
        assert!(line.ends_with("; provider batches: 1 running, 37/120 lines done (2 failed)"), "{line}");
    }
}
