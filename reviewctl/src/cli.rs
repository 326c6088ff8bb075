//! The command line.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

const EXAMPLES: &str = "\
Examples:
  # Review the branch in CI; fail the job on high or critical findings
  git diff origin/main... | reviewctl submit --wait --fail-on high

  # Let reviewctl run git, and write SARIF for code scanning
  reviewctl submit --git origin/main...HEAD --repository acme/app --pr 42 --wait --format sarif > review.sarif

  # Follow, read and cancel a review
  reviewctl watch us_3f2a...
  reviewctl get us_3f2a... --format json
  reviewctl cancel us_3f2a...

  # Review a whole repository at a revision as one sweep; one SARIF run for all of it
  reviewctl sweep --git HEAD --paths 'src/**' --repository acme/app --wait --format sarif > sweep.sarif
  reviewctl sweeps get us_9c1d...

Exit codes (submit --wait, watch, sweep --wait, sweeps watch):
  0  published, nothing at or above --fail-on
  1  published with findings at or above --fail-on
  2  the review (or an item of the sweep) ended without findings (the reason is printed)
  3  refused for now (the retry delay is printed)
  4  the review's deadline passed, or --wait-timeout or --request-timeout ran out
  5  the request failed (authentication, an invalid request, the service unreachable)
  64 the command line is wrong

Connection settings come from flags, then the environment (REVIEWLANE_ENDPOINT,
REVIEWLANE_API_KEY or REVIEWLANE_API_KEY_FILE, REVIEWLANE_TLS_CA_FILE,
REVIEWLANE_REQUEST_TIMEOUT_SECS), then the config file (--config, REVIEWCTL_CONFIG, or
~/.config/reviewlane/reviewctl.toml with the keys endpoint, api_key_file, tls_ca_file,
request_timeout_secs).";

#[derive(Debug, Parser)]
#[command(name = "reviewctl", version, about = "Submit diffs to reviewlane and act on its findings.", after_help = EXAMPLES)]
pub struct Cli {
    #[command(flatten)]
    pub conn: ConnArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Default, Args)]
