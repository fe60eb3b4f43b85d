//! `vgpuctl [--control PATH] [--json] COMMAND`: the control CLI of `vgpu-schedd`.
//! Exit codes: 0 ok, 1 the daemon refused the request, 2 usage or connection error.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use serde_json::{Map, Value, json};
use vgpu_schedd::control::{DEFAULT_CONTROL_PATH, ServerOptions, parse_assignment};
use vgpu_scheduler::PolicyConfig;

const USAGE: &str = "usage: vgpuctl [--control PATH] [--json] COMMAND
commands:
  list                               VMs, their vGPUs, the parameters in force (* where
                                     the policy overrides the VM's own), the policy
  show [--watch SECONDS] [--count N] live statistics (repeated with --watch)
  set-policy FILE.toml               install a policy (policy = \"fair\", ...)
  set VM key=value...                priority, weight, sched=prt|ht, target_fps, slo=µs/s,
                                     reserve=C_us/T_us/pe|ae
  focus VM                           the user looks at VM
  create NAME --socket PATH [-- OPTIONS]
                                     start a vgpu-server for NAME; OPTIONS: --display WxH,
                                     --renderer virgl|none, --log-level LEVEL, --exit-on-disconnect,
                                     --dump (scanouts into the daemon's STATE_DIR/dump/NAME/)
  destroy NAME                       stop the vgpu-server started for NAME
exit codes: 0 ok, 1 daemon error, 2 usage or connection error";

/// How long an answer may take: `create` waits up to 10 s for the device's socket.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest `--watch` interval (a day).
const MAX_WATCH_SECONDS: f64 = 86_400.0;
/// Largest policy file read.
const MAX_POLICY_FILE_BYTES: u64 = 1024 * 1024;

/// Why vgpuctl failed.
enum Failure {
    /// Bad arguments or no daemon: exit 2.
    Usage(String),
    /// The daemon refused: exit 1.
    Daemon(String),
}

struct Cli {
    control: PathBuf,
    json: bool,
    command: Vec<String>,
}

fn parse(args: Vec<String>) -> Result<Cli, Failure> {
    let mut control = PathBuf::from(DEFAULT_CONTROL_PATH);
    let mut json = false;
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--control" => {
                control = PathBuf::from(
                    it.next()
                        .ok_or(Failure::Usage("--control needs a value".into()))?,
                )
            }
            "--json" => json = true,
            "-h" | "--help" => return Err(Failure::Usage(String::new())),
            _ if arg.starts_with("--") => {
                return Err(Failure::Usage(format!("unknown option {arg:?}")));
            }
            _ => {
                let mut command = vec![arg];
                command.extend(it);
                return Ok(Cli {
                    control,
                    json,
                    command,
                });
            }
        }
    }
    Err(Failure::Usage("no command".into()))
}

/// A connection to the daemon's control socket.
struct Conn {
    writer: UnixStream,
    reader: BufReader<UnixStream>,
}

impl Conn {
    fn open(path: &PathBuf) -> Result<Conn, Failure> {
        let fail = |e: std::io::Error| Failure::Usage(format!("{}: {e}", path.display()));
        let writer = UnixStream::connect(path).map_err(fail)?;
        writer
            .set_read_timeout(Some(ANSWER_TIMEOUT))
            .map_err(fail)?;
        let reader = BufReader::new(writer.try_clone().map_err(fail)?);
        Ok(Conn { writer, reader })
    }

    fn call(&mut self, request: &Value) -> Result<Value, Failure> {
        let lost = |e: std::io::Error| Failure::Usage(format!("control connection: {e}"));
        let mut line = request.to_string();
        line.push('\n');
        self.writer.write_all(line.as_bytes()).map_err(lost)?;
        let mut answer = String::new();
        if self.reader.read_line(&mut answer).map_err(lost)? == 0 {
            return Err(Failure::Usage("the daemon closed the connection".into()));
        }
        let answer: Value = serde_json::from_str(&answer)
            .map_err(|e| Failure::Usage(format!("bad answer from the daemon: {e}")))?;
        match answer {
            Value::Object(mut m) => {
                if let Some(e) = m.remove("error") {
                    return Err(Failure::Daemon(e.as_str().unwrap_or("error").to_owned()));
                }
                m.remove("ok")
                    .ok_or(Failure::Usage("answer without ok or error".into()))
            }
            _ => Err(Failure::Usage("answer is not an object".into())),
        }
    }
}

