//! `vgpu-smi [--control PATH] [-q] [--json] [VM]`: the host's view of each VM's vGPU, as
//! `nvidia-smi vgpu` gives it: its device process and QEMU, how long its device has been
//! connected, its GPU share now, its memory budget's use, its frame rate and its standing
//! under the policy; `-q` a detailed block per VM. Asks `vgpu-schedd`'s control socket (as
//! `vgpuctl`). Exit codes: 0 ok; 1 refused (an unknown VM); 2 the command line does not
//! parse, or the daemon cannot be reached.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use serde_json::{Map, Value, json};
use vgpu_schedd::client::{
    Align, Conn, Failure, cell, latency_cell, memory_cell, only_vm, param_text, policy_cell, table,
};
use vgpu_schedd::control::DEFAULT_CONTROL_PATH;

/// The scheduling parameters `-q` shows, in `vgpuctl set`'s keys and syntax.
const PARAMS: [&str; 6] = [
    "priority",
    "weight",
    "sched",
    "reserve",
    "slo",
    "target_fps",
];
/// Bytes in a MiB.
const MIB: u64 = 1 << 20;

/// The host's view of each VM's vGPU.
#[derive(Debug, Parser)]
#[command(
    name = "vgpu-smi",
    version,
    about = "Each VM's vGPU as vgpu-schedd sees it: device and QEMU pids, uptime, GPU share, \
             memory used and limit, frame rate, standing under the policy",
    after_help = "Exit codes: 0 ok; 1 refused (an unknown VM); 2 the command line does not \
                  parse, or the daemon cannot be reached.",
    after_long_help = "EXIT STATUS
0 ok; 1 refused (an unknown VM); 2 the command line does not parse, or the daemon cannot be
reached.

EXAMPLES
  vgpu-smi
  vgpu-smi vm1
  vgpu-smi -q
  vgpu-smi --json

FILES
  /run/vgpu-schedd/control.sock

The daemon's control socket (--control); reading it needs the daemon's user, root or the
control group.

SEE ALSO
vgpuctl(1), vgpu-schedd(1); inside a guest, vgpu-smi-guest from the vgpu-guest-cuda package."
)]
struct Cli {
    /// The daemon's control socket.
    #[arg(long, value_name = "PATH", default_value = DEFAULT_CONTROL_PATH)]
    control: PathBuf,
    /// A detailed block per VM instead of the table.
    #[arg(short = 'q', long)]
    query: bool,
    /// Print one JSON object: the policy, and per VM its statistics and parameters.
    #[arg(long)]
    json: bool,
    /// Only this VM.
    vm: Option<String>,
}

/// Per VM, its statistics (a `stats` answer's entry) with its state and the parameters in
/// force (a `list` answer's `effective`, else its own `params`) added; only `only` if given
/// (refused when the daemon does not know it).
fn merge(stats: &Value, list: &Value, only: Option<&str>) -> Result<Vec<Value>, Failure> {
    let empty = Vec::new();
    let listed = list.get("vms").and_then(Value::as_array).unwrap_or(&empty);
    let vms = stats.get("vms").and_then(Value::as_array).unwrap_or(&empty);
    let mut out = only_vm(vms, only)?;
    for vm in &mut out {
        let name = vm
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        let connected = vm.get("connected").and_then(Value::as_bool) == Some(true);
        let state = if connected { "connected" } else { "away" };
        let entry = listed
            .iter()
            .find(|l| l.get("name").and_then(Value::as_str) == Some(name.as_str()));
        let params = entry
            .and_then(|l| {
                l.get("effective")
                    .filter(|e| !e.is_null())
                    .or(l.get("params"))
            })
            .cloned()
            .unwrap_or(Value::Null);
        if let Some(merged) = vm.as_object_mut() {
            merged.insert("state".into(), json!(state));
            merged.insert("params".into(), params);
        }
    }
    Ok(out)
}

/// A pid as a cell: `-` for none and for 0 (a QEMU its device did not name).
fn pid_cell(v: Option<&Value>) -> String {
    match v.and_then(Value::as_u64) {
        Some(pid) if pid > 0 => pid.to_string(),
        _ => "-".into(),
    }
}

/// Nanoseconds as `[Dd ]HH:MM:SS`; `-` for none.
fn uptime_cell(ns: Option<u64>) -> String {
    let Some(ns) = ns else {
        return "-".into();
    };
    let s = ns / 1_000_000_000;
    let (d, h, m, s) = (s / 86_400, s / 3_600 % 24, s / 60 % 60, s % 60);
    if d > 0 {
        format!("{d}d {h:02}:{m:02}:{s:02}")
    } else {
        format!("{h:02}:{m:02}:{s:02}")
    }
}

