//! A review written for people (text, grouped by file, coloured on a terminal) or for
//! tools (JSON, SARIF 2.1.0, reviewdog rdjsonl).

use std::collections::BTreeMap;
use std::io::Write;

use anstyle::{AnsiColor, Style};
use reviewlane_api as api;
use reviewlane_api::proto::{self, JobState};
use reviewlane_core::surfaces::{Report, rdjson, sarif};
use serde_json::{Value, json};

use crate::cli::Format;

/// The state's name as the job model writes it (`published`, `retry_scheduled`, ...).
fn state_name(state: i32) -> &'static str {
    JobState::try_from(state).ok().and_then(api::state_from_proto).map_or("unknown", |s| s.as_str())
}

/// One line on the review's state, for stderr and progress.
pub fn status_line(r: &proto::Review) -> String {
    let mut line = format!("{} {}", r.job_id, state_name(r.state));
    if !r.terminal_reason.is_empty() {
        line.push_str(&format!(" ({})", r.terminal_reason));
    }
    if r.parts_total > 1 {
        line.push_str(&format!(", part {}/{}", r.parts_done, r.parts_total));
    }
    if matches!(JobState::try_from(r.state), Ok(JobState::Published)) {
        line.push_str(&format!(", {} findings", r.findings.len()));
        if r.findings_dropped > 0 {
            line.push_str(&format!(" ({} more over the cap)", r.findings_dropped));
        }
    }
    line
}

/// One review in a listing: id, state, lane, when, findings.
pub fn list_line(r: &proto::Review) -> String {
    let lane = match proto::Lane::try_from(r.lane) {
        Ok(proto::Lane::Batch) => "batch",
        _ => "interactive",
    };
    let created = r.created_at.map(|t| t.seconds).unwrap_or_default();
    let when = time::OffsetDateTime::from_unix_timestamp(created)
        .ok()
        .and_then(|t| t.format(&time::format_description::well_known::Rfc3339).ok())
        .unwrap_or_default();
    let state = match r.terminal_reason.as_str() {
        "" => state_name(r.state).to_string(),
        reason => format!("{} ({reason})", state_name(r.state)),
    };
    format!("{}  {:<28}  {:<11}  {}", r.job_id, state, lane, when)
}

fn secs(d: Option<prost_types::Duration>) -> Option<f64> {
    d.map(|d| d.seconds as f64 + f64::from(d.nanos) / 1e9)
}

fn lane_name(lane: i32) -> &'static str {
    match proto::Lane::try_from(lane) {
        Ok(proto::Lane::Batch) => "batch",
        _ => "interactive",
    }
}

pub const LANE_HEADER: &str = "region  lane         depth/bound      oldest   per_sec  predicted wait";

/// One lane in the `lanes` table.
pub fn lane_line(l: &proto::LaneStatus) -> String {
    let age = secs(l.oldest_age).map_or("-".to_string(), |s| format!("{s:.1}s"));
    let wait = secs(l.predicted_wait).map_or("-".to_string(), |s| format!("{s:.1}s"));
    let depth = format!("{}/{}", l.depth, l.bound);
    format!("{:<6}  {:<11}  {depth:<15}  {age:>7}  {:>7.2}  {wait:>14}", l.region, lane_name(l.lane), l.per_second)
}

pub fn lane_json(l: &proto::LaneStatus) -> Value {
    json!({
        "region": l.region,
        "lane": lane_name(l.lane),
        "depth": l.depth,
        "bound": l.bound,
        "oldest_age_secs": secs(l.oldest_age),
        "per_second": l.per_second,
        "predicted_wait_secs": secs(l.predicted_wait),
    })
}

pub const DEPLOYMENT_HEADER: &str =
    "region  class       deployment        kind       state         in flight  room                       seen";