fn cell(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => "-".into(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Number(n)) => match n.as_f64() {
            Some(f) if n.is_f64() => format!("{f:.1}"),
            _ => n.to_string(),
        },
        Some(other) => other.to_string(),
    }
}

/// Prints rows as an aligned table with a header.
fn table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let parts: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        println!("{}", parts.join("  ").trim_end());
    };
    line(header.iter().map(|h| h.to_string()).collect());
    for row in rows {
        line(row.clone());
    }
}

/// Appended to a `list` value that the policy applies in place of the VM's own.
const POLICY_MARK: char = '*';
/// What [`POLICY_MARK`] means, printed under the `list` table when a value carries it.
const POLICY_LEGEND: &str =
    "* set by the policy (spec lines, focus, its defaults, admission control), not by `set`";

/// A reserve as `C_us/T_us/enforcement`, with `@name` for a Shared reserve; `-` for none.
fn reserve_cell(r: Option<&Value>) -> String {
    let text = r.and_then(|r| {
        let mut text = format!(
            "{}/{}/{}",
            r.get("c")?.as_u64()? / 1_000,
            r.get("t")?.as_u64()? / 1_000,
            r.get("enforcement")?.as_str()?
        );
        if let Some(name) = r.get("shared").and_then(Value::as_str) {
            text.push('@');
            text.push_str(name);
        }
        Some(text)
    });
    text.unwrap_or_else(|| "-".into())
}

/// A priority; `max` for the highest (a focused wildcard spec line's).
fn priority_cell(p: Option<&Value>) -> String {
    match p.and_then(Value::as_u64) {
        Some(p) if p == u64::from(u32::MAX) => "max".into(),
        _ => cell(p),
    }
}

fn print_list(v: &Value) {
    let policy = v.get("policy").and_then(|p| p.get("policy"));
    println!("policy: {}", cell(policy));
    let empty = Vec::new();
    let vms = v.get("vms").and_then(Value::as_array).unwrap_or(&empty);
    let mut marked = false;
    let mut rows: Vec<Vec<String>> = Vec::with_capacity(vms.len());
    for vm in vms {
        // What the policy applies; a VM that is away has only its own parameters.
        let own = vm.get("params");
        let applied = vm.get("effective").filter(|e| !e.is_null()).or(own);
        let mut show = |key: &str, text: String| {
            if applied.and_then(|a| a.get(key)) == own.and_then(|p| p.get(key)) {
                text
            } else {
                marked = true;
                format!("{text}{POLICY_MARK}")
            }
        };
        let field = |k: &str| cell(applied.and_then(|p| p.get(k)));
        rows.push(vec![
            cell(vm.get("name")),
            cell(vm.get("vgpu")),
            cell(vm.get("connected")),
            cell(vm.get("device_pid")),
            cell(vm.get("qemu_pid")),
            show(
                "priority",
                priority_cell(applied.and_then(|p| p.get("priority"))),
            ),
            show("weight", field("weight")),
            show("sched", field("sched")),
            show(
                "reserve",
                reserve_cell(applied.and_then(|p| p.get("reserve"))),
            ),
            show("target_fps", field("target_fps")),
        ]);
    }
    table(
        &[
            "VM",
            "vGPU",
            "connected",
            "pid",
            "qemu",
            "priority",
            "weight",
            "sched",
            "reserve",
            "fps target",
        ],
        &rows,
    );
    if marked {
        println!("{POLICY_LEGEND}");
    }
    let children = v
        .get("children")
        .and_then(Value::as_array)
        .unwrap_or(&empty);
    if !children.is_empty() {
        println!();
        let rows: Vec<Vec<String>> = children
            .iter()
            .map(|c| {
                vec![
                    cell(c.get("name")),
                    cell(c.get("pid")),
                    cell(c.get("socket")),
                ]
            })
            .collect();
        table(&["child", "pid", "socket"], &rows);
    }
}