/// A number of a VM's entry, 0 where it has none.
fn num(vm: &Value, key: &str) -> f64 {
    vm.get(key).and_then(Value::as_f64).unwrap_or(0.0)
}

/// A live figure of a VM: `-` while it is away.
fn live(vm: &Value, text: String) -> String {
    if vm.get("connected").and_then(Value::as_bool) == Some(true) {
        text
    } else {
        "-".into()
    }
}

/// A VM's policy figures (empty while away).
fn figures(vm: &Value) -> Map<String, Value> {
    vm.get("figures")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default()
}

/// The first line: the policy, how busy the engine was, how many VMs are shown.
fn summary(stats: &Value, vms: &[Value]) -> String {
    let policy = stats.get("policy").and_then(Value::as_str).unwrap_or("-");
    let busy = num(stats, "engine_busy") * 100.0;
    format!(
        "vgpu-smi  policy: {policy}  engine busy: {busy:.1} %  VMs: {}",
        vms.len()
    )
}

/// The table: a row per VM.
fn table_lines(stats: &Value, vms: &[Value]) -> Vec<String> {
    let policy = stats.get("policy").and_then(Value::as_str).unwrap_or("-");
    let rows: Vec<Vec<String>> = vms
        .iter()
        .map(|vm| {
            vec![
                cell(vm.get("name")),
                cell(vm.get("vgpu")),
                cell(vm.get("state")),
                pid_cell(vm.get("device_pid")),
                pid_cell(vm.get("qemu_pid")),
                uptime_cell(vm.get("uptime_ns").and_then(Value::as_u64)),
                live(vm, format!("{:.1} %", num(vm, "gpu_share") * 100.0)),
                memory_cell(
                    vm.get("memory_used_bytes").and_then(Value::as_u64),
                    vm.get("memory_limit_bytes").and_then(Value::as_u64),
                ),
                live(vm, format!("{:.1} fps", num(vm, "fps"))),
                policy_cell(policy, &figures(vm)),
            ]
        })
        .collect();
    use Align::{Left, Right};
    let mut lines = vec![summary(stats, vms)];
    lines.extend(table(
        &[
            ("VM", Left),
            ("vGPU", Right),
            ("state", Left),
            ("pid", Right),
            ("qemu", Right),
            ("uptime", Right),
            ("GPU share", Right),
            ("memory", Right),
            ("frame rate", Right),
            ("policy", Left),
        ],
        &rows,
    ));
    lines
}

/// Bytes as MiB (`-` for none).
fn mib(v: Option<u64>) -> String {
    v.map_or_else(|| "-".into(), |b| format!("{} MiB", b / MIB))
}