/// One deployment in the `pool` table: its budgets' room as `room/limit` each, and how
/// long ago an extractor looked.
pub fn deployment_line(d: &proto::DeploymentStatus, now: std::time::SystemTime) -> String {
    let room: Vec<String> = d.budgets.iter().map(|b| format!("{} {}/{}", b.dimension, b.room, b.limit)).collect();
    let room = if room.is_empty() { "-".to_string() } else { room.join(", ") };
    let state = match secs(d.paused_for) {
        Some(s) => format!("{} {s:.0}s", d.state),
        None => d.state.clone(),
    };
    let seen = d
        .observed_at
        .and_then(|t| now.duration_since(std::time::UNIX_EPOCH).ok().map(|n| n.as_secs_f64() - t.seconds as f64))
        .map_or("-".to_string(), |ago| format!("{:.0}s ago", ago.max(0.0)));
    let in_flight = format!("{}/{}", d.in_flight, d.window);
    format!(
        "{:<6}  {:<10}  {:<16}  {:<9}  {state:<12}  {in_flight:>9}  {room:<25}  {seen}",
        d.region, d.model_class, d.deployment, d.kind
    )
}

pub fn deployment_json(d: &proto::DeploymentStatus) -> Value {
    let budgets: Vec<Value> =
        d.budgets.iter().map(|b| json!({"dimension": b.dimension, "limit": b.limit, "room": b.room})).collect();
    json!({
        "region": d.region,
        "deployment": d.deployment,
        "kind": d.kind,
        "model": d.model,
        "model_class": d.model_class,
        "state": d.state,
        "in_flight": d.in_flight,
        "window": d.window,
        "budgets": budgets,
        "paused_for_secs": secs(d.paused_for),
        "observed_at": d.observed_at.map(|t| t.seconds),
    })
}

/// A dead letter as JSON.
pub fn dead_letter_json(d: &proto::DeadLetter) -> Value {
    let attempts = d.attempts.unwrap_or_default();
    json!({
        "job_id": d.job_id,
        "tenant": d.tenant,
        "region": d.region,
        "terminal_reason": d.terminal_reason,
        "schema_version": d.schema_version,
        "attempts": {"congestion": attempts.congestion, "transient": attempts.transient, "schema": attempts.schema},
        "submitted_at": d.submitted_at.map(|t| t.seconds),
        "dead_at": d.dead_at.map(|t| t.seconds),
        "content_available": d.content_available,
    })
}

/// One dead letter in a listing.
pub fn dead_letter_line(d: &proto::DeadLetter) -> String {
    format!("{}  {:<10}  {}", d.job_id, d.tenant, d.terminal_reason)
}

fn report<'a>(r: &'a proto::Review, findings: &'a [reviewlane_core::findings::Finding]) -> Report<'a> {
    Report { job_id: &r.job_id, schema_version: &r.schema_version, repository: "", head_revision: "", findings }
}

/// The review as JSON (the API's fields, enums as names).
pub fn review_json(r: &proto::Review) -> Value {
    let findings: Vec<Value> = r
        .findings
        .iter()
        .map(|f| serde_json::to_value(api::finding_from_proto(f)).expect("findings serialize"))
        .collect();
    let tokens = r.tokens.unwrap_or_default();
    json!({
        "job_id": r.job_id,
        "state": state_name(r.state),
        "terminal_reason": r.terminal_reason,
        "region": r.region,
        "schema_version": r.schema_version,
        "parts_total": r.parts_total,
        "parts_done": r.parts_done,
        "findings": findings,
        "findings_dropped": r.findings_dropped,
        "quarantined_count": r.quarantined_count,
        "tokens": {"input": tokens.input, "output": tokens.output},
        "estimated_cost_usd": r.estimated_cost_usd,
    })
}

fn severity_style(severity: &str) -> Style {
    match severity {
        "critical" | "high" => Style::new().fg_color(Some(AnsiColor::Red.into())).bold(),
        "medium" => Style::new().fg_color(Some(AnsiColor::Yellow.into())),
        _ => Style::new().dimmed(),
    }
}

