//! The results table: markdown for the terminal and a report file, CSV for tools.

use std::fmt::Write;

use vgpu_scheduler::sim::{RunReport, Scenario, VmReport};

/// Column headers, shared by the markdown and the CSV table.
const COLUMNS: [&str; 14] = [
    "run",
    "vm",
    "workload",
    "gpu_share_pct",
    "gpu_util_pct",
    "groups",
    "lat_p50_us",
    "lat_p99_us",
    "fps",
    "frame_p50_ms",
    "frame_p99_ms",
    "over_bound_pct",
    "work_per_s",
    "cpu_ms",
];

fn row(run: &RunReport, v: &VmReport) -> [String; 14] {
    [
        run.label.clone(),
        v.name.clone(),
        v.workload.to_owned(),
        format!("{:.1}", 100.0 * v.gpu_share),
        format!("{:.1}", 100.0 * v.gpu_util),
        v.groups.to_string(),
        format!("{:.0}", v.latency_p50_us),
        format!("{:.0}", v.latency_p99_us),
        format!("{:.1}", v.fps),
        format!("{:.2}", v.frame_time_p50_ms),
        format!("{:.2}", v.frame_time_p99_ms),
        format!("{:.1}", v.frames_over_bound_pct),
        format!("{:.1}", v.work_per_sec),
        format!("{:.0}", v.cpu_time_ns as f64 / 1e6),
    ]
}

/// The per-run x per-VM table and the per-run totals, in markdown.
pub(crate) fn markdown(sc: &Scenario, runs: &[RunReport]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "## {} ({} ms simulated)\n", sc.name, sc.duration_ms);
    if !sc.description.is_empty() {
        let _ = writeln!(s, "{}\n", sc.description.trim());
    }
    let _ = writeln!(s, "| {} |", COLUMNS.join(" | "));
    let _ = writeln!(s, "|{}", "---|".repeat(COLUMNS.len()));
    for r in runs {
        for v in &r.vms {
            let _ = writeln!(s, "| {} |", row(r, v).join(" | "));
        }
    }
    let _ = writeln!(
        s,
        "\n| run | policy | gpu_busy_pct | context_switches | sched_events | decisions |\n|---|---|---|---|---|---|"
    );
    for r in runs {
        let _ = writeln!(
            s,
            "| {} | {} | {:.1} | {} | {} | {} |",
            r.label, r.policy, r.gpu_busy_pct, r.context_switches, r.sched_events, r.decisions
        );
    }
    s
}

/// Quotes a CSV field when it needs it.
fn field(f: &str) -> String {
    if f.contains([',', '"', '\n']) {
        format!("\"{}\"", f.replace('"', "\"\""))
    } else {
        f.to_owned()
    }
}

/// The per-run x per-VM table as CSV.
pub(crate) fn csv(runs: &[RunReport]) -> String {
    let mut s = COLUMNS.join(",");
    s.push('\n');
    for r in runs {
        for v in &r.vms {
            let cells: Vec<String> = row(r, v).iter().map(|c| field(c)).collect();
            s.push_str(&cells.join(","));
            s.push('\n');
        }
    }
    s
}