/// The `-q` blocks: every figure of each VM, one per line, grouped as `nvidia-smi -q` does.
fn query_lines(stats: &Value, vms: &[Value]) -> Vec<String> {
    let policy = stats.get("policy").and_then(Value::as_str).unwrap_or("-");
    let mut lines = vec![summary(stats, vms)];
    let field = |lines: &mut Vec<String>, depth: usize, key: &str, value: String| {
        let indent = "    ".repeat(depth);
        let width = 32usize.saturating_sub(indent.len());
        lines.push(format!("{indent}{key:<width$}: {value}"));
    };
    for vm in vms {
        lines.push(String::new());
        field(&mut lines, 0, "VM", cell(vm.get("name")));
        field(&mut lines, 1, "vGPU", cell(vm.get("vgpu")));
        field(&mut lines, 1, "State", cell(vm.get("state")));
        field(&mut lines, 1, "Device pid", pid_cell(vm.get("device_pid")));
        field(&mut lines, 1, "QEMU pid", pid_cell(vm.get("qemu_pid")));
        let uptime = vm.get("uptime_ns").and_then(Value::as_u64);
        field(&mut lines, 1, "Uptime", uptime_cell(uptime));
        lines.push("    Utilization".into());
        let share = format!("{:.1} %", num(vm, "gpu_share") * 100.0);
        field(&mut lines, 2, "GPU share", live(vm, share));
        let fps = format!("{:.1} fps", num(vm, "fps"));
        field(&mut lines, 2, "Frame rate", live(vm, fps));
        let groups = format!("{:.1}/s", num(vm, "groups_per_sec"));
        field(&mut lines, 2, "Command groups", live(vm, groups));
        field(
            &mut lines,
            2,
            "Queued",
            live(vm, cell(vm.get("queue_depth"))),
        );
        field(
            &mut lines,
            2,
            "In flight",
            live(vm, cell(vm.get("in_flight"))),
        );
        let recent = latency_cell(
            num(vm, "recent_latency_p50_us"),
            num(vm, "recent_latency_p99_us"),
        );
        field(&mut lines, 2, "Latency p50/p99", live(vm, recent));
        lines.push("    Memory".into());
        let used = vm.get("memory_used_bytes").and_then(Value::as_u64);
        let limit = vm.get("memory_limit_bytes").and_then(Value::as_u64);
        field(&mut lines, 2, "Used", mib(used));
        field(&mut lines, 2, "Limit", mib(limit));
        let free = used.zip(limit).map(|(u, l)| l.saturating_sub(u));
        field(&mut lines, 2, "Free", mib(free));
        lines.push("    Totals since connect".into());
        for (key, name) in [
            ("submitted", "Submitted"),
            ("completed", "Completed"),
            ("cancelled", "Cancelled"),
            ("frames", "Frames"),
        ] {
            field(&mut lines, 2, name, live(vm, cell(vm.get(key))));
        }
        let gpu_ms = format!("{:.1} ms", num(vm, "gpu_time_ns") / 1e6);
        field(&mut lines, 2, "GPU time", live(vm, gpu_ms));
        lines.push("    Policy".into());
        field(&mut lines, 2, "Policy", policy.to_owned());
        field(&mut lines, 2, "Standing", policy_cell(policy, &figures(vm)));
        for (key, value) in figures(vm) {
            field(&mut lines, 3, &key, cell(Some(&value)));
        }
        lines.push("    Parameters".into());
        let params = vm.get("params");
        for key in PARAMS {
            let value = params.and_then(|p| p.get(key));
            field(&mut lines, 2, key, param_text(key, value));
        }
    }
    lines
}

