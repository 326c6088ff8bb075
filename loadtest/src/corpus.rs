//! Realistic unified diffs for load: several files (Rust, Python, TypeScript) with
//! several hunks each, carrying the kinds of problems reviewers flag (unwrap, SQL built
//! from strings, eval, TODOs, committed secrets), in three sizes. Every diff is unique
//! (its seed is in it), so the result cache never answers in place of the provider.

/// ~1 KB, ~6 KB, ~30 KB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Size {
    Small,
    Medium,
    Large,
}

impl Size {
    /// The mix used by the scenarios: 70% small, 25% medium, 5% large.
    pub fn mix(i: usize) -> Size {
        match i % 20 {
            0 => Size::Large,
            1..=5 => Size::Medium,
            _ => Size::Small,
        }
    }

    fn shape(self) -> (usize, usize, usize) {
        // (files, hunks per file, added lines per hunk)
        match self {
            Size::Small => (1, 2, 4),
            Size::Medium => (3, 3, 6),
            Size::Large => (8, 5, 8),
        }
    }
}

const RUST: &[&str] = &[
    "    let config = load_config(&path).unwrap();",
    "    let query = format!(\"SELECT * FROM accounts WHERE id = {}\", account_id);",
    "    // TODO: handle the retry case before release",
    "    let total: u64 = items.iter().map(|i| i.price).sum();",
    "    let handle = tokio::spawn(async move { worker.run().await });",
    "    if balance < amount { return Err(Error::Insufficient); }",
    "    println!(\"debug: {:?}\", request);",
    "    let value = cache.get(&key).expect(\"cached\");",
];
const PYTHON: &[&str] = &[
    "    rows = db.execute(\"SELECT * FROM users WHERE name = '%s'\" % name)",
    "    result = eval(expression)",
    "    # TODO: remove before shipping",
    "    API_TOKEN = \"sk_live_51Hd93kd02jd82hs\"",
    "    for item in items: total += item.price",
    "    logger.info(\"processed %d records\", count)",
    "    data = json.loads(payload)",
    "    return {\"status\": \"ok\", \"count\": len(rows)}",
];
const TYPESCRIPT: &[&str] = &[
    "  const filtered = eval(userFilter);",
    "  const html = `<div>${comment.body}</div>`;",
    "  // TODO: paginate this request",
    "  const total = items.reduce((sum, i) => sum + i.price, 0);",
    "  element.innerHTML = message;",
    "  await fetch(`/api/reports/${id}`, { method: 'DELETE' });",
    "  console.log('state', state);",
    "  return { ok: true, total };",
];

/// A unique diff of the given size; the same `seed` gives the same diff.
pub fn generate(seed: u64, size: Size) -> String {
    let (files, hunks, added) = size.shape();
    let mut out = String::new();
    for f in 0..files {
        let (ext, lines, ctx) = match (seed as usize + f) % 3 {
            0 => ("rs", RUST, "fn process(input: &Input) -> Result<Output, Error> {"),
            1 => ("py", PYTHON, "def process(records):"),
            _ => ("ts", TYPESCRIPT, "export async function process(items: Item[]) {"),
        };
        let path = format!("services/svc{}/src/module_{f}_{}.{ext}", seed % 17, seed % 5);
        out.push_str(&format!(
            "diff --git a/{path} b/{path}\nindex 1a2b3c4..5d6e7f8 100644\n--- a/{path}\n+++ b/{path}\n"
        ));
        let mut shift = 0;
        for h in 0..hunks {
            let old_start = 1 + h * 40;
            out.push_str(&format!("@@ -{old_start},3 +{},{} @@\n", old_start + shift, 3 + added));
            out.push_str(&format!(" {ctx}\n"));
            out.push_str(&format!("     // section {h} of change {seed}\n"));
            for a in 0..added {
                let line = lines[(seed as usize + f * 7 + h * 3 + a) % lines.len()];
                out.push_str(&format!("+{line}\n"));
            }
            out.push_str(" }\n");
            shift += added;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_diffs_parse_have_their_size_and_are_unique() {
        for (size, min, max) in
            [(Size::Small, 300, 2_000), (Size::Medium, 3_000, 10_000), (Size::Large, 15_000, 60_000)]
        {
            let d = generate(42, size);
            assert!((min..max).contains(&d.len()), "{size:?}: {} bytes", d.len());
            let parsed = reviewlane_core::diff::parse(&d).expect("parses");
            let (files, hunks, added) = size.shape();
            assert_eq!(parsed.added_lines().count(), files * hunks * added);
        }
        assert_ne!(generate(1, Size::Small), generate(2, Size::Small));
    }
}