/// A VM's budget as `remaining/capacity unit` ("3.2/5.0 ms", in µs below a 1 ms capacity), or
/// `-` where it has none.
fn budget_cell(budget: Option<&Value>) -> String {
    let field = |k| budget.and_then(|b| b.get(k)).and_then(Value::as_f64);
    let (Some(left), Some(capacity)) = (field("remaining_ns"), field("capacity_ns")) else {
        return "-".to_owned();
    };
    let (per_unit, unit) = if capacity >= 1e6 {
        (1e6, "ms")
    } else {
        (1e3, "µs")
    };
    format!("{:.1}/{:.1} {unit}", left / per_unit, capacity / per_unit)
}

fn print_stats(v: &Value) {
    println!(
        "policy: {}  engine busy: {:.1} %",
        cell(v.get("policy")),
        v.get("engine_busy").and_then(Value::as_f64).unwrap_or(0.0) * 100.0
    );
    let empty = Vec::new();
    let vms = v.get("vms").and_then(Value::as_array).unwrap_or(&empty);
    let rows: Vec<Vec<String>> = vms
        .iter()
        .map(|vm| {
            let share = vm.get("gpu_share").and_then(Value::as_f64).unwrap_or(0.0) * 100.0;
            let figures = vm
                .get("figures")
                .and_then(Value::as_object)
                .map(|f| {
                    f.iter()
                        .map(|(k, x)| format!("{k}={}", cell(Some(x))))
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .unwrap_or_default();
            vec![
                cell(vm.get("name")),
                cell(vm.get("vgpu")),
                cell(vm.get("connected")),
                format!("{share:.1}"),
                cell(vm.get("groups_per_sec")),
                cell(vm.get("queue_depth")),
                cell(vm.get("in_flight")),
                cell(vm.get("fps")),
                cell(vm.get("latency_p50_us")),
                cell(vm.get("latency_p99_us")),
                budget_cell(vm.get("budget")),
                figures,
            ]
        })
        .collect();
    table(
        &[
            "VM",
            "vGPU",
            "connected",
            "share %",
            "groups/s",
            "queue",
            "in flight",
            "fps",
            "p50 µs",
            "p99 µs",
            "budget",
            "policy figures",
        ],
        &rows,
    );
}

fn read_policy(path: &str) -> Result<Value, Failure> {
    let fail = |e: String| Failure::Usage(format!("{path}: {e}"));
    let meta = std::fs::metadata(path).map_err(|e| fail(e.to_string()))?;
    if meta.len() > MAX_POLICY_FILE_BYTES {
        return Err(fail(format!("larger than {MAX_POLICY_FILE_BYTES} bytes")));
    }
    let text = std::fs::read_to_string(path).map_err(|e| fail(e.to_string()))?;
    let policy: PolicyConfig = toml::from_str(&text).map_err(|e| fail(e.to_string()))?;
    serde_json::to_value(policy).map_err(|e| fail(e.to_string()))
}

fn usage<T>(msg: &str) -> Result<T, Failure> {
    Err(Failure::Usage(msg.to_owned()))
}

fn run(cli: Cli) -> Result<(), Failure> {
    let words: Vec<&str> = cli.command.iter().map(String::as_str).collect();
    let (request, shape): (Value, fn(&Value)) = match words.as_slice() {
        ["list"] => (json!({"cmd": "list"}), print_list),
        ["show", rest @ ..] => return show(&cli, rest),
        ["set-policy", file] => (
            json!({"cmd": "set-policy", "policy": read_policy(file)?}),
            |v| println!("policy: {}", cell(v.get("policy"))),
        ),
        ["set", vm, assignments @ ..] if !assignments.is_empty() => {
            let mut params = Map::new();
            for a in assignments {
                let (k, v) = parse_assignment(a).map_err(|e| Failure::Usage(e.to_string()))?;
                params.insert(k.to_owned(), v);
            }
            (
                json!({"cmd": "set-params", "vm": vm, "params": params}),
                |v| println!("{v}"),
            )
        }
        ["focus", vm] => (json!({"cmd": "focus", "vm": vm}), |_| {}),
        ["create", name, "--socket", socket, rest @ ..] => {
            let extra = match rest {
                [] => &[][..],
                ["--", extra @ ..] => extra,
                _ => return usage("create NAME --socket PATH [-- OPTIONS]"),
            };
            let owned: Vec<String> = extra.iter().map(|a| a.to_string()).collect();
            if let Err(e) = ServerOptions::try_from(owned) {
                return usage(&e.to_string());
            }
            let socket = std::path::absolute(socket)
                .map_err(|e| Failure::Usage(format!("--socket: {e}")))?;
            (
                json!({"cmd": "create", "name": name, "socket": socket, "args": extra}),
                |v| {
                    print!(
                        "{} pid {} at {}",
                        cell(v.get("name")),
                        cell(v.get("pid")),
                        cell(v.get("socket"))
                    );
                    match v.get("dump_dir") {
                        Some(dir) if !dir.is_null() => println!(", dumps in {}", cell(Some(dir))),
                        _ => println!(),
                    }
                },
            )
        }
        ["destroy", name] => (json!({"cmd": "destroy", "name": name}), |v| {
            println!("{}: {}", cell(v.get("name")), cell(v.get("status")))
        }),
        _ => return usage("unknown command or wrong arguments"),
    };
    let mut conn = Conn::open(&cli.control)?;
    let answer = conn.call(&request)?;
    if cli.json {
        println!("{answer}");
    } else {
        shape(&answer);
    }
    Ok(())
}

fn show(cli: &Cli, rest: &[&str]) -> Result<(), Failure> {
    let mut watch = None;
    let mut count = None;
    let mut it = rest.iter();
    while let Some(opt) = it.next() {
        let value = it
            .next()
            .ok_or(Failure::Usage(format!("{opt} needs a value")))?;
        match *opt {
            "--watch" => {
                let s: f64 = value
                    .parse()
                    .ok()
                    .filter(|s: &f64| s.is_finite() && *s > 0.0 && *s <= MAX_WATCH_SECONDS)
                    .ok_or(Failure::Usage(format!("--watch: bad interval {value:?}")))?;
                watch = Some(Duration::from_secs_f64(s));
            }
            "--count" => {
                let n: u64 = value
                    .parse()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or(Failure::Usage(format!("--count: bad count {value:?}")))?;
                count = Some(n);
            }
            _ => return usage("show [--watch SECONDS] [--count N]"),
        }
    }
    let count = match (watch, count) {
        (None, None) => Some(1),
        (None, Some(_)) => return usage("--count needs --watch"),
        (Some(_), c) => c,
    };
    let mut conn = Conn::open(&cli.control)?;
    let mut shown = 0u64;
    loop {
        let answer = conn.call(&json!({"cmd": "stats"}))?;
        if cli.json {
            println!("{answer}");
        } else {
            if shown > 0 {
                println!();
            }
            print_stats(&answer);
        }
        shown = shown.saturating_add(1);
        if count.is_some_and(|c| shown >= c) {
            return Ok(());
        }
        if let Some(w) = watch {
            std::thread::sleep(w);
        }
    }
}

fn main() -> ExitCode {
    let result = parse(std::env::args().skip(1).collect()).and_then(run);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Daemon(e)) => {
            eprintln!("vgpuctl: {e}");
            ExitCode::from(1)
        }
        Err(Failure::Usage(e)) => {
            if !e.is_empty() {
                eprintln!("vgpuctl: {e}");
            }
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
    }
}
