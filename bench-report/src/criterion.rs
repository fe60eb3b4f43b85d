//! Criterion benchmarks' results as one JSON and figure: criterion keeps an estimate per
//! benchmark in its own directory (`target/criterion/GROUP/FUNCTION/VALUE/new/`); after a run
//! the benchmark's `main` collects those of its groups into `target/NAME.json` (benchmark,
//! mean and its 95% confidence interval in ns) and draws it with [`crate::figure`].

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::figure::{FigureError, write_results};

/// Deepest directory searched below criterion's (GROUP/FUNCTION/VALUE/new is 4).
const MAX_DEPTH: usize = 6;
/// Most benchmarks collected into one figure's JSON.
const MAX_BENCHMARKS: usize = 1024;

/// One benchmark's estimate.
#[derive(Debug, Clone, PartialEq)]
pub struct Estimate {
    /// The series it belongs to: its group (less the prefix asked for) and function.
    pub series: String,
    /// Its parameter (`value_str`), or its function when it has none.
    pub category: String,
    pub mean_ns: f64,
    pub lower_ns: f64,
    pub upper_ns: f64,
}

/// Criterion's output directory, found as criterion finds it: `$CRITERION_HOME`,
/// `$CARGO_TARGET_DIR/criterion`, else `criterion/` of the target directory this benchmark
/// binary was built in (`target/release/deps/NAME`).
pub fn criterion_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return PathBuf::from(home);
    }
    if let Some(target) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(target).join("criterion");
    }
    std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.parent()?.join("criterion")))
        .unwrap_or_else(|| PathBuf::from("target/criterion"))
}

/// Whether criterion was asked to measure (not `--test`, `--list` or `--profile-time`, which
/// write no estimates).
pub fn measured() -> bool {
    !std::env::args().any(|a| matches!(a.as_str(), "--test" | "--list" | "--profile-time"))
}

/// The estimates under `dir` of every group whose id starts with `prefix`.
pub fn estimates(dir: &Path, prefix: &str) -> Vec<Estimate> {
    let mut found = Vec::new();
    collect(dir, prefix, 0, &mut found);
    found.sort_by(|a, b| (&a.series, &a.category).cmp(&(&b.series, &b.category)));
    found
}

fn collect(dir: &Path, prefix: &str, depth: usize, found: &mut Vec<Estimate>) {
    if depth > MAX_DEPTH || found.len() >= MAX_BENCHMARKS {
        return;
    }
    if dir.file_name().is_some_and(|n| n == "new") {
        if let Some(e) = estimate(dir, prefix) {
            found.push(e);
        }
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            collect(&entry.path(), prefix, depth + 1, found);
        }
    }
}

/// The estimate in a `new/` directory, if it is of a group under `prefix`.
fn estimate(new: &Path, prefix: &str) -> Option<Estimate> {
    let read = |name: &str| -> Option<Value> {
        serde_json::from_str(&std::fs::read_to_string(new.join(name)).ok()?).ok()
    };
    let id = read("benchmark.json")?;
    let group = id.get("group_id")?.as_str()?.strip_prefix(prefix)?;
    let function = id.get("function_id").and_then(Value::as_str);
    let value = id.get("value_str").and_then(Value::as_str);
    let mean = read("estimates.json")?.get("mean")?.clone();
    let interval = mean.get("confidence_interval")?;
    let series: Vec<&str> = [Some(group), function.filter(|_| value.is_some())]
        .into_iter()
        .flatten()
        .filter(|s| !s.is_empty())
        .collect();
    Some(Estimate {
        series: if series.is_empty() {
            prefix.trim_end_matches('/').to_owned()
        } else {
            series.join("/")
        },
        category: value.or(function).unwrap_or("-").to_owned(),
        mean_ns: mean.get("point_estimate")?.as_f64()?,
        lower_ns: interval.get("lower_bound")?.as_f64()?,
        upper_ns: interval.get("upper_bound")?.as_f64()?,
    })
}

/// What a summary's figure says: its title and what the categories are.
#[derive(Debug, Clone, Copy)]
pub struct Summary<'a> {
    /// The JSON's name in the target directory (`NAME.json`, `NAME.svg`).
    pub name: &'a str,
    /// Criterion group ids start with this.
    pub prefix: &'a str,
    pub title: &'a str,
    /// The x axis: what the benchmarks' parameters are (with units).
    pub x_label: &'a str,
    /// The y axis: what one iteration is, in the unit of `unit_ns`.
    pub y_label: &'a str,
    /// Nanoseconds per unit of the y axis (1 for ns, 1e3 for µs, 1e6 for ms).
    pub unit_ns: f64,
}