/// Findings grouped by file, in line order; styles are stripped when `out` is not a
/// terminal (anstream).
pub fn text(r: &proto::Review, out: &mut dyn Write) -> std::io::Result<()> {
    let mut by_file: BTreeMap<&str, Vec<&proto::Finding>> = BTreeMap::new();
    for f in &r.findings {
        by_file.entry(f.path.as_str()).or_default().push(f);
    }
    let bold = Style::new().bold();
    for (path, mut findings) in by_file {
        findings.sort_by_key(|f| f.line);
        writeln!(out, "{bold}{path}{bold:#}")?;
        for f in findings {
            let lines = match f.end_line {
                Some(end) if end > f.line => format!("{}-{end}", f.line),
                _ => f.line.to_string(),
            };
            let style = severity_style(&f.severity);
            writeln!(out, "  {lines:>7}  {style}{:<8}{style:#}  {:<15}  {}", f.severity, f.category, f.title)?;
            writeln!(out, "           {}", f.message)?;
            if !f.suggested_action.is_empty() {
                writeln!(out, "           -> {}", f.suggested_action)?;
            }
        }
    }
    Ok(())
}

/// Writes the review's findings in `format` to stdout.
pub fn write(r: &proto::Review, format: Format) -> std::io::Result<()> {
    let mut out = anstream::stdout();
    let findings: Vec<_> = r.findings.iter().map(api::finding_from_proto).collect();
    match format {
        Format::Text => text(r, &mut out),
        Format::Json => writeln!(out, "{:#}", review_json(r)),
        Format::Sarif => writeln!(out, "{:#}", sarif::log(&report(r, &findings))),
        Format::Rdjsonl => write!(out, "{}", rdjson::lines(&report(r, &findings))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_groups_by_file_in_line_order() {
        let f = |path: &str, line: u32, title: &str| proto::Finding {
            path: path.into(),
            line,
            severity: "high".into(),
            category: "security".into(),
            title: title.into(),
            message: "m".into(),
            ..Default::default()
        };
        let r = proto::Review {
            findings: vec![f("b.rs", 3, "third"), f("a.rs", 9, "second"), f("a.rs", 2, "first")],
            ..Default::default()
        };
        let mut out = Vec::new();
        text(&r, &mut out).unwrap();
        let plain = String::from_utf8(out).unwrap();
        let order: Vec<usize> =
            ["a.rs", "first", "second", "b.rs", "third"].iter().map(|s| plain.find(s).unwrap()).collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{plain}");
    }

    #[test]
    fn a_deployment_line_shows_state_pause_room_and_age() {
        let d = proto::DeploymentStatus {
            region: "eu".into(),
            deployment: "azure-eu-1".into(),
            kind: "azure".into(),
            model_class: "fast".into(),
            state: "paused".into(),
            in_flight: 3,
            window: 8,
            budgets: vec![
                proto::BudgetRoom { dimension: "rpm".into(), limit: 300, room: 120 },
                proto::BudgetRoom { dimension: "tpm".into(), limit: 50_000, room: 900 },
            ],
            paused_for: Some(prost_types::Duration { seconds: 4, nanos: 0 }),
            observed_at: Some(prost_types::Timestamp { seconds: 1_000, nanos: 0 }),
            ..Default::default()
        };
        let now = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_003);
        let line = deployment_line(&d, now);
        for part in ["eu", "fast", "azure-eu-1", "azure", "paused 4s", "3/8", "rpm 120/300, tpm 900/50000", "3s ago"] {
            assert!(line.contains(part), "{part} in {line}");
        }
        let j = deployment_json(&d);
        assert_eq!((j["budgets"][1]["room"].as_u64(), j["paused_for_secs"].as_f64()), (Some(900), Some(4.0)));
    }

    #[test]
    fn the_status_line_shows_parts_and_findings() {
        let r = proto::Review {
            job_id: "us_1".into(),
            state: JobState::Running as i32,
            parts_total: 5,
            parts_done: 2,
            ..Default::default()
        };
        assert_eq!(status_line(&r), "us_1 running, part 2/5");
    }
}