fn run(cli: &Cli) -> Result<(), Failure> {
    let mut conn = Conn::open(&cli.control)?;
    let stats = conn.call(&json!({"cmd": "stats"}))?;
    let list = conn.call(&json!({"cmd": "list"}))?;
    let vms = merge(&stats, &list, cli.vm.as_deref())?;
    if cli.json {
        let answer = json!({
            "policy": stats.get("policy"),
            "engine_busy": stats.get("engine_busy"),
            "vms": vms,
        });
        println!("{answer}");
        return Ok(());
    }
    let lines = if cli.query {
        query_lines(&stats, &vms)
    } else {
        table_lines(&stats, &vms)
    };
    for line in lines {
        println!("{line}");
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli: Cli = vgpu_cli::parse();
    vgpu_schedd::client::exit("vgpu-smi", cli.json, run(&cli))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_line_conventions() {
        vgpu_cli::check::conventions::<Cli>(env!("CARGO_PKG_VERSION")).unwrap();
        vgpu_cli::check::operator_man_page::<Cli>().unwrap();
        let cli: Cli = vgpu_cli::check::arguments(["-q", "--json", "vm1"]).unwrap();
        assert!(cli.query && cli.json);
        assert_eq!(cli.vm.as_deref(), Some("vm1"));
        assert!(vgpu_cli::check::arguments::<Cli, _, _>(["vm1", "vm2"]).is_err());
    }

    /// A `stats` and a `list` answer as the daemon gives them: one VM connected for 1 h 2 min
    /// 3 s with 256 MiB of its 1024 in use, one away.
    fn answers() -> (Value, Value) {
        let stats = json!({
            "now": 1, "policy": "timegraph", "engine_busy": 0.5, "engine_switches": 3,
            "vms": [
                {"name": "vm1", "vgpu": 2, "connected": true, "gpu_share": 0.25,
                 "groups_per_sec": 10.0, "fps": 59.94, "queue_depth": 1, "in_flight": 2,
                 "latency_p50_us": 100, "latency_p99_us": 900,
                 "recent_latency_p50_us": 1500, "recent_latency_p99_us": 9000,
                 "submitted": 40, "dispatched": 39, "completed": 38, "cancelled": 0,
                 "gpu_time_ns": 2_500_000u64, "frames": 7, "budget": null,
                 "figures": {"priority": 3.0, "ht": 0.0},
                 "memory_used_bytes": 256u64 << 20, "memory_limit_bytes": 1u64 << 30,
                 "device_pid": 4242, "qemu_pid": 0, "uptime_ns": 3_723_000_000_000u64},
                {"name": "vm2", "vgpu": null, "connected": false, "gpu_share": 0.0,
                 "groups_per_sec": 0.0, "fps": 0.0, "queue_depth": 0, "in_flight": 0,
                 "latency_p50_us": 0, "latency_p99_us": 0, "recent_latency_p50_us": 0,
                 "recent_latency_p99_us": 0, "submitted": 0, "dispatched": 0,
                 "completed": 0, "cancelled": 0, "gpu_time_ns": 0, "frames": 0,
                 "budget": null, "figures": {}, "memory_used_bytes": null,
                 "memory_limit_bytes": null, "device_pid": null, "qemu_pid": null,
                 "uptime_ns": null}
            ]
        });
        let list = json!({
            "policy": {"policy": "timegraph"},
            "vms": [
                {"name": "vm1", "params": {"priority": 1, "weight": 1},
                 "effective": {"priority": 3, "weight": 2, "sched": "prt",
                               "reserve": {"c": 2_000_000, "t": 10_000_000, "enforcement": "pe"}}},
                {"name": "vm2", "params": {"priority": 5}, "effective": null}
            ]
        });
        (stats, list)
    }

    #[test]
    fn the_table_has_a_row_per_vm_with_pids_uptime_share_and_memory() {
        let (stats, list) = answers();
        let vms = merge(&stats, &list, None).unwrap();
        let lines = table_lines(&stats, &vms);
        assert_eq!(
            lines[0],
            "vgpu-smi  policy: timegraph  engine busy: 50.0 %  VMs: 2"
        );
        assert!(
            lines[1].starts_with("VM   vGPU  state") && lines[1].contains("pid  qemu    uptime"),
            "{}",
            lines[1]
        );
        let row: Vec<&str> = lines[2].split("  ").filter(|c| !c.is_empty()).collect();
        let row: Vec<&str> = row.iter().map(|c| c.trim()).collect();
        assert_eq!(
            row,
            [
                "vm1",
                "2",
                "connected",
                "4242",
                "-",
                "01:02:03",
                "25.0 %",
                "256/1024 MiB",
                "59.9 fps",
                "prio 3 prt"
            ]
        );
        assert!(lines[3].starts_with("vm2"), "{}", lines[3]);
        assert!(lines[3].contains("away"));
        assert!(
            !lines[3].contains('%'),
            "no live figures while away: {}",
            lines[3]
        );
        assert_eq!(lines.len(), 4);
    }

    #[test]
    fn query_shows_a_block_per_vm_with_memory_free_and_the_parameters_in_force() {
        let (stats, list) = answers();
        let vms = merge(&stats, &list, Some("vm1")).unwrap();
        let lines = query_lines(&stats, &vms);
        let text = lines.join("\n");
        let has = |key: &str, value: &str| {
            assert!(
                lines
                    .iter()
                    .any(|l| l.trim_start().starts_with(key) && l.ends_with(&format!(": {value}"))),
                "{key}: {value} in\n{text}"
            );
        };
        assert!(lines[0].ends_with("VMs: 1"));
        has("VM", "vm1");
        has("Device pid", "4242");
        has("QEMU pid", "-");
        has("Uptime", "01:02:03");
        has("GPU share", "25.0 %");
        has("Used", "256 MiB");
        has("Limit", "1024 MiB");
        has("Free", "768 MiB");
        has("Latency p50/p99", "1.5/9.0 ms");
        has("Standing", "prio 3 prt");
        has("priority", "3");
        has("reserve", "2000/10000/pe");
        has("slo", "-");
        assert!(!text.contains("vm2"));
    }

    #[test]
    fn an_unknown_vm_is_refused_and_a_day_long_uptime_counts_days() {
        let (stats, list) = answers();
        assert!(matches!(
            merge(&stats, &list, Some("nosuchvm")),
            Err(Failure::Refused(e)) if e.contains("nosuchvm")
        ));
        assert_eq!(uptime_cell(Some(90_061_000_000_000)), "1d 01:01:01");
        assert_eq!(uptime_cell(None), "-");
        let away = &merge(&stats, &list, Some("vm2")).unwrap()[0];
        assert_eq!(away["state"], "away");
        assert_eq!(away["params"]["priority"], 5);
    }
}