/// The summary JSON of `estimates` (the figure's input).
pub fn document(summary: &Summary, estimates: &[Estimate]) -> Value {
    json!({
        "bench": "criterion",
        "title": format!("{} — {}", summary.title, crate::machine()),
        "x_label": summary.x_label,
        "y_label": summary.y_label,
        "unit_ns": summary.unit_ns,
        "estimates": estimates.iter().map(|e| json!({
            "series": e.series,
            "category": e.category,
            "mean_ns": e.mean_ns,
            "lower_ns": e.lower_ns,
            "upper_ns": e.upper_ns,
        })).collect::<Vec<_>>(),
    })
}

/// After a criterion run: collects the estimates of `summary.prefix`'s groups into
/// `target/NAME.json` beside criterion's directory and draws them. Does nothing when criterion
/// did not measure (`cargo test --benches`, `--list`).
pub fn write_summary(summary: &Summary) -> Result<(), FigureError> {
    if !measured() {
        return Ok(());
    }
    let dir = criterion_dir();
    let found = estimates(&dir, summary.prefix);
    let target = dir.parent().unwrap_or(Path::new("."));
    write_results(
        &target.join(format!("{}.json", summary.name)),
        &document(summary, &found),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bench(dir: &Path, path: &str, id: Value, mean: f64) {
        let new = dir.join(path).join("new");
        std::fs::create_dir_all(&new).unwrap();
        std::fs::write(new.join("benchmark.json"), id.to_string()).unwrap();
        let ci =
            json!({"confidence_level": 0.95, "lower_bound": mean * 0.9, "upper_bound": mean * 1.1});
        std::fs::write(
            new.join("estimates.json"),
            json!({"mean": {"confidence_interval": ci, "point_estimate": mean}}).to_string(),
        )
        .unwrap();
    }

    #[test]
    fn estimates_of_the_groups_asked_for_become_series_and_a_figure() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("criterion");
        for (policy, vgpus, mean) in [("none", 4, 100.0), ("none", 64, 300.0), ("fair", 4, 200.0)] {
            bench(
                &root,
                &format!("decision_{policy}/{vgpus}"),
                json!({"group_id": format!("decision/{policy}"), "function_id": null, "value_str": vgpus.to_string()}),
                mean,
            );
        }
        bench(
            &root,
            "daemon/fair/4",
            json!({"group_id": "daemon", "function_id": "fair", "value_str": "4"}),
            5.0,
        );
        // A run in progress: no estimates yet.
        std::fs::create_dir_all(root.join("decision_x/4/new")).unwrap();
        let found = estimates(&root, "decision/");
        assert_eq!(found.len(), 3, "{found:?}");
        assert_eq!(found[0].series, "fair");
        assert_eq!(
            (found[2].category.as_str(), found[2].mean_ns),
            ("64", 300.0)
        );
        assert!((found[2].lower_ns - 270.0).abs() < 1e-9);
        let daemon = estimates(&root, "daemon");
        assert_eq!(
            (daemon[0].series.as_str(), daemon[0].category.as_str()),
            ("fair", "4")
        );

        let summary = Summary {
            name: "decision",
            prefix: "decision/",
            title: "decision cost",
            x_label: "vGPUs",
            y_label: "µs per decision",
            unit_ns: 1e3,
        };
        let json = dir.path().join("decision.json");
        write_results(&json, &document(&summary, &found)).unwrap();
        let svg = std::fs::read_to_string(dir.path().join("decision.svg")).unwrap();
        for text in [
            "decision cost",
            "vGPUs",
            "µs per decision",
            "fair",
            "none",
            "64",
        ] {
            assert!(svg.contains(text), "{text} missing");
        }
        // Drawn in the summary's unit: none at 64 vGPUs, 300 ns, is 0.3 µs.
        let figure = crate::figure::figure(&document(&summary, &found)).unwrap();
        let none = &figure.panels[0].series[1];
        assert_eq!(none.name, "none");
        assert_eq!(figure.panels[0].categories, ["4", "64"]);
        assert!((none.values[1].unwrap() - 0.3).abs() < 1e-9, "{none:?}");
        // Nothing measured: the JSON says so and no figure is drawn.
        let empty = dir.path().join("empty.json");
        write_results(&empty, &document(&summary, &[])).unwrap();
        assert!(!dir.path().join("empty.svg").exists());
    }
}