pub struct ConnArgs {
    /// The ingress's gRPC endpoint (http:// or https://) [default: http://127.0.0.1:50051]
    #[arg(long, env = "REVIEWLANE_ENDPOINT", global = true)]
    pub endpoint: Option<String>,
    /// A file holding the tenant's API key
    #[arg(long, env = "REVIEWLANE_API_KEY_FILE", global = true)]
    pub api_key_file: Option<PathBuf>,
    /// The tenant's API key (prefer --api-key-file: a flag's value shows in process lists)
    #[arg(long, env = "REVIEWLANE_API_KEY", hide_env_values = true, global = true, hide = true)]
    pub api_key: Option<String>,
    /// A PEM CA certificate to trust for https:// endpoints (besides the web's roots)
    #[arg(long = "tls-ca", env = "REVIEWLANE_TLS_CA_FILE", global = true)]
    pub tls_ca_file: Option<PathBuf>,
    /// Seconds one request (and connecting) may wait for an answer (exit 4 past it)
    /// [default: 30]
    #[arg(long, value_name = "SECS", env = "REVIEWLANE_REQUEST_TIMEOUT_SECS", global = true)]
    pub request_timeout: Option<f64>,
    /// Config file [default: ~/.config/reviewlane/reviewctl.toml when it exists]
    #[arg(long, env = "REVIEWCTL_CONFIG", global = true)]
    pub config: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Submit a diff for review (from a file, stdin, or `git diff <range>`)
    Submit(SubmitArgs),
    /// Show a review
    Get {
        job_id: String,
        #[arg(long, value_enum, default_value_t = Format::Text)]
        format: Format,
    },
    /// Follow a review until it is published or ends; exit codes as `submit --wait`
    Watch {
        job_id: String,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Cancel a review (unless its delivery has started)
    Cancel { job_id: String },
    /// List your reviews, newest first
    List(ListArgs),
    /// Dead letters: reviews that ended without findings (an operator key sees its region's)
    #[command(subcommand)]
    Dlq(DlqCommand),
    /// Each lane of your region: depth, oldest review's age, throughput, predicted wait (operator keys)
    Lanes {
        /// One JSON object a line instead of a table
        #[arg(long)]
        json: bool,
    },
    /// The provider deployments serving your region: class, state, calls in flight, room in each budget (operator keys)
    Pool {
        /// One JSON object a line instead of a table
        #[arg(long)]
        json: bool,
    },
    /// Review a repository at a revision as one sweep: each text file one item
    Sweep(SweepArgs),
    /// Follow, read and cancel sweeps (`batch` is an old name for it)
    #[command(subcommand, alias = "batch")]
    Sweeps(SweepsCommand),
    /// Print shell completions
    Completions { shell: clap_complete::Shell },
}

impl Command {
    /// How long the whole command may wait, when it waits (`--wait` with `--wait-timeout`,
    /// `watch`, `sweeps watch`): every request it makes ends by then.
    pub fn wait_timeout(&self) -> Option<std::time::Duration> {
        let secs = match self {
            Command::Submit(a) if a.wait => a.waiting.wait_timeout,
            Command::Sweep(a) if a.wait => a.waiting.wait_timeout,
            Command::Watch { wait, .. } => wait.wait_timeout,
            Command::Dlq(DlqCommand::Replay { wait: true, waiting, .. }) => waiting.wait_timeout,
            Command::Sweeps(SweepsCommand::Watch { wait_timeout, .. }) => *wait_timeout,
            _ => return None,
        };
        Some(std::time::Duration::from_secs(secs))
    }
}

#[derive(Debug, Args)]
pub struct SweepArgs {
    /// The revision whose files are reviewed (each as a diff adding the whole file)
    #[arg(long, value_name = "REV")]
    pub git: String,
    /// Only files matching these globs (git pathspec globs, repeatable) [default: every file]
    #[arg(long = "paths", value_name = "GLOB", num_args = 1..)]
    pub paths: Vec<String>,
    /// Files larger than this are left out
    #[arg(long, default_value_t = 256 * 1024)]
    pub max_file_bytes: u64,
    /// Repository name (metadata; shown in review surfaces)
    #[arg(long)]
    pub repository: Option<String>,
    /// Findings schema version
    #[arg(long, default_value = "findings.v2")]
    pub schema: String,
    #[arg(long, value_enum, default_value_t = SweepModeArg::Auto)]
    pub mode: SweepModeArg,
    /// The sweep's idempotency key [default: derived from the revision's commit and the
    /// options above, so re-running the same sweep continues it]
    #[arg(long)]
    pub idempotency_key: Option<String>,
    /// Wait until every item is published or ends, then write the findings
    #[arg(long)]
    pub wait: bool,
    #[command(flatten)]
    pub waiting: WaitArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SweepModeArg {
    /// The provider's batch API where the region has one, else the batch lane
    Auto,
    Lanes,
    ProviderBatch,
}

#[derive(Debug, Subcommand)]
pub enum SweepsCommand {
    /// A sweep's progress: items by state, failed by reason, tokens, cost, estimate
    Get { sweep_id: String },
    /// A sweep's items: job id, state, key (a line each)
    Items {
        sweep_id: String,
        /// Only items in these states (repeatable)
        #[arg(long = "state", value_enum)]
        states: Vec<ItemStateArg>,
    },
    /// Follow a sweep until every item is final (exit 2 when one failed)
    Watch {
        sweep_id: String,
        /// Stop waiting after this many seconds (exit 4)
        #[arg(long, default_value_t = 24 * 3600)]
        wait_timeout: u64,
    },
    /// Cancel a sweep: items not yet run end cancelled; paid results are still delivered
    Cancel { sweep_id: String },
    /// Your sweeps, newest first, with their progress
    List {
        /// Every page, not just the first 20
        #[arg(long)]
        all: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ItemStateArg {
    Queued,
    Submitted,
    Running,
    Validated,
    Published,
    Failed,
    Cancelled,
}

impl ItemStateArg {
    pub fn to_proto(self) -> reviewlane_api::proto::SweepItemState {
        use reviewlane_api::proto::SweepItemState as S;
        match self {
            ItemStateArg::Queued => S::Queued,
            ItemStateArg::Submitted => S::Submitted,
            ItemStateArg::Running => S::Running,
            ItemStateArg::Validated => S::Validated,
            ItemStateArg::Published => S::Published,
            ItemStateArg::Failed => S::Failed,
            ItemStateArg::Cancelled => S::Cancelled,
        }
    }
}

#[derive(Debug, Args)]
pub struct SubmitArgs {
    /// The diff file; `-` or none reads stdin
    #[arg(conflicts_with = "git")]
    pub file: Option<PathBuf>,
    /// Run `git diff <RANGE>` in the current directory and review its output
    #[arg(long, value_name = "RANGE")]
    pub git: Option<String>,
    /// Repository name (metadata; shown in review surfaces)
    #[arg(long)]
    pub repository: Option<String>,
    /// Pull request number
    #[arg(long)]
    pub pr: Option<u32>,
    /// Base and head revisions (with --git: resolved from the range unless given)
    #[arg(long)]
    pub base: Option<String>,
    #[arg(long)]
    pub head: Option<String>,
    #[arg(long, value_enum, default_value_t = LaneArg::Interactive)]
    pub lane: LaneArg,
    /// Findings schema version
    #[arg(long, default_value = "findings.v2")]
    pub schema: String,
    /// Idempotency key [default: derived from the diff's digest and the options above,
    /// so re-running the same submit is the same review]
    #[arg(long)]
    pub idempotency_key: Option<String>,
    /// The review is useless after this many seconds [default: the lane's]
    #[arg(long)]
    pub timeout_secs: Option<u64>,
    /// Wait until the review is published or ends
    #[arg(long)]
    pub wait: bool,
    #[command(flatten)]
    pub waiting: WaitArgs,
}

#[derive(Debug, Clone, Args)]
pub struct WaitArgs {
    /// Exit 1 when a finding is at or above this severity
    #[arg(long, value_enum)]
    pub fail_on: Option<SeverityArg>,
    /// How the findings are written to stdout
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Stop waiting after this many seconds (exit 4)
    #[arg(long, default_value_t = 3600)]
    pub wait_timeout: u64,
}

#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// List dead letters, oldest first
    List {
        /// Every page, not just the first 100
        #[arg(long)]
        all: bool,
        /// One JSON object a line instead of a table
        #[arg(long)]
        json: bool,
    },
    /// Show one dead letter (and whether its content is still kept for a replay)
    Show { job_id: String },
    /// Submit a dead letter's review again as a new job (idempotent); prints the new job
    Replay {
        job_id: String,
        /// Wait for the new job (exit codes as `submit --wait`)
        #[arg(long)]
        wait: bool,
        #[command(flatten)]
        waiting: WaitArgs,
    },
}

#[derive(Debug, Args)]
pub struct ListArgs {
    /// Only reviews in these states (repeatable)
    #[arg(long = "state", value_enum)]
    pub states: Vec<StateArg>,
    #[arg(long, value_enum)]
    pub lane: Option<LaneArg>,
    #[arg(long)]
    pub repository: Option<String>,
    /// Only reviews created in the last this many seconds
    #[arg(long, value_name = "SECS")]
    pub since_secs: Option<u64>,
    #[arg(long, default_value_t = 20)]
    pub page_size: i32,
    /// Continue a listing (the token the previous page printed)
    #[arg(long)]
    pub page_token: Option<String>,
    /// Every page, not just one
    #[arg(long)]
    pub all: bool,
    /// One JSON object a line instead of a table
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StateArg {
    Waiting,
    Running,
    RetryScheduled,
    Validated,
    Published,
    Terminal,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Grouped by file, with line numbers (coloured on a terminal)
    Text,
    /// The review as JSON
    Json,
    /// SARIF 2.1.0
    Sarif,
    /// reviewdog's rdjsonl (one diagnostic a line)
    Rdjsonl,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LaneArg {
    Interactive,
    Batch,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SeverityArg {
    Info,
    Low,
    Medium,
    High,
    Critical,
}

impl SeverityArg {
    pub fn as_str(self) -> &'static str {
        match self {
            SeverityArg::Info => "info",
            SeverityArg::Low => "low",
            SeverityArg::Medium => "medium",
            SeverityArg::High => "high",
            SeverityArg::Critical => "critical",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn submit_parses_its_options() {
        let cli = Cli::try_parse_from([
            "reviewctl",
            "submit",
            "--git",
            "main...",
            "--wait",
            "--fail-on",
            "high",
            "--format",
            "sarif",
            "--pr",
            "7",
        ])
        .unwrap();
        let Command::Submit(s) = cli.command else { panic!() };
        assert_eq!(s.git.as_deref(), Some("main..."));
        assert!(s.wait);
        assert_eq!((s.waiting.fail_on, s.waiting.format, s.pr), (Some(SeverityArg::High), Format::Sarif, Some(7)));
        assert!(Cli::try_parse_from(["reviewctl", "submit", "x.diff", "--git", "main"]).is_err());
    }
}
